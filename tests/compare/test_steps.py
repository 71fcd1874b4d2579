"""A one-token-step drafter's round (diff/detectors/steps.py): the seed and each draft step of
EAGLE3 and MTP, one eval each. The positions detector on small manifests of that flow fires on
steps placed off the reference's and stays silent on the clean flow; the state detector on the
rows of one round fires where steps 2 and later repeat the state step 1 was fed."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from featdiff.core.phases import Phase
from featdiff.diff import detectors as d
from featdiff.diff import positions
from featdiff.diff.attribution import place
from featdiff.diff.detectors.steps import ANOTHER_SEQUENCE_SOURCE, SEED_STATE_SOURCE
from featdiff.diff.export import Export
from featdiff.diff.tolerance import Tolerance
from featdiff.dump import Manifest
from featdiff.dump.records import Eval

PROMPT = (5, 6, 7, 8, 9)
SEED, STEP1, STEP2 = 2, 3, 4  # evals of round 1's draft
TOL = Tolerance(rel=1e-3, sources=("test",))


def step_evals() -> list[Eval]:
    """Prefill 0..3, the catch-up decode, round 1 (seed at 4, steps at 5, 6; verify 4..7; its
    catch-up), round 2 (seed at 6, steps at 7, 8)."""
    rows = [
        ("target", Phase.PREFILL, (0, 1, 2, 3), PROMPT[:4], 0),
        ("draft", Phase.INJECT, (0, 1, 2), PROMPT[1:4], 0),
        ("draft", Phase.DRAFT, (4,), (9,), 1),
        ("draft", Phase.DRAFT, (5,), (11,), 1),
        ("draft", Phase.DRAFT, (6,), (12,), 1),
        ("target", Phase.VERIFY, (4, 5, 6, 7), (9, 11, 12, 13), 1),
        ("draft", Phase.INJECT, (3, 4, 5), (9, 11, 14), 1),
        ("draft", Phase.DRAFT, (6,), (14,), 2),
        ("draft", Phase.DRAFT, (7,), (15,), 2),
        ("draft", Phase.DRAFT, (8,), (16,), 2),
    ]
    return [
        Eval(i, role, phase, len(pos), pos, toks, (0,) * len(pos), rnd)  # type: ignore[arg-type]
        for i, (role, phase, pos, toks, rnd) in enumerate(rows)
    ]


def manifest(evals: list[Eval], source: str = "llama.cpp") -> Manifest:
    return Manifest(source, {"draft": {"architecture": "eagle3"}}, {}, tuple(evals), (), (), prompt_tokens=PROMPT)


def moved(evals: list[Eval], k: int, which: set[int]) -> list[Eval]:
    return [replace(e, positions=tuple(p + k for p in e.positions)) if e.eval in which else e for e in evals]


REF = manifest(step_evals(), source="reference")


def test_steps_after_the_seed_one_position_late_are_a_position_offset_of_the_first_step():
    run = manifest(moved(step_evals(), 1, {STEP1, STEP2}))
    f = d.detect_position_offset_of_steps(REF, run)
    assert f is not None and (f.kind, f.severity, f.tensor) == ("position_offset", "error", "inp_pos")
    assert f.fields == {"offset": 1, "role": "draft", "phase": "draft", "round": 1, "eval": STEP1}
    assert f.message.startswith("draft step 1 and every step after it of the draft of round 1 is off by +1")
    assert "decoded it at 6" in f.message and "reference decoded it at 5" in f.message
    assert place(f, Export({}, {}), ()).where == "driver"


def test_a_refused_step_still_holds_the_positions_the_driver_gave_it():
    """llama.cpp refuses the late step (a gap in the cache); the driver stops drafting there."""
    evals = [replace(e, rc=-1) if e.eval == STEP1 else e for e in moved(step_evals(), 2, {STEP1})]
    run = manifest([e for e in evals if e.eval != STEP2])
    f = d.detect_position_offset_of_steps(REF, run)
    assert f is not None and (f.fields["offset"], f.fields["eval"]) == (2, STEP1)
    assert "two positions late" not in f.message and "2 positions late" in f.message and "refused" in f.message
    # the reference that follows the run decodes only the steps the run made: the flow places the rest
    ref = manifest([e for e in step_evals() if e.eval not in (STEP1, STEP2)], source="reference")
    f = d.detect_position_offset_of_steps(ref, run)
    assert f is not None and (f.fields["offset"], f.fields["eval"]) == (2, STEP1)
    assert "where the flow puts it at 5" in f.message


def test_a_seed_off_with_its_steps_is_named_at_the_seed():
    run = manifest(moved(step_evals(), -1, {SEED, STEP1, STEP2}))
    f = d.detect_position_offset_of_steps(REF, run)
    assert f is not None and (f.fields["offset"], f.fields["eval"]) == (-1, SEED)
    assert f.message.startswith("the seed of the draft of round 1 is off by -1 (one position early)")


def test_step_positions_silent_on_the_clean_flow_steps_off_by_varying_amounts_and_another_seed_token():
    assert d.detect_position_offset_of_steps(REF, manifest(step_evals())) is None
    assert d.detect_position_offset_of_steps(REF, manifest(moved(moved(step_evals(), 1, {STEP1}), 2, {STEP2}))) is None
    other_seed = [replace(e, token_ids=(10,)) if e.eval == SEED else e for e in moved(step_evals(), 1, {STEP1, STEP2})]
    assert d.detect_position_offset_of_steps(REF, manifest(other_seed)) is None


def test_a_later_round_is_checked_while_the_histories_agree_and_not_after():
    late2 = moved(step_evals(), 1, {8, 9})
    f = d.detect_position_offset_of_steps(REF, manifest(late2))
    assert f is not None and (f.fields["round"], f.fields["eval"]) == (2, 8)
    other_verify = [replace(e, token_ids=(9, 11, 12, 20)) if e.eval == 5 else e for e in late2]
    assert d.detect_position_offset_of_steps(REF, manifest(other_verify)) is None


def test_check_batches_names_the_late_steps_of_a_step_drafter():
    found = positions.check_batches(REF, manifest(moved(step_evals(), 1, {STEP1, STEP2})))
    assert [(f.kind, f.fields["eval"]) for f in found] == [("position_offset", STEP1)]
    assert positions.check_batches(REF, manifest(step_evals())) == ()


# --- the state a step is fed ----------------------------------------------------------------------


def _round_rows(n: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)


def _evidence(record: str, ref: np.ndarray, run: np.ndarray, first: int = 20) -> d.Evidence:
    pos = tuple(range(first, first + len(ref)))
    return d.Evidence(record, ref, run, TOL, positions=pos, ref_all=ref, ref_all_positions=pos, record=record)


def test_steps_fed_the_seeds_state_are_a_wrong_source_seed_state():
    for record in ("g_norm-0", "mtp_h_input", "mtp_hnorm-6"):
        ref = _round_rows()
        run = ref.copy()
        run[2:] = ref[1]
        f = d.detect_wrong_source_of_step_state(_evidence(record, ref, run))
        assert f is not None and (f.kind, f.tensor) == ("wrong_source", record), record
        assert f.fields == {"source": SEED_STATE_SOURCE, "candidate": f"{record} of step 1 (position 21)"}
        assert "steps 2 to 3 (positions 22..23)" in f.message
        assert place(f, Export({}, {}), ()).where == "driver"
    ref = _round_rows(3)
    run = ref.copy()
    run[2] = ref[1]
    f = d.detect_wrong_source_of_step_state(_evidence("g_norm-0", ref, run))
    assert f is not None and f.message.startswith(
        "g_norm-0 of draft step 2 (position 22) holds the state step 1 was fed"
    )


def test_step_state_silent_on_other_records_other_rows_and_rows_not_step_1s():
    ref = _round_rows()
    run = ref.copy()
    run[2:] = ref[1]
    assert d.detect_wrong_source_of_step_state(_evidence("l_out-0", ref, run)) is None  # not a fed state
    assert d.detect_wrong_source_of_step_state(_evidence("g_norm-0", ref, ref.copy())) is None  # clean
    noise = ref.copy()
    noise[2:] = _round_rows(2, seed=1)
    assert d.detect_wrong_source_of_step_state(_evidence("g_norm-0", ref, noise)) is None  # not step 1's
    step1_too = run.copy()
    step1_too[1] = ref[0]
    assert d.detect_wrong_source_of_step_state(_evidence("g_norm-0", ref, step1_too)) is None  # step 1 wrong too
    ev = _evidence("g_norm-0", ref, run)
    gap = replace(ev, positions=(20, 21, 22, 30))  # not one round of consecutive steps
    assert d.detect_wrong_source_of_step_state(gap) is None
    assert d.detect_wrong_source_of_step_state(_evidence("g_norm-0", ref[:2], run[:2])) is None  # no step 2


def test_steps_fed_a_state_row_never_written_are_zeros_from_the_driver():
    for record in ("g_norm-0", "mtp_h_input", "mtp_hnorm-6"):
        ref = _round_rows()
        run = ref.copy()
        run[1:] = 0.0
        f = d.detect_zeros_of_step_state(_evidence(record, ref, run))
        assert f is not None and (f.kind, f.tensor, f.fields) == ("zeros", record, {"rows": [21, 22, 23]}), record
        assert f.message.startswith(f"{record} of draft steps 1, 2, 3 (positions 21, 22, 23) is all zeros")
        assert place(f, Export({}, {}), ()).where == "driver"
    ref = _round_rows(3)
    run = ref.copy()
    run[2] = 0.0
    f = d.detect_zeros_of_step_state(_evidence("g_norm-0", ref, run))
    assert f is not None and f.fields["rows"] == [22] and "draft step 2 (position 22)" in f.message


def test_step_zeros_silent_on_other_records_the_seed_and_other_errors():
    ref = _round_rows()
    run = ref.copy()
    run[1:] = 0.0
    assert d.detect_zeros_of_step_state(_evidence("l_out-0", ref, run)) is None  # not a fed state
    assert d.detect_zeros_of_step_state(_evidence("g_norm-0", ref, ref.copy())) is None  # clean
    seed_too = run.copy()
    seed_too[0] = 0.0
    assert d.detect_zeros_of_step_state(_evidence("g_norm-0", ref, seed_too)) is None  # the seed's row: not a step's
    other = run.copy()
    other[0] = _round_rows(1, seed=1)[0]
    assert d.detect_zeros_of_step_state(_evidence("g_norm-0", ref, other)) is None  # another row wrong too
    gap = replace(_evidence("g_norm-0", ref, run), positions=(20, 21, 22, 30))  # not one round of steps
    assert d.detect_zeros_of_step_state(gap) is None


def test_steps_fed_another_sequences_state_name_that_sequence():
    """Two sequences drafting in the same decodes; this flow's steps 1.. were handed the rows the
    other sequence's steps made (patch 0014's `*-step-other-seq`): wrong_source another_sequence,
    naming the flow and sequence, placed in the driver."""
    for record in ("g_norm-0", "mtp_h_input", "mtp_hnorm-6"):
        ref, other = _round_rows(), _round_rows(seed=5)
        run = ref.copy()
        run[1:] = other[1:]
        labels = tuple((0, 0, p) for p in range(20, 24))
        ev = replace(_evidence(record, ref, run), siblings=other, sibling_rows=labels)
        f = d.detect_wrong_source_of_another_sequence(ev)
        assert f is not None and (f.kind, f.tensor) == ("wrong_source", record), record
        assert f.fields == {"source": ANOTHER_SEQUENCE_SOURCE, "candidate": "flow 0 (sequence 0)"}
        assert f.message.startswith(f"{record} at positions 21, 22, 23 holds another sequence's state")
        assert place(f, Export({}, {}), ()).where == "driver"


def test_another_sequence_silent_without_siblings_or_where_the_rows_are_no_siblings():
    ref, other = _round_rows(), _round_rows(seed=5)
    run = ref.copy()
    run[1:] = other[1:]
    labels = tuple((0, 0, p) for p in range(20, 24))
    ev = replace(_evidence("g_norm-0", ref, run), siblings=other, sibling_rows=labels)
    assert d.detect_wrong_source_of_another_sequence(replace(ev, siblings=None, sibling_rows=())) is None  # one flow
    assert d.detect_wrong_source_of_another_sequence(replace(ev, record="l_out-0")) is None  # not a fed state
    assert d.detect_wrong_source_of_another_sequence(replace(ev, run=ref.copy())) is None  # clean
    noise = ref.copy()
    noise[1:] = _round_rows(seed=9)[1:]
    assert d.detect_wrong_source_of_another_sequence(replace(ev, run=noise)) is None  # nobody's rows
    same = replace(ev, siblings=ref.copy())  # the other sequence's rows are this one's own (same prompt)
    assert d.detect_wrong_source_of_another_sequence(replace(same, run=noise)) is None
    zeros = ref.copy()
    zeros[1:] = 0.0  # every sequence's steps fed zeros: zeros' finding, not another sequence's
    assert d.detect_wrong_source_of_another_sequence(replace(ev, run=zeros, siblings=np.zeros_like(ref))) is None


def test_the_step_state_records_are_each_step_drafter_kinds_own():
    """The kinds registry says which records hold a step's state: EAGLE3's g (per layer) and the MTP
    head's hidden input and its norm; nothing else, and no name that merely starts alike."""
    from featdiff.kinds.registry import is_step_state

    assert all(map(is_step_state, ["g_norm-0", "mtp_h_input", "mtp_hnorm-6", "mtp_hnorm-48"]))
    assert not any(map(is_step_state, ["g_norm", "mtp_h_input-2", "mtp_hnormx", "result_output", "l_out-3"]))
