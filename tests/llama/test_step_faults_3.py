"""The wiring faults of 0013-step-faults-3.patch (issue 42 item 5), each captured from the patched
build with `FEATDIFF_FAULT` set, in-process where it lives in libllama's graphs and around
`llama-speculative-simple` (with the reference that follows the run), and named with its kind,
tensor and `where` (docs/faults.md): EAGLE3's reduced-vocabulary map in its graph (d2t never
applied, read one entry ahead: `wrong_source` at `result_output`, never `nonfinite`), the layers it
is handed (every slot on the first, in the driver: `layer_offset`; each slot its layer's attention
norm, in the qwen3 graph: `wrong_source`), and GLM-4.5's graphs (the head's two norms crossed:
`wrong_source` naming the other norm; the hidden of the layer before the trunk's last handed over:
`layer_offset`), and 0015's first layer's hidden handed over, five layers back: `layer_offset`."""

from __future__ import annotations

from pathlib import Path

import pytest

from featdiff.diff import compare_dumps
from featdiff.diff.result import Finding
from featdiff.programs import exec as exec_capture
from featdiff.torchref.kind import reference

from eagle3_real import run_and_ref

RUN_TIMEOUT_S = 120
PROGRAM = "llama-speculative-simple"
DRAFT_ARGS = ["--spec-draft-n-max", "3", "--spec-draft-p-min", "0", "-c", "256", "-t", "1"]
TOKENS = "7,21,3,99,140,5,260,33,18,402,77,9"

pytestmark = pytest.mark.slow  # the pinned converter makes the pairs (cached per machine)


def _program(tools, kind: str, d: Path) -> tuple[list[str], Path, Path]:
    """llama-speculative-simple's command line on the pair `d`, and the reference's target and model."""
    cmd = [str(tools.program(PROGRAM)), "-m", str(d / "target.gguf")]
    if kind == "eagle3":
        cmd += ["-md", str(d / "draft.gguf"), "--spec-type", "draft-eagle3", *DRAFT_ARGS, "-td", "1"]
        return [*cmd, "-p", "The quick brown fox", "-n", "16", "--temp", "0"], d / "target.gguf", d / "draft.gguf"
    cmd += ["--spec-type", "draft-mtp", *DRAFT_ARGS, "-p", "hello world", "-n", "16", "--temp", "0"]
    return cmd, d / "target-hf", d / "target.gguf"


def around_program(tools, kind: str, d: Path, fault: str, tmp: Path, monkeypatch) -> list[Finding]:
    """The error findings of the run around the program with `fault` planted, against the reference
    that follows it."""
    cmd, target, model = _program(tools, kind, d)
    monkeypatch.setenv("FEATDIFF_FAULT", fault)
    run = exec_capture.capture_exec(cmd, tmp / "run.npz", timeout_s=RUN_TIMEOUT_S)
    monkeypatch.delenv("FEATDIFF_FAULT")
    ref = reference(
        target, model, tmp / "ref.npz", prompt=None, tokens=None, rounds=0, dtype="float32", device="cpu",
        kv_dtype="f16", llama_dir=None, follow=run,
    )  # fmt: skip
    return [f for f in compare_dumps(ref, run).findings if f.severity == "error"]


def in_process(kind: str, d: Path, fault: str, tmp: Path, monkeypatch) -> list[Finding]:
    """The error findings of featdiff's own driver on the patched library with `fault` planted."""
    monkeypatch.setenv("FEATDIFF_FAULT", fault)  # read by libllama's graphs (0013)
    if kind == "eagle3":
        run, ref = run_and_ref(d, d / "draft.gguf", tmp)  # the reference reads FEATDIFF_FAULT nowhere
    else:
        from featdiff.driver.capture import capture

        run = capture(d / "target.gguf", d / "target.gguf", tmp / "run.npz", tokens=TOKENS, rounds=3)
        ref = reference(
            d / "target-hf", d / "target.gguf", tmp / "ref.npz", prompt=None, tokens=None, rounds=3,
            dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None, follow=run,
        )  # fmt: skip
    return [f for f in compare_dumps(ref, run).findings if f.severity == "error"]


def planted(where: str, tools, kind: str, d: Path, fault: str, tmp: Path, monkeypatch) -> list[Finding]:
    """The error findings of `fault` captured `where`: "in-process" or "around the program"."""
    if where == "in-process":
        return in_process(kind, d, fault, tmp, monkeypatch)
    return around_program(tools, kind, d, fault, tmp, monkeypatch)


D2T = [
    ("eagle3-d2t-dropped", "no_d2t", "row i sits at target id i"),
    ("eagle3-d2t-shifted", "d2t_shift+1", "d2t[i + 1]"),
]


@pytest.mark.parametrize("where", ["in-process", "around the program"])
@pytest.mark.parametrize("fault, source, words", D2T)
def test_a_d2t_map_off_is_a_wrong_source_at_the_lookup_never_nonfinite(
    tools, eagle3_pairs, tmp_path, monkeypatch, where, fault, source, words
):
    d = eagle3_pairs("eagle3")  # drafts a reduced vocabulary: half the target's ids
    errors = planted(where, tools, "eagle3", d, fault, tmp_path, monkeypatch)
    assert errors and not [f for f in errors if f.kind == "nonfinite"], [f.message for f in errors]
    first = errors[0]
    assert (first.kind, first.tensor, first.fields["source"]) == ("wrong_source", "result_output", source), [
        f.message for f in errors
    ]
    assert words in first.message, first.message
    assert first.fields["where"] == "graph", first.fields["where_reason"]  # the reference read the same GGUF
    assert "re-export" not in first.message  # the GGUF is right: never advise rewriting it


def test_every_eagle3_slot_tapping_the_first_layer_is_a_layer_offset_from_the_driver(
    tools, eagle3_pairs, tmp_path, monkeypatch
):
    """Planted in common/speculative.cpp: only a program runs that driver (featdiff's in-process
    EAGLE3 driver taps the layers itself)."""
    errors = around_program(tools, "eagle3", eagle3_pairs("eagle3"), "eagle3-slots-one-layer", tmp_path, monkeypatch)
    assert errors, "the tapped layers were not named"
    first = errors[0]
    assert (first.kind, first.tensor) == ("layer_offset", "inp_embd"), [f.message for f in errors]
    assert first.fields["expected_layers"] == [1, 3, 5] and first.fields["observed_layers"] == [1, 1, 1]
    assert (first.fields["slot"], first.fields["observed_layer"], first.fields["expected_layer"]) == (1, 1, 3)
    assert first.fields["where"] == "driver", first.fields["where_reason"]


@pytest.mark.parametrize("where", ["in-process", "around the program"])
def test_glm4moe_mtp_norms_crossed_in_the_graph_are_a_wrong_source_naming_the_other_norm(
    tools, mtp_pairs, tmp_path, monkeypatch, where
):
    """The head's hidden normed with enorm's weight and its embedding with hnorm's (the reference's
    `mtp_enorm-<il>@norm=hnorm`), the GGUF the reference's own: the graph's fix, not the converter's."""
    d, fault = mtp_pairs("mtp-glm4moe"), "mtp-glm4moe-norms-swapped"
    errors = planted(where, tools, "mtp", d, fault, tmp_path, monkeypatch)
    assert errors, "the crossed norms were not named"
    first = errors[0]
    assert (first.kind, first.tensor, first.fields["source"]) == ("wrong_source", "mtp_enorm-6", "hnorm"), [
        f.message for f in errors
    ]
    assert "the graph norms the MTP head's two inputs each with the other's weight" in first.message, first.message
    assert first.fields["where"] == "graph", first.fields["where_reason"]
    assert "re-export" not in first.message and "converter" not in first.message


# fault -> the target layer whose output the head is handed (the trunk's last is 5) and the words
LAYER_FAULTS = {
    "mtp-glm4moe-hidden-layer-before": (4, "1 layer before"),  # 0013: the last layer's input
    "mtp-glm4moe-hidden-layer-first": (0, "5 layers before"),  # 0015: the first layer's output
}


@pytest.mark.parametrize("fault", LAYER_FAULTS)
@pytest.mark.parametrize("where", ["in-process", "around the program"])
def test_glm4moe_handing_its_head_an_earlier_layers_hidden_is_a_layer_offset_naming_the_layers(
    tools, mtp_pairs, tmp_path, monkeypatch, where, fault
):
    """The glm4-moe target hands its head an earlier layer's output under the final norm: layer 4's
    (the last trunk layer's input, 0013) or layer 0's (the first's, 0015) where the trunk's last is 5
    (the reference's `@h=l_out-<il>` candidates, every layer of this trunk), named at the head's
    input `mtp_h_input` in-process and around the program alike (a graph input only the head's norm
    reads, captured since issue 42), in the target's graph, which exposes that layer."""
    d, (layer, before) = mtp_pairs("mtp-glm4moe"), LAYER_FAULTS[fault]
    errors = planted(where, tools, "mtp", d, fault, tmp_path, monkeypatch)
    assert errors, "the earlier layer's hidden was not named"
    first = errors[0]
    assert (first.kind, first.tensor) == ("layer_offset", "mtp_h_input"), [f.message for f in errors]
    assert (first.fields["observed_layer"], first.fields["expected_layer"]) == (layer, 5)
    assert first.fields["delta"] == layer - 5
    assert f"target layer {layer}'s output" in first.message and before in first.message, first.message
    assert "t_h_nextn" in first.message, first.message
    assert first.fields["where"] == "graph", first.fields["where_reason"]


@pytest.mark.parametrize("where", ["in-process", "around the program"])
def test_eagle3_features_tapped_after_each_layers_norm_are_a_wrong_source_naming_the_norms(
    tools, eagle3_pairs, tmp_path, monkeypatch, where
):
    """The qwen3 target hands over, as each tapped layer's input, its attention norm's output."""
    d, fault = eagle3_pairs("eagle3"), "eagle3-tap-normed"
    errors = planted(where, tools, "eagle3", d, fault, tmp_path, monkeypatch)
    assert errors, "the normed taps were not named"
    first = errors[0]
    assert (first.kind, first.tensor, first.fields["source"]) == ("wrong_source", "inp_embd", "attn_norm"), [
        f.message for f in errors
    ]
    assert "(attn_norm-1, attn_norm-3, attn_norm-5)" in first.message, first.message
    assert first.fields["where"] == "graph", first.fields["where_reason"]
