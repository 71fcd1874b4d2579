"""Drawing (html/heatmap.py plans each figure, html/raster.py draws it): real sizes stay legible,
every figure states its scale, and the PNG shows the colours of the planned cells."""

from __future__ import annotations

import io

import numpy as np

from featdiff.diff.result import Comparison, PairMetrics
from featdiff.diff.rowshift import RowShift
from featdiff.diff.sketch import LayerMatch
from featdiff.html.figure import bin_map, map_divergence
from featdiff.html.heatmap import (
    ERROR_SCALE,
    MAX_MAP_COLS,
    MAX_MAP_ROWS,
    MIN_LABEL_GAP_IN,
    draw_divergence_map,
    draw_layer_match,
    draw_row_shift,
)
from featdiff.html.plot import DPI
from featdiff.html.raster import cell_colours, png_from_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _big_comparison(n_layer: int = 64, n_prompt: int = 3000, rounds: int = 6) -> Comparison:
    """A prefill of n_prompt rows and `rounds` verify blocks, n_layer records per eval."""
    pairs = []
    evals = [(0, "prefill", list(range(n_prompt)))] + [
        (r, "verify", list(range(n_prompt + 4 * r, n_prompt + 4 * r + 4))) for r in range(1, rounds + 1)
    ]
    for e, phase, positions in evals:
        for L in range(n_layer):
            err = tuple(1e-4 if L < 30 else 0.5 for _ in positions)
            pairs.append(
                PairMetrics(
                    "target",
                    phase,
                    e,
                    f"l_out-{L}",
                    0,
                    0.0,
                    0.0,
                    1.0,
                    1.0,
                    0.0,
                    0.0,
                    1e-6,
                    L < 30,
                    err,
                    tuple(positions),
                )
            )
    return Comparison("ref.npz", "run.npz", (), tuple(pairs), (), 30)


def test_divergence_map_of_hundreds_of_records_and_thousands_of_positions_is_binned_and_legible() -> None:
    m = bin_map(map_divergence(_big_comparison()), MAX_MAP_ROWS, MAX_MAP_COLS)
    assert m.n_records == 7 * 64 and m.matrix.shape[0] <= MAX_MAP_ROWS + 2 and m.matrix.shape[1] <= MAX_MAP_COLS
    plot = draw_divergence_map(m)
    width, height = plot.size
    assert height <= 18
    axes_height_in = plot.axes[3]
    assert len(plot.yticks) * MIN_LABEL_GAP_IN <= axes_height_in + 1e-9  # labels never overlap
    assert len(plot.xticks) <= 15
    assert "log scale" in plot.colorbar_label and "not compared" in plot.colorbar_label
    assert "first divergence" in plot.note and "l_out-30" in plot.note
    assert png_from_plot(plot).startswith(PNG_MAGIC)


def test_layer_match_of_many_layers_keeps_ticks_and_drops_cell_numbers() -> None:
    matrix = np.random.default_rng(0).uniform(0, 1, (5, 80))
    m = LayerMatch("inp_target_features", tuple(range(80)), (3, 10, 20, 30, 40), 1 - matrix, matrix, tuple(range(100)))
    plot = draw_layer_match(m)
    assert not plot.cell_texts and len(plot.xticks) <= 40
    assert plot.size[0] <= 14
    assert "relative error" in plot.colorbar_label and "log scale" in plot.colorbar_label
    assert len(plot.boxes) == 5  # one outline per expected cell


def test_layer_match_of_few_layers_prints_each_cell() -> None:
    m = LayerMatch("inp_target_features", tuple(range(6)), (0, 1), 1 - np.eye(2, 6), np.eye(2, 6), (0, 1, 2))
    assert len(draw_layer_match(m).cell_texts) == 12


def test_row_shift_states_the_best_shift_and_its_scale() -> None:
    m = RowShift(np.eye(4, 4, k=1), (0, 1, 2, 3), (0, 1, 2, 3), "inp_noise_embd (e2 draft draft)", 4, 4)
    plot = draw_row_shift(m)
    assert "run row i = ref row i + 1" in plot.title
    assert "cosine similarity" in plot.colorbar_label
    assert plot.dashed == tuple((float(i), float(i)) for i in range(4))  # the same-position cells


def _decoded(png: bytes) -> np.ndarray:
    """(height, width, 3) the PNG's pixels, decoded by another library than the one that wrote it."""
    from matplotlib.image import imread

    return np.round(imread(io.BytesIO(png), format="png")[..., :3] * 255).astype(np.uint8)


def test_png_is_the_figure_size_with_each_cell_in_its_colour() -> None:
    """The drawn PNG decodes, has the figure's pixel size, and each cell's centre pixel is the
    colour of its value on the scale (a NaN cell grey): a one-row shift or a wrong scale shows."""
    m = bin_map(map_divergence(_big_comparison(n_layer=32, n_prompt=40, rounds=2)), MAX_MAP_ROWS, MAX_MAP_COLS)
    plot = draw_divergence_map(m)
    pixels = _decoded(png_from_plot(plot))  # (height, width, 3)
    assert pixels.shape == (round(plot.size[1] * DPI), round(plot.size[0] * DPI), 3)
    left, bottom, width, height = plot.axes
    n_rows, n_cols = plot.values.shape
    colours = cell_colours(plot.values, ERROR_SCALE)  # (n_rows, n_cols, 3)
    assert np.isnan(plot.values).any() and len({tuple(c) for c in colours.reshape(-1, 3)}) >= 3
    for i in range(n_rows):
        for j in range(n_cols):
            if (i, j) == (m.first_row, m.first_col) or i in (m.first_row - 1, m.first_row, m.first_row + 1):
                continue  # the red box and ring cover this row and its neighbours' edges
            x = (left + (j + 0.5) * width / n_cols) * DPI
            y = (plot.size[1] - bottom - height + (i + 0.5) * height / n_rows) * DPI
            assert (pixels[int(y), int(x)] == colours[i, j]).all(), (i, j)
