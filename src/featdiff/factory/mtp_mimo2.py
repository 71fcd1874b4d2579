"""MiMo-V2-Flash's MTP fixture pieces (featdiff.factory.mtp's `mtp-mimo2` variants): its target
family, where its checkpoint keeps the head and what the pinned converter writes of it."""

from __future__ import annotations

import numpy as np

from featdiff.core import names
from featdiff.factory import pairs
from featdiff.factory.hf_families import (
    CHOICE_BIAS_GAIN,
    N_EXPERT,
    N_EXPERT_USED,
    Family,
    _mimo2_config,
    mimo2_layer_types,
)

_IL = pairs.TINY.target.n_layer
_TRUNK_LAYER = names.HF_TARGET_PREFIX + names.HF_LAYER_PREFIX  # model.layers.{il}.
_BLK = f"blk.{_IL}."

# MiMo-V2's target (hf_targets._mimo2_config), llama.cpp's mimo2 (not one of hf_targets.FAMILIES)
MIMO2_TARGET = Family(
    names.ARCH_MIMO2,
    f"MiMo-V2-Flash target: sliding-window layers with sinks between full-attention ones, value heads narrower "
    f"than query/key heads, a dense first layer, then {N_EXPERT} experts, top-{N_EXPERT_USED} by sigmoid + a "
    "choice bias",
    _mimo2_config,
    gains=(("e_score_correction_bias", CHOICE_BIAS_GAIN),),
    buffers=("e_score_correction_bias",),
)
# MiMo-V2 ships its heads as `model.mtp.layers.{i}.*` (3 chained heads; the fixture one, see
# converter.MIMO_N_NEXTN), a count its config.json does not say. Each is a sliding-window layer
# (the converter extends hybrid_layer_pattern with 1s for them) with q/k/v fused in `qkv_proj`
# (mimo2.cpp graph_mtp requires attn_qkv), sinks and a dense FFN, holding `eh_proj` over
# [enorm(embed(token)), hnorm(h)] and the head norm `final_layernorm` (the GGUF's
# layer_output_norm, which graph_mtp reads when there is no shared_head_norm). The converter's
# MimoV2Model moves the layer to block n_layer; norms are written as they are.
MIMO_LAYER = "model.mtp.layers.0."
HF_MIMO_FC = MIMO_LAYER + "eh_proj.weight"
HF_MIMO_NORMS = tuple(MIMO_LAYER + f"{n}.weight" for n in ("enorm", "hnorm", "final_layernorm"))
GGUF_FROM_HF_MIMO2 = {
    HF_MIMO_FC: names.T_NEXTN.format(il=_IL, name=names.NEXTN_EH_PROJ),
    HF_MIMO_NORMS[0]: names.T_NEXTN.format(il=_IL, name="enorm"),
    HF_MIMO_NORMS[1]: names.T_NEXTN.format(il=_IL, name="hnorm"),
    HF_MIMO_NORMS[2]: _BLK + "layer_output_norm.weight",
    MIMO_LAYER + "input_layernorm.weight": _BLK + "attn_norm.weight",
    MIMO_LAYER + "self_attn.qkv_proj.weight": _BLK + "attn_qkv.weight",  # rows [q, k, v]
    MIMO_LAYER + "self_attn.o_proj.weight": _BLK + "attn_output.weight",
    MIMO_LAYER + "self_attn.attention_sink_bias": _BLK + "attn_sinks.weight",
    MIMO_LAYER + "post_attention_layernorm.weight": _BLK + "ffn_norm.weight",
    **{f"{MIMO_LAYER}mlp.{p}_proj.weight": f"{_BLK}ffn_{p}.weight" for p in ("gate", "up", "down")},
}


def mimo2_layer(config: dict, target: dict[str, np.ndarray], head_layer: str) -> dict[str, tuple[int, ...]]:
    """MiMo-V2's head layer: a sliding layer's attention (its KV heads, sinks) with q, k and v fused
    in qkv_proj, rows [q, k, v] `(n_head d_k + n_head_kv (d_k + d_v), n_embd)`, and a dense FFN as
    the first layer's."""
    sliding = mimo2_layer_types(int(config["num_hidden_layers"])).index("sliding_attention")
    attn = _TRUNK_LAYER.format(il=sliding) + "self_attn."
    q, k, v = (target[f"{attn}{p}_proj.weight"].shape for p in "qkv")  # (n_out, n_embd) each
    dense = _TRUNK_LAYER.format(il=0)
    return {
        head_layer + "input_layernorm.weight": (config["hidden_size"],),
        head_layer + "post_attention_layernorm.weight": (config["hidden_size"],),
        head_layer + "self_attn.qkv_proj.weight": (q[0] + k[0] + v[0], q[1]),
        head_layer + "self_attn.o_proj.weight": target[f"{attn}o_proj.weight"].shape,
        head_layer + "self_attn.attention_sink_bias": target[f"{attn}attention_sink_bias"].shape,
        **{head_layer + n[len(dense) :]: a.shape for n, a in target.items() if n.startswith(dense + "mlp.")},
    }
