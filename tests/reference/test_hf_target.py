"""The transformers-backed target (torchref/hf_target.py): equal to featdiff's own qwen3 path on
the qwen3 fixture, clean against a real capture of a converted Qwen3-MoE pair, and refusing what
it does not run with exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import featdiff
from featdiff.core import names
from featdiff.cli import app
from featdiff.factory.hf_targets import write_family_fixture
from featdiff.torchref.dflash.flow import run_flow
from featdiff.torchref.hf_target import HfTarget, target_from_transformers
from featdiff.torchref.load import load_draft, load_target
from featdiff.torchref.numerics import Numerics
import families
from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS, reference_of

runner = CliRunner()
PROMPT = tuple(int(t) for t in DEFAULT_TOKENS.split(","))
# rel L2 per record, transformers vs featdiff's own stack on the same weights. f32 cache: float32
# op order only (transformers' RMS norm sums in float32, ggml's in double; RoPE angles by powf vs
# repeated products), measured <= 8e-7. f16 cache: the same f16 emulation on both, but those
# 1e-7 differences flip an occasional f16 rounding, as against llama.cpp (test_matches_llama's
# AFTER_ATTENTION), measured <= 2.8e-4.
BOUND = {"f32": 1e-5, "f16": 5e-3}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / a.norm().clamp_min(torch.finfo(torch.float32).tiny))


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_transformers_target_equals_native_qwen3_path(fixture_models, kv_dtype):
    d = fixture_models("clean")
    num = Numerics(torch.float32, torch.device("cpu"), kv_dtype)
    native = load_target(d / "target-hf", num.dtype, num.device)
    hf = target_from_transformers(d / "target-hf", num.dtype, num.device)
    assert isinstance(hf, HfTarget) and not isinstance(native, HfTarget)
    draft = load_draft(d / "draft-hf", num.dtype, num.device)
    with torch.no_grad():
        a = run_flow(native, draft, PROMPT, DEFAULT_ROUNDS, num, block_rows=draft.block_size)
        b = run_flow(hf, draft, PROMPT, DEFAULT_ROUNDS, num, block_rows=draft.block_size)
    assert a.rounds == b.rounds
    assert any(r.accepted < len(r.drafts) for r in a.rounds)  # rejected rows were rolled back
    assert [e.eval for e in a.evals] == [e.eval for e in b.evals]
    for ea, eb in zip(a.evals, b.evals, strict=True):
        ref, got = {n.name: n.array for n in ea.records}, {n.name: n.array for n in eb.records}
        assert list(ref) == list(got), ea.eval
        for name, array in ref.items():
            assert array.shape == got[name].shape, (ea.eval, name)
            if array.numel():
                assert _rel(array, got[name]) <= BOUND[kv_dtype], (ea.eval, name, _rel(array, got[name]))


@pytest.fixture(scope="session")
def qwen3moe(tmp_path_factory):
    """The tiny Qwen3-MoE pair, converted by the pinned tree's converter (made once)."""
    return write_family_fixture(tmp_path_factory.mktemp("fam-qwen3moe"), "qwen3moe")


def test_qwen3moe_pair_compares_clean_with_nothing_skipped(qwen3moe, tmp_path):
    families.assert_clean_in_process(qwen3moe, tmp_path)


def _reference_cli(target: Path, model: Path, out: Path):
    return runner.invoke(
        app, ["reference", "--target", str(target), "--model", str(model), "-o", str(out), "--tokens", "1,2,3"]
    )


def test_transformers_arch_gguf_target_exits_2_asking_for_its_hf_dir(qwen3moe, tmp_path):
    result = _reference_cli(qwen3moe / "target.gguf", qwen3moe / "draft.gguf", tmp_path / "ref.npz")
    assert result.exit_code == 2, result.output
    assert "'qwen3moe' runs through transformers" in result.output and "HF checkpoint directory" in result.output


def test_unsupported_model_type_exits_2_naming_the_supported(fixture_models, tmp_path):
    target = shutil.copytree(fixture_models("clean") / "target-hf", tmp_path / "t-hf")
    config = json.loads((target / names.HF_CONFIG).read_text())
    (target / names.HF_CONFIG).write_text(json.dumps({**config, "model_type": "gemma3_text"}))
    result = _reference_cli(target, fixture_models("clean") / "draft.gguf", tmp_path / "ref.npz")
    assert result.exit_code == 2, result.output
    assert "model_type 'gemma3_text'" in result.output and "qwen3_moe" in result.output


# ---------------------------------------------------------------- around llama-server, check, a planted fault


def test_qwen3moe_pair_around_llama_server_compares_clean(qwen3moe, tools, tmp_path):
    families.assert_clean_around_server(qwen3moe, tools, tmp_path)


def test_qwen3moe_check_passes_and_its_accept_agrees(qwen3moe, tmp_path):
    families.assert_check_passes(qwen3moe, tmp_path)


def test_qwen3moe_layers_off_by_one_is_a_layer_offset(qwen3moe, tools, tmp_path):
    families.assert_layer_offset_named(qwen3moe, tools, tmp_path)


# ---------------------------------------------------------------- a real MoE near-tie

TIE_LAYER = 1  # the layer whose router gets two equal expert rows


@pytest.fixture(scope="session")
def qwen3moe_tied(qwen3moe, tmp_path_factory):
    """The tiny Qwen3-MoE target with experts 0 and 1 of layer TIE_LAYER given the same router row:
    an exact tie wherever the two straddle the top-2 cut, which llama.cpp's argsort and torch's
    topk break differently (measured: token 7 of the default prompt). Converted by the pinned converter."""
    from safetensors.torch import load_file, save_file

    from featdiff.factory.converter import convert_checkpoint

    out = tmp_path_factory.mktemp("fam-qwen3moe-tied")
    hf = shutil.copytree(qwen3moe / "target-hf", out / "target-hf")
    weights = next(hf.glob("*.safetensors"))
    w = load_file(weights)
    gate = f"model.layers.{TIE_LAYER}.mlp.gate.weight"  # (n_expert, n_embd)
    w[gate][1] = w[gate][0]
    save_file(w, weights, metadata={"format": "pt"})
    return convert_checkpoint(hf, out / "target.gguf", bootstrap="spm").parent


def _in_process(target: Path, draft: Path, out: Path) -> Path:
    return featdiff.capture(target, draft, out, tokens=DEFAULT_TOKENS, rounds=DEFAULT_ROUNDS, filters=["*"])


def test_a_real_expert_choice_on_a_router_tie_is_information(qwen3moe, qwen3moe_tied, tmp_path):
    run = _in_process(qwen3moe_tied / "target.gguf", qwen3moe / "draft.gguf", tmp_path / "run.npz")
    ref = reference_of(qwen3moe_tied / "target-hf", qwen3moe / "draft.gguf", tmp_path / "ref.npz", follow=run)
    comparison = featdiff.compare(ref, run)
    found = [f for f in comparison.findings if f.kind == "expert_choice"]
    assert found and found[0].severity == "info", [f.message for f in comparison.findings]
    f = found[0]
    assert f.tensor == names.layer_name(names.L_OUT, TIE_LAYER) and f.fields["layer"] == TIE_LAYER
    assert f.fields["margins"] == [0.0] * len(f.fields["rows"])  # the planted exact tie
    assert comparison.ok, [f.message for f in comparison.findings if f.severity == "error"]


def test_a_layer_offset_beside_a_real_expert_choice_is_named(qwen3moe, qwen3moe_tied, tmp_path):
    from featdiff.diff import exit_code

    from featdiff.factory.converter_faults import rewrite_gguf

    layers = families.draft_layers(qwen3moe / "draft.gguf")
    planted = {names.KEY_TARGET_LAYERS: [i + 1 for i in layers]}
    draft = rewrite_gguf(qwen3moe / "draft.gguf", tmp_path / "draft-plus1.gguf", planted)
    run = _in_process(qwen3moe_tied / "target.gguf", draft, tmp_path / "run.npz")
    ref = reference_of(qwen3moe_tied / "target-hf", qwen3moe / "draft.gguf", tmp_path / "ref.npz", follow=run)
    comparison = featdiff.compare(ref, run)
    kinds = {(f.kind, f.severity) for f in comparison.findings}
    assert {("expert_choice", "info"), ("layer_offset", "error")} <= kinds, [f.message for f in comparison.findings]
    f = next(f.to_json() for f in comparison.findings if f.kind == "layer_offset")
    assert (f["slot"], f["expected_layer"], f["observed_layer"], f["delta"]) == (0, layers[0], layers[0] + 1, 1)
    assert exit_code(comparison) == 1
