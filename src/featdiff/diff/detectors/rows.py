"""Detectors of rows and layouts: rows shifted within a batch or staged from other positions, a
buffer read in another axis order, and a record computed at offset positions (RoPE'd values,
`inp_pos`). Each `detect_<kind>(ev)` tests one hypothesis on one divergent pair's `Evidence`
and returns `Finding | None`; its sentence is written beside it.
"""

from __future__ import annotations

import numpy as np

from featdiff.core import names
from featdiff.diff.detectors.base import (
    Evidence,
    at_positions,
    error_finding,
    explains,
    labels,
    rotate,
    same_shape,
    shifts,
)
from featdiff.diff.fields import (
    LayoutTransposeFields,
    MisplacedRowsFields,
    PositionOffsetFields,
    RowShiftFields,
)
from featdiff.diff.metrics import row_relative_error
from featdiff.diff.result import Finding

MAX_ROW_SHIFT = 8  # rows: a block is 4..16 rows; a shift past that is not a shift
MAX_POSITION_OFFSET = 8  # RoPE positions tried on either side


def detect_row_shift(ev: Evidence) -> Finding | None:
    """Hypothesis: run row at position p holds the ref row of p + s, one s != 0 for all rows.
    Evidence: every run row whose p + s exists in the ref group matches it; at most |s| rows fall off."""
    if ev.ref_all is None or not ev.positions or not same_shape(ev):
        return None
    ref_at = {p: i for i, p in enumerate(ev.ref_all_positions)}
    for s in shifts(MAX_ROW_SHIFT):
        pairs = [(j, ref_at[p + s]) for j, p in enumerate(ev.positions) if p + s in ref_at]
        if not pairs or len(ev.positions) - len(pairs) > abs(s):
            continue
        run_j, ref_i = (list(x) for x in zip(*pairs))
        if explains(ev.ref_all[ref_i], ev.run[run_j], ev.tolerance):
            return error_finding(ev, _shift_message(ev, s), RowShiftFields(shift=s))
    return None


def _shift_message(ev: Evidence, s: int) -> str:
    """What a shift of `s` rows means where it is: the pairing of an MTP head's hidden rows (token
    p with the target's hidden of p - 1), else a drafter's anchor and block."""
    said = f"{ev.tensor} rows are shifted by {s:+d}: the run's row at position p holds the reference's row at p{s:+d}"
    if ev.record == names.MTP_H_INPUT or ev.record.startswith(f"{names.MTP_HNORM}-"):
        return (
            f"{said}; an MTP head pairs token p with the target's hidden of position p - 1 (the first token of a "
            "sequence with zeros): stage the hidden rows one position behind their tokens"
        )
    if ev.kind.row_token is not None:
        return f"{said}; {_step_row_advice(ev)}"
    return f"{said}; check the anchor row and the block offset"


def _step_row_advice(ev: Evidence) -> str:
    """A step drafter's rows pair a token with a hidden state of the row before (EAGLE3: token
    p+1 with g p at p; MTP: token p with the hidden of p - 1): what a shift there points at."""
    paired = "the token of p + 1 with the encoder row of p" if ev.kind.row_token else "token p with the hidden of p - 1"
    kept = (
        f" (this flow began with {ev.kept} positions kept from an earlier request: a drafter row kept or restored "
        "apart from the target's shifts them)"
        if ev.kept
        else ""
    )
    return f"a {ev.kind.name} row at position p pairs {paired}: check which rows the driver stages together{kept}"


def detect_misplaced_rows(ev: Evidence) -> Finding | None:
    """Hypothesis: some run rows, not all and not by one shift, hold the ref rows of other
    positions of the batch, the rest their own: a driver that staged the wrong rows for part of a
    batch (a chunked inject reading another chunk's rows). Evidence: every run row matches its own
    ref row or another ref row of the group within the row tolerance, and at least one does not
    match its own."""
    if ev.ref_all is None or not ev.positions or not same_shape(ev) or ev.ref.ndim != 2:
        return None
    own = row_relative_error(ev.ref, ev.run) <= ev.tolerance.row_rel  # (R,)
    if own.all() or not own.any():
        return None
    sources = [_matching_row(ev.ref_all, ev.run[i], ev.tolerance.row_rel) for i in np.flatnonzero(~own)]
    if any(j is None for j in sources):
        return None
    rows = labels(ev, ~own)
    held = tuple(int(ev.ref_all_positions[j]) for j in sources if j is not None)
    return error_finding(
        ev,
        f"{ev.tensor} {at_positions(rows)} hold the reference's rows of {at_positions(held)}, the other "
        f"rows their own: the driver staged the wrong rows for part of the batch; check how it "
        f"indexes rows past the first chunk (n_ubatch) or sequence",
        MisplacedRowsFields(rows=rows, sources=held),
    )


def _matching_row(rows: np.ndarray, row: np.ndarray, row_rel: float) -> int | None:
    """Index of the first of `rows` (N, D) that `row` (D,) equals within `row_rel`, else None."""
    err = row_relative_error(rows, np.broadcast_to(row, rows.shape))  # (N,)
    hits = np.flatnonzero(err <= row_rel)
    return int(hits[0]) if hits.size else None


def detect_layout_transpose(ev: Evidence) -> Finding | None:
    """Hypothesis: the run's buffer holds the right values in another axis order (layer-major
    staging, head-major, swapped axes). Evidence: some reinterpretation of the run buffer matches ref."""
    if ev.run_raw is None or ev.run_raw.size != ev.ref.size or ev.ref.ndim != 2:
        return None
    for detail, candidate in _reinterpretations(np.asarray(ev.run_raw), ev.ref.shape, ev.n_extract):
        if explains(ev.ref, candidate, ev.tolerance):
            return error_finding(
                ev,
                f"{ev.tensor} is {detail}; stage it token-major, one row of {ev.ref.shape[1]} values per token",
                LayoutTransposeFields(detail=detail),
            )
    return None


def _reinterpretations(raw: np.ndarray, shape: tuple[int, int], n_extract: int):
    """(description, (T, D) array) for each other reading of the run's buffer."""
    n_rows, width = shape
    if raw.ndim == 2 and raw.shape == (width, n_rows):
        yield f"transposed: stored ({width}, {n_rows}) where ({n_rows}, {width}) is expected", raw.T  # (T, D)
    flat = raw.reshape(-1)
    for k in _major_counts(width, n_extract):
        major = flat.reshape(k, n_rows, width // k)  # (k, T, D / k): k blocks of T rows each
        what = "staged layer-major" if k == n_extract else f"stored {k}-block-major"
        yield (
            f"{what}: a ({k}, {n_rows}, {width // k}) buffer read as ({n_rows}, {width})",
            major.transpose(1, 0, 2).reshape(n_rows, width),
        )  # (T, k * D / k)


def _major_counts(width: int, n_extract: int) -> list[int]:
    """Block counts to try: n_extract first, then the small divisors of the row width."""
    ks = [n_extract] if n_extract > 1 and width % n_extract == 0 else []
    return ks + [k for k in range(2, 65) if width % k == 0 and k not in ks]


def detect_position_offset_of_record(ev: Evidence) -> Finding | None:
    """Hypothesis: the record was computed at positions off by k. Evidence: integer positions
    (`inp_pos`) differ from ref by one constant k, or RoPE'd rows equal ref rows rotated by k more
    positions. (A whole batch placed at offset positions: positions.detect_position_offset_of_batch.)"""
    if not same_shape(ev) or not ev.ref.size:
        return None
    if ev.is_integer:
        diff = np.unique(np.asarray(ev.run, dtype=np.int64) - np.asarray(ev.ref, dtype=np.int64))
        k = int(diff[0]) if diff.size == 1 and diff[0] != 0 else None
    else:
        k = _rope_offset(ev)
    if k is None:
        return None
    return error_finding(
        ev,
        f"{ev.tensor} was computed at positions off by {k:+d}; check the positions passed with this batch",
        PositionOffsetFields(offset=k),
    )


def _rope_offset(ev: Evidence) -> int | None:
    if ev.rope is None or ev.ref.shape[1] != ev.rope.n_head * ev.rope.head_dim:
        return None
    for k in shifts(MAX_POSITION_OFFSET):
        for neox in (True, False):
            if explains(rotate(ev.ref, k, ev.rope, neox), ev.run, ev.tolerance):
                return k
    return None
