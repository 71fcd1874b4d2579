"""The state a target hands its MTP head tested against the layers before the trunk's last (issue 42
item 2): rows that match the reference's `<record>@h=l_out-<il>` candidate are a `layer_offset`
naming layer il and the last; rows that match none are left to the other detectors. Also EAGLE3's
taps (`@tap=attn_norm`) and its bridge row's g (`g_norm-0@g=batch_last`, from the driver)."""

from __future__ import annotations

import numpy as np
import pytest

from featdiff.diff import detectors as d
from featdiff.diff.detectors import Evidence
from featdiff.diff.tolerance import Tolerance

TOL = Tolerance(rel=1e-3, sources=("test",))
RNG = np.random.default_rng(5)
REF = RNG.standard_normal((5, 16)).astype(np.float32)  # (R, n_embd): the last layer's output, handed
LAYERS = {il: RNG.standard_normal((5, 16)).astype(np.float32) for il in (4, 3)}  # the two layers before it


def evidence(run: np.ndarray, tensor: str = "mtp_h_input", **kw) -> Evidence:
    candidates = {f"{tensor}@h=l_out-{il}": rows for il, rows in LAYERS.items()}
    return Evidence(tensor=tensor, record=tensor, ref=REF, run=run, tolerance=TOL, candidates=candidates, **kw)


@pytest.mark.parametrize("il, words", [(4, "1 layer before the trunk's last (5)"), (3, "2 layers before")])
def test_a_hidden_of_an_earlier_layer_is_a_layer_offset_naming_both_layers(il, words):
    f = d.detect_layer_offset_of_handed_state(evidence(LAYERS[il] + 1e-6, weights_where="graph"))
    assert f is not None and f.kind == "layer_offset", f
    assert (f.fields["observed_layer"], f.fields["expected_layer"], f.fields["delta"]) == (il, 5, il - 5)
    assert words in f.message and "the target graph sets the hidden it hands over" in f.message, f.message


def test_around_a_program_the_heads_norm_is_judged_alike():
    f = d.detect_layer_offset_of_handed_state(evidence(LAYERS[4], tensor="mtp_hnorm-6"))
    assert f is not None and f.tensor == "mtp_hnorm-6" and f.fields["observed_layer"] == 4
    assert "either" in f.message  # where not known: both fixes, and what tells them apart


def test_rows_no_layer_explains_are_not_claimed():
    assert d.detect_layer_offset_of_handed_state(evidence(RNG.standard_normal((5, 16)).astype(np.float32))) is None
    plain = Evidence(tensor="mtp_h_input", ref=REF, run=LAYERS[4], tolerance=TOL)  # no candidates recorded
    assert d.detect_layer_offset_of_handed_state(plain) is None


def test_eagle3_features_tapped_after_the_layers_norm_are_a_wrong_source_naming_each_norm():
    """The EAGLE3 reference's `inp_target_features@tap=attn_norm`: every slot its layer's attention norm."""
    from featdiff.diff.sketch import LayerMatch

    normed = RNG.standard_normal((5, 48)).astype(np.float32)
    lm = LayerMatch("inp_embd", (0, 1, 2, 3, 4, 5), (1, 3, 5), np.ones((3, 6)), np.zeros((3, 6)), ())
    ev = Evidence(
        tensor="inp_embd", record="inp_target_features", ref=RNG.standard_normal((5, 48)).astype(np.float32),
        run=normed, tolerance=TOL, candidates={"inp_target_features@tap=attn_norm": normed}, layers=lm,
        weights_where="graph",
    )  # fmt: skip
    f = d.detect_wrong_source(ev)
    assert f is not None and (f.kind, f.fields["source"]) == ("wrong_source", "attn_norm"), f
    assert "(attn_norm-1, attn_norm-3, attn_norm-5)" in f.message and "t_layer_inp" in f.message, f.message


@pytest.mark.parametrize(
    "where, words", [("graph", "the graph norms the MTP head's two inputs"), ("export", "re-export")]
)
def test_an_mtp_heads_norms_crossed_are_a_wrong_source_with_the_fix_of_their_place(where, words):
    e_norm = RNG.standard_normal((5, 16)).astype(np.float32)
    ev = Evidence(
        tensor="mtp_enorm-6", record="mtp_enorm-6", ref=REF, run=e_norm + 1e-6, tolerance=TOL,
        candidates={"mtp_enorm-6@norm=hnorm": e_norm}, weights_where=where,
    )  # fmt: skip
    f = d.detect_wrong_source(ev)
    assert f is not None and (f.kind, f.fields["source"]) == ("wrong_source", "hnorm"), f
    assert words in f.message, f.message


def test_an_eagle3_batchs_first_token_on_its_last_g_is_a_wrong_source_from_the_driver():
    """The EAGLE3 reference's `g_norm-0@g=batch_last` (process()'s bridge row on the batch's own last
    g, a later position's): the one row that differs matches it, and the driver is told to fix it."""
    from featdiff.diff.attribution import place
    from featdiff.diff.export import Export, RoleExport

    last = REF.copy()
    last[0] = REF[4]  # (n_embd,): the bridge row on the batch's last g
    ev = Evidence(
        tensor="g_norm-0", record="g_norm-0", ref=REF, run=last + 1e-6, tolerance=TOL,
        candidates={"g_norm-0@g=batch_last": last}, weights_where="graph",
    )  # fmt: skip
    f = d.detect_wrong_source(ev)
    assert f is not None and (f.kind, f.fields["source"]) == ("wrong_source", "batch_last"), f
    assert "the batch's last g row" in f.message and "pending_g_last" in f.message, f.message
    same = Export(roles={"draft": RoleExport("same_file", complete=True)}, gguf={"draft": "d.gguf"})
    assert place(f, same, inputs=()).where == "driver"


def test_an_eagle3_g_norm_no_candidate_explains_is_not_a_batch_last():
    last = REF.copy()
    last[0] = REF[4]
    ev = Evidence(
        tensor="g_norm-0", record="g_norm-0", ref=REF, run=RNG.standard_normal((5, 16)).astype(np.float32),
        tolerance=TOL, candidates={"g_norm-0@g=batch_last": last},
    )  # fmt: skip
    assert d.detect_wrong_source(ev) is None
