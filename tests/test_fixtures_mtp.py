"""The Qwen3.5 MTP fixtures (featdiff.factory.mtp): the head the checkpoint gains, the pinned
converter's GGUFs of it (the head inside the target, or cut out as draft.gguf: keys, tensors and
shapes as src/models/qwen35.cpp load_block_mtp creates them, values the checkpoint's), the target
left as the qwen35 family's, the Qwen3.5-MoE variant (its head an MoE layer, as
src/models/qwen35moe.cpp loads it), the GLM-4.5 variant (its head one more decoder layer of the
checkpoint, as src/models/glm4-moe.cpp loads it), the MiMo-V2 variant (one head of the three MiMo
ships, converted as src/models/mimo2.cpp loads it), the `featdiff fixture` command, and llama.cpp
drafting with the head."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import array_from_tensor, has_meta, int_meta, meta, read_gguf
from featdiff.factory.converter import CONVERTER
from featdiff.factory.hf_families import (
    CHOICE_BIAS_GAIN,
    GLM4MOE_ROUTED_SCALE,
    MIMO2_V_HEAD_DIM,
    MIMO2_VALUE_SCALE,
    N_EXPERT,
    N_EXPERT_USED,
    N_FF_EXPERT,
    SLIDING_WINDOW,
)
from featdiff.factory.mtp import (
    ARCH_QWEN35MOE,
    GGUF_FROM_HF,
    GGUF_FROM_HF_GLM,
    GGUF_FROM_HF_MIMO2,
    GGUF_FROM_HF_MOE,
    GLM4MOE_MTP,
    GLM4MOE_TARGET,
    HF_GLM_FC,
    HF_GLM_N_MTP,
    HF_GLM_NORMS,
    HF_N_MTP,
    HF_SAFETENSORS,
    MIMO2_TARGET,
    MOE_TARGET,
    MTP_SETTINGS,
    MTP_VARIANTS,
    N_MTP,
    mtp_weights,
    write_mtp_fixture,
)
from featdiff.factory.pairs import TINY
from featdiff_process import drafted_counts

S = TINY.target
KEY_BLOCK_COUNT = names.KEY_BLOCK_COUNT.format(arch=names.ARCH_QWEN35)
KEY_NEXTN = names.KEY_NEXTN_LAYERS.format(arch=names.ARCH_QWEN35)
MTP_BLOCK = f"blk.{S.n_layer}."
MOE = "mtp-qwen35moe"
GLM = "mtp-glm4moe"
GLM_HF_LAYER = f"model.layers.{S.n_layer}."  # GLM-4.5's head: one more decoder layer of the checkpoint
MIMO = "mtp-mimo2"
QWEN3NEXT = "mtp-qwen3next"
MIMO_SWA_KV = 2 * 1  # the tiny MiMo's full layers have 1 KV head, its sliding ones (and its head) twice as many
# the trunk's tensors outside any block, which the converter's --mtp output keeps for the head
SHARED = {"token_embd.weight", "output.weight", "output_norm.weight"}
SPEC_PROMPT, SPEC_N_PREDICT, SPEC_N_DRAFT, SPEC_N_CTX, N_THREADS = "hello world", 8, 3, 256, 2


def _expected_block() -> dict[str, tuple[int, ...]]:
    """The MTP block as llama_model_qwen35::load_arch_tensors' load_block_mtp creates it (ggml ne;
    the optional nextn.embed_tokens and nextn.shared_head_head left out, as Qwen3.5 ships them)."""
    q_gated = S.n_embd_head * S.n_head * 2  # query and its output gate, per head
    kv = S.n_embd_head * S.n_head_kv
    ne = {
        "attn_norm": (S.n_embd,),
        "post_attention_norm": (S.n_embd,),
        "attn_q": (S.n_embd, q_gated),
        "attn_k": (S.n_embd, kv),
        "attn_v": (S.n_embd, kv),
        "attn_output": (S.n_embd_head * S.n_head, S.n_embd),
        "attn_q_norm": (S.n_embd_head,),
        "attn_k_norm": (S.n_embd_head,),
        "ffn_gate": (S.n_embd, S.n_ff),
        "ffn_up": (S.n_embd, S.n_ff),
        "ffn_down": (S.n_ff, S.n_embd),
        "nextn.eh_proj": (2 * S.n_embd, S.n_embd),
        "nextn.enorm": (S.n_embd,),
        "nextn.hnorm": (S.n_embd,),
        "nextn.shared_head_norm": (S.n_embd,),
    }
    return {f"{MTP_BLOCK}{name}.weight": shape for name, shape in ne.items()}


def _expected_moe_block() -> dict[str, tuple[int, ...]]:
    """The MoE variant's MTP block as llama_model_qwen35moe::load_arch_tensors' load_block_mtp
    creates it: the dense block's attention and nextn tensors, and an MoE FFN (router, experts
    stacked on ne[2], shared expert, the shared expert's gate: ne (n_embd, 1), its HF (1, n_embd))."""
    dense = {k: v for k, v in _expected_block().items() if not k.startswith(MTP_BLOCK + "ffn_")}
    ne = {
        "ffn_gate_inp": (S.n_embd, N_EXPERT),
        "ffn_gate_exps": (S.n_embd, N_FF_EXPERT, N_EXPERT),
        "ffn_up_exps": (S.n_embd, N_FF_EXPERT, N_EXPERT),
        "ffn_down_exps": (N_FF_EXPERT, S.n_embd, N_EXPERT),
        "ffn_gate_shexp": (S.n_embd, N_FF_EXPERT),
        "ffn_up_shexp": (S.n_embd, N_FF_EXPERT),
        "ffn_down_shexp": (N_FF_EXPERT, S.n_embd),
        "ffn_gate_inp_shexp": (S.n_embd, 1),
    }
    return dense | {f"{MTP_BLOCK}{name}.weight": shape for name, shape in ne.items()}


def _expected_glm_block() -> dict[str, tuple[int, ...]]:
    """The GLM variant's MTP block as llama_model_glm4_moe::load_arch_tensors creates it: attention
    with q/k/v biases (create_tensor_qkv) and no q/k norms (GLM-4.5-Air's), an MoE FFN (router,
    its choice bias exp_probs_b, experts stacked on ne[2], an ungated shared expert) and the nextn
    tensors (no embed_tokens or shared_head_head, as GLM-4.5 ships it)."""
    q, kv = S.n_embd_head * S.n_head, S.n_embd_head * S.n_head_kv
    ne = {
        "attn_norm.weight": (S.n_embd,),
        "post_attention_norm.weight": (S.n_embd,),
        "attn_q.weight": (S.n_embd, q),
        "attn_k.weight": (S.n_embd, kv),
        "attn_v.weight": (S.n_embd, kv),
        "attn_q.bias": (q,),
        "attn_k.bias": (kv,),
        "attn_v.bias": (kv,),
        "attn_output.weight": (q, S.n_embd),
        "ffn_gate_inp.weight": (S.n_embd, N_EXPERT),
        "exp_probs_b.bias": (N_EXPERT,),
        "ffn_gate_exps.weight": (S.n_embd, N_FF_EXPERT, N_EXPERT),
        "ffn_up_exps.weight": (S.n_embd, N_FF_EXPERT, N_EXPERT),
        "ffn_down_exps.weight": (N_FF_EXPERT, S.n_embd, N_EXPERT),
        "ffn_gate_shexp.weight": (S.n_embd, N_FF_EXPERT),
        "ffn_up_shexp.weight": (S.n_embd, N_FF_EXPERT),
        "ffn_down_shexp.weight": (N_FF_EXPERT, S.n_embd),
        "nextn.eh_proj.weight": (2 * S.n_embd, S.n_embd),
        "nextn.enorm.weight": (S.n_embd,),
        "nextn.hnorm.weight": (S.n_embd,),
        "nextn.shared_head_norm.weight": (S.n_embd,),
    }
    return {f"{MTP_BLOCK}{name}": shape for name, shape in ne.items()}


def _expected_mimo_block() -> dict[str, tuple[int, ...]]:
    """The MiMo variant's MTP block as llama_model_mimo2::load_arch_tensors creates it: a sliding
    layer's fused attn_qkv (create_tensor_qkv: keys n_embd_head_k wide, values n_embd_head_v),
    attn_output from the value heads, sinks, a dense FFN, the nextn tensors and layer_output_norm
    (MiMo's final_layernorm: the head norm graph_mtp falls back on)."""
    q, kv, v = S.n_embd_head * S.n_head, S.n_embd_head * MIMO_SWA_KV, MIMO2_V_HEAD_DIM * MIMO_SWA_KV
    ne = {
        "attn_norm": (S.n_embd,),
        "attn_qkv": (S.n_embd, q + kv + v),
        "attn_output": (MIMO2_V_HEAD_DIM * S.n_head, S.n_embd),
        "attn_sinks": (S.n_head,),
        "ffn_norm": (S.n_embd,),
        "ffn_gate": (S.n_embd, S.n_ff),
        "ffn_up": (S.n_embd, S.n_ff),
        "ffn_down": (S.n_ff, S.n_embd),
        "nextn.eh_proj": (2 * S.n_embd, S.n_embd),
        "nextn.enorm": (S.n_embd,),
        "nextn.hnorm": (S.n_embd,),
        "layer_output_norm": (S.n_embd,),
    }
    return {f"{MTP_BLOCK}{name}.weight": shape for name, shape in ne.items()}


EXPECTED_BLOCK = {
    "mtp": _expected_block,
    MOE: _expected_moe_block,
    GLM: _expected_glm_block,
    MIMO: _expected_mimo_block,
    QWEN3NEXT: _expected_moe_block,  # qwen3next.cpp's load_block_mtp: the trunk's block, as qwen35moe's
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """variant -> its fixture directory (seed 0), written once."""
    return {v: write_mtp_fixture(tmp_path_factory.mktemp(v), v) for v in MTP_VARIANTS}


def _hf(d: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(d / "target-hf" / HF_SAFETENSORS))


def _block(path: Path) -> dict[str, tuple[int, ...]]:
    """The GGUF's tensors of the MTP block: name -> ne."""
    return {name: t.ne for name, t in read_gguf(path).tensors.items() if name.startswith(MTP_BLOCK)}


# --- the table -----------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["fixture", "{out}", "--variant", "mtp-sideways"], ["fixture", "--list"]])
def test_the_fixture_command_lists_the_variants_and_refuses_an_unknown_one(tmp_path, args):
    result = CliRunner().invoke(app, [a.format(out=tmp_path / "out") for a in args])
    if "--list" in args:
        assert result.exit_code == 0 and all(f"\n{name} " in result.output for name in MTP_VARIANTS)
    else:
        assert result.exit_code == 2 and "no such fixture variant" in result.output
        assert all(name in result.output for name in MTP_VARIANTS)
        assert not (tmp_path / "out").exists()


def test_an_unknown_mtp_variant_is_refused_in_one_line_naming_the_choices(tmp_path):
    with pytest.raises(InputError) as e:
        write_mtp_fixture(tmp_path / "out", "mtp-sideways")
    assert "\n" not in str(e.value) and all(name in str(e.value) for name in MTP_VARIANTS)
    assert not (tmp_path / "out").exists()


def test_the_variant_table_and_its_settings_agree():
    assert MTP_VARIANTS == {name: v.doc for name, v in MTP_SETTINGS.items()}
    assert {name: v.has_separate_head for name, v in MTP_SETTINGS.items()} == {
        "mtp": False,
        "mtp-separate": True,
        "trained-mtp": False,
        MOE: False,
        GLM: False,
        MIMO: False,
        QWEN3NEXT: False,
        "mtp-deepseek2": False,
        "mtp-deepseek32": False,
        "mtp-glm-dsa": False,
        "mtp-nemotron-h-moe": False,
        "mtp-hy-v3": False,
        "mtp-cohere2moe": False,
        "mtp-bailingmoe3": False,
    }
    assert {name: v.arch for name, v in MTP_SETTINGS.items()} == {
        "mtp": names.ARCH_QWEN35,
        "mtp-separate": names.ARCH_QWEN35,
        "trained-mtp": names.ARCH_QWEN35,
        MOE: ARCH_QWEN35MOE,
        GLM: names.ARCH_GLM4MOE,
        MIMO: names.ARCH_MIMO2,
        QWEN3NEXT: names.ARCH_QWEN3NEXT,
        "mtp-deepseek2": names.ARCH_DEEPSEEK2,
        "mtp-deepseek32": names.ARCH_DEEPSEEK32,
        "mtp-glm-dsa": names.ARCH_GLM_DSA,
        "mtp-nemotron-h-moe": names.ARCH_NEMOTRON_H_MOE,
        "mtp-hy-v3": names.ARCH_HY_V3,
        "mtp-cohere2moe": names.ARCH_COHERE2MOE,
        "mtp-bailingmoe3": names.ARCH_BAILINGMOE3,
    }
    assert set(GGUF_FROM_HF.values()) == set(_expected_block())
    assert set(GGUF_FROM_HF_MOE.values()) == set(_expected_moe_block())
    assert set(GGUF_FROM_HF_GLM.values()) == set(_expected_glm_block())
    assert MTP_SETTINGS[MOE].gguf_from_hf is GGUF_FROM_HF_MOE and MTP_SETTINGS["mtp"].gguf_from_hf is GGUF_FROM_HF
    assert MTP_SETTINGS[GLM].gguf_from_hf is GGUF_FROM_HF_GLM
    assert set(GGUF_FROM_HF_MIMO2.values()) == set(_expected_mimo_block())
    assert MTP_SETTINGS[MIMO].gguf_from_hf is GGUF_FROM_HF_MIMO2


# --- the checkpoint ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_checkpoint_is_the_qwen35_target_with_a_seeded_head(made, tmp_path):
    """The target's tensors are the qwen35 family's of the same seed, bit for bit; the head adds
    exactly GGUF_FROM_HF's HF names, its decoder layer shaped as the target's full-attention layer 2."""
    from featdiff.factory.hf_families import FAMILIES
    from featdiff.factory.hf_targets import write_hf_target

    w = _hf(made["mtp"])
    write_hf_target(tmp_path / "plain" / "target-hf", FAMILIES["qwen35"], 0)
    plain = _hf(tmp_path / "plain")
    assert set(w) - set(plain) == set(GGUF_FROM_HF)
    assert all(np.array_equal(w[k], a) for k, a in plain.items())
    for hf in GGUF_FROM_HF:
        if hf.startswith("mtp.layers.0."):
            assert w[hf].shape == plain[hf.replace("mtp.layers.0.", "model.layers.2.")].shape, hf
    assert w["mtp.fc.weight"].shape == (S.n_embd, 2 * S.n_embd)
    config = json.loads((made["mtp"] / "target-hf" / names.HF_CONFIG).read_text())
    assert config[HF_N_MTP] == N_MTP
    assert all(np.array_equal(_hf(made["mtp-separate"])[k], a) for k, a in w.items())  # one checkpoint
    again, other = mtp_weights(config, plain, 0), mtp_weights(config, plain, 1)
    assert all(np.array_equal(w[k], a) for k, a in again.items())
    assert not np.array_equal(w["mtp.fc.weight"], other["mtp.fc.weight"])


@pytest.mark.slow
def test_the_moe_checkpoint_is_its_target_with_a_seeded_moe_head(made, tmp_path):
    """The MoE variant's target is MOE_TARGET's of the same seed, bit for bit; its head adds exactly
    GGUF_FROM_HF_MOE's HF names: the full-attention layer 2's shapes, router, every expert, the
    shared expert and its gate."""
    from featdiff.factory.hf_targets import write_hf_target

    w = _hf(made[MOE])
    write_hf_target(tmp_path / "plain" / "target-hf", MOE_TARGET, 0)
    plain = _hf(tmp_path / "plain")
    assert set(w) - set(plain) == set(GGUF_FROM_HF_MOE)
    assert all(np.array_equal(w[k], a) for k, a in plain.items())
    for hf in GGUF_FROM_HF_MOE:
        if hf.startswith("mtp.layers.0."):
            assert w[hf].shape == plain[hf.replace("mtp.layers.0.", "model.layers.2.")].shape, hf
    assert w["mtp.layers.0.mlp.gate.weight"].shape == (N_EXPERT, S.n_embd)
    assert w["mtp.layers.0.mlp.shared_expert_gate.weight"].shape == (1, S.n_embd)
    config = json.loads((made[MOE] / "target-hf" / names.HF_CONFIG).read_text())
    assert config[HF_N_MTP] == N_MTP and config["num_experts"] == N_EXPERT


@pytest.mark.slow
def test_the_glm_checkpoint_is_its_target_with_a_seeded_head_as_glm_ships_it(made, tmp_path):
    """The GLM variant's target is GLM4MOE_TARGET's of the same seed, bit for bit; its head adds
    exactly GGUF_FROM_HF_GLM's HF names: one more decoder layer `model.layers.<n_layer>.*` shaped as
    the trunk's last (MoE) layer, with eh_proj, enorm, hnorm and shared_head.norm inside it, counted
    by `num_nextn_predict_layers`; the routers' choice biases drawn CHOICE_BIAS_GAIN times as wide."""
    from featdiff.factory.hf_targets import write_hf_target

    w = _hf(made[GLM])
    write_hf_target(tmp_path / "plain" / "target-hf", GLM4MOE_TARGET, 0)
    plain = _hf(tmp_path / "plain")
    assert set(w) - set(plain) == set(GGUF_FROM_HF_GLM)
    assert all(np.array_equal(w[k], a) for k, a in plain.items())
    last = f"model.layers.{S.n_layer - 1}."
    for hf in set(GGUF_FROM_HF_GLM) - {HF_GLM_FC, *HF_GLM_NORMS}:
        assert w[hf].shape == plain[hf.replace(GLM_HF_LAYER, last)].shape, hf
    assert w[HF_GLM_FC].shape == (S.n_embd, 2 * S.n_embd)
    config = json.loads((made[GLM] / "target-hf" / names.HF_CONFIG).read_text())
    assert config[HF_GLM_N_MTP] == N_MTP and config["n_routed_experts"] == N_EXPERT
    assert config["first_k_dense_replace"] == 1
    ungained = replace(GLM4MOE_TARGET, gains=())
    write_hf_target(tmp_path / "ungained" / "target-hf", ungained, 0)
    bias = "mlp.gate.e_score_correction_bias"
    assert np.allclose(plain[last + bias] - 1, CHOICE_BIAS_GAIN * (_hf(tmp_path / "ungained")[last + bias] - 1))
    head = mtp_weights(config, plain, 0, replace(GLM4MOE_MTP, family=ungained))
    assert np.allclose(w[GLM_HF_LAYER + bias] - 1, CHOICE_BIAS_GAIN * (head[GLM_HF_LAYER + bias] - 1))
    assert all(np.array_equal(w[k], a) for k, a in head.items() if not k.endswith(bias))


@pytest.mark.slow
def test_the_mimo_checkpoint_is_its_target_with_one_seeded_head_as_mimo_ships_it(made, tmp_path):
    """The MiMo variant's target is MIMO2_TARGET's of the same seed, bit for bit; its head adds
    exactly GGUF_FROM_HF_MIMO2's HF names under `model.mtp.layers.0.`: a sliding layer's attention
    with q/k/v fused (rows [q, k, v]) and its sinks, the first (dense) layer's FFN; its config.json
    keeps the keys the converter reads and says no head count (MiMo's does not)."""
    from featdiff.factory.hf_targets import write_hf_target

    w = _hf(made[MIMO])
    write_hf_target(tmp_path / "plain" / "target-hf", MIMO2_TARGET, 0)
    plain = _hf(tmp_path / "plain")
    assert set(w) - set(plain) == set(GGUF_FROM_HF_MIMO2)
    assert all(np.array_equal(w[k], a) for k, a in plain.items())
    sliding, head = "model.layers.1.self_attn.", "model.mtp.layers.0."
    qkv = sum(plain[f"{sliding}{p}_proj.weight"].shape[0] for p in "qkv")
    assert w[head + "self_attn.qkv_proj.weight"].shape == (qkv, S.n_embd)
    assert w[head + "self_attn.attention_sink_bias"].shape == plain[sliding + "attention_sink_bias"].shape
    assert w[head + "mlp.up_proj.weight"].shape == plain["model.layers.0.mlp.up_proj.weight"].shape
    config = json.loads((made[MIMO] / "target-hf" / names.HF_CONFIG).read_text())
    assert config["hybrid_layer_pattern"] == [0, 1, 1, 1, 1, 0] and config["swa_num_key_value_heads"] == MIMO_SWA_KV
    assert not {HF_N_MTP, HF_GLM_N_MTP} & set(config)


# --- the converter's GGUFs -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mtp", MOE, GLM, MIMO, QWEN3NEXT])
def test_the_mtp_target_holds_the_head_as_llama_cpp_loads_it(made, variant):
    """qwen35.cpp's block, qwen35moe.cpp's (the MoE variant) or glm4-moe.cpp's (the GLM variant),
    keyed by the variant's arch."""
    d, arch = made[variant], MTP_SETTINGS[variant].arch
    m = read_gguf(d / "target.gguf")
    assert m.arch == arch
    assert int_meta(m, names.KEY_BLOCK_COUNT.format(arch=arch)) == S.n_layer + N_MTP
    assert int_meta(m, names.KEY_NEXTN_LAYERS.format(arch=arch)) == N_MTP
    assert _block(d / "target.gguf") == EXPECTED_BLOCK[variant]()
    assert not (d / "draft.gguf").exists()
    assert (d / "VARIANT").read_text() == f"{variant}: {MTP_VARIANTS[variant]} (converted by {CONVERTER})\n"


@pytest.mark.slow
def test_the_moe_target_carries_its_expert_keys(made):
    m = read_gguf(made[MOE] / "target.gguf")
    keys = {
        "expert_count": N_EXPERT,
        "expert_used_count": N_EXPERT_USED,
        "expert_feed_forward_length": N_FF_EXPERT,
        "expert_shared_feed_forward_length": N_FF_EXPERT,
    }
    assert {k: int_meta(m, f"{ARCH_QWEN35MOE}.{k}") for k in keys} == keys
    trunk = {n: t.ne for n, t in m.tensors.items() if n.startswith("blk.5.ffn")}
    assert trunk == {k.replace(MTP_BLOCK, "blk.5."): v for k, v in _expected_moe_block().items() if "ffn_" in k}


@pytest.mark.slow
def test_the_glm_target_carries_its_routing_keys(made):
    """What glm4-moe.cpp reads of the routing: sigmoid gating, the scale, the renormalization, the
    dense first layer; RoPE on half the head."""
    m, arch = read_gguf(made[GLM] / "target.gguf"), names.ARCH_GLM4MOE
    keys = {
        "expert_count": N_EXPERT,
        "expert_used_count": N_EXPERT_USED,
        "expert_feed_forward_length": N_FF_EXPERT,
        "expert_shared_count": 1,
        "expert_gating_func": 2,  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        "leading_dense_block_count": 1,
        "rope.dimension_count": S.n_embd_head // 2,
    }
    assert {k: int_meta(m, f"{arch}.{k}") for k in keys} == keys
    assert meta(m, f"{arch}.expert_weights_scale") == GLM4MOE_ROUTED_SCALE and meta(m, f"{arch}.expert_weights_norm")
    assert "blk.0.ffn_gate.weight" in m.tensors and "blk.1.ffn_gate_exps.weight" in m.tensors


@pytest.mark.slow
def test_the_mimo_target_carries_one_sliding_head(made):
    """The converter's bootstrap (converter.MIMO_N_NEXTN) counts one head, not MimoV2Model's 3:
    block_count n_layer + 1, the sliding-window pattern extended by one sliding entry, the head's KV
    heads the sliding layers'; and what mimo2.cpp reads of the attention: the window, the value
    heads' width, the value scale, RoPE on half the head with a sliding base of its own."""
    m, arch = read_gguf(made[MIMO] / "target.gguf"), names.ARCH_MIMO2
    assert meta(m, f"{arch}.attention.sliding_window_pattern") == [0, 1, 1, 1, 1, 0, 1]
    assert meta(m, f"{arch}.attention.head_count_kv") == [1, MIMO_SWA_KV, MIMO_SWA_KV, MIMO_SWA_KV, MIMO_SWA_KV, 1, 2]
    keys = {
        "attention.sliding_window": SLIDING_WINDOW,
        "attention.key_length": S.n_embd_head,
        "attention.value_length": MIMO2_V_HEAD_DIM,
        "rope.dimension_count": S.n_embd_head // 2,
    }
    assert {k: int_meta(m, f"{arch}.{k}") for k in keys} == keys
    assert meta(m, f"{arch}.attention.value_scale") == MIMO2_VALUE_SCALE
    assert meta(m, f"{arch}.rope.freq_base_swa") != meta(m, f"{arch}.rope.freq_base")
    assert not any(name.startswith(f"blk.{S.n_layer + 1}.") for name in m.tensors)


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant, gguf",
    [
        ("mtp", "target.gguf"),
        ("mtp-separate", "draft.gguf"),
        (MOE, "target.gguf"),
        (GLM, "target.gguf"),
        (MIMO, "target.gguf"),
        (QWEN3NEXT, "target.gguf"),
    ],
)
def test_the_heads_values_are_the_checkpoints_with_the_converters_norm_offset(made, variant, gguf):
    """The converter copies the head's matrices and biases as they are (eh_proj: fc over
    [embedding, hidden]; expert x: slice x of the stacked experts) and writes each norm as
    offset + w: 1 + w for Qwen3.5 (its RMSNorm scales by 1 + w), w for GLM-4.5."""
    w, m = _hf(made[variant]), read_gguf(made[variant] / gguf)
    offset = np.float32(MTP_SETTINGS[variant].target.norm_offset)
    for hf, name in MTP_SETTINGS[variant].gguf_from_hf.items():
        want = w[hf] + offset if name.endswith("norm.weight") else w[hf]  # enorm, hnorm, ...: every norm
        got = array_from_tensor(m, name)
        if expert := re.search(r"\.experts\.(\d+)\.", hf):
            got = got[int(expert.group(1))]
        assert np.array_equal(got, want), hf


@pytest.mark.slow
def test_the_separate_target_is_the_trunk_and_the_draft_the_head_alone(made):
    d = made["mtp-separate"]
    target, draft = read_gguf(d / "target.gguf"), read_gguf(d / "draft.gguf")
    assert target.arch == draft.arch == names.ARCH_QWEN35
    assert int_meta(target, KEY_BLOCK_COUNT) == S.n_layer and not has_meta(target, KEY_NEXTN)
    assert not _block(d / "target.gguf") and not any("nextn" in name for name in target.tensors)
    assert int_meta(draft, KEY_BLOCK_COUNT) == S.n_layer + N_MTP and int_meta(draft, KEY_NEXTN) == N_MTP
    assert set(draft.tensors) == set(_expected_block()) | SHARED
    assert _block(d / "draft.gguf") == _expected_block()
    mtp = read_gguf(made["mtp"] / "target.gguf")  # the same trunk and head, cut apart
    for name in target.tensors:
        assert np.array_equal(array_from_tensor(target, name), array_from_tensor(mtp, name)), name
    assert set(mtp.tensors) == set(target.tensors) | set(_expected_block())


@pytest.mark.slow
def test_the_fixture_command_writes_what_the_library_does(made, tmp_path):
    result = CliRunner().invoke(app, ["fixture", str(tmp_path / "fx"), "--variant", "mtp-separate"])
    assert result.exit_code == 0, result.output
    assert _files(tmp_path / "fx") == _files(made["mtp-separate"])


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# --- llama.cpp -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("variant", MTP_VARIANTS)
def test_llama_cpp_drafts_with_the_head(made, tools, variant):
    """llama-speculative-simple runs `--spec-type draft-mtp` on each fixture (the head from
    target.gguf itself, or from draft.gguf) and drafts every round; the random head's drafts are
    not expected to be accepted."""
    d = made[variant]
    draft = ["-md", str(d / "draft.gguf")] if MTP_SETTINGS[variant].has_separate_head else []
    argv = [str(tools.program("llama-speculative-simple")), "-m", str(d / "target.gguf"), *draft]
    argv += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(SPEC_N_DRAFT), "-c", str(SPEC_N_CTX)]
    argv += ["-p", SPEC_PROMPT, "-n", str(SPEC_N_PREDICT), "--temp", "0", "-t", str(N_THREADS)]
    counts, log = drafted_counts(argv)
    assert counts.get("n_drafted", 0) > 0 and "n_accept" in counts, log[-3000:]
