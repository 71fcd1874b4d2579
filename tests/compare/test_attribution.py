"""diff/attribution.py: every error finding placed in the export, the graph or the driver by the
evidence (diff/export.py), or `unknown` with what would decide it; the fix sentence follows it."""

from __future__ import annotations

import numpy as np
import pytest

from featdiff.diff.attribution import attributed, place
from featdiff.diff.detectors import detect_scale_per_channel, detect_wrong_source
from featdiff.diff.detectors.base import Evidence
from featdiff.diff.export import Export, RoleExport, role_export
from featdiff.diff.fields import LayerOffsetFields, RowShiftFields, ScaleFields, WrongSourceFields
from featdiff.diff.result import Finding
from featdiff.diff.tolerance import Tolerance
from featdiff.dump.manifest_fields import ModelInfo

SAME = Export(roles={"draft": RoleExport("same_file", complete=True)}, gguf={"draft": "d.gguf"})
KEYS_AGREE = Export(roles={"draft": RoleExport("checkpoint")}, gguf={"draft": "d.gguf"})
LAYERS_DIFFER = Export(
    roles={
        "draft": RoleExport("checkpoint", differs=("target_layers [2, 4] in the run's, [1, 3] in the reference's",))
    },
    gguf={"draft": "d.gguf"},
)
FC_DIFFERS = Export(roles={"draft": RoleExport("other_gguf", differs=("fc.weight",), complete=True)}, gguf={})
NOTHING = Export(roles={}, gguf={})
# the run's own GGUF, keys and all (role_export's same_file)
SAME_FILE = Export(
    roles={"draft": RoleExport("same_file", complete=True, keys_complete=True)}, gguf={"draft": "d.gguf"}
)
# a checkpoint whose every tensor was found in the GGUF, its keys compared only through the manifests
TENSORS_AGREE = Export(roles={"draft": RoleExport("checkpoint", complete=True)}, gguf={"draft": "d.gguf"})
F32 = Tolerance(rel=1e-4, sources=("f32",))


def _layer_offset(tensor: str = "inp_target_features") -> Finding:
    return Finding.of(LayerOffsetFields(0, 2, 3, 1, (3, 5), (2, 4)), tensor=tensor, message="m")


def _routed() -> Finding:
    return Finding.of(
        WrongSourceFields("softmax", "mtp_post_ffn-6@routing=softmax"), tensor="mtp_post_ffn-6", message="m"
    )


def _scale(tensor: str = "fc_out") -> Finding:
    return Finding.of(ScaleFields(factor=2.0), tensor=tensor, message="m")


@pytest.mark.parametrize(
    ("finding", "export", "where"),
    [
        (_layer_offset(), LAYERS_DIFFER, "export"),  # the GGUF's key differs from the checkpoint's
        (_layer_offset(), SAME, "driver"),  # the same GGUF on both sides: the driver staged other layers
        (_layer_offset(), KEYS_AGREE, "driver"),
        (_layer_offset(), NOTHING, "unknown"),
        (_scale(), SAME, "graph"),  # inputs agree, output does not, same weights
        (_scale(), FC_DIFFERS, "export"),
        (_scale(), KEYS_AGREE, "unknown"),  # a checkpoint's tensors were not compared
        (_scale(), NOTHING, "unknown"),
        (Finding.of(RowShiftFields(shift=1), tensor="fc_out", message="m"), LAYERS_DIFFER, "driver"),
        (Finding.of(WrongSourceFields("stale_pending", "x"), tensor="mtp_h_input", message="m"), SAME, "driver"),
        (Finding.of(WrongSourceFields("prenorm", "x"), tensor="mtp_h_input", message="m"), SAME, "graph"),
        (_layer_offset("mtp_h_input"), SAME, "graph"),  # the target graph exposes the layer the head is handed
        (_layer_offset("mtp_h_input"), FC_DIFFERS, "export"),
        (Finding.of(RowShiftFields(shift=1), tensor="mtp_h_input", message="m"), SAME, "driver"),
        (_routed(), SAME_FILE, "graph"),  # the same file's expert_gating_func: the graph chose the other function
        (_routed(), LAYERS_DIFFER, "export"),
        (_routed(), TENSORS_AGREE, "unknown"),  # the key that decides it was not compared
    ],
)
def test_each_finding_is_placed_by_its_evidence(finding, export, where):
    placed = place(finding, export, inputs={"inp_target_features", "mtp_h_input"})
    assert placed.where == where, placed.where_reason
    assert placed.where_reason


def test_unknown_says_what_would_decide_it():
    assert "--model" in place(_scale(), NOTHING, ()).where_reason
    assert "featdiff reference --model d.gguf" in place(_scale(), KEYS_AGREE, ()).where_reason


def test_only_error_findings_get_where_and_a_detectors_own_is_kept():
    info = Finding.of(ScaleFields(factor=2.0), tensor="x", message="m", severity="info")
    own = Finding.of(ScaleFields(factor=2.0), tensor="x", message="m")
    own = Finding(
        own.kind, own.tensor, own.severity, own.message, {**own.fields, "where": "graph", "where_reason": "r"}
    )
    out = attributed((info, own, _scale()), NOTHING, ())
    assert "where" not in out[0].fields and out[1].fields["where"] == "graph" and out[2].fields["where"] == "unknown"
    assert Finding.from_json(out[2].to_json()) == out[2]  # round-trips: the keys sit among the fields


def _info(path: str, sha: str, layers: tuple[int, ...]) -> ModelInfo:
    return ModelInfo(path, sha, "dflash", 1, 16, 64, ("f32",), target_layers=layers)


def test_role_export_tells_the_same_file_a_checkpoint_and_its_keys():
    run = _info("d.gguf", "abc", (2, 4))
    assert role_export(_info("other/d.gguf", "abc", (2, 4)), run).origin == "same_file"
    hf = role_export(_info("draft-hf", "hf1", (1, 3)), run)
    assert hf.origin == "checkpoint" and hf.differs == ("target_layers [2, 4] in the run's, [1, 3] in the reference's",)
    assert role_export(_info("draft-hf", "hf1", (2, 4)), run).differs == ()
    assert role_export(None, run).origin == "unknown"


def _channel_ev(where) -> Evidence:
    rows = np.random.default_rng(0).standard_normal((8, 16))  # (R, D)
    factors = np.linspace(0.5, 2.0, 16)  # (D,)
    return Evidence(tensor="enc_norm", ref=rows, run=rows * factors, tolerance=F32, weights_where=where)


@pytest.mark.parametrize(
    ("where", "says", "never"),
    [
        ("graph", "the graph multiplies it", "converter"),
        ("export", "converter", "the graph multiplies"),
        ("unknown", "either", ""),
    ],
)
def test_a_norm_weight_fix_follows_where(where, says, never):
    f = detect_scale_per_channel(_channel_ev(where))
    assert f is not None and says in f.message
    assert not never or never not in f.message


def test_a_finding_is_placed_by_its_own_roles_evidence():
    """An MTP head read from the run's own GGUF while the reference's target came from a checkpoint
    (whose converted values differ by design): the head's node is the graph's, not the export's."""
    both = Export(
        roles={"target": RoleExport("checkpoint", differs=("blk.0.attn_norm.weight",)), "draft": SAME.roles["draft"]},
        gguf={"target": "t.gguf", "draft": "t.gguf"},
    )
    head = _scale("mtp_hnorm-6")
    assert attributed((head,), both, (), roles={"mtp_hnorm-6": "draft"})[0].fields["where"] == "graph"
    assert attributed((head,), both, (), roles={})[0].fields["where"] == "export"  # role unknown: all evidence


@pytest.mark.parametrize(("where", "says"), [("graph", "the graph embeds with the target's table"), ("export", "")])
def test_a_borrowed_table_fix_follows_where(where, says):
    """Never tell a user to ship a table the GGUF already ships: with the GGUF cleared (graph), the
    fix is the graph's; otherwise the export's sentence stands."""
    rows = np.random.default_rng(1).standard_normal((6, 16))  # (R, D)
    borrowed = np.random.default_rng(2).standard_normal((6, 16))  # (R, D)
    ev = Evidence(
        tensor="inp_noise_embd", ref=rows, run=borrowed, tolerance=F32, record="inp_noise_embd",
        candidates={"inp_noise_embd@table=target": borrowed}, weights_where=where,
    )  # fmt: skip
    f = detect_wrong_source(ev)
    assert f is not None and f.fields["source"] == "target"
    assert (says in f.message) if says else "the graph embeds" not in f.message


def test_a_divergence_whose_inputs_were_not_captured_is_not_placed_in_the_graph():
    """A plain divergence at a node none of whose inputs were captured (the graph leaves the nodes
    before it unnamed: bailingmoe3's MTP head names only mtp_eh_proj) has no evidence that its
    inputs agree: unknown, saying why; the same divergence with its inputs compared is the graph's,
    and an export difference still places it in the export."""
    from featdiff.diff.fields import DivergenceFields

    f = Finding.of(DivergenceFields(metric="nmse", value=0.9, tolerance=1e-3), tensor="mtp_eh_proj-6", message="m")
    unplaced = attributed((f,), SAME, (), unchecked={"mtp_eh_proj-6"})[0]
    assert unplaced.fields["where"] == "unknown" and "inputs were not captured" in unplaced.fields["where_reason"]
    assert attributed((f,), SAME, ())[0].fields["where"] == "graph"
    assert attributed((f,), FC_DIFFERS, (), unchecked={"mtp_eh_proj-6"})[0].fields["where"] == "export"
    assert attributed((_scale("mtp_eh_proj-6"),), SAME, (), unchecked={"mtp_eh_proj-6"})[0].fields["where"] == "graph"


@pytest.mark.parametrize(
    ("where", "says"),
    [
        (
            "graph",
            "the graph routes the head's experts by softmax although the GGUF and the checkpoint route by sigmoid",
        ),
        ("export", "write <arch>.expert_gating_func = 2 (sigmoid) into the GGUF"),
    ],
)
def test_a_head_routed_by_the_other_gating_function_is_named_and_its_fix_follows_where(where, says):
    """An MTP head's MoE block whose rows are the reference's `@routing=softmax` candidate (GLM-5's
    head run under DeepSeek's reading of a file without expert_gating_func): wrong_source `softmax`;
    the graph's fix where the GGUF was cleared, the key's where it was not."""
    rng = np.random.default_rng(3)
    rows, crossed = rng.standard_normal((4, 16)), rng.standard_normal((4, 16))  # (R, D) each
    ev = Evidence(
        tensor="mtp_post_ffn-6", ref=rows, run=crossed, tolerance=F32, record="mtp_post_ffn-6",
        candidates={"mtp_post_ffn-6@routing=softmax": crossed}, weights_where=where,
    )  # fmt: skip
    f = detect_wrong_source(ev)
    assert f is not None and (f.kind, f.fields["source"]) == ("wrong_source", "softmax")
    assert says in f.message, f.message
    other = Evidence(
        tensor="mtp_post_ffn-6", ref=rows, run=rng.standard_normal((4, 16)), tolerance=F32, record="mtp_post_ffn-6",
        candidates={"mtp_post_ffn-6@routing=softmax": crossed}, weights_where=where,
    )  # fmt: skip
    assert detect_wrong_source(other) is None  # rows neither function makes
