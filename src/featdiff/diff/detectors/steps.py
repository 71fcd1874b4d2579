"""Detectors of a one-token-step drafter's round (EAGLE3, MTP: docs/flow.md): the seed decode and
each draft step after it, one eval each. `detect_position_offset_of_steps` reads the two
manifests only; `detect_wrong_source_of_step_state` and `detect_zeros_of_step_state` one divergent
pair's evidence. All pure; each sentence a finding says is written beside its detector. (A block's
positions, one batch per round: positions.detect_position_offset_of_batch.)
"""

from __future__ import annotations

import numpy as np

from featdiff.core import names
from featdiff.core.names import ROLE_DRAFT
from featdiff.core.phases import Phase
from featdiff.diff.batches import Batch, batches, decoded_alike
from featdiff.diff.detectors.base import Evidence, error_finding, explains, labels, same_shape
from featdiff.diff.fields import PositionOffsetFields, WrongSourceFields, ZerosFields
from featdiff.diff.metrics import row_relative_error
from featdiff.diff.result import Finding
from featdiff.dump import Manifest
from featdiff.kinds.registry import is_step_state

# wrong_source's `source` when a draft step past the first was fed the state the seed made (the
# state step 1 was fed) instead of the previous step's (docs/findings.md)
SEED_STATE_SOURCE = "seed_state"
# wrong_source's `source` when a draft step of one sequence was fed another sequence's state (the
# row that sequence's step made, in the same decode)
ANOTHER_SEQUENCE_SOURCE = "another_sequence"


# --- the positions of the seed and each step -----------------------------------------------------


def detect_position_offset_of_steps(ref: Manifest, run: Manifest) -> Finding | None:
    """Hypothesis: the driver decoded a round's seed, or its draft steps after the seed, at
    positions off by a constant (each step one position late). Evidence, in flow order: each
    one-token draft eval of the run against the reference's eval of the same index in the same
    round (past the steps the reference decoded, the flow's: the seed's position + the step),
    while both sides decoded the same tokens so far; the first eval off by k != 0 from which every
    later one of the round is off by the same k. A refused decode (llama.cpp refuses a step that
    leaves a gap in the cache; a reference that follows the run leaves it out) still holds the
    positions the driver gave it."""
    ref_batches = batches(ref)
    same_history = run.prompt_tokens == ref.prompt_tokens
    for key, batch in batches(run).items():
        ref_batch = ref_batches.get(key) if same_history else None
        if ref_batch is None:
            return None
        if (
            key[:2] == (ROLE_DRAFT, Phase.DRAFT)
            and len(batch.evals) > 1
            and _one_token(batch)
            and _one_token(ref_batch)
        ):
            found = _step_offset(batch, ref_batch)
            if found is not None:
                return _step_finding(batch, ref_batch, *found)
        same_history = decoded_alike(batch, ref_batch)
    return None


def _one_token(batch: Batch) -> bool:
    return all(len(ev.positions) == 1 for ev in batch.evals)


def _expected(ref_batch: Batch, step: int) -> int:
    """Where step `step` of the round sits: the reference's, else the seed's position + the step."""
    if step < len(ref_batch.evals):
        return ref_batch.evals[step].positions[0]
    return ref_batch.evals[0].positions[0] + step


def _step_offset(batch: Batch, ref_batch: Batch) -> tuple[int, int] | None:
    """(the first step off, its offset k) when from that step on every step of the round is off
    by the same k != 0 from where the reference (or the flow) puts it; None when none is, or the
    offsets vary."""
    if batch.evals[0].token_ids != ref_batch.evals[0].token_ids:
        return None  # another seed token: another history
    offsets = [ev.positions[0] - _expected(ref_batch, i) for i, ev in enumerate(batch.evals)]
    first = next((i for i, k in enumerate(offsets) if k != 0), None)
    if first is None or len(set(offsets[first:])) != 1:
        return None
    return first, offsets[first]


def _step_finding(batch: Batch, ref_batch: Batch, step: int, k: int) -> Finding:
    ev, at = batch.evals[step], _expected(ref_batch, step)
    by = "the reference decoded it" if step < len(ref_batch.evals) else "the flow puts it"
    rnd = batch.key[2]
    late = "late" if k > 0 else "early"
    how = "one position" if abs(k) == 1 else f"{abs(k)} positions"
    what = (
        "the seed"
        if step == 0
        else f"draft step {step}" + (" and every step after it" if step < len(batch.evals) - 1 else "")
    )
    refused = " (llama.cpp refused it: a step must follow the last position the cache holds)" if ev.rc else ""
    expected = (
        "the seed sits at the pending position (the last row the target handed over)"
        if step == 0
        else "each draft step sits one position after the step before it (the seed's position + the step)"
    )
    return Finding.of(
        PositionOffsetFields(offset=k, role=ROLE_DRAFT, phase=Phase.DRAFT, round=rnd, eval=ev.eval),
        tensor=names.INP_POS,
        message=f"{what} of the draft of round {rnd} is off by {k:+d} ({how} {late}): the run decoded it at "
        f"{ev.positions[0]}{refused} where {by} at {at}; {expected}: "
        "check the position the driver gives each step",
    )


# --- the state each step is fed -------------------------------------------------------------------


def detect_wrong_source_of_step_state(ev: Evidence) -> Finding | None:
    """Hypothesis: a one-token-step drafter's draft step k >= 2 was fed the state the seed made
    (the one step 1 was fed) instead of the previous step's. Evidence: at a record holding the
    state a step is fed, in a round of one row per position (the seed at p0, step k at p0 + k),
    the divergent rows are steps 2 and later, and each equals the reference's row of step 1."""
    if not is_step_state(ev.record) or not same_shape(ev) or len(ev.positions) < 3 or ev.ref_all is None:
        return None
    pos = np.asarray(ev.positions)
    if not np.array_equal(pos, pos[0] + np.arange(len(pos))):
        return None
    bad = row_relative_error(ev.ref, ev.run) > ev.tolerance.row_rel
    if bad[:2].any() or not bad[2:].all():
        return None
    step1 = ev.ref[1:2]
    if not np.all(row_relative_error(np.repeat(step1, len(pos) - 2, axis=0), ev.run[2:]) <= ev.tolerance.row_rel):
        return None
    steps = (
        f"draft step 2 (position {int(pos[2])})"
        if len(pos) == 3
        else f"draft steps 2 to {len(pos) - 1} (positions {int(pos[2])}..{int(pos[-1])})"
    )
    return error_finding(
        ev,
        f"{ev.tensor} of {steps} holds the state "
        f"step 1 was fed, the one the seed made (position {int(pos[0])}): the driver hands every step after the "
        "first the seed's state again; hand step k the state step k - 1 made (its output row)",
        WrongSourceFields(source=SEED_STATE_SOURCE, candidate=f"{ev.record} of step 1 (position {int(pos[1])})"),
    )


def detect_zeros_of_step_state(ev: Evidence) -> Finding | None:
    """Hypothesis: a one-token-step drafter's draft steps were fed a state row the driver never
    wrote (zeros) instead of the state the step before made. Evidence: at a record holding the
    state a step is fed, in a round of one row per position (the seed at p0, step k at p0 + k),
    all-zero run rows where the reference's are not, none of them the seed's, every other row
    within tolerance. (The step before made its state right: this is the first divergence.)"""
    if not is_step_state(ev.record) or not same_shape(ev) or len(ev.positions) < 2:
        return None
    pos = np.asarray(ev.positions)
    if not np.array_equal(pos, pos[0] + np.arange(len(pos))):
        return None
    zero = ~np.any(ev.run, axis=1) & np.any(ev.ref, axis=1)  # (n_tokens,)
    if zero[0] or not zero.any() or not explains(ev.ref[~zero], ev.run[~zero], ev.tolerance):
        return None
    steps = [int(k) for k in np.flatnonzero(zero)]
    which = f"draft step {steps[0]}" if len(steps) == 1 else "draft steps " + ", ".join(map(str, steps))
    rows = labels(ev, zero)
    return error_finding(
        ev,
        f"{ev.tensor} of {which} (position{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows))}) is all "
        "zeros: the driver fed the step a state row it never wrote, where the step before made its state right; "
        "hand step k the state step k - 1 made (its output row)",
        ZerosFields(rows=rows),
    )


def detect_wrong_source_of_another_sequence(ev: Evidence) -> Finding | None:
    """Hypothesis: in a run of several sequences, a one-token-step drafter's draft steps were fed
    another sequence's state: the row that sequence's own step made, handed on in the same decode.
    Evidence: at a record holding the state a step is fed, every divergent run row equals, within
    tolerance, a run row of another flow beside it (`siblings`), while the reference's row there
    is not that row; the rows within tolerance of the reference stay so."""
    if not is_step_state(ev.record) or not same_shape(ev) or ev.siblings is None or not len(ev.siblings):
        return None
    bad = row_relative_error(ev.ref, ev.run) > ev.tolerance.row_rel  # (R,)
    if not bad.any() or not np.any(ev.run[bad], axis=1).all():
        return None  # a zero row is nobody's state (zeros' finding)
    owners = []
    for i in np.flatnonzero(bad):
        errors = row_relative_error(ev.siblings, np.repeat(ev.run[i : i + 1], len(ev.siblings), axis=0))  # (S,)
        j = int(np.argmin(errors))
        if errors[j] > ev.tolerance.row_rel or explains(ev.ref[i : i + 1], ev.siblings[j : j + 1], ev.tolerance):
            return None
        owners.append(ev.sibling_rows[j])
    flows = sorted({(f, s) for f, s, _ in owners})
    whose = ", ".join(f"flow {f} (sequence {s})" for f, s in flows)
    rows = labels(ev, bad)
    return error_finding(
        ev,
        f"{ev.tensor} at position{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows))} holds another "
        f"sequence's state: the row {whose} made in the same decode, where this sequence's own step made "
        "another; the driver handed this sequence's draft step another sequence's row (an index into the "
        "decode's rows, or a buffer kept per drafter instead of per sequence); hand each sequence's step "
        "the row its own step made",
        WrongSourceFields(source=ANOTHER_SEQUENCE_SOURCE, candidate=whose),
    )
