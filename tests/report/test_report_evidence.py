"""Figure data read from dumps (report/evidence.py), on synthetic DFlash-shaped dump pairs."""

from __future__ import annotations

import numpy as np

from featdiff.dump import read_dump
from featdiff.report.evidence import layer_match_from_dumps, row_shift_from_dumps


def test_layer_match_of_off_by_one_layers_is_the_expected_layer_plus_one(plus1_pair) -> None:
    with read_dump(plus1_pair.ref) as ref, read_dump(plus1_pair.run) as run:
        m = layer_match_from_dumps(ref, run)
    assert m is not None
    assert m.expected == (2, 4) and m.run_layers == (3, 5)
    assert m.best_layers() == tuple(L + 1 for L in m.expected)
    for k, j in enumerate(m.expected_columns()):
        assert m.matrix[k, j] < m.matrix[k].max()  # the outlined cell is not the brightest
    assert m.n_rows == 11  # the prefill rows: prompt length - 1


def test_layer_match_of_a_clean_run_is_the_expected_layer(clean_pair) -> None:
    with read_dump(clean_pair.ref) as ref, read_dump(clean_pair.run) as run:
        m = layer_match_from_dumps(ref, run)
    assert m is not None and m.best_layers() == m.expected == (2, 4)
    assert np.allclose(m.matrix[[0, 1], list(m.expected_columns())], 1.0, atol=1e-6)


def test_layer_match_needs_layer_inputs_in_the_ref(clean_pair) -> None:
    with read_dump(clean_pair.run) as run:
        assert layer_match_from_dumps(run, run) is None  # a run dump has no layer_inp-<L>


def test_row_shift_of_the_first_divergent_record_shows_the_planted_shift(shift_pair) -> None:
    c = shift_pair.comparison
    assert c.pairs[c.first_divergence].name == "inp_noise_embd"
    with read_dump(shift_pair.ref) as ref, read_dump(shift_pair.run) as run:
        m = row_shift_from_dumps(ref, run, c)
    assert m is not None and m.record == "inp_noise_embd (e2 draft draft)"
    assert m.run_positions == m.ref_positions == (11, 12, 13, 14)
    assert m.best_shift() == 1


def test_row_shift_without_divergence_is_none(clean_pair) -> None:
    assert clean_pair.comparison.first_divergence is None
    with read_dump(clean_pair.ref) as ref, read_dump(clean_pair.run) as run:
        assert row_shift_from_dumps(ref, run, clean_pair.comparison) is None
