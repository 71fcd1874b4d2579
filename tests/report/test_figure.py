"""Figure data (html/figure.py): the divergence map laid out from hand-made comparisons, no dumps."""

from __future__ import annotations

import math

import numpy as np

from featdiff.diff.result import Comparison, PairMetrics
from featdiff.html.figure import bin_map, map_divergence


def _pair(
    eval_index: int,
    name: str,
    errors: list[float],
    positions: list[int],
    phase: str = "prefill",
    tolerance: float = 1e-6,
) -> PairMetrics:
    nmse = max(errors) ** 2 if errors else 0.0
    return PairMetrics(
        role="target",
        phase=phase,
        eval=eval_index,
        name=name,
        occurrence=0,
        max_abs=0.0,
        nmse=nmse,
        cos_min=1.0,
        cos_median=1.0,
        rel_p50=0.0,
        rel_p99=0.0,
        tolerance=tolerance,
        within=nmse <= tolerance,
        row_rel_err=tuple(errors),
        positions=tuple(positions),
    )


def _comparison(pairs: list[PairMetrics], first: int | None) -> Comparison:
    return Comparison("ref.npz", "run.npz", (), tuple(pairs), (), first)


def test_divergence_map_places_rows_at_positions_and_leaves_the_rest_nan() -> None:
    pairs = [
        _pair(0, "l_out-0", [1e-7, 1e-7, 1e-7], [0, 1, 2]),
        _pair(1, "inp_g_embeddings", [1e-7, 0.5], [3, 4], phase="inject"),
    ]
    m = map_divergence(_comparison(pairs, 1))
    assert m.matrix.shape == (2, 5)
    assert m.col_start == (0, 1, 2, 3, 4)
    assert np.isnan(m.matrix[0, 3:]).all() and np.isnan(m.matrix[1, :3]).all()
    assert m.matrix[1, 4] == 0.5
    assert [s.label for s in m.segments] == ["e0 target prefill", "e1 target inject"]
    assert (m.first_row, m.first_col) == (1, 4)  # the first row over sqrt(tolerance)


def test_divergence_map_sorts_records_by_eval_and_follows_the_first_divergence() -> None:
    pairs = [_pair(2, "b", [1.0], [5]), _pair(0, "a", [1e-9], [0])]
    m = map_divergence(_comparison(pairs, 0))
    assert m.row_labels == ("a", "b")
    assert m.first_row == 1


def test_divergence_map_without_divergence_marks_nothing() -> None:
    m = map_divergence(_comparison([_pair(0, "a", [1e-9, 1e-9], [0, 1])], None))
    assert m.first_row is None and m.first_col is None


def test_binning_keeps_the_largest_error_and_keeps_phases_apart() -> None:
    errors = [1e-7] * 1000
    errors[777] = 0.9
    pairs = [_pair(0, f"l_out-{i}", errors, list(range(1000))) for i in range(150)]
    pairs += [_pair(1, "inp_target_features", [1e-7] * 10, list(range(10)), phase="inject")]
    m = map_divergence(_comparison(pairs, 0))
    b = bin_map(m, max_rows=40, max_cols=100)
    assert b.matrix.shape[1] <= 100 and b.col_width == 10
    assert b.matrix.shape[0] <= 40
    assert b.rows_per_bin == math.ceil(150 / 39)
    assert [s.label for s in b.segments] == ["e0 target prefill", "e1 target inject"]
    last = b.segments[-1]
    assert last.stop - last.start == 1 and b.row_labels[last.start] == "inp_target_features"
    assert np.nanmax(b.matrix) == 0.9
    assert b.first_row == 0 and b.row_labels[0] == "l_out-0" and b.col_start[b.first_col] == 770
    assert b.first_position == 777 and b.first_label == "l_out-0 (e0 target prefill)"
    assert np.isnan(b.matrix[last.start, 1:]).all()  # positions 10.. never compared


def test_binning_gives_the_first_divergent_record_a_row_of_its_own() -> None:
    pairs = [_pair(0, f"l_out-{i}", [1e-7], [0]) for i in range(100)]
    m = map_divergence(_comparison(pairs, 42))
    b = bin_map(m, max_rows=10, max_cols=10)
    assert b.row_labels[b.first_row] == "l_out-42"
    assert b.row_labels[b.first_row - 1].endswith("l_out-41 (2)")  # the bin before ends early


def test_positions_binned_on_the_way_in_match_binning_afterwards() -> None:
    rng = np.random.default_rng(5)
    pairs = [_pair(e, f"r{e}", list(rng.uniform(0, 1, 700)), list(range(e * 10, e * 10 + 700))) for e in range(5)]
    c = _comparison(pairs, 3)
    direct, after = map_divergence(c, max_cols=64), bin_map(map_divergence(c), max_rows=96, max_cols=64)
    assert direct.col_width == after.col_width == 12 and direct.col_start == after.col_start
    assert np.allclose(direct.matrix, after.matrix, equal_nan=True)
    assert direct.first_col == after.first_col


def test_a_non_finite_row_shows_as_the_largest_error() -> None:
    m = map_divergence(_comparison([_pair(0, "a", [1e-7, float("nan")], [0, 1])], 0))
    assert m.matrix[0, 1] == np.inf


def test_binning_a_small_map_changes_nothing() -> None:
    m = map_divergence(_comparison([_pair(0, "a", [0.1, 0.2], [0, 1])], 0))
    b = bin_map(m, max_rows=96, max_cols=256)
    assert np.array_equal(b.matrix, m.matrix) and b.row_labels == m.row_labels
