"""What each sequence holds, followed through a program's decodes and memory changes (issue 30):
a restored RAM prompt cache brings back the history saved under its bytes' name, a drafter
restored from another saved prompt is seen, and shifts and unseen states are named, never
guessed. Pure: hand-made logs of what the preload notes."""

from __future__ import annotations

from dataclasses import replace

from featdiff.core.phases import Phase
from featdiff.dump.records import UNKNOWN_TOKEN as UNKNOWN
from featdiff.dump.records import FlowInfo
from featdiff.programs.memory import follow_memory
from featdiff.programs.phases import flow_evals
from featdiff.programs.run_log import ExecContext, ExecEval, ExecLog, ExecMemory

E = -1  # an embedding row (inject)
CTXS = (ExecContext(0, "target", "qwen3", "T.gguf", True), ExecContext(1, "draft", "dflash", "D.gguf", True))


def _request(prompt, first, seq=0, start=0):
    """One request's decodes: prefill of prompt[start:], its inject, a draft block, its verify."""
    n = len(prompt)
    pos = list(range(start, n))
    return [
        (0, prompt[start:], pos, [seq] * len(pos)),
        (1, [E] * len(pos), pos, [seq] * len(pos)),
        (1, [first, 0, 0], [n, n + 1, n + 2], [seq] * 3),
        (0, [first, 5, 6], [n, n + 1, n + 2], [seq] * 3),
    ]


def _log(decodes, memory) -> ExecLog:
    evs = tuple(
        ExecEval(i, c, tuple(t), tuple(p), tuple(s), (1,) * len(p), 0) for i, (c, t, p, s) in enumerate(decodes)
    )
    return ExecLog("libllama.so", CTXS, evs, (), (), 0, memory=tuple(memory))


def _follow(log: ExecLog):
    evals = flow_evals(log)
    return evals, {s.flow: s for s in follow_memory(log, evals)}


A, B = [10, 11, 12, 13], [20, 21, 22, 23, 24]


def _save_and_restore(draft_state: str) -> ExecLog:
    """One slot: request A, then B (the slot saves A's states first), then A again restored from
    the cache (its last prompt token decoded again at position 3)."""
    decodes = _request(A, 7) + _request(B, 8) + _request(A, 7, start=3)
    return _log(
        decodes,
        [
            ExecMemory(0, 3, "state_save", 0, state="tA"),
            ExecMemory(1, 3, "state_save", 0, state="dA"),
            ExecMemory(0, 3, "seq_rm", 0),
            ExecMemory(1, 3, "seq_rm", 0),
            ExecMemory(0, 7, "state_save", 0, state="tB"),
            ExecMemory(1, 7, "state_save", 0, state="dB"),
            ExecMemory(0, 7, "state_restore", 0, state="tA"),
            ExecMemory(1, 7, "state_restore", 0, state=draft_state),
            ExecMemory(0, 7, "seq_rm", 0, p0=3),
            ExecMemory(1, 7, "seq_rm", 0, p0=3),
        ],
    )


def test_a_restored_ram_cache_entry_brings_back_the_tokens_saved_under_its_name():
    evals, starts = _follow(_save_and_restore("dA"))
    assert sorted(starts) == [0, 1, 2]
    third = starts[2]
    assert third.n_cached == 3 and third.target == (10, 11, 12) and third.draft == (10, 11, 12)
    assert not third.unfollowed
    # a one-token prefill right after a restore starts a new request, not a verify of no drafts
    assert [e.phase for e in evals if e.flow == 2 and e.role == "target"][0] == Phase.PREFILL


def test_a_drafter_restored_from_another_saved_prompt_holds_that_prompts_features():
    _, starts = _follow(_save_and_restore("dB"))
    assert starts[2].target == (10, 11, 12) and starts[2].draft == (20, 21, 22)


def test_a_shifted_or_unseen_state_leaves_its_positions_unknown_and_says_why():
    log = _save_and_restore("dA")
    unseen = replace(
        log,
        memory=tuple(
            replace(m, state="elsewhere") if (m.op, m.state) == ("state_restore", "tA") else m for m in log.memory
        ),
    )
    _, starts = _follow(unseen)
    assert starts[2].target == (UNKNOWN,) * 3 and "never saw saved" in starts[2].unfollowed
    shift = (ExecMemory(0, 7, "seq_rm", 0, p0=1, p1=2), ExecMemory(0, 7, "seq_add", 0, p0=2, p1=-1, delta=-1))
    shifted = replace(log, memory=log.memory + shift)  # a context shift: one row out, the rest moved
    _, starts = _follow(shifted)
    assert starts[2].target[0] == 10 and UNKNOWN in starts[2].target and "seq_add" in starts[2].unfollowed


def test_a_flow_with_unknown_positions_says_which_and_why_in_one_line():
    info = FlowInfo(3, 1, (UNKNOWN,) * 82 + (119, 192), 82, unfollowed="the program moved 82 positions")
    why = info.why_unreplayable()
    assert why == (
        "flow 3 (sequence 1) starts with 82 positions (0..81) whose tokens are not known: the program moved 82 positions"
    )
    assert FlowInfo(0, 0, (1, 2, 3)).why_unreplayable() == ""


def test_a_context_shift_while_a_flow_runs_leaves_that_flow_unfollowed():
    decodes = _request(A, 7) + [(0, [9], [6], [0])]  # the shift, then the next token at its new position
    shift = (ExecMemory(0, 3, "seq_rm", 0, p0=1, p1=3), ExecMemory(0, 3, "seq_add", 0, p0=3, p1=-1, delta=-2))
    _, starts = _follow(_log(decodes, shift))
    assert "while the flow ran" in starts[0].unfollowed and "seq_add" in starts[0].unfollowed
    info = FlowInfo(0, 0, tuple(A), unfollowed=starts[0].unfollowed)
    assert info.why_unreplayable().startswith("flow 0 (sequence 0): the program moved positions of sequence 0")


def test_a_drafter_cache_of_another_prompt_is_a_wrong_source_and_the_same_one_is_nothing():
    from featdiff.diff.detectors import detect_wrong_source_restored
    from featdiff.dump.manifest import Manifest

    swapped = FlowInfo(2, 0, (10, 11, 12, 13, 7), 3, draft_cached=(20, 21, 22))
    found = detect_wrong_source_restored(Manifest("llama.cpp", {}, {}, (), (), flows=(swapped,)))
    assert found is not None and found.kind == "wrong_source" and found.fields["source"] == "another_saved_prompt"
    assert "positions 0..2" in found.message and "flow 2" in found.message
    same = replace(swapped, draft_cached=(10, 11, 12))
    assert detect_wrong_source_restored(Manifest("llama.cpp", {}, {}, (), (), flows=(same,))) is None
    unknown = replace(swapped, draft_cached=None)  # a dump before issue 30: nothing said
    assert detect_wrong_source_restored(Manifest("llama.cpp", {}, {}, (), (), flows=(unknown,))) is None


def test_a_drafter_holding_nothing_where_the_target_holds_a_prefix_is_not_conditioned():
    from featdiff.diff.detectors import detect_not_conditioned_restored
    from featdiff.dump.manifest import Manifest
    from featdiff.dump.records import NO_ROW

    empty = FlowInfo(1, 0, (10, 11, 12, 13, 7), 3, draft_cached=(10, NO_ROW, NO_ROW))
    found = detect_not_conditioned_restored(Manifest("llama.cpp", {}, {}, (), (), flows=(empty,)))
    assert found is not None and found.kind == "not_conditioned" and "positions 1..2" in found.message
    held = replace(empty, draft_cached=(10, 11, 12))
    assert detect_not_conditioned_restored(Manifest("llama.cpp", {}, {}, (), (), flows=(held,))) is None


def test_a_cache_reuse_shift_after_a_flow_ended_sets_aside_only_the_next_flow():
    """--cache-reuse: request A served, then B reuses a chunk of A's rows moved down by seq_add
    before B's prefill: A ran before the shift and is followed; B's moved rows are not modelled."""
    reused = [30, 31, 12, 13, 33]  # A's 12, 13 moved from positions 2..3 to 0..1 (B's first tokens)
    decodes = _request(A, 7) + _request(reused, 8, start=2)
    shift = (
        ExecMemory(0, 3, "seq_rm", 0, p0=0, p1=2),
        ExecMemory(0, 3, "seq_add", 0, p0=2, p1=4, delta=-2),
        ExecMemory(0, 3, "seq_rm", 0, p0=2),
    )
    _, starts = _follow(_log(decodes, shift))
    assert not starts[0].unfollowed
    assert starts[1].target == (UNKNOWN, UNKNOWN) and "seq_add" in starts[1].unfollowed
    assert "--cache-reuse" in starts[1].unfollowed


def test_an_eagle3_drafters_rows_hold_the_token_each_was_decoded_with_and_a_kept_row_shows_its_request():
    """EAGLE3 writes (token p+1, g p) at p and its encoder call writes no cache: when the next
    request keeps a prefix of 2 positions, the drafter's row 1 still pairs the earlier request's
    token at 2 (12), where the new prompt has 30."""
    ctxs = (CTXS[0], ExecContext(1, "draft", "eagle3", "D.gguf", True))
    calls = [
        (0, [10, 11, 12], [0, 1, 2], 0, "decode"),  # prefill of A = 10 11 12 13
        (1, [E, E, E], [0, 1, 2], 0, "encode"),
        (1, [11, 12], [0, 1], 0, "decode"),  # (A[p+1], g p); row 2 pending
        (1, [13], [2], 1, "decode"),  # the seed
        (0, [13, 5], [3, 4], 2, "decode"),  # verify
        (0, [30, 31], [2, 3], 0, "decode"),  # B = 10 11 30 31 32 keeps positions 0..1
    ]
    evs = tuple(
        ExecEval(i, c, tuple(t), tuple(p), (0,) * len(p), (o,) * len(p), 0, call)
        for i, (c, t, p, o, call) in enumerate(calls)
    )
    keep = (ExecMemory(0, 4, "seq_rm", 0, p0=2), ExecMemory(1, 4, "seq_rm", 0, p0=2))
    _, starts = _follow(ExecLog("libllama.so", ctxs, evs, (), (), 0, memory=keep))
    assert starts[1].n_cached == 2 and starts[1].target == (10, 11)
    assert starts[1].draft == (11, 12)  # row 1 pairs A's 12, not B's 30


def test_an_eagle3_row_kept_from_an_earlier_request_is_a_wrong_source_naming_upstreams_driver():
    from featdiff.diff.detectors import detect_wrong_source_kept_row
    from featdiff.dump.manifest import Manifest
    from featdiff.dump.records import NO_ROW

    kept = FlowInfo(1, 0, (10, 11, 30, 31, 32), 2, draft_cached=(11, 12))  # row 1 pairs A's 12, B has 30
    found = detect_wrong_source_kept_row(Manifest("llama.cpp", {}, {}, (), (), flows=(kept,)), row_token=1)
    assert found is not None and found.kind == "wrong_source" and found.fields["source"] == "another_request_row"
    assert "position 1 " in found.message and "token 12" in found.message and "flow 1" in found.message
    assert "common_speculative_impl_draft_eagle3::process" in found.message
    for held in ((11, 30), (11, NO_ROW)):  # the row the flow prescribes, or none (the prefill's bridge writes it)
        ok = replace(kept, draft_cached=held)
        assert detect_wrong_source_kept_row(Manifest("llama.cpp", {}, {}, (), (), flows=(ok,)), row_token=1) is None


def test_a_decode_holding_several_sequences_is_recorded_as_batched_rows():
    from featdiff.dump.manifest import Build
    from featdiff.programs.pack import seqs_per_decode

    alone = _log(_request(A, 7) + _request(B, 8, seq=1), [])
    assert seqs_per_decode(alone) == 1  # one sequence per decode: one after the other
    together = _log([(0, [10, 20], [0, 0], [0, 1]), (0, [11, 21, 31], [1, 1, 0], [0, 1, 2])], [])
    assert seqs_per_decode(together) == 3
    assert Build.from_json({"seqs_per_decode": 3}).seqs_per_decode == 3 and Build.from_json({}).seqs_per_decode == 1
