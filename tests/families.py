"""What every transformers-backed target family must pass (issue 24), written once: a tiny
converted pair (featdiff.factory.hf_targets) captured in-process and around llama-server compares clean
with nothing skipped, `featdiff check` passes with the accept probe agreeing, and a drafter whose
layer ids are one too high is a `layer_offset` (and, for some, slots in reverse order a
`slot_permutation`). tests/reference/test_hf_target.py (qwen3moe),
test_gpt_oss.py, test_qwen35.py and test_gemma4.py call these on their family's fixture directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFReader

import featdiff
from featdiff.core import names
from featdiff.diff import compare_dumps, exit_code
from featdiff.factory.converter_faults import rewrite_gguf

from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS, reference_of

# llama-server as the family tests run it: DFlash drafts of 3, a small context, one thread each
SERVER_ARGS = ["--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-c", "256", "-t", "1", "-td", "1"]
RUN_TIMEOUT_S = 120
SECOND_PROMPT = "11,40,2,75,300,6,19,8"  # check's second prompt, as token ids
FAULT_VAR = "FEATDIFF_FAULT"  # the patched llama.cpp's planted faults (patches/llama.cpp)
REJECTED_BLOCK = (1, 2, 3, 4)  # a verify block the eager comparisons roll back
ACCEPTED_ROWS = (11, 40, 2, 75, 300, 6)  # and the rows they run after it


def draft_layers(draft: Path) -> list[int]:
    """The drafter GGUF's `dflash.target_layers`."""
    return [int(i) for i in GGUFReader(str(draft)).fields[names.KEY_TARGET_LAYERS].contents()]


def server_capture(tools, d: Path, draft: Path, out: Path, extra: tuple[str, ...] = ()) -> Path:
    """`d`'s target with `draft` around llama-server, every record kept."""
    from featdiff.programs.exec import capture_exec

    cmd = [str(tools.program("llama-server")), "-m", str(d / "target.gguf"), "-md", str(draft), *SERVER_ARGS, *extra]
    return capture_exec(cmd, out, filters=["*"], tokens=DEFAULT_TOKENS, timeout_s=RUN_TIMEOUT_S)


def followed(d: Path, draft: Path, run: Path, out: Path) -> Path:
    """The transformers reference of `d`'s target-hf/ directory, replaying the run's flow."""
    return reference_of(d / "target-hf", draft, out, follow=run)


def assert_clean_in_process(d: Path, tmp_path: Path, embd: str = names.TARGET_EMBD, l_out: str = names.L_OUT) -> dict:
    """`d`'s pair in-process, every record kept, against the reference from its HF target: no
    error, nothing skipped, the embeddings (`embd`) and every target layer's output (`l_out`-<il>):
    the names the arch's graph gives them) paired; return the comparison's JSON (its `run`: the run
    dump's path)."""
    run = featdiff.capture(
        d / "target.gguf", d / "draft.gguf", tmp_path / "run.npz", tokens=DEFAULT_TOKENS, rounds=DEFAULT_ROUNDS,
        filters=["*"],  # every layer's l_out and the target's embd, not only the drafter's taps
    )  # fmt: skip
    ref = featdiff.reference(
        d / "target-hf", d / "draft.gguf", tmp_path / "ref.npz", tokens=DEFAULT_TOKENS, rounds=DEFAULT_ROUNDS
    )
    result = featdiff.compare(ref, run).to_json()
    assert result["ok"], result["findings"]
    assert [f for f in result["findings"] if f["severity"] == "error"] == []
    assert result["first_divergence"] is None
    cov = result["coverage"]
    assert (cov["pairs_skipped"], cov["rows_skipped"], cov["ref_only"]) == (0, 0, 0), cov
    paired = {(r["role"], r["name"]) for r in result["records"]}
    config = json.loads((d / "target-hf" / names.HF_CONFIG).read_text())
    n_layer = config.get("num_hidden_layers") or len(config["layers_block_type"])  # Nemotron-H: its block list
    target = {embd, names.RESULT_NORM, names.RESULT_OUTPUT} | {names.layer_name(l_out, il) for il in range(n_layer)}
    assert {("target", n) for n in target} | {("draft", names.INP_TARGET_FEATURES)} <= paired
    assert result["layer_match"]["closest_layers"] == result["layer_match"]["expected_layers"]
    return {**result, "run": run}


def assert_clean_around_server(d: Path, tools, tmp_path: Path, extra: tuple[str, ...] = ()) -> dict:
    """`d`'s pair around llama-server against the reference replaying its flow: no error, nothing
    skipped but what llama-server is expected to leave out; return the comparison's JSON."""
    run = server_capture(tools, d, d / "draft.gguf", tmp_path / "run.npz", extra)
    result = compare_dumps(followed(d, d / "draft.gguf", run, tmp_path / "ref.npz"), run).to_json()
    assert result["ok"], [f["message"] for f in result["findings"] if f["severity"] == "error"]
    cov = result["coverage"]
    assert (cov["pairs_skipped"], cov["rows_skipped"], cov["ref_only"]) == (0, 0, 0), cov
    assert all(s["expected"] for s in cov["skipped"]), cov["skipped"]
    assert cov["pairs"] > 0 and ("draft", names.INP_TARGET_FEATURES) in {
        (r["role"], r["name"]) for r in result["records"]
    }
    return result


def assert_check_passes(d: Path, tmp_path: Path) -> None:
    """`featdiff check` in-process on `d`'s pair (token-id prompts: the tiny SPM vocabulary spells
    check's default text byte by byte) passes, and the accept probe agrees."""
    from featdiff.verdict.probe import TOKENS_PREFIX
    from featdiff.verdict.run import check

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{TOKENS_PREFIX} {DEFAULT_TOKENS}\n{TOKENS_PREFIX} {SECOND_PROMPT}\n")
    result = check(
        d / "target.gguf", d / "draft.gguf", ref_target=d / "target-hf", ref_model=d / "draft-hf", prompts=prompts,
        rounds=DEFAULT_ROUNDS, keep=tmp_path / "dumps",
    )  # fmt: skip
    assert result.ok and result.verdict == "pass", result.reasons
    assert result.mode == "in-process" and result.comparison.ok
    assert result.accept.matches and result.accept.blocks >= DEFAULT_ROUNDS, result.accept.to_json()


def assert_layer_offset_named(d: Path, tools, tmp_path: Path) -> dict:
    """`d`'s drafter GGUF with every layer id one too high, around llama-server, against the
    reference of the drafter as trained: a `layer_offset` at slot 0 by +1; return its JSON."""
    draft = d / "draft.gguf"
    layers = draft_layers(draft)
    planted = rewrite_gguf(draft, tmp_path / "draft-plus1.gguf", {names.KEY_TARGET_LAYERS: [i + 1 for i in layers]})
    run = server_capture(tools, d, planted, tmp_path / "run.npz")
    comparison = compare_dumps(followed(d, draft, run, tmp_path / "ref.npz"), run)
    offsets = [f.to_json() for f in comparison.findings if f.kind == "layer_offset"]
    assert offsets, [f.message for f in comparison.findings]
    f = offsets[0]
    assert (f["slot"], f["expected_layer"], f["observed_layer"], f["delta"]) == (0, layers[0], layers[0] + 1, 1)
    assert exit_code(comparison) == 1
    return f


def assert_slots_reversed_named(d: Path, tools, tmp_path: Path) -> dict:
    """`d`'s drafter GGUF with its tapped layers in reverse slot order, around llama-server,
    against the reference of the drafter as trained: a `slot_permutation` that reverses the
    slots; return its JSON."""
    draft = d / "draft.gguf"
    layers = draft_layers(draft)
    planted = rewrite_gguf(draft, tmp_path / "draft-reversed.gguf", {names.KEY_TARGET_LAYERS: layers[::-1]})
    run = server_capture(tools, d, planted, tmp_path / "run.npz")
    comparison = compare_dumps(followed(d, draft, run, tmp_path / "ref.npz"), run)
    found = [f.to_json() for f in comparison.findings if f.kind == "slot_permutation"]
    assert found, [f.message for f in comparison.findings]
    assert found[0]["permutation"] == list(range(len(layers)))[::-1]
    assert exit_code(comparison) == 1
    return found[0]


@dataclass(frozen=True)
class RolledBack:
    """A target's prompt run through the reference's flow cache, a rejected block rolled back and
    the accepted rows run after it, beside transformers' eager forward over the whole sequence."""

    hf: Any  # the reference's HfTarget
    tokens: Any  # (n_tokens,): the prompt, then ACCEPTED_ROWS
    n: int  # the prompt's length
    want: Any  # transformers' eager output over `tokens` (hidden states, logits)
    prefill: Any  # the flow's KvCache after the prompt
    rejected: Any  # the HfPass of REJECTED_BLOCK after the prompt
    got: Any  # the HfPass of ACCEPTED_ROWS on the cache rolled back to the prompt


def rolled_back_passes(d: Path, prompt: tuple[int, ...]) -> RolledBack:
    """`d`'s target through the flow cache (prefill, REJECTED_BLOCK rolled back, ACCEPTED_ROWS)
    and through transformers' eager attention at once (f32 cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    from featdiff.torchref.attention import empty_cache, truncated
    from featdiff.torchref.hf_target import forward_hf, target_from_transformers

    tokens = torch.tensor([*prompt, *ACCEPTED_ROWS])
    n = len(prompt)
    hf = target_from_transformers(d / "target-hf", torch.float32, torch.device("cpu"))
    hp = hf.hparams
    eager = AutoModelForCausalLM.from_pretrained(d / "target-hf", attn_implementation="eager").eval()
    with torch.no_grad():
        want = eager(input_ids=tokens[None], output_hidden_states=True)
        cache = empty_cache(hp.n_layer, hp.n_head_kv, hp.n_embd_head, "f32", torch.device("cpu"))
        cache = forward_hf(hf, tokens[:n], torch.arange(n), cache, False).cache
        block = torch.tensor(REJECTED_BLOCK)
        rejected = forward_hf(hf, block, torch.arange(n, n + len(block)), cache, True)
        got = forward_hf(hf, tokens[n:], torch.arange(n, len(tokens)), truncated(rejected.cache, n), True)
    return RolledBack(hf, tokens, n, want, cache, rejected, got)


def rel(a, b) -> float:
    """Relative L2 error of `b` against `a`, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / a.norm())


def assert_cached_forward_equals_eager(
    d: Path, prompt: tuple[int, ...], bound: float, no_window_min: float | None = None
) -> None:
    """The flow's cache (prefill, a rejected block rolled back, the accepted rows) through the
    reference equals transformers' own eager forward over the whole sequence, layer inputs and
    logits within `bound` (rel L2); with `no_window_min`, ignoring the sliding window does not
    (layer 0 slides: its output differs by more than that)."""
    import torch
    from transformers import AutoModelForCausalLM

    rb = rolled_back_passes(d, prompt)
    n, want = rb.n, rb.want
    for il in range(rb.hf.hparams.n_layer):  # hidden_states[n_layer] is after the final norm
        assert rel(want.hidden_states[il][0, n:], rb.got.layer_inputs[il]) <= bound, il
    assert rel(want.logits[0, n:], rb.got.logits) <= bound
    if no_window_min is not None:
        wide = AutoModelForCausalLM.from_pretrained(
            d / "target-hf", attn_implementation="eager", sliding_window=10 * len(rb.tokens)
        ).eval()
        with torch.no_grad():
            unwindowed = wide(input_ids=rb.tokens[None], output_hidden_states=True).hidden_states
        assert rel(want.hidden_states[1][0, n:], unwindowed[1][0, n:]) > no_window_min


def assert_recurrent_kept_rejected_named(d: Path, tmp_path: Path, monkeypatch) -> dict:
    """patches/llama.cpp 0004 `recurrent-keep-rejected`: llama.cpp's recurrent seq_rm moves the
    position back but keeps the state after the rejected drafts. In-process (the suite's own
    libllama reads FEATDIFF_FAULT at each rollback), the first divergence, in the next verify, is
    named as a state that kept them (`wrong_source`, `source: kept_rejected`), not a generic
    divergence; return the finding's JSON."""
    monkeypatch.setenv(FAULT_VAR, "recurrent-keep-rejected")
    run = featdiff.capture(
        d / "target.gguf", d / "draft.gguf", tmp_path / "run.npz", tokens=DEFAULT_TOKENS, rounds=DEFAULT_ROUNDS
    )
    monkeypatch.delenv(FAULT_VAR)
    ref = featdiff.reference(
        d / "target-hf", d / "draft.gguf", tmp_path / "ref.npz", tokens=DEFAULT_TOKENS, rounds=DEFAULT_ROUNDS
    )
    comparison = featdiff.compare(ref, run)
    errors = [f.to_json() for f in comparison.findings if f.severity == "error"]
    assert errors and errors[0]["kind"] == "wrong_source", errors
    f = errors[0]
    assert f["source"] == "kept_rejected" and f["candidate"] == f"{f['tensor']}@{names.HYP_RECURRENT_KEPT}"
    assert f["where"] == "driver", f["where_reason"]  # the state it was handed, not the graph or the GGUF
    diverged = comparison.to_json()["first_divergence"]
    assert (diverged["name"], diverged["phase"]) == (f["tensor"], "verify")
    assert exit_code(comparison) == 1
    return f
