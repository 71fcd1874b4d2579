"""Token ids and positions as evidence (diff/detectors/positions.py and kvcache.py): each
detector on small manifests of the synthetic flow (synth.py, docs/flow.md) fires on its planted
fault with the row, expected and observed, and stays silent on the clean flow."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from featdiff.core.phases import Phase
from featdiff.diff import comparison, detectors, positions
from featdiff.diff.fields import PositionOffsetFields, fields_of
from featdiff.diff.tolerance import Tolerance
from featdiff.dump.manifest import Manifest
from featdiff.dump.records import Eval, MemoryOp

import synth

SPEC = synth.Spec()  # prompt of 8 tokens: prefill 0..6; round 1 at 7..10, round 2 at 9..12
PROMPT = SPEC.prompt
FIRST_DRAFT, FIRST_VERIFY, FIRST_INJECT = 2, 3, 4  # evals of round 1


def clean_evals() -> list[Eval]:
    evals, _ = synth.flow(SPEC)
    return [e for e, _, _ in evals]


def clean_ops(evals: list[Eval]) -> tuple[MemoryOp, ...]:
    """The removals of docs/flow.md on the draft context: the draft block after each draft eval,
    the rejected rows (positions >= the new n_past) after each round's inject."""
    _, rounds = synth.flow(SPEC)
    ops = []
    for r in rounds:
        draft = next(e for e in evals if e.round == r.round and e.phase == "draft")
        inject = next(e for e in evals if e.round == r.round and e.phase == "inject")
        ops += [
            MemoryOp("draft", draft.eval, 0, r.pos0, -1),
            MemoryOp("draft", inject.eval, 0, r.pos0 + r.accepted + 1, -1),
        ]
    return tuple(ops)


def manifest(evals: list[Eval], source: str = "llama.cpp", **kw) -> Manifest:
    _, rounds = synth.flow(SPEC)
    kw.setdefault("prompt_tokens", PROMPT)
    return Manifest(source, {"draft": {"mask_token_id": synth.MASK}}, {}, tuple(evals), (), tuple(rounds), **kw)


def changed(evals: list[Eval], index: int, **fields) -> list[Eval]:
    return [replace(e, **fields) if e.eval == index else e for e in evals]


def shifted(evals: list[Eval], k: int, where) -> list[Eval]:
    return [replace(e, positions=tuple(p + k for p in e.positions)) if where(e) else e for e in evals]


REF = manifest(clean_evals(), source="reference")


def test_clean_flow_has_no_finding():
    evals = clean_evals()
    assert positions.check_batches(REF, manifest(evals, memory_ops=clean_ops(evals))) == ()
    assert positions.history_divergence(REF, manifest(evals)) is None


# --- block_token ---------------------------------------------------------------------------------


def test_block_token_found_when_the_anchor_is_a_mask_token():
    run = manifest(changed(clean_evals(), FIRST_DRAFT, token_ids=(synth.MASK,) * 4))
    f = detectors.detect_block_token(REF, run)
    assert (f.kind, f.severity, f.tensor) == ("block_token", "error", "inp_noise_embd")
    assert f.fields == {"row": 0, "expected": PROMPT[-1], "observed": synth.MASK, "round": 1, "eval": FIRST_DRAFT}
    assert f.message.startswith(
        f"row 0 of the draft block of round 1 is token {synth.MASK} (the mask token); "
        f"the flow expects the anchor {PROMPT[-1]}, the last accepted target token"
    )


def test_block_token_found_when_a_mask_row_carries_another_token():
    run = manifest(changed(clean_evals(), 5, token_ids=(42, synth.MASK, 17, synth.MASK)))
    f = detectors.detect_block_token(REF, run)
    assert f.fields == {"row": 2, "expected": synth.MASK, "observed": 17, "round": 2, "eval": 5}


def test_block_token_found_when_the_block_is_shorter_than_the_references():
    evals = changed(
        clean_evals(),
        FIRST_DRAFT,
        token_ids=(PROMPT[-1], synth.MASK, synth.MASK),
        n_tokens=3,
        positions=(7, 8, 9),
        seq_ids=(0,) * 3,
    )
    f = detectors.detect_block_token(REF, manifest(evals))
    assert (f.fields["row"], f.fields["expected"], f.fields["observed"]) == (3, synth.MASK, None)
    assert "has 3 rows where the reference's has 4" in f.message


def test_block_token_takes_the_mask_from_the_reference_blocks_when_no_manifest_states_it():
    bare = Manifest(
        "llama.cpp", {}, {}, tuple(changed(clean_evals(), FIRST_DRAFT, token_ids=(PROMPT[-1], 5, 5, 5))), ()
    )
    f = detectors.detect_block_token(replace(REF, models={}), bare)
    assert (f.fields["row"], f.fields["expected"], f.fields["observed"]) == (1, synth.MASK, 5)


def test_block_token_silent_on_the_clean_flow():
    assert detectors.detect_block_token(REF, manifest(clean_evals())) is None


# --- position_offset -----------------------------------------------------------------------------


def test_inject_rows_one_position_late_are_a_position_offset_of_the_inject_batch():
    run = manifest(shifted(clean_evals(), 1, lambda e: e.eval == 1))
    f = detectors.detect_position_offset_of_batch(REF, run)
    assert (f.kind, f.tensor) == ("position_offset", "inp_pos")
    assert f.fields == {"offset": 1, "role": "draft", "phase": "inject", "round": 0, "eval": 1}
    assert "positions of the inject batch of round 0 are off by +1 (one position late)" in f.message


def test_both_producers_of_position_offset_fill_one_record_and_only_a_batch_names_a_group():
    """A batch's `position_offset` says where it is (role .. eval), a record's values only the
    offset: one record for both, and compare's row-shift suppression reads the batch's group and
    passes over the other (it once indexed a `role` only the batch's has)."""
    batch = detectors.detect_position_offset_of_batch(REF, manifest(shifted(clean_evals(), 1, lambda e: e.eval == 1)))
    ref = np.arange(10, 14, dtype=np.float64)[:, None]  # (4, 1) positions
    values = detectors.detect_position_offset_of_record(
        detectors.Evidence("inp_pos", ref, ref + 1, Tolerance(rel=0.0, sources=("exact",)), is_integer=True)
    )
    assert fields_of(values) == PositionOffsetFields(offset=1)
    assert fields_of(batch) == PositionOffsetFields(offset=1, role="draft", phase=Phase.INJECT, round=0, eval=1)
    assert comparison._misplaced_groups((values, batch)) == {("draft", Phase.INJECT, 0)}


def test_draft_block_one_position_late_is_a_position_offset_of_the_draft_batch():
    f = detectors.detect_position_offset_of_batch(
        REF, manifest(shifted(clean_evals(), 1, lambda e: e.eval == FIRST_DRAFT))
    )
    assert (f.fields["phase"], f.fields["round"], f.fields["offset"], f.fields["eval"]) == ("draft", 1, 1, FIRST_DRAFT)


def test_n_past_drifting_after_an_accept_is_named_at_the_next_verify():
    """The block and the verify of round 2 both one late: the target's n_past, not the block."""
    run = manifest(shifted(clean_evals(), 1, lambda e: e.round == 2))
    f = detectors.detect_position_offset_of_batch(REF, run)
    assert (f.fields["phase"], f.fields["round"], f.fields["offset"], f.fields["eval"]) == ("verify", 2, 1, 6)
    assert "n_past drifted after the accept of round 1" in f.message


def test_n_past_drift_is_found_although_the_run_records_another_accepted_count():
    """A capture derives `accepted` from where the next decode starts: drift reads as one more."""
    _, rounds = synth.flow(SPEC)
    drifted = [replace(r, accepted=r.accepted + 1) if r.round == 1 else r for r in rounds]
    run = replace(manifest(shifted(clean_evals(), 1, lambda e: e.round == 2)), rounds=tuple(drifted))
    f = detectors.detect_position_offset_of_batch(REF, run)
    assert (f.fields["phase"], f.fields["round"], f.fields["offset"]) == ("verify", 2, 1)


def test_inject_off_its_verify_is_found_even_after_the_histories_part():
    """Once the run drafts other tokens the reference's positions say nothing; the flow still does."""
    evals = changed(clean_evals(), FIRST_VERIFY, token_ids=(PROMPT[-1], 70, 71, 72))
    run = manifest(shifted(evals, -1, lambda e: e.round == 2 and e.phase == "inject"))
    f = detectors.detect_position_offset_of_batch(REF, run)
    assert (f.fields["phase"], f.fields["round"], f.fields["offset"]) == ("inject", 2, -1)
    assert "those of the target rows it carries, 9..12" in f.message


def test_later_positions_are_not_compared_with_the_reference_after_another_accept():
    """Accepting another count moves the next block and changes its anchor (t_accepted): the
    block is not compared with the reference's, so that is not an offset of the run."""
    evals = shifted(clean_evals(), 1, lambda e: e.round == 2)
    evals = [
        replace(e, token_ids=(43,) + e.token_ids[1:]) if e.round == 2 and e.phase != "inject" else e for e in evals
    ]
    assert detectors.detect_position_offset_of_batch(REF, manifest(evals)) is None


def test_position_offset_silent_on_the_clean_flow():
    assert detectors.detect_position_offset_of_batch(REF, manifest(clean_evals())) is None


# --- the draft KV cache: stale, duplicate_rows ---------------------------------------------------


def test_stale_rows_found_when_the_rejected_rows_stay_in_the_draft_cache():
    evals = clean_evals()
    ops = tuple(op for op in clean_ops(evals) if op.after_eval != FIRST_INJECT)  # no seq_rm(n_past) in round 1
    f = detectors.detect_stale_cache(manifest(evals, memory_ops=ops))
    assert (f.kind, f.tensor, f.severity) == ("stale", "Kcur_injected-*", "error")
    assert (f.fields["rows"], f.fields["source_eval"], f.fields["round"], f.fields["eval"]) == (
        [9, 10],
        FIRST_INJECT,
        2,
        5,
    )
    assert "holds positions 9..10" in f.fields["detail"] and "starts at n_past 9" in f.message


def test_a_draft_block_never_removed_leaves_its_accepted_rows_twice():
    """The block's rows 7..10 stay; the inject writes 7..10 again; the accept removes 9.. of both."""
    evals = clean_evals()
    ops = tuple(op for op in clean_ops(evals) if op.after_eval != FIRST_DRAFT)
    m = manifest(evals, memory_ops=ops)
    f = detectors.detect_duplicate_rows(m)
    assert (f.fields["rows"], f.fields["source_evals"], f.fields["round"]) == ([7, 8], [FIRST_DRAFT, FIRST_INJECT], 2)
    assert detectors.detect_stale_cache(m) is None


def test_stale_says_nothing_without_memory_ops_or_on_the_clean_flow():
    evals = clean_evals()
    assert detectors.detect_stale_cache(manifest(evals)) is None
    assert detectors.detect_stale_cache(manifest(evals, memory_ops=clean_ops(evals))) is None


def _inject_twice(evals: list[Eval]) -> list[Eval]:
    """Round 1's inject decoded twice (the second renumbered after it, later evals moved on)."""
    again = replace(evals[FIRST_INJECT], eval=FIRST_INJECT + 1)
    return evals[: FIRST_INJECT + 1] + [again] + [replace(e, eval=e.eval + 1) for e in evals[FIRST_INJECT + 1 :]]


def test_duplicate_rows_found_from_memory_ops():
    evals = _inject_twice(clean_evals())
    ops = (
        MemoryOp("draft", FIRST_DRAFT, 0, 7, -1),
        MemoryOp("draft", FIRST_INJECT + 1, 0, 9, -1),
        MemoryOp("draft", 6, 0, 9, -1),
        MemoryOp("draft", 8, 0, 11, -1),
    )
    f = detectors.detect_duplicate_rows(manifest(evals, memory_ops=ops))
    assert (f.kind, f.severity) == ("duplicate_rows", "error")
    assert (f.fields["rows"], f.fields["source_evals"], f.fields["round"]) == ([7, 8], [4, 5], 2)
    assert detectors.detect_stale_cache(manifest(evals, memory_ops=ops)) is None


def test_duplicate_rows_found_without_memory_ops_from_two_injects_of_one_round():
    f = detectors.detect_duplicate_rows(manifest(_inject_twice(clean_evals())))
    assert (f.fields["rows"], f.fields["source_evals"], f.fields["round"], f.fields["eval"]) == (
        [7, 8, 9, 10],
        [4, 5],
        1,
        5,
    )


def test_duplicate_rows_silent_on_the_clean_flow():
    evals = clean_evals()
    assert detectors.detect_duplicate_rows(manifest(evals)) is None
    assert detectors.detect_duplicate_rows(manifest(evals, memory_ops=clean_ops(evals))) is None


def test_a_removal_between_two_injects_is_not_a_duplicate():
    evals = _inject_twice(clean_evals())
    ops = (
        MemoryOp("draft", FIRST_DRAFT, 0, 7, -1),
        MemoryOp("draft", FIRST_INJECT, 0, 7, -1),
        MemoryOp("draft", FIRST_INJECT + 1, 0, 9, -1),
        MemoryOp("draft", 6, 0, 9, -1),
    )
    assert detectors.detect_duplicate_rows(manifest(evals, memory_ops=ops)) is None


# --- the prompt, the producer's notes, where histories part --------------------------------------


def test_another_prompt_is_an_unpaired_error_naming_the_first_differing_token():
    run = manifest(clean_evals(), prompt_tokens=PROMPT[:3] + (50,) + PROMPT[4:])
    f = detectors.detect_unpaired_prompt(REF, run)
    assert (f.kind, f.severity, f.fields["reason"], f.fields["row"]) == ("unpaired", "error", "prompt", 3)
    assert (f.fields["expected"], f.fields["observed"]) == (PROMPT[3], 50)
    # the fix is the program's own prompt, never the run's tokens (a faulty driver changes those)
    assert "give `featdiff reference --tokens` the prompt the program was given" in f.message
    assert "5,9,2,50" not in f.message


def test_a_run_whose_first_anchor_differs_is_not_another_prompt():
    # the last prompt token is the first draft block's anchor: a driver fault there is a block_token
    run = manifest(clean_evals(), prompt_tokens=PROMPT[:-1] + (511,))
    assert detectors.detect_unpaired_prompt(REF, run) is None


def test_prompt_silent_when_equal_or_unknown():
    assert detectors.detect_unpaired_prompt(REF, manifest(clean_evals())) is None
    assert detectors.detect_unpaired_prompt(REF, manifest(clean_evals(), prompt_tokens=())) is None


def test_flow_notes_become_a_finding():
    note = "eval 9: a token batch on the drafter while a draft awaited its verify; taken as a new round"
    f = detectors.detect_flow_note(manifest(clean_evals(), flow_notes=(note,)))
    assert (f.kind, f.severity, f.fields["notes"]) == ("flow_note", "error", [note])
    assert detectors.detect_flow_note(manifest(clean_evals())) is None


def test_check_batches_lists_findings_in_the_order_the_run_met_them():
    evals = shifted(changed(clean_evals(), 5, token_ids=(synth.MASK,) * 4), 1, lambda e: e.eval == 1)
    found = positions.check_batches(REF, manifest(evals, flow_notes=("a note",)))
    assert [(f.kind, f.fields.get("eval")) for f in found] == [
        ("position_offset", 1),
        ("block_token", 5),
        ("flow_note", None),
    ]


def test_history_divergence_names_the_first_batch_decoded_otherwise():
    run = manifest(changed(clean_evals(), FIRST_DRAFT, token_ids=(synth.MASK,) * 4))
    where = positions.history_divergence(REF, run)
    assert where.startswith(f"the draft block of round 1: the run decoded [{synth.MASK}, {synth.MASK}")


@pytest.mark.parametrize("k,word", [(1, "one position late"), (-2, "2 positions early")])
def test_position_offset_says_late_or_early(k, word):
    f = detectors.detect_position_offset_of_batch(
        REF, manifest(shifted(clean_evals(), k, lambda e: e.eval == FIRST_INJECT))
    )
    assert f.fields["offset"] == k and word in f.message


def test_rows_staged_twice_in_one_inject_batch_are_duplicate_rows():
    evals = clean_evals()
    twice = replace(evals[1], n_tokens=14, positions=evals[1].positions * 2, seq_ids=(0,) * 14)
    f = detectors.detect_duplicate_rows(manifest([twice if e.eval == 1 else e for e in evals]))
    assert (f.fields["rows"], f.fields["source_evals"], f.fields["round"]) == (list(range(7)), [1], 0)
    assert "the inject batch of round 0 carries each of them twice" in f.message


def test_a_refused_batch_that_repeats_positions_is_named_as_refused_not_held():
    evals = clean_evals()
    twice = replace(evals[1], n_tokens=14, positions=evals[1].positions * 2, seq_ids=(0,) * 14, rc=-1)
    f = detectors.detect_duplicate_rows(
        manifest([twice if e.eval == 1 else e for e in evals], memory_ops=clean_ops(evals))
    )
    assert f.fields["rows"] == list(range(7)) and "llama.cpp refused it (rc -1)" in f.message
    assert "held twice" not in f.message
