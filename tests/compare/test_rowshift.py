"""The figures compare returns with its findings (diff/sketch.py `LayerMatch`, diff/rowshift.py
`RowShift`), built from arrays, no dumps."""

from __future__ import annotations

import numpy as np

from featdiff.diff.rowshift import MAX_SHIFT_ROWS, SHIFT_MARGIN_ROWS, measure_row_shift
from featdiff.diff.sketch import LayerMatch


def _match(similarity: np.ndarray, layers: tuple[int, ...], expected: tuple[int, ...]) -> LayerMatch:
    return LayerMatch(
        "inp_target_features",
        layers,
        expected,
        rel_err=1.0 - similarity,
        similarity=similarity,
        positions=tuple(range(7)),
    )


def test_layer_match_names_the_closest_layer_and_the_expected_column_of_each_slot() -> None:
    similarity = np.array([[0.5, 0.9, 1.0, 0.9], [0.4, 0.6, 0.8, 0.7]])  # (n_slots, n_layers)
    m = _match(similarity, layers=(1, 2, 3, 4), expected=(2, 3))
    assert m.closest_layers == (3, 3)
    assert m.expected_columns() == (1, 2)


def test_layer_match_without_stated_layers_outlines_nothing() -> None:
    m = _match(np.zeros((2, 3)), layers=(0, 1, 2), expected=(7,))
    assert m.expected_columns() == (None, None)


def test_row_shift_reports_run_row_i_as_ref_row_i_plus_shift() -> None:
    ref = np.random.default_rng(2).standard_normal((10, 12))
    run = np.roll(ref, -1, axis=0)  # run row i = ref row i + 1
    m = measure_row_shift(run, ref, list(range(5, 15)), list(range(5, 15)), "inp_noise_embd")
    assert m.similarity.shape == (10, 10)
    assert m.best_shift() == 1 and m.to_json()["best_shift"] == 1
    assert measure_row_shift(ref, ref, range(10), range(10), "x").best_shift() == 0


def test_row_shift_of_a_long_record_is_a_window_around_the_focus() -> None:
    ref = np.random.default_rng(3).standard_normal((500, 8))
    run = np.roll(ref, -1, axis=0)  # run row i = ref row i + 1
    m = measure_row_shift(run, ref, range(500), range(500), "x", focus=300)
    assert m.similarity.shape == (MAX_SHIFT_ROWS, MAX_SHIFT_ROWS + 2 * SHIFT_MARGIN_ROWS)
    assert m.run_positions[0] == 300 - MAX_SHIFT_ROWS // 4
    assert m.ref_positions[0] == m.run_positions[0] - SHIFT_MARGIN_ROWS
    assert m.best_shift() == 1 and (m.n_run_rows, m.n_ref_rows) == (500, 500)


def test_row_shift_window_stays_inside_the_record() -> None:
    rows = np.random.default_rng(4).standard_normal((100, 4))
    m = measure_row_shift(rows, rows, range(100), range(100), "x", focus=99)
    assert m.run_positions == tuple(range(100 - MAX_SHIFT_ROWS, 100))
    assert m.ref_positions[-1] == 99 and m.best_shift() == 0
