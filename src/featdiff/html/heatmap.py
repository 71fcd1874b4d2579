"""Heatmaps: plans the report's three figures as `Plot`s (plot.py) from compare's records.

Consumes figure.py's `DivergenceMap` and compare's `LayerMatch` and `RowShift` as compare returned
them (`Comparison.layer_match`, `Comparison.row_shift`); produces `Plot`s, which raster.py draws as
PNG bytes. Every figure states its colour scale on its colour bar; sizes grow with the data up to a
cap, and tick labels are thinned so they never overlap. Pure: no drawing, no I/O.
"""

from __future__ import annotations

import math

import numpy as np

from featdiff.diff.rowshift import RowShift
from featdiff.diff.sketch import LayerMatch
from featdiff.html.figure import DivergenceMap
from featdiff.html.plot import LABEL_PT, Box, CellText, MarginLabel, Plot, Scale, Tick

# Relative error per row: f32 rounding sits near 1e-7, the f16 KV cache and flash attention
# near 1e-3, a wiring fault near 1. A fixed range keeps reports comparable with each other.
REL_ERR_RANGE = (1e-6, 10.0)
COSINE_RANGE = (0.0, 1.0)  # a match is near 1; negative cosines mean "unrelated" as much as 0
MAX_MAP_ROWS = 96  # rows of the divergence map before records are binned
MAX_MAP_COLS = 256  # position columns before positions are binned
MIN_LABEL_GAP_IN = 0.12  # vertical room one tick label needs at LABEL_PT
ERROR_SCALE = Scale("magma", *REL_ERR_RANGE, is_log=True)
COSINE_SCALE = Scale("viridis", *COSINE_RANGE, is_log=False)
# the layer match: small errors bright (the match), large ones dark, on REL_ERR_RANGE's log scale
MATCH_SCALE = Scale("magma_r", *REL_ERR_RANGE, is_log=True)
MATCH_TEXT_DARK_BELOW = 1e-3  # magma_r is light below about 1e-3 on REL_ERR_RANGE: dark text there
TITLE_PT = 10.0


# --- divergence map ---------------------------------------------------------------------------


def draw_divergence_map(m: DivergenceMap) -> Plot:
    """Records (rows, graph order, phases apart) x token positions, log relative error."""
    n_rows, n_cols = m.matrix.shape
    size = (11.0, min(18.0, max(3.6, 2.1 + 0.13 * n_rows)))
    axes = _axes_in_inches(size, left=2.6, right=1.9, top=0.95, bottom=1.25)
    rows = _tick_indices(n_rows, max(1, int(axes[3] / MIN_LABEL_GAP_IN)))  # labels never overlap
    cols = _tick_indices(n_cols, 14)
    binned = f", {m.col_width} per column, max" if m.col_width > 1 else ""
    per_row = f" (up to {m.rows_per_bin} per row, max)" if m.rows_per_bin > 1 else ""
    boxes, circles, note = _first_divergence_marks(m)
    return Plot(
        size=size,
        axes=axes,
        # log scale: exact rows sit at the floor, non-finite ones at the top; NaN (not compared) stays grey
        values=np.clip(m.matrix, *REL_ERR_RANGE),
        scale=ERROR_SCALE,
        title=f"Divergence map: {m.n_records} records in {len(m.segments)} evals, run vs ref",
        title_pad=22 / 72,
        colorbar=_inches_to_box(size, left=2.6, bottom=0.5, width=5.5, height=0.16),
        colorbar_label="relative error ||run - ref|| / ||ref|| per token row (log scale, clipped); grey = not compared",
        xticks=tuple(Tick(int(j), str(m.col_start[j])) for j in cols),
        yticks=tuple(Tick(int(i), _short(m.row_labels[i], 38)) for i in rows),
        xlabel=f"token position{binned}",
        ylabel=f"record, graph order{per_row}",
        margin_labels=_segment_labels(m, axes[3] / max(n_rows, 1)),
        rules=tuple(s.start - 0.5 for s in m.segments if s.start > 0),
        boxes=boxes,
        circles=circles,
        note=note,
    )


def _segment_labels(m: DivergenceMap, inches_per_row: float) -> tuple[MarginLabel, ...]:
    """Each eval's label at the right margin, beside its rows, skipped where it would overlap."""
    gap_rows = MIN_LABEL_GAP_IN / inches_per_row
    labels: list[MarginLabel] = []
    for s in m.segments:
        middle = (s.start + s.stop - 1) / 2
        if not labels or middle - labels[-1].y >= gap_rows:
            labels.append(MarginLabel(middle, s.label))
    return tuple(labels)


def _first_divergence_marks(m: DivergenceMap) -> tuple[tuple[Box, ...], tuple[tuple[float, float], ...], str]:
    """The red box around the first divergent record, a ring at its first bad row, and a note."""
    if m.first_row is None:
        return (), (), ""
    where = f", from position {m.first_position} (circle)" if m.first_position is not None else ""
    box = (-0.5, m.first_row - 0.5, m.matrix.shape[1], 1.0)
    circles = () if m.first_col is None else ((float(m.first_col), float(m.first_row)),)
    return (box,), circles, f"first divergence (red box): {m.first_label}{where}"


# --- layer match ------------------------------------------------------------------------------


def draw_layer_match(m: LayerMatch) -> Plot:
    """Feature slots x target layer inputs, relative error on a log scale; expected cells
    outlined, compare's closest layer of each slot (the one its layer-offset detector reads) starred.

    The relative error, not the cosine: a residual stream changes slowly, so neighbouring layer
    inputs can have a cosine near 1, while only the layer a slot holds matches it to rounding
    (1e-6 and below on the fixtures), decades below its neighbours on a log scale."""
    n_slots, n_layers = m.rel_err.shape
    size = (min(14.0, max(7.0, 2.6 + 0.42 * n_layers)), min(9.0, max(3.4, 2.3 + 0.6 * n_slots)))
    best = [m.layers.index(L) for L in m.closest_layers]  # (n_slots,) columns
    return Plot(
        size=size,
        axes=_axes_in_inches(size, left=1.5, right=0.4, top=0.75, bottom=1.3),
        values=np.clip(m.rel_err, *REL_ERR_RANGE),  # an exact match (0) sits at the floor, not off the log scale
        scale=MATCH_SCALE,
        title=(
            "Layer match: which target layer input each feature slot carries\n"
            "red box = the layer the checkpoint expects, white star = the closest match"
        ),
        colorbar=_inches_to_box(size, left=1.5, bottom=0.5, width=4.5, height=0.16),
        colorbar_label=(
            f"relative error rms(slot - layer input) / rms(layer input), {len(m.positions)} rows, log scale"
        ),
        xticks=tuple(Tick(int(j), str(m.layers[j])) for j in _tick_indices(n_layers, 40)),
        yticks=tuple(Tick(k, _slot_label(m, k)) for k in range(n_slots)),
        xlabel="target layer L (ref layer_inp-L: the input of layer L)",
        ylabel="",
        tick_pt=LABEL_PT + 0.5,
        boxes=tuple((j - 0.5, k - 0.5, 1, 1) for k, j in enumerate(m.expected_columns()) if j is not None),
        box_px=3,
        stars=tuple((float(j), float(k)) for k, j in enumerate(best)),
        cell_texts=_cell_texts(m.rel_err) if n_layers <= 48 else (),
    )


def _slot_label(m: LayerMatch, k: int) -> str:
    expected = str(m.expected_layers[k]) if k < len(m.expected_layers) else "?"
    return f"slot {k}\nexpects L={expected}"


def _cell_texts(matrix: np.ndarray) -> tuple[CellText, ...]:
    size = LABEL_PT if matrix.shape[1] <= 24 else LABEL_PT - 2
    return tuple(
        CellText(j, k, _error_label(value), size, "black" if value < MATCH_TEXT_DARK_BELOW else "white")
        for (k, j), value in np.ndenumerate(matrix)
    )


def _error_label(value: float) -> str:
    """A relative error in a cell: two digits from 0.01 up, else its decade (`3e-07`)."""
    return f"{value:.2f}" if value >= 0.01 else f"{value:.0e}"


# --- row shift --------------------------------------------------------------------------------


def draw_row_shift(m: RowShift) -> Plot:
    """Run rows x ref rows of one record, cosine; the same-position cells dashed."""
    n_run, n_ref = m.similarity.shape
    size = (7.0, 6.4)
    rows, cols = _tick_indices(n_run, 24), _tick_indices(n_ref, 24)
    run_cut = f" ({n_run} of {m.n_run_rows} rows)" if m.n_run_rows > n_run else ""
    ref_cut = f" ({n_ref} of {m.n_ref_rows} rows)" if m.n_ref_rows > n_ref else ""
    return Plot(
        size=size,
        axes=_axes_in_inches(size, left=1.1, right=0.4, top=0.9, bottom=1.4),
        values=np.asarray(m.similarity),
        scale=COSINE_SCALE,
        title=(
            f"Row-shift matrix: {m.record}\n"
            f"best match: run row i = ref row i + {m.best_shift()}  (dashed = same position)"
        ),
        colorbar=_inches_to_box(size, left=1.1, bottom=0.5, width=4.5, height=0.16),
        colorbar_label="cosine similarity of a run row with a ref row (colour clipped to [0, 1])",
        xticks=tuple(Tick(int(j), str(m.ref_positions[j])) for j in cols),
        yticks=tuple(Tick(int(i), str(m.run_positions[i])) for i in rows),
        xlabel=f"ref row (token position){ref_cut}",
        ylabel=f"run row (token position){run_cut}",
        xtick_rotation=90,
        dashed=tuple(
            (float(j), float(i)) for i, p in enumerate(m.run_positions) for j, q in enumerate(m.ref_positions) if p == q
        ),
    )


# --- layout helpers ---------------------------------------------------------------------------


def _axes_in_inches(size: tuple[float, float], left: float, right: float, top: float, bottom: float) -> Box:
    """The cells' box with fixed margins in inches, so labels keep their room at any figure size."""
    w, h = size
    return (left, bottom, w - left - right, h - top - bottom)


def _inches_to_box(size: tuple[float, float], left: float, bottom: float, width: float, height: float) -> Box:
    return (left, bottom, min(width, size[0] - left - 0.2), height)


def _tick_indices(n: int, max_ticks: int) -> np.ndarray:
    """Every k-th index of `n`, with k the smallest step giving at most `max_ticks` ticks."""
    return np.arange(0, n, max(1, math.ceil(n / max(max_ticks, 1))))


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 2] + ".."
