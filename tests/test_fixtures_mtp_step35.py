"""The Step-3.5 MTP fixtures (factory/mtp_step35.py) without the converter: `fixture --list` names
each variant, the checkpoint holds every head as a decoder layer past the trunk, and the trunk's
transformers stand-in (`target-ref/`) holds the trunk's tensors only, its norms as llama.cpp
multiplies them (the converter adds 1 to each zero-centred norm)."""

from __future__ import annotations

import numpy as np
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.factory.mtp_step35 import N_HEADS, N_LAYER, STEP35_VARIANTS, qwen3moe_weights, step35_weights


def test_fixture_list_names_every_step35_variant():
    result = CliRunner().invoke(app, ["fixture", "--list"])
    assert result.exit_code == 0 and all(f"\n{name} " in result.output for name in STEP35_VARIANTS)


def test_the_checkpoint_holds_each_head_past_the_trunk_and_the_stand_in_the_trunk_only():
    step35 = step35_weights(0)
    for k in range(N_HEADS):
        assert f"model.layers.{N_LAYER + k}.eh_proj.weight" in step35
        assert f"model.layers.{N_LAYER + k}.self_attn.g_proj.weight" in step35
    assert not any(".g_proj." in n or ".moe." in n for n in step35 if n.startswith("model.layers.0."))
    trunk = qwen3moe_weights(step35)
    assert not any(n.startswith(f"model.layers.{N_LAYER}.") for n in trunk)
    norm = "model.layers.0.input_layernorm.weight"
    np.testing.assert_array_equal(trunk[norm], step35[norm] + 1.0)
    proj = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(trunk[proj], step35[proj])
    assert step35_weights(0).keys() == step35.keys() and np.array_equal(step35_weights(0)[proj], step35[proj])  # seeded
