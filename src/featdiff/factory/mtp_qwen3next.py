"""The tiny Qwen3-Next target (transformers' `qwen3_next`, llama.cpp's `qwen3next`) that the
`mtp-qwen3next` fixture (featdiff.factory.mtp) gives an MTP head, and where its checkpoint keeps
that head.

Qwen3-Next is Qwen3.5-MoE's predecessor: the same hybrid trunk (gated delta-net layers with a
gated full-attention layer every few layers, a routed MoE and a sigmoid-gated shared expert in
every layer, zero-centred norms) and the same head layout (`mtp.fc`, `mtp.pre_fc_norm_*`,
`mtp.norm`, `mtp.layers.0.*`: converted as conversion/qwen.py _QwenMtpMixin converts Qwen3.5's).
What differs, as the pinned converter and src/models/qwen3next.cpp see it:
* the linear attention's projections are fused per key head (`in_proj_qkvz`, `in_proj_ba`), which
  Qwen3NextModel.modify_tensors splits into `attn_qkv` and `attn_gate` (no V-head reordering:
  the graph repeats q/k heads interleaved instead);
* RoPE is plain NeoX on the first head_dim x partial_rotary_factor dims (0.25), not M-RoPE;
* config.json does not count the MTP blocks (no `mtp_num_hidden_layers`): the converter counts
  the `mtp.layers.<i>` tensors it meets (_QwenMtpMixin.opt_num_mtp_layers), so the fixture's
  config says nothing either (factory/mtp.py QWEN3NEXT_MTP: Qwen3.5's head layout without the count).
"""

from __future__ import annotations

from typing import Any

from featdiff.core import names
from featdiff.factory import pairs
from featdiff.factory.hf_families import N_EXPERT, N_EXPERT_USED, N_FF_EXPERT, QWEN35_FULL_EVERY, Family, _qwen35_fields

# Qwen3-Next-80B-A3B's partial_rotary_factor (and the converter's default): RoPE on a quarter of
# the head, 4 of the tiny 16 dims
QWEN3NEXT_ROTARY = 0.25
QWEN3NEXT_ROPE: dict[str, Any] = {
    "rope_type": "default",
    "rope_theta": pairs.ROPE_BASE,
    "partial_rotary_factor": QWEN3NEXT_ROTARY,
}


def _qwen3next_config(sz: pairs.Sizes) -> object:
    """Qwen3-Next at the tiny sizes: Qwen3.5's layer kinds and linear-attention heads
    (hf_families._qwen35_fields: 2 key heads, 4 value heads, so the graph's q/k head repeat runs),
    QWEN3NEXT_ROPE, and a sparse MoE block in every layer (decoder_sparse_step 1): N_EXPERT experts
    of width N_FF_EXPERT, top-N_EXPERT_USED renormalized (norm_topk_prob, as qwen3next.cpp's graph
    always does), one shared expert of width N_FF_EXPERT behind a sigmoid gate."""
    from transformers import Qwen3NextConfig

    fields: dict[str, Any] = {
        **_qwen35_fields(sz),
        "rope_parameters": dict(QWEN3NEXT_ROPE),
        "intermediate_size": sz.target.n_ff,  # the dense MLP's width: no layer has one (mlp_only_layers [])
        "moe_intermediate_size": N_FF_EXPERT,
        "shared_expert_intermediate_size": N_FF_EXPERT,
        "num_experts": N_EXPERT,
        "num_experts_per_tok": N_EXPERT_USED,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    return Qwen3NextConfig(**fields)


QWEN3NEXT_TARGET = Family(
    names.ARCH_QWEN3NEXT,
    f"Qwen3-Next target: gated delta-net layers, gated full attention every {QWEN35_FULL_EVERY}rd layer, "
    f"{N_EXPERT} experts top-{N_EXPERT_USED} and a gated shared expert in every layer",
    _qwen3next_config,
)
