"""Drawing (html/heatmap.py): real sizes stay legible and every figure states its scale."""

from __future__ import annotations

import numpy as np

from featdiff.diff.result import Comparison, PairMetrics
from featdiff.diff.rowshift import RowShift
from featdiff.diff.sketch import LayerMatch
from featdiff.html.figure import bin_map, map_divergence
from featdiff.html.heatmap import (
    MAX_MAP_COLS,
    MAX_MAP_ROWS,
    MIN_LABEL_GAP_IN,
    draw_divergence_map,
    draw_layer_match,
    draw_row_shift,
    png_from_figure,
)

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


def _axes(fig):
    return fig.axes[0]


def _colourbar_label(fig) -> str:
    return fig.axes[-1].get_xlabel()


def test_divergence_map_of_hundreds_of_records_and_thousands_of_positions_is_binned_and_legible() -> None:
    m = bin_map(map_divergence(_big_comparison()), MAX_MAP_ROWS, MAX_MAP_COLS)
    assert m.n_records == 7 * 64 and m.matrix.shape[0] <= MAX_MAP_ROWS + 2 and m.matrix.shape[1] <= MAX_MAP_COLS
    fig = draw_divergence_map(m)
    width, height = fig.get_size_inches()
    assert height <= 18
    ax = _axes(fig)
    axes_height_in = ax.get_position().height * height
    assert len(ax.get_yticks()) * MIN_LABEL_GAP_IN <= axes_height_in + 1e-9  # labels never overlap
    assert len(ax.get_xticks()) <= 15
    assert "log scale" in _colourbar_label(fig) and "not compared" in _colourbar_label(fig)
    assert any("first divergence" in t.get_text() and "l_out-30" in t.get_text() for t in ax.texts)
    assert png_from_figure(fig).startswith(PNG_MAGIC)


def test_layer_match_of_many_layers_keeps_ticks_and_drops_cell_numbers() -> None:
    matrix = np.random.default_rng(0).uniform(0, 1, (5, 80))
    m = LayerMatch("inp_target_features", tuple(range(80)), (3, 10, 20, 30, 40), 1 - matrix, matrix, tuple(range(100)))
    fig = draw_layer_match(m)
    ax = _axes(fig)
    assert not ax.texts and len(ax.get_xticks()) <= 40
    assert fig.get_size_inches()[0] <= 14
    assert "relative error" in _colourbar_label(fig) and "log scale" in _colourbar_label(fig)
    assert len(ax.patches) == 5  # one outline per expected cell


def test_layer_match_of_few_layers_prints_each_cell() -> None:
    m = LayerMatch("inp_target_features", tuple(range(6)), (0, 1), 1 - np.eye(2, 6), np.eye(2, 6), (0, 1, 2))
    assert len(_axes(draw_layer_match(m)).texts) == 12


def test_row_shift_states_the_best_shift_and_its_scale() -> None:
    m = RowShift(np.eye(4, 4, k=1), (0, 1, 2, 3), (0, 1, 2, 3), "inp_noise_embd (e2 draft draft)", 4, 4)
    fig = draw_row_shift(m)
    assert "run row i = ref row i + 1" in _axes(fig).get_title(loc="left")
    assert "cosine similarity" in _colourbar_label(fig)
