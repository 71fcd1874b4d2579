"""RoPE scaling: the reference rotates as llama.cpp does for llama3 (`rope_freqs`) and YaRN, from
a GGUF or a HF config, proven against captures of the real library; and a scaling it does not
implement is refused, never computed as plain RoPE."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFValueType

from featdiff.core import names
from featdiff.diff import compare_dumps
from featdiff.core.errors import InputError
from featdiff.torchref import load_gguf, numerics
from featdiff.torchref.load import load_target
from featdiff.torchref.rope_params import PLAIN, hf_rope, llama3_freq_factors, llama_scaling
from featdiff.torchref.weights import Hparams
from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS, reference_of

from conftest import rewrite_gguf

SCALED = ["llama3-rope", "yarn"]
FILES = {"gguf": ("target.gguf", "draft.gguf"), "hf": ("target-hf", "draft-hf")}


@pytest.mark.parametrize("variant", SCALED)
@pytest.mark.parametrize("files", sorted(FILES))
def test_scaled_rope_compares_clean_against_the_real_library(referenced, captured, variant, files):
    target, model = FILES[files]
    ref = referenced(variant, model=model, target=target)
    comparison = compare_dumps(ref, captured(variant))
    assert comparison.ok, [f.message for f in comparison.findings if f.severity == "error"]
    compared = {p.name.split("-")[0] for p in comparison.pairs}
    assert {names.L_OUT, names.KCUR_INJECTED, names.RESULT_OUTPUT} <= compared, compared


@pytest.mark.parametrize("variant", SCALED)
def test_a_reference_that_ignored_the_scaling_would_be_caught(variant_dir, captured, tmp_path, monkeypatch, variant):
    """The fixtures' scaling moves what the run computes: plain RoPE in its place fails compare."""
    monkeypatch.setattr(load_gguf, "_rope_scaling", lambda g, n_rot: PLAIN)
    d = variant_dir(variant)
    ref = reference_of(d / "target.gguf", d / "draft.gguf", tmp_path / "plain.npz", tokens=DEFAULT_TOKENS,
                       rounds=DEFAULT_ROUNDS)  # fmt: skip
    assert not compare_dumps(ref, captured(variant)).ok


def test_the_loaded_scaling_is_the_fixtures(variant_dir):
    yarn = load_target(variant_dir("yarn") / "target.gguf", torch.float32, torch.device("cpu")).hparams.rope_scaling
    assert (yarn.freq_scale, yarn.ext_factor, yarn.n_ctx_orig) == (0.25, 1.0, 64)
    # llama.cpp's attention factor cancels the kernel's own YaRN magnitude correction: net 1 + 0.1 ln 4
    assert yarn.attn_factor * (1 + 0.1 * math.log(4.0)) == pytest.approx(1 + 0.1 * math.log(4.0))
    llama3 = load_target(variant_dir("llama3-rope") / "target.gguf", torch.float32, torch.device("cpu")).hparams
    assert llama3.rope_scaling.freq_factors is not None and len(llama3.rope_scaling.freq_factors) == 8
    assert llama3.rope_scaling.freq_factors[0] == 1.0 and llama3.rope_scaling.freq_factors[-1] == 8.0


def test_llama3_factors_blend_from_one_to_the_factor():
    f = llama3_freq_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    assert len(f) == 64 and f[0] == 1.0 and f[-1] == 8.0
    assert all(a <= b for a, b in zip(f, f[1:]))  # longer wavelengths, larger factors


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "longrope", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "mscale": 0.7},
        {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16},
    ],
)
def test_hf_scalings_not_implemented_are_refused(tmp_path, scaling):
    with pytest.raises(InputError, match="config.json"):
        hf_rope(tmp_path / "config.json", {"rope_theta": 10000.0, "rope_scaling": scaling}, 16)


def test_hf_rope_parameters_and_partial_rotary():
    config = {
        "partial_rotary_factor": 0.5,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
    }
    base, scaling, n_rot = hf_rope(Path("config.json"), config, 16)
    assert (base, scaling.freq_scale, n_rot) == (5e5, 0.5, 8)


@pytest.mark.parametrize(
    "keys",
    [
        {names.KEY_ROPE_SCALING_TYPE: ("longrope", GGUFValueType.STRING)},
        {names.KEY_ROPE_YARN_LOG_MUL: (0.1, GGUFValueType.FLOAT32)},
    ],
)
def test_gguf_scalings_not_implemented_are_refused(variant_dir, tmp_path, keys):
    src = variant_dir("clean") / "target.gguf"
    broken = rewrite_gguf(src, tmp_path / "t.gguf", set_keys={k.format(arch="qwen3"): v for k, v in keys.items()})
    with pytest.raises(InputError, match="t.gguf"):
        load_target(broken, torch.float32, torch.device("cpu"))


def _one_head(**over) -> Hparams:
    """A one-head, 8-dim stack's hyperparameters: enough for RoPE alone."""
    base = {"arch": "qwen3", "n_layer": 1, "n_embd": 8, "n_head": 1, "n_head_kv": 1, "n_embd_head": 8, "n_ff": 8,
            "n_vocab": 8, "rms_eps": 1e-6, "rope_base": 10000.0, "rope_type": "neox"}  # fmt: skip
    return Hparams(**{**base, **over})


def test_linear_scaling_divides_the_angle():
    hp = _one_head()
    x = torch.randn(3, 1, 8)
    plain = numerics.rope(x, torch.tensor([0, 2, 4]), hp)
    halved = numerics.rope(x, torch.tensor([0, 1, 2]), hp)
    scaled_hp = Hparams(**{**hp.__dict__, "rope_scaling": llama_scaling(Path("m.gguf"), "linear", 2.0, 0)})
    assert torch.allclose(numerics.rope(x, torch.tensor([0, 2, 4]), scaled_hp), halved, atol=1e-6)
    assert not torch.allclose(plain, halved)


def test_partial_rotary_leaves_the_other_dims_as_they_were():
    hp = _one_head(n_rot=4)
    x = torch.randn(3, 2, 8)
    out = numerics.rope(x, torch.tensor([1, 2, 3]), hp)
    assert torch.equal(out[..., 4:], x[..., 4:]) and not torch.equal(out[..., :4], x[..., :4])


def test_hf_config_of_the_fixture_states_the_scaling(variant_dir):
    config = json.loads((variant_dir("yarn") / "target-hf" / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "yarn"
    assert np.isclose(hf_rope(variant_dir("yarn"), config, 16)[1].freq_scale, 0.25)
