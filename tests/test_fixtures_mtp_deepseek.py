"""The `mtp-deepseek2` fixture (featdiff.factory.mtp_deepseek): a tiny DeepSeek-V3 checkpoint with its
MTP head as DeepSeek ships it (decoder layer n_layer), converted by the pinned converter through the
"deepseek" bootstrap (the converter's own DeepseekV2Model code, the head kept as its Glm4MoeLiteModel
keeps GLM-4.7-Flash's), holds what llama.cpp's deepseek2 graph_mtp reads."""

from __future__ import annotations

import numpy as np
import pytest

from featdiff.core import names
from featdiff.core.gguf_reader import array_from_tensor, int_meta, meta, read_gguf
from featdiff.factory.converter import BOOTSTRAPS
from featdiff.factory.hf_families import GLM4MOE_ROUTED_SCALE, N_EXPERT, N_EXPERT_USED, N_FF_EXPERT
from featdiff.factory.mtp import HF_SAFETENSORS, MTP_SETTINGS, MTP_VARIANTS
from featdiff.factory.mtp_deepseek import (
    BOOTSTRAP_DEEPSEEK,
    DEEPSEEK2_SPLIT,
    GGUF_FROM_HF_DEEPSEEK2,
    GGUF_FROM_HF_GLM_DSA,
    HF_KV_B,
    INDEX_TOPK,
    KV_LORA_RANK,
    Q_LORA_RANK,
    QK_NOPE_HEAD_DIM,
    QK_ROPE_HEAD_DIM,
    V_HEAD_DIM,
)
from featdiff.factory.pairs import TINY

VARIANT = "mtp-deepseek2"
S = TINY.target
ARCH = names.ARCH_DEEPSEEK2


def test_the_variant_is_listed_with_its_arch_and_bootstrap():
    assert VARIANT in MTP_VARIANTS
    v = MTP_SETTINGS[VARIANT]
    assert v.arch == ARCH and not v.has_separate_head
    assert v.target.bootstrap == BOOTSTRAP_DEEPSEEK and "Glm4MoeLiteModel" in BOOTSTRAPS[BOOTSTRAP_DEEPSEEK]


@pytest.mark.slow
def test_the_deepseek_target_holds_an_mla_moe_head_with_its_keys(mtp_pairs):
    """deepseek2.cpp graph_mtp's asserts: one nextn block after the trunk, MLA (q_lora, kv_lora,
    the MLA key/value lengths), an MoE block (sigmoid gating, the scale, the renormalization, the
    dense first layer), plain RoPE on the qk_rope dims (no YaRN key)."""
    m = read_gguf(mtp_pairs(VARIANT) / "target.gguf")
    assert m.arch == ARCH
    keys = {
        "block_count": S.n_layer + 1,
        "nextn_predict_layers": 1,
        "attention.q_lora_rank": Q_LORA_RANK,
        "attention.kv_lora_rank": KV_LORA_RANK,
        "attention.key_length_mla": QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM,
        "attention.value_length_mla": V_HEAD_DIM,
        "attention.head_count_kv": 1,  # MLA as MQA over the latent
        "rope.dimension_count": QK_ROPE_HEAD_DIM,
        "expert_count": N_EXPERT,
        "expert_used_count": N_EXPERT_USED,
        "expert_feed_forward_length": N_FF_EXPERT,
        "expert_shared_count": 1,
        "expert_gating_func": 2,  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        "leading_dense_block_count": 1,
    }
    assert {k: int_meta(m, f"{ARCH}.{k}") for k in keys} == keys
    assert meta(m, f"{ARCH}.expert_weights_scale") == GLM4MOE_ROUTED_SCALE and meta(m, f"{ARCH}.expert_weights_norm")
    assert f"{ARCH}.rope.scaling.yarn_log_multiplier" not in m.reader.fields
    assert "blk.0.ffn_gate.weight" in m.tensors and f"blk.{S.n_layer}.ffn_gate_exps.weight" in m.tensors


@pytest.mark.slow
def test_the_heads_values_are_the_checkpoints_and_kv_b_is_split_per_head(mtp_pairs):
    """Every head tensor is the checkpoint's as it is (expert x: slice x of the stacked experts);
    kv_b `(n_head (nope + v), kv_lora)` is k_b (transposed) and v_b per head."""
    from safetensors.numpy import load_file

    d = mtp_pairs(VARIANT)
    w, m = load_file(str(d / "target-hf" / HF_SAFETENSORS)), read_gguf(d / "target.gguf")
    for hf, name in GGUF_FROM_HF_DEEPSEEK2.items():
        got = array_from_tensor(m, name)
        if ".experts." in hf:
            got = got[int(hf.split(".experts.")[1].split(".")[0])]
        assert np.array_equal(got, w[hf]), hf
    per_head = w[HF_KV_B].reshape(S.n_head, QK_NOPE_HEAD_DIM + V_HEAD_DIM, KV_LORA_RANK)
    k_b, v_b = (array_from_tensor(m, n) for n in DEEPSEEK2_SPLIT)
    assert np.array_equal(k_b, per_head[:, :QK_NOPE_HEAD_DIM].transpose(0, 2, 1))
    assert np.array_equal(v_b, per_head[:, QK_NOPE_HEAD_DIM:])


@pytest.mark.slow
def test_the_deepseek32_target_carries_its_indexer_and_a_head_as_deepseek2s(mtp_pairs):
    """DeepSeek-V3.2 (llama.cpp's deepseek32, converted by the pinned DeepseekV32Model, which keeps the
    head): the indexer's keys (top-k above every test's context: its trunk attends densely), the
    indexer in every block the head's included, and the head's MLA block as deepseek2's."""
    m32, m2 = (read_gguf(mtp_pairs(v) / "target.gguf") for v in ("mtp-deepseek32", VARIANT))
    arch = names.ARCH_DEEPSEEK32
    assert m32.arch == arch
    keys = {"nextn_predict_layers": 1, "attention.indexer.top_k": INDEX_TOPK, "attention.indexer.key_length": 64}
    assert {k: int_meta(m32, f"{arch}.{k}") for k in keys} == keys
    head = f"blk.{S.n_layer}."
    assert {f"{head}indexer.proj.weight", f"{head}indexer.k_norm.bias"} <= set(m32.tensors)
    block2 = {n: t.ne for n, t in m2.tensors.items() if n.startswith(head)}
    assert {n: t.ne for n, t in m32.tensors.items() if n.startswith(head) and ".indexer." not in n} == block2


@pytest.mark.slow
def test_the_glm_dsa_target_says_no_gating_and_holds_deepseek32s_head_as_the_checkpoint(mtp_pairs):
    """GLM-5 (llama.cpp's glm-dsa, converted by the pinned GlmMoeDsaModel through the "glm" bootstrap):
    no expert_gating_func in the file (glm-dsa.cpp then routes by sigmoid, deepseek2.cpp by softmax),
    every trunk layer a full indexer layer, and the head block deepseek32's, its values the checkpoint's."""
    from safetensors.numpy import load_file

    d = mtp_pairs("mtp-glm-dsa")
    m, m32 = read_gguf(d / "target.gguf"), read_gguf(mtp_pairs("mtp-deepseek32") / "target.gguf")
    arch = names.ARCH_GLM_DSA
    assert m.arch == arch and MTP_SETTINGS["mtp-glm-dsa"].target.bootstrap == "glm"
    assert f"{arch}.expert_gating_func" not in m.reader.fields
    assert (
        int_meta(m, f"{arch}.nextn_predict_layers") == 1
        and int_meta(m, f"{arch}.attention.indexer.top_k") == INDEX_TOPK
    )
    assert list(meta(m, f"{arch}.attention.indexer.types")) == [True] * S.n_layer
    head = f"blk.{S.n_layer}."
    block32 = {n: t.ne for n, t in m32.tensors.items() if n.startswith(head)}
    assert {n: t.ne for n, t in m.tensors.items() if n.startswith(head)} == block32
    w = load_file(str(d / "target-hf" / HF_SAFETENSORS))
    for hf, name in GGUF_FROM_HF_GLM_DSA.items():
        got = array_from_tensor(m, name)
        if ".experts." in hf:
            got = got[int(hf.split(".experts.")[1].split(".")[0])]
        assert np.array_equal(got, w[hf]), hf
