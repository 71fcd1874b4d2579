"""A tiny DeepSeek-V3 target (transformers' `deepseek_v3`, llama.cpp's `deepseek2`) for the
`mtp-deepseek2` fixture (factory/mtp.py): MLA attention (a low-rank query `q_a -> q_a_norm -> q_b`,
the compressed KV `kv_a_proj_with_mqa` with its decoupled RoPE part, `kv_a_norm`, `kv_b`), a dense
first layer (`first_k_dense_replace` 1), then experts routed by sigmoid + a choice bias
(`scoring_func` sigmoid, one group), renormalized and scaled, one shared expert. The head is one
more decoder layer `model.layers.<n_layer>.*` holding `eh_proj`, `enorm`, `hnorm` and
`shared_head.norm` as DeepSeek ships it (GLM-4.5's layout, factory/mtp.py's GLM4MOE_HEAD), with
`num_nextn_predict_layers` 1.

RoPE stays plain (`rope_type` default, no YaRN and so no mscale: kq_scale is 1/sqrt(qk_head_dim)
on both sides); DeepSeek-V3's own YaRN (factor 40, mscale_all_dim 1) is not modelled
(torchref/load_gguf.py refuses a GGUF with `rope.scaling.yarn_log_multiplier`).

The pinned converter drops DeepSeek-V3's head: DeepseekV2Model, the class it converts
`DeepseekV3ForCausalLM` with, sets `skip_mtp = True` ("remove this when we support MTP for deepseek
models", conversion/deepseek.py). The one class of the pinned converter that writes a deepseek2
GGUF with its nextn block is Glm4MoeLiteModel (GLM-4.7-Flash: DeepseekV2Model plus the appended
block kept, `nextn_predict_layers` written; conversion/glm.py). The fixture converts through the
"deepseek" bootstrap (converter.BOOTSTRAPS), which converts `DeepseekV3ForCausalLM` with that class
(its vocabulary read from the fixtures' tokenizer.model): every hparam and tensor then goes
through the converter's own DeepSeek-V2 code (kv_b split into k_b and v_b, the experts stacked).
"""

from __future__ import annotations

from typing import Any

from featdiff.core import names
from featdiff.factory import pairs
from featdiff.factory.hf_families import (
    CHOICE_BIAS_GAIN,
    GLM4MOE_ROUTED_SCALE,
    N_EXPERT,
    N_EXPERT_USED,
    N_FF_EXPERT,
    Family,
    _tiny_fields,
)

BOOTSTRAP_DEEPSEEK = "deepseek"  # converter.BOOTSTRAPS: DeepseekV3ForCausalLM converted keeping its head
BOOTSTRAP_DEEPSEEK32 = "deepseek32"  # converter.BOOTSTRAPS: DeepseekV32Model's vocabulary from tokenizer.model
# MLA at the tiny sizes (DeepSeek-V3's: q_lora 1536, kv_lora 512, nope 128, rope 64, v 128, 128 heads)
Q_LORA_RANK = 32
KV_LORA_RANK = 32
QK_NOPE_HEAD_DIM = 16
QK_ROPE_HEAD_DIM = 8  # deepseek2.rope.dimension_count: RoPE on interleaved pairs (LLAMA_ROPE_TYPE_NORM)
V_HEAD_DIM = 16
DEEPSEEK2_ROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": pairs.ROPE_BASE}
SCORING_FUNC = "sigmoid"  # DeepSeek-V3's config.json; the converter writes it as expert_gating_func 2


def deepseek_v3_config(sz: pairs.Sizes) -> object:
    """DeepSeek-V3's model at the tiny sizes (module docstring), no MTP layers
    (`num_nextn_predict_layers` 0: factory/mtp.py adds the head)."""
    from transformers import DeepseekV3Config

    fields: dict[str, Any] = {
        **_tiny_fields(sz),
        "num_key_value_heads": sz.target.n_head,  # MLA: every head has its K/V (the converter writes 1: MQA)
        "head_dim": QK_ROPE_HEAD_DIM,  # transformers' RoPE width
        "q_lora_rank": Q_LORA_RANK,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_nope_head_dim": QK_NOPE_HEAD_DIM,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "v_head_dim": V_HEAD_DIM,
        "moe_intermediate_size": N_FF_EXPERT,
        "n_routed_experts": N_EXPERT,
        "num_experts_per_tok": N_EXPERT_USED,
        "n_shared_experts": 1,
        "n_group": 1,  # group-limited routing off (llama.cpp's build_moe_ffn groups: not modelled)
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": GLM4MOE_ROUTED_SCALE,
        "scoring_func": SCORING_FUNC,
        "rope_interleave": True,
        "attention_bias": False,
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "rms_norm_eps": pairs.RMS_EPS,
        "rope_parameters": dict(DEEPSEEK2_ROPE),
        "tie_word_embeddings": False,
    }
    return DeepseekV3Config(**fields)


# DeepSeek-V3.2's sparse-attention indexer at the tiny sizes (V3.2's: 64 heads of 128, top 2048).
# INDEX_TOPK is the number of cells each query attends to: llama.cpp's deepseek32 trunk takes
# min(n_kv, top_k) (deepseek32.cpp), so below it the trunk attends to every cell, densely, as the
# reference runs it (hf_taps refuses a batch whose indexer selects fewer cells than it sees); the
# head's graph (graph_mtp) has no indexer at all: its attention is deepseek2's MLA
INDEX_TOPK = 2048
INDEX_HEAD_DIM = 64  # a multiple of 64 (the indexer keys' Hadamard rotation is 64 wide or more: llama-kv-cache.cpp)
INDEX_N_HEADS = 2


def deepseek_v32_config(sz: pairs.Sizes) -> object:
    """DeepSeek-V3.2's model at the tiny sizes: DeepSeek-V3's (deepseek_v3_config) with the indexer."""
    from transformers import DeepseekV32Config

    v3 = deepseek_v3_config(sz).to_dict()  # type: ignore[attr-defined]
    kept = {k: v for k, v in v3.items() if k not in ("model_type", "architectures", "transformers_version")}
    index: dict[str, Any] = {"index_topk": INDEX_TOPK, "index_head_dim": INDEX_HEAD_DIM, "index_n_heads": INDEX_N_HEADS}
    return DeepseekV32Config(**{**kept, **index})


DEEPSEEK2_DOC = (
    f"DeepSeek-V3 target (MLA, a dense first layer, {N_EXPERT} experts top-{N_EXPERT_USED} by sigmoid + a choice bias, "
    "a shared expert) with its MTP head, an MLA + MoE layer, inside target.gguf (as `mtp`; llama.cpp's deepseek2)"
)
DEEPSEEK32_DOC = (
    "DeepSeek-V3.2 target (DeepSeek-V3's plus the sparse-attention indexer, dense at these lengths) with its MTP head "
    "(deepseek2's, no indexer) inside target.gguf (as `mtp`; llama.cpp's deepseek32)"
)
DEEPSEEK2_TARGET = Family(
    names.ARCH_DEEPSEEK2,
    f"DeepSeek-V3 target: MLA (low-rank q, compressed KV, decoupled RoPE), a dense first layer, then {N_EXPERT} "
    f"experts, top-{N_EXPERT_USED} by sigmoid + a choice bias, a shared expert",
    deepseek_v3_config,
    gains=(("e_score_correction_bias", CHOICE_BIAS_GAIN),),
    buffers=("e_score_correction_bias",),
)

DEEPSEEK32_TARGET = Family(
    names.ARCH_DEEPSEEK32,
    f"DeepSeek-V3.2 target: DeepSeek-V3's with the sparse-attention indexer (top-{INDEX_TOPK}: dense at these lengths)",
    deepseek_v32_config,
    gains=(("e_score_correction_bias", CHOICE_BIAS_GAIN),),
    buffers=("e_score_correction_bias",),
)

# What the converter writes of the head (DeepseekV2Model.modify_tensors, gguf-py's deepseek2 map):
# HF (after `model.layers.<n_layer>.`) -> the GGUF block's name; kv_b_proj is split per head into
# attn_k_b (transposed) and attn_v_b, which DEEPSEEK2_SPLIT names; the experts are stacked
_IL = pairs.TINY.target.n_layer
_LAYER = f"{names.HF_TARGET_PREFIX}{names.HF_LAYER_PREFIX.format(il=_IL)}"
_BLK = f"blk.{_IL}."
GGUF_FROM_HF_DEEPSEEK2 = {
    _LAYER + "eh_proj.weight": names.T_NEXTN.format(il=_IL, name=names.NEXTN_EH_PROJ),
    _LAYER + "enorm.weight": names.T_NEXTN.format(il=_IL, name="enorm"),
    _LAYER + "hnorm.weight": names.T_NEXTN.format(il=_IL, name="hnorm"),
    _LAYER + "shared_head.norm.weight": names.T_NEXTN.format(il=_IL, name="shared_head_norm"),
    _LAYER + "input_layernorm.weight": _BLK + "attn_norm.weight",
    _LAYER + "self_attn.q_a_proj.weight": _BLK + "attn_q_a.weight",
    _LAYER + "self_attn.q_a_layernorm.weight": _BLK + "attn_q_a_norm.weight",
    _LAYER + "self_attn.q_b_proj.weight": _BLK + "attn_q_b.weight",
    _LAYER + "self_attn.kv_a_proj_with_mqa.weight": _BLK + "attn_kv_a_mqa.weight",
    _LAYER + "self_attn.kv_a_layernorm.weight": _BLK + "attn_kv_a_norm.weight",
    _LAYER + "self_attn.o_proj.weight": _BLK + "attn_output.weight",
    _LAYER + "post_attention_layernorm.weight": _BLK + "ffn_norm.weight",
    _LAYER + "mlp.gate.weight": _BLK + "ffn_gate_inp.weight",
    _LAYER + "mlp.gate.e_score_correction_bias": _BLK + "exp_probs_b.bias",
    **{f"{_LAYER}mlp.shared_experts.{p}_proj.weight": f"{_BLK}ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
    **{
        f"{_LAYER}mlp.experts.{x}.{p}_proj.weight": f"{_BLK}ffn_{p}_exps.weight"
        for p in ("gate", "up", "down")
        for x in range(N_EXPERT)
    },
}
# DeepSeek-V3.2's head layer also carries its indexer (the converter writes it; graph_mtp reads none of it)
GGUF_FROM_HF_DEEPSEEK32 = {
    **GGUF_FROM_HF_DEEPSEEK2,
    _LAYER + "self_attn.indexer.k_norm.weight": _BLK + "indexer.k_norm.weight",
    _LAYER + "self_attn.indexer.k_norm.bias": _BLK + "indexer.k_norm.bias",
    _LAYER + "self_attn.indexer.weights_proj.weight": _BLK + "indexer.proj.weight",
    _LAYER + "self_attn.indexer.wk.weight": _BLK + "indexer.attn_k.weight",
    _LAYER + "self_attn.indexer.wq_b.weight": _BLK + "indexer.attn_q_b.weight",
}
HF_KV_B = _LAYER + "self_attn.kv_b_proj.weight"  # (n_head (nope + v), kv_lora): rows [k_nope, v] per head
DEEPSEEK2_SPLIT = (_BLK + "attn_k_b.weight", _BLK + "attn_v_b.weight")  # (n_head, kv_lora, nope), (n_head, v, kv_lora)


# GLM-5 (transformers' `glm_moe_dsa`, llama.cpp's `glm-dsa`): DeepSeek-V3.2's shape (MLA, the DSA
# indexer, sigmoid routing with a choice bias, a shared expert) and its head as GLM-5 ships it,
# one more decoder layer with the indexer (GLM-4.5's layout). The pinned GlmMoeDsaModel keeps the head
# and writes the indexer's keys and per-layer `indexer_types` (every layer "full" here: transformers'
# default schedule, index_topk_freq 1); its vocabulary (`_set_vocab_glm`) is read from tokenizer.model
# through the "glm" bootstrap. llama.cpp's glm-dsa trunk keeps min(n_kv, index_topk) cells as
# deepseek32's does, so it runs dense below INDEX_TOPK cells, as the reference does (hf_taps)
BOOTSTRAP_GLM_DSA = "glm"  # converter.BOOTSTRAPS: `_set_vocab_glm` read as `_set_vocab_sentencepiece`


def glm_moe_dsa_config(sz: pairs.Sizes) -> object:
    """GLM-5's model at the tiny sizes: DeepSeek-V3.2's (deepseek_v32_config) as `glm_moe_dsa`
    (which has no scoring_func: its router is sigmoid, and the converter writes no gating function)."""
    from transformers import GlmMoeDsaConfig

    v32 = deepseek_v32_config(sz).to_dict()  # type: ignore[attr-defined]
    dropped = ("model_type", "architectures", "transformers_version", "scoring_func", "rope_interleave")
    return GlmMoeDsaConfig(**{k: v for k, v in v32.items() if k not in dropped})


GLM_DSA_DOC = (
    "GLM-5 target (DeepSeek-V3.2's shape: MLA, the sparse-attention indexer dense at these lengths, sigmoid-routed "
    "experts) with its MTP head (deepseek32's, sigmoid routing where the file says none) inside target.gguf "
    "(as `mtp`; llama.cpp's glm-dsa)"
)
GLM_DSA_TARGET = Family(
    names.ARCH_GLM_DSA,
    f"GLM-5 target: DeepSeek-V3.2's shape (MLA, the sparse-attention indexer top-{INDEX_TOPK}: dense at these "
    "lengths, sigmoid routing with a choice bias, a shared expert)",
    glm_moe_dsa_config,
    gains=(("e_score_correction_bias", CHOICE_BIAS_GAIN),),
    buffers=("e_score_correction_bias",),
)
GGUF_FROM_HF_GLM_DSA = GGUF_FROM_HF_DEEPSEEK32  # the converter's DeepSeek-V2 code names the same block
