"""Detector of the state a target hands its MTP head taken from another layer than the trunk's last.
Consumes one pair's `Evidence` (the head's input `mtp_h_input`, or its norm `mtp_hnorm-<il>` where a
program's capture sees the input normed) and the reference's `<record>@h=l_out-<il>` candidates:
the rows the head would be handed were it given target layer il's output (the reference records the
layers before the last, nearest first, so the nearest candidate's layer + 1 is the last). Returns `Finding | None`.
"""

from __future__ import annotations

from featdiff.core import names
from featdiff.diff.detectors.base import Evidence, error_finding, explains, fix_by_place
from featdiff.diff.fields import LayerOffsetFields
from featdiff.diff.result import Finding

_MARK = f"{names.CANDIDATE_SEP}{names.HYP_H_LAYER}"


def detect_layer_offset_of_handed_state(ev: Evidence) -> Finding | None:
    """Hypothesis: the target hands its MTP head the output of a layer before the trunk's last (under
    the same norm). Evidence: the run's rows match a reference candidate `<record>@h=l_out-<il>`
    within tolerance, the nearest layer first."""
    layers = sorted(
        ((int(name.rsplit("-", 1)[1]), name, arr) for name, arr in ev.candidates.items() if _MARK in name),
        key=lambda c: -c[0],
    )
    if not layers:
        return None
    last = layers[0][0] + 1
    for il, name, arr in layers:
        if not explains(arr, ev.run, ev.tolerance):
            continue
        before = last - il
        graph_fix = (
            f"the target graph sets the hidden it hands over (t_h_nextn) from layer {il}'s output: take it after "
            f"the trunk's last layer, {last}"
        )
        export_fix = (
            "the GGUF's block count or nextn_predict_layers puts the head's hand-over before the trunk's last layer: "
            "re-export them as the checkpoint has them"
        )
        return error_finding(
            ev,
            f"{ev.tensor} is computed from target layer {il}'s output (it matches the reference's {name}), "
            f"{before} layer{'s' if before > 1 else ''} before the trunk's last ({last}): the MTP head is handed the "
            f"hidden state of the wrong layer; {fix_by_place(ev, export_fix, graph_fix)}",
            LayerOffsetFields(
                slot=0,
                expected_layer=last,
                observed_layer=il,
                delta=il - last,
                observed_layers=(il,),
                expected_layers=(last,),
            ),
        )
    return None
