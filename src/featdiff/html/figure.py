"""Figure data: the divergence map, laid out from a `Comparison`'s per-row errors.

Consumes a `Comparison` (diff/result.py); produces a `DivergenceMap` (records x positions),
which tests check without parsing images. The other two figures are compare's own records
(`Comparison.layer_match`, `Comparison.row_shift`), drawn as they are. Pure: no I/O, no drawing
(heatmap.py plans, raster.py draws), and no measuring: every number comes from compare.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from featdiff.diff.result import Comparison, PairMetrics


@dataclass(frozen=True)
class Segment:
    """Rows `start .. stop-1` of a divergence map come from one eval (a phase of the flow)."""

    start: int
    stop: int
    label: str  # "e<eval> <role> <phase>"


@dataclass(frozen=True, eq=False)
class DivergenceMap:
    """Per-row relative error of every compared record: records in graph order x positions.

    `matrix` is (n_rows, n_cols), NaN where a record has no row at those positions. Row r holds
    `rows_per_bin` records or fewer (never across a segment), column j the positions
    `col_start[j] .. col_start[j] + col_width - 1`; a binned cell holds the largest error.
    """

    matrix: np.ndarray
    row_labels: tuple[str, ...]
    segments: tuple[Segment, ...]
    col_start: tuple[int, ...]
    col_width: int = 1
    rows_per_bin: int = 1
    first_row: int | None = None  # the first divergent record's row
    first_col: int | None = None  # its first row over tolerance (else its worst row)
    first_label: str = ""  # that record and eval, e.g. "inp_target_features (e1 draft inject)"
    first_position: int | None = None  # the token position of `first_col`, before binning
    n_records: int = 0  # records before binning


# --- divergence map ---------------------------------------------------------------------------


def map_divergence(comparison: Comparison, max_cols: int | None = None) -> DivergenceMap:
    """Every pair's per-row relative error placed at its positions, one row per record.

    With `max_cols`, positions are binned on the way in (largest error per bin), so a long prompt
    never builds a full-width matrix.
    """
    order = sorted(range(len(comparison.pairs)), key=lambda i: comparison.pairs[i].eval)
    pairs = [comparison.pairs[i] for i in order]
    lo = min((min(p.row_positions()) for p in pairs if p.row_rel_err), default=0)
    hi = max((max(p.row_positions()) for p in pairs if p.row_rel_err), default=0)
    width = math.ceil((hi - lo + 1) / max_cols) if max_cols else 1
    first_row = order.index(comparison.first_divergence) if comparison.first_divergence is not None else None
    first = pairs[first_row] if first_row is not None else None
    first_pos = first.first_bad_position() if first is not None else None
    return DivergenceMap(
        matrix=_placed_errors(pairs, lo, width, math.ceil((hi - lo + 1) / width)),
        row_labels=tuple(_record_label(p) for p in pairs),
        segments=_segments(pairs),
        col_start=tuple(range(lo, hi + 1, width)),
        col_width=width,
        first_row=first_row,
        first_col=None if first_pos is None else (first_pos - lo) // width,
        first_label=f"{_record_label(first)} ({eval_label(first)})" if first else "",
        first_position=first_pos,
        n_records=len(pairs),
    )


def _placed_errors(pairs: Sequence[PairMetrics], lo: int, width: int, n_cols: int) -> np.ndarray:
    """(n_records, n_cols) row errors at column (position - lo) // width, NaN where none."""
    matrix = np.full((len(pairs), n_cols), np.nan, dtype=np.float32)  # (n_records, n_cols)
    for i, p in enumerate(pairs):
        cols = (np.asarray(p.row_positions(), dtype=np.int64) - lo) // width
        err = np.asarray(p.row_rel_err, dtype=np.float64)
        # a non-finite row is as wrong as it gets; a bin (or a position compare saw under two
        # token histories) shows its largest error
        np.fmax.at(matrix[i], cols, np.where(np.isnan(err), np.inf, err))
    return matrix


def bin_map(m: DivergenceMap, max_rows: int, max_cols: int) -> DivergenceMap:
    """The map with at most `max_cols` columns and about `max_rows` rows, keeping the largest error.

    Rows are binned inside each segment, so phases stay apart; with more segments than
    `max_rows`, each segment becomes one row.
    """
    if m.matrix.size == 0:
        return m
    col_width = math.ceil(m.matrix.shape[1] / max_cols)
    col_idx = np.arange(0, m.matrix.shape[1], col_width)
    per_bin = _rows_per_bin(m.segments, max_rows)
    row_idx, segments = _row_bins(m.segments, per_bin, m.first_row)
    # fmax ignores NaN unless a whole bin is NaN, so "not compared" survives binning.
    matrix = np.fmax.reduceat(np.fmax.reduceat(m.matrix, row_idx, axis=0), col_idx, axis=1)  # (n_bins, n_col_bins)
    return DivergenceMap(
        matrix=matrix,
        row_labels=tuple(_bin_label(m.row_labels, row_idx, i) for i in range(len(row_idx))),
        segments=segments,
        col_start=tuple(m.col_start[j] for j in col_idx),
        col_width=col_width * m.col_width,
        rows_per_bin=per_bin * m.rows_per_bin,
        first_row=_bin_of(row_idx, m.first_row),
        first_col=_bin_of(col_idx, m.first_col),
        first_label=m.first_label,
        first_position=m.first_position,
        n_records=m.n_records,
    )


def _record_label(p: PairMetrics) -> str:
    return p.name if p.occurrence == 0 else f"{p.name}#{p.occurrence}"


def eval_label(p: PairMetrics) -> str:
    """`e<eval> <role> <phase>`: where in the flow a record was taken."""
    return f"e{p.eval} {p.role} {p.phase}"


def _segments(pairs: Sequence[PairMetrics]) -> tuple[Segment, ...]:
    segments: list[Segment] = []
    for i, p in enumerate(pairs):
        if segments and segments[-1].label == eval_label(p):
            segments[-1] = replace(segments[-1], stop=i + 1)
        else:
            segments.append(Segment(i, i + 1, eval_label(p)))
    return tuple(segments)


def _rows_per_bin(segments: Sequence[Segment], max_rows: int) -> int:
    """The smallest bin size that brings the row count down to `max_rows` (or one per segment)."""
    longest = max(s.stop - s.start for s in segments)
    for per_bin in range(1, longest + 1):
        if sum(math.ceil((s.stop - s.start) / per_bin) for s in segments) <= max_rows:
            return per_bin
    return longest


def _row_bins(segments: Sequence[Segment], per_bin: int, alone: int | None) -> tuple[np.ndarray, tuple[Segment, ...]]:
    """Bin starts inside each segment; row `alone` (the first divergence) gets a bin to itself."""
    starts: list[int] = []
    binned: list[Segment] = []
    for s in segments:
        first = len(starts)
        cuts = set(range(s.start, s.stop, per_bin))
        if alone is not None and s.start <= alone < s.stop:
            cuts |= {alone} | ({alone + 1} if alone + 1 < s.stop else set())
        starts.extend(sorted(cuts))
        binned.append(Segment(first, len(starts), s.label))
    return np.asarray(starts, dtype=np.int64), tuple(binned)


def _bin_label(labels: Sequence[str], starts: np.ndarray, i: int) -> str:
    stop = int(starts[i + 1]) if i + 1 < len(starts) else len(labels)
    first, n = labels[int(starts[i])], stop - int(starts[i])
    return first if n == 1 else f"{first} .. {labels[stop - 1]} ({n})"


def _bin_of(starts: np.ndarray, index: int | None) -> int | None:
    return None if index is None else int(np.searchsorted(starts, index, side="right") - 1)
