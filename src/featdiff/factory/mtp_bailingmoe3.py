"""The tiny Bailing-MoE 3 target (Ling 3.0: transformers' `bailing_hybrid`, llama.cpp's `bailingmoe3`)
that the `mtp-bailingmoe3` fixture (featdiff.factory.mtp) gives an MTP head, and what the pinned
converter writes of that head.

transformers 5.23 builds the trunk (BailingHybridForCausalLM): groups of LAYER_GROUP layers, each
KDA (Kimi delta attention: short convolutions on q/k/v, a bounded forget gate, a gated RMS output
norm) but the group's last, which is MLA (a plain query, the compressed KV with its decoupled RoPE
part in interleaved pairs) with a sigmoid output gate per head; a dense first layer, then experts
routed by sigmoid + the choice bias, renormalized and times `routed_scaling_factor`, and an ungated
shared expert. It saves the checkpoint under Ling's own names (its conversion_mapping reversed:
`model.word_embeddings`, `attention.*`, `attention.dense`, `mlp.gate.expert_bias`, per-expert
matrices, separate q/k/v convolutions), which conversion/bailingmoe3.py reads. It has no model
code for the head (it leaves `model.layers.<n_layer>.*` unloaded), which Ling ships as GLM-4.5 ships
its own: one more decoder layer `model.layers.<n_layer>.*` (`num_nextn_predict_layers` in
config.json), a full-attention layer holding `eh_proj` over [enorm(embed(token)), hnorm(h)],
`enorm`, `hnorm` and a trailing `final_layernorm` (gguf-py's LAYER_OUT_NORM: the GGUF's
`blk.<n_layer>.layer_output_norm`, the head norm bailingmoe3.cpp reads).

config.json is written as transformers saves it plus what a Ling checkpoint's config.json says and
transformers' dict renames or leaves out (CONFIG_JSON): the architecture the converter registers,
`norm_topk_prob`, `num_experts_per_tok`, `n_group`, the KDA and gate settings the converter checks,
and `score_function` (sigmoid, the converter's expert_gating_func 2). The pinned converter reads it
as written (the "bailingmoe3" bootstrap: its pinned transformers knows no `bailing_hybrid`), the
GPT-2 byte-level BPE vocabulary through the "pre" route. KDA's head width equals the RoPE width here:
transformers' config reads `head_dim` as both.
"""

from __future__ import annotations

from typing import Any

from featdiff.core import names
from featdiff.factory import pairs
from featdiff.factory.hf_families import (
    CHOICE_BIAS_GAIN,
    N_EXPERT,
    N_EXPERT_USED,
    N_FF_EXPERT,
    TOKENIZER_BYTE_BPE,
    Family,
    _tiny_fields,
)

BOOTSTRAP_BAILINGMOE3 = "bailingmoe3"  # converter.BOOTSTRAPS: config.json as written, the "pre" vocabulary
LAYER_GROUP = 3  # layers 2 and 5 MLA, the others KDA (Ling 3.0's groups are 6 long)
KV_LORA_RANK = 32
QK_NOPE_HEAD_DIM = 16
QK_ROPE_HEAD_DIM = 16  # also KDA's head width (transformers' `head_dim`)
V_HEAD_DIM = 16
BAILINGMOE3_ROUTED_SCALE = 2.5  # Ling 3.0's routed_scaling_factor: llama.cpp's expert_weights_scale
# config.json beside what transformers saves: what a Ling checkpoint says that the converter reads
CONFIG_JSON: dict[str, Any] = {
    "architectures": ["BailingMoeV3ForCausalLM"],
    "norm_topk_prob": True,
    "num_experts_per_tok": N_EXPERT_USED,
    "n_group": 1,
}


def _bailingmoe3_config(sz: pairs.Sizes) -> object:
    """Ling 3.0's model at the tiny sizes: KDA and MLA layers (module docstring), layer 0 dense, the
    others N_EXPERT experts of width N_FF_EXPERT, top-N_EXPERT_USED by sigmoid, one group (llama.cpp's
    group-limited routing is not modelled), one shared expert as wide; no MTP layer (the fixture adds
    the head and its count)."""
    from transformers import BailingHybridConfig

    fields: dict[str, Any] = {
        **_tiny_fields(sz),
        "num_key_value_heads": sz.target.n_head,  # MLA: every head has its K/V (the converter writes 1: MQA)
        "head_dim": QK_ROPE_HEAD_DIM,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_nope_head_dim": QK_NOPE_HEAD_DIM,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "v_head_dim": V_HEAD_DIM,
        "moe_intermediate_size": N_FF_EXPERT,
        "moe_shared_expert_intermediate_size": N_FF_EXPERT,
        "num_experts": N_EXPERT,
        "num_experts_per_tok": N_EXPERT_USED,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": BAILINGMOE3_ROUTED_SCALE,
        "score_function": "sigmoid",
        "layer_group_size": LAYER_GROUP,
        "short_conv_kernel_size": 4,
        "kda_safe_gate": True,
        "kda_lower_bound": -5.0,
        "no_kda_lora": True,
        "gated_attention_proj_granularity_type": "head_wise",
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "rms_norm_eps": pairs.RMS_EPS,
        "rope_theta": pairs.ROPE_BASE,
        "rope_parameters": {"rope_type": "default", "rope_theta": pairs.ROPE_BASE},
        "pad_token_id": None,
        "eos_token_id": None,
        "tie_word_embeddings": False,
    }
    return BailingHybridConfig(**fields)


BAILINGMOE3_TARGET = Family(
    names.ARCH_BAILINGMOE3,
    f"Ling 3.0 target: KDA layers and a gated MLA layer per group of {LAYER_GROUP}, a dense first layer, then "
    f"{N_EXPERT} experts top-{N_EXPERT_USED} by sigmoid + a choice bias and an ungated shared expert",
    _bailingmoe3_config,
    # the router's choice bias (llama.cpp's exp_probs_b): the trunk's buffer, the head's saved name
    gains=(("e_score_correction_bias", CHOICE_BIAS_GAIN), ("mlp.gate.expert_bias", CHOICE_BIAS_GAIN)),
    buffers=("e_score_correction_bias",),
    tokenizer=TOKENIZER_BYTE_BPE,
)
BAILINGMOE3_DOC = (
    f"Ling 3.0 target (KDA and gated MLA layers, a dense first layer, {N_EXPERT} experts top-{N_EXPERT_USED} by "
    "sigmoid + a choice bias, an ungated shared expert) with its MTP head, a gated MLA + MoE layer and its own "
    "final norm, inside target.gguf (as `mtp`; llama.cpp's bailingmoe3)"
)

# What the converter writes of the head (BailingMoeV3Model: the layer kept as block n_layer, kv_b split
# into k_b and v_b, the experts stacked; gguf-py's bailingmoe3 map): HF -> GGUF
_IL = pairs.TINY.target.n_layer
_BLK = f"blk.{_IL}."
_LAYER = f"model.layers.{_IL}."
HF_FC = _LAYER + "eh_proj.weight"
HF_NORMS = tuple(_LAYER + f"{n}.weight" for n in ("enorm", "hnorm", "final_layernorm"))
HF_KV_B = _LAYER + "attention.kv_b_proj.weight"  # split: attn_k_b and attn_v_b
GGUF_FROM_HF_BAILINGMOE3 = {
    HF_FC: names.T_NEXTN.format(il=_IL, name=names.NEXTN_EH_PROJ),
    HF_NORMS[0]: names.T_NEXTN.format(il=_IL, name="enorm"),
    HF_NORMS[1]: names.T_NEXTN.format(il=_IL, name="hnorm"),
    HF_NORMS[2]: _BLK + "layer_output_norm.weight",
    _LAYER + "input_layernorm.weight": _BLK + "attn_norm.weight",
    _LAYER + "attention.q_proj.weight": _BLK + "attn_q.weight",
    _LAYER + "attention.kv_a_proj_with_mqa.weight": _BLK + "attn_kv_a_mqa.weight",
    _LAYER + "attention.kv_a_layernorm.weight": _BLK + "attn_kv_a_norm.weight",
    _LAYER + "attention.g_proj.weight": _BLK + "attn_gate.weight",
    _LAYER + "attention.dense.weight": _BLK + "attn_output.weight",
    _LAYER + "post_attention_layernorm.weight": _BLK + "ffn_norm.weight",
    _LAYER + "mlp.gate.weight": _BLK + "ffn_gate_inp.weight",
    _LAYER + "mlp.gate.expert_bias": _BLK + "exp_probs_b.bias",
    **{f"{_LAYER}mlp.shared_experts.{p}_proj.weight": f"{_BLK}ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
    **{
        f"{_LAYER}mlp.experts.{x}.{p}_proj.weight": f"{_BLK}ffn_{p}_exps.weight"
        for p in ("gate", "up", "down")
        for x in range(N_EXPERT)
    },
}
