"""The tiny Cohere2-MoE target (transformers' `cohere2_moe`, llama.cpp's `cohere2moe`) that the
`mtp-cohere2moe` fixture (featdiff.factory.mtp) gives an MTP head, and what the pinned converter
writes of that head.

transformers 5.23 builds the trunk (Cohere2MoeForCausalLM: Cohere's parallel block, attention and
FFN both reading the layer's one input norm and added to its input together; interleaved (GPT-J)
RoPE on sliding-window layers and the dense first layer, none on the other full-attention ones; a
dense first layer, then experts routed by sigmoid, renormalized, and a shared expert averaged with
them; the logits times `logit_scale`); it has no model code for the head, which the pinned
converter (conversion/command_r.py Cohere2MoeModel) reads as GLM-4.5 ships its own: one more
decoder layer `model.layers.<n_layer>.*` (`num_nextn_predict_layers` in config.json) holding
`eh_proj` over [enorm(embed(token)), hnorm(h)], `enorm`, `hnorm` and `shared_head.norm`. The norms
are RMSNorm here (`rms_norm_eps` set: llama.cpp's cohere2moe then runs LLM_NORM_RMS); weights are
written as they are, the experts stacked. The vocabulary is a GPT-2 byte-level BPE one
(Cohere2MoeModel._set_vocab_gpt2), converted through the "pre" bootstrap.
"""

from __future__ import annotations

from typing import Any

from featdiff.core import names
from featdiff.factory import pairs
from featdiff.factory.hf_families import (
    N_EXPERT,
    N_EXPERT_USED,
    N_FF_EXPERT,
    TOKENIZER_BYTE_BPE,
    Family,
    _tiny_fields,
)

# Cohere's logit_scale (0.0625 in its config): a scale llama.cpp applies to the head's logits too
COHERE2MOE_LOGIT_SCALE = 0.0625


def _cohere2moe_config(sz: pairs.Sizes) -> object:
    """Cohere2-MoE at the tiny sizes: layer 0 dense (first_k_dense_replace, full attention with RoPE),
    the others N_EXPERT experts of width N_FF_EXPERT, top-N_EXPERT_USED by sigmoid, renormalized,
    one shared expert as wide, averaged; RMS norms; no MTP layer (the fixture adds the head and its
    count). The window is wider than any fixture flow."""
    from transformers import Cohere2MoeConfig

    s = sz.target
    fields: dict[str, Any] = {
        **_tiny_fields(sz),
        "intermediate_size": N_FF_EXPERT,  # Cohere2-MoE's expert width
        "prefix_dense_intermediate_size": s.n_ff,
        "first_k_dense_replace": 1,
        "num_experts": N_EXPERT,
        "num_experts_per_tok": N_EXPERT_USED,
        "num_shared_experts": 1,
        "expert_selection_fn": "sigmoid",
        "norm_topk_prob": True,
        "logit_scale": COHERE2MOE_LOGIT_SCALE,
        "sliding_window": pairs.N_POS_TRAIN,
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "rms_norm_eps": pairs.RMS_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": pairs.ROPE_BASE},
        "eos_token_id": None,
        "bos_token_id": None,
        "tie_word_embeddings": False,
    }
    return Cohere2MoeConfig(**fields)


COHERE2MOE_TARGET = Family(
    names.ARCH_COHERE2MOE,
    f"Cohere2-MoE target: parallel attention and FFN blocks, interleaved RoPE on sliding layers, a dense first "
    f"layer, then {N_EXPERT} experts top-{N_EXPERT_USED} by sigmoid and a shared expert averaged in, scaled logits",
    _cohere2moe_config,
    tokenizer=TOKENIZER_BYTE_BPE,
)
COHERE2MOE_DOC = (
    f"Cohere2-MoE target (parallel blocks, a dense first layer, {N_EXPERT} experts top-{N_EXPERT_USED} by sigmoid, "
    "a shared expert averaged in, scaled logits) with its MTP head, a parallel MoE layer with its own norm, inside "
    "target.gguf (as `mtp`; llama.cpp's cohere2moe)"
)

# What the converter writes of the head (Cohere2MoeModel: the layer kept as block n_layer, gguf-py's
# nextn map): HF -> GGUF
_IL = pairs.TINY.target.n_layer
_BLK = f"blk.{_IL}."
_LAYER = f"model.layers.{_IL}."
GGUF_FROM_HF_COHERE2MOE = {
    _LAYER + "eh_proj.weight": names.T_NEXTN.format(il=_IL, name=names.NEXTN_EH_PROJ),
    _LAYER + "enorm.weight": names.T_NEXTN.format(il=_IL, name="enorm"),
    _LAYER + "hnorm.weight": names.T_NEXTN.format(il=_IL, name="hnorm"),
    _LAYER + "shared_head.norm.weight": names.T_NEXTN.format(il=_IL, name="shared_head_norm"),
    _LAYER + "input_layernorm.weight": _BLK + "attn_norm.weight",
    **{f"{_LAYER}self_attn.{p}_proj.weight": f"{_BLK}attn_{p}.weight" for p in "qkv"},
    _LAYER + "self_attn.o_proj.weight": _BLK + "attn_output.weight",
    _LAYER + "mlp.gate.weight": _BLK + "ffn_gate_inp.weight",
    **{f"{_LAYER}mlp.shared_experts.{p}_proj.weight": f"{_BLK}ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
    **{
        f"{_LAYER}mlp.experts.{x}.{p}_proj.weight": f"{_BLK}ffn_{p}_exps.weight"
        for p in ("gate", "up", "down")
        for x in range(N_EXPERT)
    },
}
