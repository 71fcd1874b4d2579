"""Two llama-server events end to end (issue 46): `--cache-reuse N` really reusing a chunk on a
DFlash pair (the server keeps the first request's prefix, drops a middle span and shifts a later
chunk down with seq_rm / seq_add), and a context shift (`--context-shift`, a small `-c`, a request
generating past it) on EAGLE3 and MTP drafters. Each flow is followed and compared, or the flow
the shift touched is set aside alone as an information finding naming the event; never a false
FAIL. Real build, real fixture models, the official `openai` client over real HTTP."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import openai
import pytest
from test_exec_memory import A, _follow, _request
from test_exec_memory import _log as _memory_log
from test_sequences import _log, _record
from test_server_clients import (
    _checked,
    _client,
    _errors,
    _step_capture,
    _step_pair,
    _step_verdicts,
    _summary,
    _verdicts,
)

from featdiff.dump.reader import read_dump
from featdiff.programs.run_log import ExecMemory
from featdiff.programs.sequences import Split, split_decodes

N_PREDICT = 8
CACHE_REUSE = 16  # --cache-reuse: the shortest chunk the server shifts into place
HEAD = list(range(100, 120))  # both prompts' shared prefix (the slot's common prefix)
DROPPED = list(range(300, 330))  # the first prompt's middle span, which the second leaves out
REUSED = list(range(150, 190))  # a chunk past CACHE_REUSE both prompts carry after it
# token ids, not text: the DFlash fixture's test tokenizer splits the same text differently in
# its two contexts, so a text prompt never meets a chunk of CACHE_REUSE equal tokens there
REUSE_PROMPTS = (HEAD + DROPPED + REUSED, HEAD + REUSED)
REUSED_LOG = f"reusing chunk with size {len(REUSED)}"  # server-context.cpp's trace line (-lv 4)
SPEC_TYPES = {"clean": "draft-dflash", "dspark": "draft-dspark"}  # --spec-type of a DFlash-family fixture
SHIFT_LOG = "slot context shift"  # server-context.cpp's warning, with n_keep and n_discard
NO_SHIFT_LOG = "KV cache shifting is not supported for this context"  # common_init_from_params: memory cannot shift


def _reused_chunk(port: int) -> None:
    """The first prompt, then the second, which keeps its prefix and reuses its last chunk."""
    client = _client(port)
    for prompt in REUSE_PROMPTS:
        client.completions.create(model="m", prompt=prompt, max_tokens=N_PREDICT, temperature=0)


def _server_log(run: Path) -> str:
    return run.with_name(run.name + ".log").read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["clean", "dspark"])
def test_cache_reuse_moving_a_chunk_on_a_dflash_pair_sets_aside_that_flow_alone(
    variant, tools, fixture_models, tmp_path
):
    """--cache-reuse 16, -np 1: the server moves the reused chunk's rows by -len(DROPPED) on the
    target and the drafter (seq_add: keys and values computed at other positions, which a replay
    from position 0 does not compute); the second flow is set aside as information naming
    --cache-reuse, the first compares clean and check --run passes; on DFlash and on DSpark (its
    Markov head modelled) alike."""
    models = fixture_models(variant)
    options = ["-np", "1", "--cache-ram", "0", "--cache-reuse", str(CACHE_REUSE), "-lv", "4"]
    spec = ["-md", str(models / "draft.gguf"), "--spec-type", SPEC_TYPES[variant]]
    run = _step_capture(tmp_path, models, spec, tools.program("llama-server"), options, _reused_chunk, 2)
    assert REUSED_LOG in _server_log(run)  # the server did reuse the chunk
    with read_dump(run) as dump:
        flows = [dump.manifest.flow_info(k) for k in dump.manifest.flow_ids()]
    why = [f.why_unreplayable() for f in flows]
    assert len(why) == 2 and not why[0] and "seq_add" in why[1] and "--cache-reuse" in why[1], why
    assert f"by -{len(DROPPED)}" in why[1], why
    # the moved chunk counts as cached: the second flow's prefill starts past it
    assert flows[1].n_cached >= len(HEAD) + len(REUSED) - 1, [f.n_cached for f in flows]
    result, check = _verdicts(tmp_path, models, run)
    notes = [f for f in result["findings"] if f["kind"] == "flow_note"]
    assert [(f["severity"], f["flow"]) for f in notes] == [("info", 1)], _summary(result)
    assert "--cache-reuse" in notes[0]["message"], notes[0]["message"]
    assert result["ok"] and not _errors(result["findings"]), _summary(result)
    assert result["coverage"]["pairs"] > 0 and result["coverage"]["pairs_skipped"] == 0
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-2000:]


@pytest.mark.slow
def test_cache_reuse_moving_a_chunk_on_an_mtp_head_sets_aside_that_flow_alone(tools, eagle3_pairs, mtp_pairs, tmp_path):
    """--cache-reuse 16, -np 1, on GLM-4.5's MTP head (an attention target, which can shift: the
    `mtp` pair's Qwen3.5 state cannot, test_server_clients): the server moves the reused chunk's
    rows on the target (seq_add), so the second flow alone is set aside as information naming
    --cache-reuse (upstream's pending hidden it would meet there is not judged either), the first
    compares clean and check --run passes."""
    d, spec, target, model = _shift_pair("mtp-glm4moe", eagle3_pairs, mtp_pairs)
    options = ["-np", "1", "--cache-ram", "0", "--cache-reuse", str(CACHE_REUSE), "-lv", "4"]
    run = _step_capture(tmp_path, d, spec, tools.program("llama-server"), options, _reused_chunk, 2)
    assert REUSED_LOG in _server_log(run)  # the server did reuse the chunk
    with read_dump(run) as dump:
        flows = [dump.manifest.flow_info(k) for k in dump.manifest.flow_ids()]
    why = [f.why_unreplayable() for f in flows]
    assert len(why) == 2 and not why[0] and "seq_add" in why[1] and "--cache-reuse" in why[1], why
    result, check = _step_verdicts(tmp_path, target, model, run)
    notes = [f for f in result["findings"] if f["kind"] == "flow_note"]
    assert [(f["severity"], f["flow"]) for f in notes] == [("info", 1)], _summary(result)
    assert result["ok"] and not _errors(result["findings"]), _summary(result)
    assert result["coverage"]["pairs"] > 0 and result["coverage"]["pairs_skipped"] == 0
    _checked(tmp_path, check, [])


class _PastTheContext:
    """A completion longer than the slot's context (256: llama.cpp pads -c 128 up), then a short
    one; what the server answered the first (its finish reason, or its error: a request the server
    fails is the user's traffic too, and the capture goes on)."""

    def __init__(self) -> None:
        self.first = ""

    def __call__(self, port: int) -> None:
        client = _client(port)
        try:
            long = client.completions.create(model="m", prompt="Tell a long story. " * 6, max_tokens=300, temperature=0)
            self.first = f"{long.choices[0].finish_reason}, {long.usage.completion_tokens if long.usage else 0} tokens"
        except openai.InternalServerError as e:
            self.first = str(e)
        client.completions.create(model="m", prompt="Another, shorter request.", max_tokens=N_PREDICT, temperature=0)


def _shift_pair(kind: str, eagle3_pairs, mtp_pairs) -> tuple[Path, list[str], Path, Path]:
    """The step pair of `kind`: an EAGLE3 fixture or an MTP head inside its target's GGUF."""
    if kind == "eagle3":
        return _step_pair(kind, eagle3_pairs, mtp_pairs)
    d = mtp_pairs(kind)
    return d, ["--spec-type", "draft-mtp"], d / "target-hf", d / "target.gguf"


def test_a_graph_cut_where_a_shift_graphs_node_addresses_came_round_is_one_graph():
    """A drafter's first decode after a context shift it never decoded past (upstream's EAGLE3
    driver failed every draft after it): llama.cpp computes the K-shift graph, then the batch's
    graph in the same call, and the shim, starting a graph where a node address comes round,
    cut the batch's graph in two. Two graphs of all 31 rows are one graph, kept whole without a
    note, each node's occurrence counting on; graphs sharing the rows out are split as before."""
    names = [("inp_embd", 0), ("Qcur-0", 0), ("Qcur-0", 1), ("result_norm", 1)]
    records = [_record(0, name, 31, ubatch=u) for name, u in names]
    split = split_decodes(_log([(0, list(range(31)), list(range(1, 32)), [0] * 31)], records), {0: Split(512)})
    assert split.notes == () and len(split.log.evals) == 1 and len(split.log.evals[0].positions) == 31
    assert [(r.name, r.occurrence) for r in split.log.records] == [
        ("inp_embd", 0), ("Qcur-0", 0), ("Qcur-0", 1), ("result_norm", 0)
    ]  # fmt: skip
    shared = [_record(0, "embd", 2, ubatch=u) for u in range(3)]  # 3 graphs of 2 of 4 rows: no split makes them
    kept = split_decodes(_log([(0, [5, 6, 7, 8], [0, 1, 2, 3], [0] * 4)], shared), {0: Split(2)})
    assert "computed as 3 graphs" in kept.notes[0]


def test_decodes_failing_after_a_context_shift_are_said_with_the_shift():
    """A shifted flow whose drafter decodes fail after the shift (upstream's EAGLE3 driver drafting
    from its unshifted position): the sentence that sets the flow aside says so, with the first
    failed decode's context, position and return code; a shift with no failure says nothing more."""
    decodes = _request(A, 7) + [(1, [9], [6], [0]), (0, [9], [6], [0])]  # the draft decode fails
    shift = (ExecMemory(0, 3, "seq_rm", 0, p0=1, p1=3), ExecMemory(0, 3, "seq_add", 0, p0=3, p1=-1, delta=-2))
    log = _memory_log(decodes, shift)
    _, starts = _follow(log)
    assert "while the flow ran" in starts[0].unfollowed and "failed" not in starts[0].unfollowed
    failing = replace(log, evals=tuple(replace(e, rc=-1) if e.eval == 4 else e for e in log.evals))
    _, starts = _follow(failing)
    assert starts[0].unfollowed.endswith(
        "; after it 1 decode of the flow failed, the first of the draft context at position 6 (return code -1), "
        "so the program did not complete the flow either"
    ), starts[0].unfollowed


# the MTP pairs with a memory that can shift: GLM-4.5's attention target (mtp-glm4moe). The `mtp`
# pair's Qwen3.5 target cannot (its recurrent state): see the test after this one.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle3", "mtp-glm4moe"])
def test_a_context_shift_on_a_step_drafter_sets_aside_that_flow_alone(kind, tools, eagle3_pairs, mtp_pairs, tmp_path):
    """-np 1, -c 128 (256), --context-shift: a completion of 300 tokens, then a short one. The server
    shifts the first request's rows (n_discard 127: seq_rm, then seq_add on the target and the
    drafter), so that flow alone is set aside as information naming the shift; the second is
    followed. EAGLE3: upstream's driver drafts after the shift from its unshifted position
    (pending_pos_last), every draft decode fails and the server answers 500; the note says those
    failed decodes, the second flow compares clean and check --run passes. MTP (GLM-4.5): the
    request completes through two shifts; the second flow, on a slot that served before, is
    upstream's pending hidden kept across requests (stale_pending), named by compare and check."""
    d, spec, target, model = _shift_pair(kind, eagle3_pairs, mtp_pairs)
    traffic = _PastTheContext()
    options = ["-np", "1", "-c", "128", "--context-shift", "--cache-ram", "0"]
    run = _step_capture(tmp_path, d, spec, tools.program("llama-server"), options, traffic, 2)
    assert SHIFT_LOG in _server_log(run) and NO_SHIFT_LOG not in _server_log(run)
    with read_dump(run) as dump:
        why = [dump.manifest.flow_info(k).why_unreplayable() for k in dump.manifest.flow_ids()]
    assert len(why) == 2 and "while the flow ran" in why[0] and "seq_add: a context shift" in why[0], why
    assert not why[1], why
    result, check = _step_verdicts(tmp_path, target, model, run)
    notes = [f for f in result["findings"] if f["kind"] == "flow_note"]
    assert [(f["severity"], f["flow"]) for f in notes] == [("info", 0)], _summary(result)
    assert "a context shift" in notes[0]["message"], notes[0]["message"]
    assert result["coverage"]["pairs"] > 0 and result["coverage"]["pairs_skipped"] == 0
    if kind == "eagle3":
        assert traffic.first.startswith("Error code: 500") and "speculative batch" in traffic.first, traffic.first
        assert "decodes of the flow failed, the first of the draft context" in why[0], why
        assert result["ok"] and not _errors(result["findings"]), _summary(result)
        _checked(tmp_path, check, [])
    else:
        assert traffic.first == "length, 300 tokens" and "failed" not in why[0], (traffic.first, why)
        assert _errors(result["findings"]) == [("wrong_source", "stale_pending", 1)], _summary(result)
        _checked(tmp_path, check, [("wrong_source", "stale_pending", 1)])


@pytest.mark.slow
def test_context_shift_asked_of_a_qwen35_mtp_pair_shifts_nothing_and_both_flows_are_followed(
    tools, eagle3_pairs, mtp_pairs, tmp_path
):
    """The same traffic on the `mtp` pair: Qwen3.5's recurrent state cannot shift, so llama.cpp
    disables --context-shift and the server stops the long request at its context (finish reason
    length, fewer than the 300 tokens asked). Nothing moved: both flows are followed and compared
    (the first to the context's end, within the recurrent-state tolerance), the second is
    upstream's pending hidden kept across requests (stale_pending), in compare and check alike."""
    d, spec, target, model = _shift_pair("mtp", eagle3_pairs, mtp_pairs)
    traffic = _PastTheContext()
    options = ["-np", "1", "-c", "128", "--context-shift", "--cache-ram", "0"]
    run = _step_capture(tmp_path, d, spec, tools.program("llama-server"), options, traffic, 2)
    assert NO_SHIFT_LOG in _server_log(run) and SHIFT_LOG not in _server_log(run)
    reason, n_tokens = traffic.first.split(", ")
    assert reason == "length" and int(n_tokens.split()[0]) < 300, traffic.first  # the context, not max_tokens
    with read_dump(run) as dump:
        flows = [dump.manifest.flow_info(k) for k in dump.manifest.flow_ids()]
    assert [f.why_unreplayable() for f in flows] == ["", ""], [f.why_unreplayable() for f in flows]
    result, check = _step_verdicts(tmp_path, target, model, run)
    assert not [f for f in result["findings"] if f["kind"] == "flow_note"], _summary(result)
    assert result["coverage"]["pairs_skipped"] == 0 and result["coverage"]["rows_skipped"] == 0
    assert _errors(result["findings"]) == [("wrong_source", "stale_pending", 1)], _summary(result)
    _checked(tmp_path, check, [("wrong_source", "stale_pending", 1)])
