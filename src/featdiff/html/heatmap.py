"""Heatmaps: draws the figure data with matplotlib (Agg, no pyplot state).

Consumes figure.py's `DivergenceMap` and compare's `LayerMatch` and `RowShift` as compare returned
them (`Comparison.layer_match`, `Comparison.row_shift`); produces matplotlib `Figure`s and PNG
bytes. Every figure states its colour scale on its colour bar; sizes grow with the data up to a
cap, and tick labels are thinned so they never overlap.
"""

from __future__ import annotations

import io
import math

import matplotlib
import numpy as np
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from featdiff.diff.rowshift import RowShift
from featdiff.diff.sketch import LayerMatch
from featdiff.html.figure import DivergenceMap

# Relative error per row: f32 rounding sits near 1e-7, the f16 KV cache and flash attention
# near 1e-3, a wiring fault near 1. A fixed range keeps reports comparable with each other.
REL_ERR_RANGE = (1e-6, 10.0)
COSINE_RANGE = (0.0, 1.0)  # a match is near 1; negative cosines mean "unrelated" as much as 0
MAX_MAP_ROWS = 96  # rows of the divergence map before records are binned
MAX_MAP_COLS = 256  # position columns before positions are binned
DPI = 100
LABEL_PT = 7.5
MIN_LABEL_GAP_IN = 0.12  # vertical room one tick label needs at LABEL_PT
NOT_COMPARED = "#dcdcdc"
MARK = "#ff2d2d"
ERROR_CMAP = matplotlib.colormaps["magma"].with_extremes(bad=NOT_COMPARED, under="black")
COSINE_CMAP = matplotlib.colormaps["viridis"].with_extremes(bad=NOT_COMPARED)
# the layer match: small errors bright (the match), large ones dark, on REL_ERR_RANGE's log scale
MATCH_CMAP = matplotlib.colormaps["magma_r"].with_extremes(bad=NOT_COMPARED)
MATCH_TEXT_DARK_BELOW = 1e-3  # magma_r is light below about 1e-3 on REL_ERR_RANGE: dark text there


def png_from_figure(fig: Figure) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


# --- divergence map ---------------------------------------------------------------------------


def draw_divergence_map(m: DivergenceMap) -> Figure:
    """Records (rows, graph order, phases apart) x token positions, log relative error."""
    n_rows, n_records = m.matrix.shape[0], m.n_records
    fig = Figure(figsize=(11.0, min(18.0, max(3.6, 2.1 + 0.13 * n_rows))))
    ax = _axes_in_inches(fig, left=2.6, right=1.9, top=0.95, bottom=1.25)
    # log scale: exact rows sit at the floor, non-finite ones at the top; NaN (not compared) stays grey
    values = np.clip(m.matrix, *REL_ERR_RANGE)
    image = ax.imshow(
        np.ma.masked_invalid(values),
        aspect="auto",
        interpolation="nearest",
        cmap=ERROR_CMAP,
        norm=LogNorm(*REL_ERR_RANGE, clip=True),
    )
    _label_map_axes(ax, m)
    _separate_segments(ax, m)
    _mark_first_divergence(ax, m)
    cax = fig.add_axes(_inches_to_box(fig, left=2.6, bottom=0.5, width=5.5, height=0.16))
    bar = fig.colorbar(image, cax=cax, orientation="horizontal")
    bar.set_label(
        "relative error ||run - ref|| / ||ref|| per token row (log scale, clipped); grey = not compared",
        fontsize=LABEL_PT + 0.5,
    )
    bar.ax.tick_params(labelsize=LABEL_PT)
    ax.set_title(
        f"Divergence map: {n_records} records in {len(m.segments)} evals, run vs ref", fontsize=10, loc="left", pad=22
    )
    return fig


def _label_map_axes(ax, m: DivergenceMap) -> None:
    n_rows, n_cols = m.matrix.shape
    rows = _tick_indices(n_rows, _label_capacity(ax, n_rows))
    ax.set_yticks(rows, [_short(m.row_labels[i], 38) for i in rows], fontsize=LABEL_PT)
    cols = _tick_indices(n_cols, 14)
    ax.set_xticks(cols, [str(m.col_start[j]) for j in cols], fontsize=LABEL_PT)
    binned = f", {m.col_width} per column, max" if m.col_width > 1 else ""
    ax.set_xlabel(f"token position{binned}", fontsize=LABEL_PT + 1)
    per_row = f" (up to {m.rows_per_bin} per row, max)" if m.rows_per_bin > 1 else ""
    ax.set_ylabel(f"record, graph order{per_row}", fontsize=LABEL_PT + 1)


def _separate_segments(ax, m: DivergenceMap) -> None:
    """A white rule between evals and the eval's label at the right margin."""
    gap_rows = MIN_LABEL_GAP_IN / _inches_per_row(ax, m.matrix.shape[0])
    last_label_y = -math.inf
    for s in m.segments:
        if s.start > 0:
            ax.axhline(s.start - 0.5, color="white", linewidth=1.4)
        middle = (s.start + s.stop - 1) / 2
        if middle - last_label_y >= gap_rows:
            ax.text(1.01, middle, s.label, transform=ax.get_yaxis_transform(), va="center", fontsize=LABEL_PT)
            last_label_y = middle


def _mark_first_divergence(ax, m: DivergenceMap) -> None:
    if m.first_row is None:
        return
    n_cols = m.matrix.shape[1]
    ax.add_patch(Rectangle((-0.5, m.first_row - 0.5), n_cols, 1, fill=False, edgecolor=MARK, linewidth=2))
    if m.first_col is not None:
        ax.plot(
            [m.first_col],
            [m.first_row],
            marker="o",
            markersize=9,
            markerfacecolor="none",
            markeredgecolor=MARK,
            markeredgewidth=2,
            clip_on=False,
        )
    where = f", from position {m.first_position} (circle)" if m.first_position is not None else ""
    ax.annotate(
        f"first divergence (red box): {m.first_label}{where}",
        xy=(0.0, 1.0),
        xycoords="axes fraction",
        xytext=(0, 6),
        textcoords="offset points",
        ha="left",
        va="bottom",
        color=MARK,
        fontsize=LABEL_PT + 1.5,
        fontweight="bold",
    )


# --- layer match ------------------------------------------------------------------------------


def draw_layer_match(m: LayerMatch) -> Figure:
    """Feature slots x target layer inputs, relative error on a log scale; expected cells
    outlined, compare's closest layer of each slot (the one its layer-offset detector reads) starred.

    The relative error, not the cosine: a residual stream changes slowly, so neighbouring layer
    inputs can have a cosine near 1, while only the layer a slot holds matches it to rounding
    (1e-6 and below on the fixtures), decades below its neighbours on a log scale."""
    n_slots, n_layers = m.rel_err.shape
    fig = Figure(figsize=(min(14.0, max(7.0, 2.6 + 0.42 * n_layers)), min(9.0, max(3.4, 2.3 + 0.6 * n_slots))))
    ax = _axes_in_inches(fig, left=1.5, right=0.4, top=0.75, bottom=1.3)
    values = np.clip(m.rel_err, *REL_ERR_RANGE)  # an exact match (0) sits at the floor, not off the log scale
    image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap=MATCH_CMAP, norm=LogNorm(*REL_ERR_RANGE))
    cols = _tick_indices(n_layers, 40)
    ax.set_xticks(cols, [str(m.layers[j]) for j in cols], fontsize=LABEL_PT + 0.5)
    ax.set_yticks(range(n_slots), [_slot_label(m, k) for k in range(n_slots)], fontsize=LABEL_PT + 0.5)
    ax.set_xlabel("target layer L (ref layer_inp-L: the input of layer L)", fontsize=LABEL_PT + 1)
    if n_layers <= 48:
        _annotate_cells(ax, m.rel_err)
    _outline_expected(ax, m)
    ax.set_title(
        "Layer match: which target layer input each feature slot carries\n"
        "red box = the layer the checkpoint expects, white star = the closest match",
        fontsize=10,
        loc="left",
    )
    cax = fig.add_axes(_inches_to_box(fig, left=1.5, bottom=0.5, width=4.5, height=0.16))
    bar = fig.colorbar(image, cax=cax, orientation="horizontal")
    bar.set_label(
        f"relative error rms(slot - layer input) / rms(layer input), {len(m.positions)} rows, log scale",
        fontsize=LABEL_PT + 0.5,
    )
    bar.ax.tick_params(labelsize=LABEL_PT)
    return fig


def _slot_label(m: LayerMatch, k: int) -> str:
    expected = str(m.expected_layers[k]) if k < len(m.expected_layers) else "?"
    return f"slot {k}\nexpects L={expected}"


def _annotate_cells(ax, matrix: np.ndarray) -> None:
    size = LABEL_PT if matrix.shape[1] <= 24 else LABEL_PT - 2
    for (k, j), value in np.ndenumerate(matrix):
        colour = "black" if value < MATCH_TEXT_DARK_BELOW else "white"
        ax.text(j, k, _error_label(value), ha="center", va="center", fontsize=size, color=colour)


def _error_label(value: float) -> str:
    """A relative error in a cell: two digits from 0.01 up, else its decade (`3e-07`)."""
    return f"{value:.2f}" if value >= 0.01 else f"{value:.0e}"


def _outline_expected(ax, m: LayerMatch) -> None:
    for k, j in enumerate(m.expected_columns()):
        if j is not None:
            ax.add_patch(Rectangle((j - 0.5, k - 0.5), 1, 1, fill=False, edgecolor=MARK, linewidth=3))
    best = np.array([m.layers.index(L) for L in m.closest_layers])  # (n_slots,) columns
    ax.plot(
        best + 0.3,
        np.arange(len(best)) - 0.25,
        linestyle="none",
        marker="*",
        markersize=13,
        markerfacecolor="white",
        markeredgecolor="black",
        markeredgewidth=0.8,
    )


# --- row shift --------------------------------------------------------------------------------


def draw_row_shift(m: RowShift) -> Figure:
    """Run rows x ref rows of one record, cosine; the same-position cells dashed."""
    n_run, n_ref = m.similarity.shape
    fig = Figure(figsize=(7.0, 6.4))
    ax = _axes_in_inches(fig, left=1.1, right=0.4, top=0.9, bottom=1.4)
    image = ax.imshow(
        m.similarity, aspect="auto", interpolation="nearest", cmap=COSINE_CMAP, norm=Normalize(*COSINE_RANGE, clip=True)
    )
    _position_ticks(ax, m)
    same = [(j, i) for i, p in enumerate(m.run_positions) for j, q in enumerate(m.ref_positions) if p == q]
    if same:
        ax.plot(*zip(*same), linestyle=(0, (2, 3)), color="white", linewidth=0.9, alpha=0.7)
    shift = m.best_shift()
    ax.set_title(
        f"Row-shift matrix: {m.record}\nbest match: run row i = ref row i + {shift}  (dashed = same position)",
        fontsize=10,
        loc="left",
    )
    cax = fig.add_axes(_inches_to_box(fig, left=1.1, bottom=0.5, width=4.5, height=0.16))
    bar = fig.colorbar(image, cax=cax, orientation="horizontal")
    bar.set_label("cosine similarity of a run row with a ref row (colour clipped to [0, 1])", fontsize=LABEL_PT + 0.5)
    bar.ax.tick_params(labelsize=LABEL_PT)
    return fig


def _position_ticks(ax, m: RowShift) -> None:
    n_run, n_ref = m.similarity.shape
    rows, cols = _tick_indices(n_run, 24), _tick_indices(n_ref, 24)
    ax.set_yticks(rows, [str(m.run_positions[i]) for i in rows], fontsize=LABEL_PT)
    ax.set_xticks(cols, [str(m.ref_positions[j]) for j in cols], fontsize=LABEL_PT, rotation=90)
    cut = f" ({n_run} of {m.n_run_rows} rows)" if m.n_run_rows > n_run else ""
    ax.set_ylabel(f"run row (token position){cut}", fontsize=LABEL_PT + 1)
    cut = f" ({n_ref} of {m.n_ref_rows} rows)" if m.n_ref_rows > n_ref else ""
    ax.set_xlabel(f"ref row (token position){cut}", fontsize=LABEL_PT + 1)


# --- layout helpers ---------------------------------------------------------------------------


def _axes_in_inches(fig: Figure, left: float, right: float, top: float, bottom: float):
    """An axes with fixed margins in inches, so labels keep their room at any figure size."""
    w, h = fig.get_size_inches()
    return fig.add_axes((left / w, bottom / h, 1 - (left + right) / w, 1 - (top + bottom) / h))


def _inches_to_box(fig: Figure, left: float, bottom: float, width: float, height: float):
    w, h = fig.get_size_inches()
    return (left / w, bottom / h, min(width, w - left - 0.2) / w, height / h)


def _inches_per_row(ax, n_rows: int) -> float:
    return ax.get_position().height * ax.figure.get_size_inches()[1] / max(n_rows, 1)


def _label_capacity(ax, n_rows: int) -> int:
    """How many row labels fit on the axes without overlapping."""
    return max(1, int(n_rows * _inches_per_row(ax, n_rows) / MIN_LABEL_GAP_IN))


def _tick_indices(n: int, max_ticks: int) -> np.ndarray:
    """Every k-th index of `n`, with k the smallest step giving at most `max_ticks` ticks."""
    return np.arange(0, n, max(1, math.ceil(n / max(max_ticks, 1))))


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 2] + ".."
