"""Gemma 4's assistant drafter (llama.cpp's `gemma4-assistant`, issue 44): the `gemma4-assistant`
fixture (a transformers Gemma 4 target and a tiny Gemma4AssistantForCausalLM, both converted by the
pinned converter) is a pair the pinned llama-speculative-simple drafts with (`-md` and `--spec-type
draft-mtp`: its layers read the target's KV cache). The in-process flow (no catch-up, every draft step
at the round's first position) compares clean against the reference that follows it
(torchref/mtp/gemma4_assistant.py), and a reference without the sliding layers' window does not; so
do llama-speculative-simple and llama-server drafting with it; its checkpoint directory is refused
by name (read it from the GGUF)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mtp_head_runs import PROGRAMS, RUN_TIMEOUT_S
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core import names
from featdiff.core.gguf_reader import int_meta, read_gguf
from featdiff.diff import compare_dumps
from featdiff.driver.capture import capture
from featdiff.dump.reader import read_dump
from featdiff.factory.converter import DRAFT_GGUF, DRAFT_HF, TARGET_GGUF, TARGET_HF
from featdiff.factory.gemma4_assistant import ASSISTANT_LAYER_TYPES, ASSISTANT_N_EMBD, write_gemma4_assistant_fixture
from featdiff.factory.gguf_rewrite import rewrite_gguf
from featdiff.factory.pairs import TINY
from featdiff.programs import exec as exec_capture
from featdiff.torchref.kind import reference
from featdiff_process import check_passes, drafted_counts, refused_in_one_line

pytestmark = pytest.mark.slow  # the pinned converter makes the pair

ARCH = names.ARCH_GEMMA4_ASSISTANT
SPEC = ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "-c", "256", "-t", "1"]
RUN = ["-p", "hello world", "-n", "16", "--temp", "0"]
TOKENS = "7,21,3,99,140,5,260,33,18,402,77,9"  # 12 tokens: the window (8) leaves the first cells out
ROUNDS = 3
CLEAN_NMSE = 1e-5  # a clean comparison's largest NMSE stays below this (measured: 3.9e-07 in-process,
# 1.2e-06 around llama-speculative-simple, 5.8e-07 around llama-server)
NO_WINDOW_NMSE = 1e-2  # a sliding layer attending past its window (0.28 measured at round 1's kqv_out-0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    return write_gemma4_assistant_fixture(tmp_path_factory.mktemp("gemma4-assistant"))


@pytest.fixture(scope="module")
def run(pair, tmp_path_factory) -> Path:
    """The in-process capture of ROUNDS rounds on the pair."""
    out = tmp_path_factory.mktemp("gemma4-assistant-run") / "run.npz"
    return capture(pair / TARGET_GGUF, pair / DRAFT_GGUF, out, tokens=TOKENS, rounds=ROUNDS)


def follow(pair: Path, model: Path, run: Path, out: Path) -> Path:
    """The reference of the assistant `model` that follows `run`."""
    return reference(
        pair / TARGET_HF, model, out, prompt=None, tokens=None, rounds=0,
        dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None, follow=run,
    )  # fmt: skip


def test_the_converter_writes_an_assistant_reading_the_targets_kv(pair):
    """draft.gguf is the pinned converter's gemma4-assistant: one nextn head per layer, the target's
    width as embedding_length_out, the pre / post projections and per layer a query but no key or
    value projection."""
    d, t = read_gguf(pair / DRAFT_GGUF), read_gguf(pair / TARGET_GGUF)
    assert d.arch == ARCH and t.arch == "gemma4"
    assert int_meta(d, names.KEY_NEXTN_LAYERS.format(arch=ARCH)) == len(ASSISTANT_LAYER_TYPES)
    assert int_meta(d, f"{ARCH}.embedding_length_out") == TINY.target.n_embd == int_meta(t, "gemma4.embedding_length")
    assert {"nextn.pre_projection.weight", "nextn.post_projection.weight"} <= set(d.tensors)
    per_layer = {t.split(".", 2)[2] for t in d.tensors if t.startswith("blk.")}
    assert "attn_q.weight" in per_layer and not per_layer & {"attn_k.weight", "attn_v.weight"}


def test_llama_speculative_simple_drafts_with_it(tools, pair):
    """The pinned tree runs the pair: the assistant's two layers share the target's last two layers'
    KV cache (sliding 4, full 5 of the 6) and it drafts."""
    cmd = [str(tools.program("llama-speculative-simple")), "-m", str(pair / TARGET_GGUF)]
    counts, log = drafted_counts([*cmd, "-md", str(pair / DRAFT_GGUF), *SPEC, *RUN])
    n = TINY.target.n_layer
    assert f"layer   0: sharing with layer {n - 2}" in log and f"layer   1: sharing with layer {n - 1}" in log
    assert counts.get("n_drafted", 0) > 0, log[-2000:]


def test_lint_finds_nothing_to_say(pair):
    draft = pair / DRAFT_GGUF
    out = CliRunner().invoke(app, ["lint", str(draft), "--target", str(pair / TARGET_GGUF)])
    assert out.exit_code == 0 and out.output.strip() == f"{draft}: ok", out.output


def test_the_in_process_flow_compares_clean(pair, run, tmp_path):
    """ROUNDS rounds in-process compare clean, nothing skipped: no catch-up decode, each round's
    three draft steps at one position (its pos0), paired step by step (by occurrence at that
    position), every record of the assistant's graph among them, down to each layer's attention
    over the target's cache (kqv_out)."""
    with read_dump(run) as dump:
        m = dump.manifest
    assert m.models["draft"]["architecture"] == ARCH
    assert not [e for e in m.evals if e.phase == "inject"]
    steps = [e for e in m.evals if e.phase == "draft"]
    assert len(steps) == 3 * ROUNDS and {e.positions for e in steps} == {(r.pos0,) for r in m.rounds}
    c = compare_dumps(follow(pair, pair / DRAFT_GGUF, run, tmp_path / "ref.npz"), run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    assert not c.skipped
    kqv = [p for p in c.pairs if p.name == "kqv_out-0"]
    assert len(kqv) == ROUNDS and all(len(p.positions) == 3 and len(set(p.positions)) == 1 for p in kqv)
    paired = {p.name for p in c.pairs if p.role == names.ROLE_DRAFT}
    wanted = {"inp_xh", "pre_proj", "kqv_out-1", "out_scaled-1", names.H_NEXTN, names.DRAFT_LOGITS}
    assert wanted <= paired, sorted(paired)
    assert max(p.nmse for p in c.pairs) < CLEAN_NMSE


def test_a_reference_without_the_window_is_caught(pair, run, tmp_path):
    """The reference of an assistant whose sliding window is wider than the run's (its GGUF's
    sliding_window rewritten: its sliding layer attends over every target cell) parts from the run
    at that layer's attention."""
    wide = rewrite_gguf(pair / DRAFT_GGUF, tmp_path / "wide.gguf", keys={f"{ARCH}.attention.sliding_window": 4096})
    c = compare_dumps(follow(pair, wide, run, tmp_path / "ref.npz"), run)
    assert not c.ok
    first = {p.name: p.nmse for p in c.pairs if p.role == names.ROLE_DRAFT and p.round == 1}
    assert first["kqv_out-0"] > NO_WINDOW_NMSE, first


@pytest.mark.parametrize("program", PROGRAMS)
def test_around_the_program_compares_clean(tools, pair, tmp_path, program):
    """llama-speculative-simple (16 tokens of a prompt, greedy) and llama-server (one request of
    TOKENS) with `-md draft.gguf --spec-type draft-mtp`: the capture keeps the assistant's records
    (its steps' one-row records shaped as in-process: the program's two-token warm-up decode of the
    draft context, one row an output, does not drop their row dimension) and compares clean against
    the reference that follows the run, the warm-up alone left out."""
    is_server = program == "llama-server"
    cmd = [str(tools.program(program)), "-m", str(pair / TARGET_GGUF), "-md", str(pair / DRAFT_GGUF), *SPEC]
    cmd += [] if is_server else RUN
    tokens = TOKENS if is_server else None
    run = exec_capture.capture_exec(cmd, tmp_path / "run.npz", tokens=tokens, timeout_s=RUN_TIMEOUT_S)
    with read_dump(run) as dump:
        m = dump.manifest
    assert m.models["draft"]["architecture"] == ARCH and any(r.drafts for r in m.rounds)
    assert {(r.name, r.shape) for r in m.records if r.role == names.ROLE_DRAFT and r.phase == "draft"} >= {
        ("out_scaled-1", (1, ASSISTANT_N_EMBD)),
        (names.H_NEXTN, (1, TINY.target.n_embd)),  # handed back at the target's width
    }
    c = compare_dumps(follow(pair, pair / DRAFT_GGUF, run, tmp_path / "ref.npz"), run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    expected = ("a warm-up or probe decode", "output no rows")  # llama-server samples its prefill's last row
    assert not [s for s in c.skipped if not any(e in s for e in expected)], c.skipped
    assert {"kqv_out-0", "out_scaled-1", names.H_NEXTN} <= {p.name for p in c.pairs if p.role == names.ROLE_DRAFT}
    assert max(p.nmse for p in c.pairs) < CLEAN_NMSE


def test_check_around_the_program_passes_and_measures_the_accept(tools, pair, tmp_path):
    """`featdiff check --exec -- llama-speculative-simple` on the correct pair: the wiring compares
    clean and the accept probe replays the assistant's rounds beside the run's (before: exit 2, the
    probe modelled a single MTP head only)."""
    cmd = [str(tools.program("llama-speculative-simple")), "-m", str(pair / TARGET_GGUF), "-md", str(pair / DRAFT_GGUF)]
    args = ["--target", pair / TARGET_GGUF, "--model", pair / DRAFT_GGUF, "--ref-target", pair / TARGET_HF]
    check_passes([*args, "--exec", "--", *cmd, *SPEC, *RUN], tmp_path)


def test_its_checkpoint_directory_is_refused_by_name(pair, tmp_path):
    """config.json model_type gemma4_assistant: read it from the converted GGUF."""
    out = tmp_path / "ref.npz"
    args = ["reference", "--target", str(pair / TARGET_HF), "--model", str(pair / DRAFT_HF), "--tokens", "7,21,3"]
    line = refused_in_one_line([*args, "-o", str(out)], "model_type 'gemma4_assistant'")
    assert "converted GGUF only" in line and not out.exists()
