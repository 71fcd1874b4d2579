"""The transformers-backed target (reference/hf_target.py): equal to featdiff's own qwen3 path on
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
from featdiff import names
from featdiff.cli import app
from featdiff.hf_targets import write_family_fixture
from featdiff.reference.flow import run_flow
from featdiff.reference.hf_target import HfTarget, target_from_transformers
from featdiff.reference.load import load_draft, load_target
from featdiff.reference.numerics import Numerics
from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS

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
    run = featdiff.capture(
        qwen3moe / "target.gguf",
        qwen3moe / "draft.gguf",
        tmp_path / "run.npz",
        tokens=DEFAULT_TOKENS,
        rounds=DEFAULT_ROUNDS,
        filters=["*"],  # every layer's l_out and the target's embd, not only the drafter's taps
    )
    ref = featdiff.reference(
        qwen3moe / "target-hf",
        qwen3moe / "draft.gguf",
        tmp_path / "ref.npz",
        tokens=DEFAULT_TOKENS,
        rounds=DEFAULT_ROUNDS,
    )
    result = featdiff.compare(ref, run).to_json()
    assert result["ok"], result["findings"]
    assert [f for f in result["findings"] if f["severity"] == "error"] == []
    assert result["first_divergence"] is None
    cov = result["coverage"]
    assert (cov["pairs_skipped"], cov["rows_skipped"], cov["ref_only"]) == (0, 0, 0), cov
    paired = {(r["role"], r["name"]) for r in result["records"]}
    n_layer = json.loads((qwen3moe / "target-hf" / names.HF_CONFIG).read_text())["num_hidden_layers"]
    target = {names.TARGET_EMBD, names.RESULT_NORM, names.RESULT_OUTPUT}
    target |= {names.layer_name(names.L_OUT, il) for il in range(n_layer)}
    assert {("target", n) for n in target} | {("draft", names.INP_TARGET_FEATURES)} <= paired
    assert result["layer_match"]["closest_layers"] == result["layer_match"]["expected_layers"]


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
    (target / names.HF_CONFIG).write_text(json.dumps({**config, "model_type": "gpt_oss"}))
    result = _reference_cli(target, fixture_models("clean") / "draft.gguf", tmp_path / "ref.npz")
    assert result.exit_code == 2, result.output
    assert "model_type 'gpt_oss'" in result.output and "qwen3_moe" in result.output
