"""The DeepSeek-V4 MTP fixture (factory/mtp_deepseek4.py) without the converter: `fixture --list`
names it, and the checkpoint is DeepSeek's own layout, seeded: the head as `mtp.0.*` with its
e/h projections, norms and hyper-connection head, the routed experts packed as MXFP4 with their E8M0
scales, and exactly one trunk layer compressed with the lightning indexer."""

from __future__ import annotations

import numpy as np
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.factory.hf_families import N_EXPERT, N_FF_EXPERT
from featdiff.factory.mtp_deepseek4 import (
    COMPRESSED,
    DEEPSEEK4_VARIANTS,
    E8M0_BIAS,
    EXPERT_SCALE_EXP,
    MXFP4_BLOCK,
    N_LAYER,
    deepseek4_config,
    deepseek4_weights,
)
from featdiff.factory.pairs import TINY


def test_fixture_list_names_the_deepseek4_variant():
    result = CliRunner().invoke(app, ["fixture", "--list"])
    assert result.exit_code == 0 and all(f"\n{name} " in result.output for name in DEEPSEEK4_VARIANTS)


def test_the_head_is_mtp_0_with_its_projections_norms_and_hyper_connection_head():
    w = deepseek4_weights(0)
    d = TINY.target.n_embd
    for name in ("e_proj", "h_proj"):
        assert w[f"mtp.0.{name}.weight"].shape == (d, d)
    assert all(f"mtp.0.{n}.weight" in w for n in ("enorm", "hnorm", "norm", "attn_norm", "ffn_norm"))
    assert w["mtp.0.hc_head_fn"].shape == w["hc_head_fn"].shape == (4, 4 * d)
    assert not np.array_equal(w["mtp.0.hc_head_fn"], w["hc_head_fn"])  # the head's own, not the trunk's
    assert deepseek4_config()["num_nextn_predict_layers"] == 1
    assert not any(k.startswith(f"layers.{N_LAYER}.") for k in w)  # the head is mtp.0, not a layer past the trunk


def test_the_experts_are_packed_as_deepseek_ships_them():
    w = deepseek4_weights(0)
    d = TINY.target.n_embd
    for e in range(N_EXPERT):
        for name, (rows, cols) in (("w1", (N_FF_EXPERT, d)), ("w2", (d, N_FF_EXPERT)), ("w3", (N_FF_EXPERT, d))):
            packed, scale = w[f"mtp.0.ffn.experts.{e}.{name}.weight"], w[f"mtp.0.ffn.experts.{e}.{name}.scale"]
            assert packed.dtype == scale.dtype == np.uint8
            assert packed.shape == (rows, cols // 2) and scale.shape == (rows, cols // MXFP4_BLOCK)
            assert (scale == E8M0_BIAS + EXPERT_SCALE_EXP).all()
    assert len({int(v) & 15 for v in w["layers.0.ffn.experts.0.w1.weight"].ravel()}) == 16  # every E2M1 code


def test_one_trunk_layer_compresses_with_the_indexer_and_the_weights_are_seeded():
    w = deepseek4_weights(0)
    ratios = deepseek4_config()["compress_ratios"]
    assert len(ratios) == N_LAYER + 1 and [i for i, r in enumerate(ratios) if r] == [COMPRESSED] and ratios[-1] == 0
    compressed = {k for k in w if ".compressor." in k or ".indexer." in k}
    assert compressed and all(k.startswith(f"layers.{COMPRESSED}.attn.") for k in compressed)
    again, other = deepseek4_weights(0), deepseek4_weights(1)
    assert again.keys() == w.keys() and all(np.array_equal(again[k], w[k]) for k in w)
    assert not np.array_equal(other["mtp.0.e_proj.weight"], w["mtp.0.e_proj.weight"])
