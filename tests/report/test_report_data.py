"""The report draws what compare concluded: the layer match and the row shift come from
`compare_dumps`'s `Comparison` (report/ measures nothing), and the figures show exactly the data
the findings JSON carries. On synthetic DFlash-shaped dump pairs (conftest `Pair.comparison`)."""

from __future__ import annotations

import numpy as np
import pytest

from featdiff.diff import compare_dumps
from featdiff.html.figure import map_divergence
from featdiff.html.heatmap import REL_ERR_RANGE, draw_layer_match, draw_row_shift
from featdiff.html.writer import draw_pictures

import synth
from findings_schema import written


def test_layer_match_of_off_by_one_layers_is_the_expected_layer_plus_one(plus1_pair) -> None:
    m = plus1_pair.comparison.layer_match
    assert m is not None
    assert m.expected_layers == (2, 4) and m.run_layers == (3, 5)
    assert m.closest_layers == tuple(L + 1 for L in m.expected_layers)
    for k, j in enumerate(m.expected_columns()):
        assert m.similarity[k, j] < m.similarity[k].max()  # the outlined cell is not the brightest
    assert len(m.positions) == len(synth.Spec().prompt) - 1  # the prefill rows


def test_layer_match_of_a_clean_run_is_the_expected_layer(clean_pair) -> None:
    m = clean_pair.comparison.layer_match
    assert m is not None and m.closest_layers == m.expected_layers == (2, 4)
    assert np.allclose(m.similarity[[0, 1], list(m.expected_columns())], 1.0, atol=1e-6)


def test_layer_match_needs_layer_inputs_in_the_ref(clean_pair) -> None:
    assert compare_dumps(clean_pair.run, clean_pair.run).layer_match is None  # a run dump has no layer_inp-<L>


def test_row_shift_of_the_first_divergent_record_shows_the_planted_shift(shift_pair) -> None:
    c = shift_pair.comparison
    assert c.pairs[c.first_divergence].name == "inp_target_features"
    m = c.row_shift
    assert m is not None and m.record == "inp_target_features (e4 draft inject)"  # round 1's inject
    n_past = len(synth.Spec().prompt) - 1
    assert m.run_positions == m.ref_positions == tuple(range(n_past, n_past + synth.Spec().block_size))
    assert m.best_shift() == 1


def test_row_shift_without_divergence_is_none(clean_pair) -> None:
    assert clean_pair.comparison.first_divergence is None and clean_pair.comparison.row_shift is None


@pytest.mark.parametrize("variant", ["plus1_pair", "shift_pair"])
def test_figure_data_is_the_findings_jsons(variant, request) -> None:
    """Each figure shows the numbers `compare --json` writes, and nothing the report computed."""
    c = request.getfixturevalue(variant).comparison
    data = written(c.to_json())
    layer_plot = draw_layer_match(c.layer_match)
    assert np.allclose(layer_plot.values, np.clip(data["layer_match"]["rel_err"], *REL_ERR_RANGE), atol=0, rtol=0)
    stars = [x for x, _ in layer_plot.stars]  # the closest layer of each slot, as columns
    assert [data["layer_match"]["layers"][int(round(j))] for j in stars] == data["layer_match"]["closest_layers"]
    shift_plot = draw_row_shift(c.row_shift)
    assert np.allclose(shift_plot.values, np.asarray(data["row_shift"]["similarity"]), atol=0, rtol=0)
    assert f"ref row i + {data['row_shift']['best_shift']}" in shift_plot.title
    first = data["first_divergence"]
    assert map_divergence(c).first_label == f"{first['name']} (e{first['eval']} {first['role']} {first['phase']})"
    captions = " ".join(p.caption for p in draw_pictures(c))
    assert str(data["layer_match"]["closest_layers"]) in captions
