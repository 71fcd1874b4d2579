"""The row-shift matrix of a divergent record: the cosine of each run row with each ref row.

Consumes the aligned rows of one pair (diff/align.py) and their positions; produces a
`RowShift`, which compare returns with its findings (the first divergence's) and the report
draws as it is. A shifted batch shows as a bright line off the same-position diagonal. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from featdiff.diff.metrics import row_similarity

# A window of run rows around the first row over tolerance: a one-row shift must stay visible as
# one cell off the diagonal, and a shift shows in any window.
MAX_SHIFT_ROWS = 64
SHIFT_MARGIN_ROWS = 8  # ref rows beyond the window's positions on each side, to show shifts out of it


@dataclass(frozen=True, eq=False)
class RowShift:
    """Cosine similarity of each run row with each ref row of one record: (n_run, n_ref)."""

    similarity: np.ndarray
    run_positions: tuple[int, ...]
    ref_positions: tuple[int, ...]
    record: str  # "<name> (e<eval> <role> <phase>)"
    n_run_rows: int = 0  # rows of the record before the window was cut
    n_ref_rows: int = 0

    def best_shift(self) -> int | None:
        """The most common `ref position - run position` of each run row's most similar ref row.

        In the findings' convention run row i = ref row i + shift; None when there are no rows.
        """
        if self.similarity.size == 0:
            return None
        ref = np.asarray(self.ref_positions)[np.argmax(self.similarity, axis=1)]  # (n_run,)
        values, counts = np.unique(ref - np.asarray(self.run_positions), return_counts=True)
        return int(values[np.argmax(counts)])

    def to_json(self) -> dict[str, Any]:
        return {
            "record": self.record,
            "run_positions": list(self.run_positions),
            "ref_positions": list(self.ref_positions),
            "similarity": self.similarity.tolist(),
            "best_shift": self.best_shift(),
            "n_run_rows": self.n_run_rows,
            "n_ref_rows": self.n_ref_rows,
        }


def measure_row_shift(
    run_rows: np.ndarray,
    ref_rows: np.ndarray,
    run_positions: Sequence[int],
    ref_positions: Sequence[int],
    record: str,
    focus: int | None = None,
) -> RowShift:
    """Cosine of run rows (n_run, width) with ref rows (n_ref, width) in a window: MAX_SHIFT_ROWS
    run rows from a little before position `focus` (default: the first rows), and the ref rows
    within SHIFT_MARGIN_ROWS positions of them."""
    run_idx = _run_window(run_positions, focus)
    ref_idx = _ref_window(ref_positions, [run_positions[i] for i in run_idx], run_idx)
    with np.errstate(invalid="ignore"):  # a NaN/Inf row's cosines are NaN: shown as not comparable
        similarity = row_similarity(ref_rows[ref_idx], run_rows[run_idx])  # (n_run, n_ref)
    return RowShift(
        similarity=similarity,
        run_positions=tuple(int(run_positions[i]) for i in run_idx),
        ref_positions=tuple(int(ref_positions[i]) for i in ref_idx),
        record=record,
        n_run_rows=len(run_rows),
        n_ref_rows=len(ref_rows),
    )


def _run_window(positions: Sequence[int], focus: int | None) -> np.ndarray:
    """Up to MAX_SHIFT_ROWS row indices, starting a quarter window before the focus row."""
    at = next((i for i, p in enumerate(positions) if p >= focus), 0) if focus is not None else 0
    start = max(0, min(at - MAX_SHIFT_ROWS // 4, len(positions) - MAX_SHIFT_ROWS))
    return np.arange(start, min(start + MAX_SHIFT_ROWS, len(positions)))


def _ref_window(positions: Sequence[int], run_window: Sequence[int], run_idx: np.ndarray) -> np.ndarray:
    """Ref rows within SHIFT_MARGIN_ROWS positions of the run window; the same indices when
    no position falls there."""
    if len(run_window):
        lo, hi = min(run_window) - SHIFT_MARGIN_ROWS, max(run_window) + SHIFT_MARGIN_ROWS
        near = np.flatnonzero((np.asarray(positions) >= lo) & (np.asarray(positions) <= hi))
        if near.size:
            return near[: MAX_SHIFT_ROWS + 2 * SHIFT_MARGIN_ROWS]
    return run_idx[run_idx < len(positions)]
