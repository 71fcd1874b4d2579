"""The tiny Hy3 target (transformers' `hy_v3`, llama.cpp's `hy_v3`) that the `mtp-hy-v3` fixture
(featdiff.factory.mtp) gives an MTP head, and what the pinned converter writes of that head.

transformers 5.23 builds the trunk (HYV3ForCausalLM: q/k RMS norms per head, NeoX RoPE on the
whole head, a dense first layer, then experts routed by sigmoid + the choice bias
`e_score_correction_bias`, renormalized and times `router_scaling_factor`, and an ungated shared
expert); it has no model code for the head, which Hy3 ships as GLM-4.5 ships its own: one more
decoder layer `model.layers.<n_layer>.*` (`num_nextn_predict_layers` in config.json) holding
`eh_proj` over [enorm(embed(token)), hnorm(h)], `enorm`, `hnorm` and the layer's trailing
`final_layernorm` (conversion/hunyuan.py HYV3Model.filter_tensors renames it `shared_head.norm`:
the GGUF's nextn.shared_head_norm). transformers saves the router, its bias and the shared expert
under Hy3's own names (its conversion_mapping's `hy_v3` renames, reversed on save:
`mlp.router.gate`, `mlp.expert_bias`, `mlp.shared_mlp`), which gguf-py maps as they are. Norms
are plain RMSNorm weights, written as they are. The vocabulary is a GPT-2 byte-level BPE one
(HYV3Model.set_vocab: `_set_vocab_gpt2`), converted through the "pre" bootstrap.
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

# Hy3's router_scaling_factor (2.826): a scale llama.cpp applies (expert_weights_scale, not 0 or 1)
HY_V3_ROUTED_SCALE = 2.826


def _hy_v3_config(sz: pairs.Sizes) -> object:
    """Hy3's model at the tiny sizes: layer 0 dense (mlp_layer_types), the others N_EXPERT experts of
    width N_FF_EXPERT, top-N_EXPERT_USED, one shared expert as wide; no MTP layer (the fixture adds
    the head and its count)."""
    from transformers import HYV3Config

    s = sz.target
    fields: dict[str, Any] = {
        **_tiny_fields(sz),
        "moe_intermediate_size": N_FF_EXPERT,
        "num_experts": N_EXPERT,
        "num_experts_per_tok": N_EXPERT_USED,
        "num_shared_experts": 1,
        "router_scaling_factor": HY_V3_ROUTED_SCALE,
        "mlp_layer_types": ["dense"] + ["sparse"] * (s.n_layer - 1),
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "rms_norm_eps": pairs.RMS_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": pairs.ROPE_BASE},
        "tie_word_embeddings": False,
    }
    return HYV3Config(**fields)


HY_V3_TARGET = Family(
    names.ARCH_HY_V3,
    f"Hy3 target: q/k norms, a dense first layer, then {N_EXPERT} experts top-{N_EXPERT_USED} by sigmoid + a "
    "choice bias and an ungated shared expert",
    _hy_v3_config,
    # the router's choice bias (llama.cpp's exp_probs_b): the trunk's buffer, the head's saved name
    gains=(("e_score_correction_bias", CHOICE_BIAS_GAIN), ("mlp.expert_bias", CHOICE_BIAS_GAIN)),
    buffers=("e_score_correction_bias",),
    tokenizer=TOKENIZER_BYTE_BPE,
)
HY_V3_DOC = (
    f"Hy3 target (q/k norms, a dense first layer, {N_EXPERT} experts top-{N_EXPERT_USED} by sigmoid + a choice "
    "bias, an ungated shared expert) with its MTP head, an MoE layer and its own final norm, inside target.gguf "
    "(as `mtp`; llama.cpp's hy_v3)"
)

# What the converter writes of the head (HYV3Model: the layer kept as block n_layer, gguf-py's
# hy_v3 map): HF -> GGUF
_IL = pairs.TINY.target.n_layer
_BLK = f"blk.{_IL}."
_LAYER = f"model.layers.{_IL}."
HF_FC = _LAYER + "eh_proj.weight"
HF_NORMS = tuple(_LAYER + f"{n}.weight" for n in ("enorm", "hnorm", "final_layernorm"))
GGUF_FROM_HF_HY_V3 = {
    HF_FC: names.T_NEXTN.format(il=_IL, name=names.NEXTN_EH_PROJ),
    HF_NORMS[0]: names.T_NEXTN.format(il=_IL, name="enorm"),
    HF_NORMS[1]: names.T_NEXTN.format(il=_IL, name="hnorm"),
    HF_NORMS[2]: names.T_NEXTN.format(il=_IL, name="shared_head_norm"),
    _LAYER + "input_layernorm.weight": _BLK + "attn_norm.weight",
    **{f"{_LAYER}self_attn.{p}_proj.weight": f"{_BLK}attn_{p}.weight" for p in "qkv"},
    _LAYER + "self_attn.o_proj.weight": _BLK + "attn_output.weight",
    _LAYER + "self_attn.q_norm.weight": _BLK + "attn_q_norm.weight",
    _LAYER + "self_attn.k_norm.weight": _BLK + "attn_k_norm.weight",
    _LAYER + "post_attention_layernorm.weight": _BLK + "ffn_norm.weight",
    _LAYER + "mlp.router.gate.weight": _BLK + "ffn_gate_inp.weight",
    _LAYER + "mlp.expert_bias": _BLK + "exp_probs_b",  # no `.bias`: the HF name has no suffix, as hy-v3.cpp reads it
    **{f"{_LAYER}mlp.shared_mlp.{p}_proj.weight": f"{_BLK}ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
    **{
        f"{_LAYER}mlp.experts.{x}.{p}_proj.weight": f"{_BLK}ffn_{p}_exps.weight"
        for p in ("gate", "up", "down")
        for x in range(N_EXPERT)
    },
}
