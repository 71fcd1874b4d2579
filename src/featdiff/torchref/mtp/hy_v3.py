"""Hy3's MTP block attention as `src/models/hy-v3.cpp` graph_mtp computes it, for
torchref/mtp/layer.py's GRAPHS entry `hy_v3` (the rest of its head is the shared MoE decoder
layer: ffn_norm, experts routed by sigmoid (the file's gating where it says one) plus the choice
bias, renormalized and scaled, an ungated shared expert; the hidden state handed over and recycled
after the norms, as GLM-4.5's: the target's output_norm rows, then each step's
`nextn.shared_head_norm` of its block's output).

Consumes the block's weights (GGUF names without `blk.<il>.`) and the attn_norm rows
`(n_tokens, n_embd)`; produces the attention output `(n_tokens, n_embd)` and the cache after it.
"""

from __future__ import annotations

import torch

from featdiff.torchref.attention import KvCache, attend, cache_with, layer_kv
from featdiff.torchref.numerics import linear, rms_norm, rope
from featdiff.torchref.weights import Hparams

# hy-v3.cpp's MTP block (load_block): q/k/v (create_tensor_qkv), attn_output, the q/k norms (required:
# build_norm runs on them in every layer) and the FFN's norm
HY_V3_ATTENTION = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm")
# hy-v3.cpp loads the choice bias as `blk.<il>.exp_probs_b`, without the `.bias` suffix the other
# graphs' files have (tn(LLM_TENSOR_FFN_EXP_PROBS_B, i)): the converter maps Hy3's `mlp.expert_bias`,
# a name without one, to it
HY_V3_CHOICE_BIAS = "exp_probs_b"


def hy_v3_attention(
    hp: Hparams, b: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor, cache: KvCache
) -> tuple[torch.Tensor, KvCache]:
    """q/k/v, the per-head q/k RMS norms, NeoX RoPE on the whole head (hy-v3.cpp asserts n_rot =
    n_embd_head), causal attention through the cache scaled 1/sqrt(n_embd_head), attn_output.
    Returns the output `(n_tokens, n_embd)` and the cache with this eval's K/V."""
    n_tokens, d = x.shape[0], hp.n_embd_head
    q = rms_norm(linear(x, b["attn_q"]).reshape(n_tokens, hp.n_head, d), b["attn_q_norm"], hp.rms_eps)
    k = rms_norm(linear(x, b["attn_k"]).reshape(n_tokens, hp.n_head_kv, d), b["attn_k_norm"], hp.rms_eps)
    v = linear(x, b["attn_v"]).reshape(n_tokens, hp.n_head_kv, d)
    q, k = rope(q, positions, hp), rope(k, positions, hp)
    k_all, v_all = layer_kv(cache, 0, k, v)
    kv_pos = torch.cat([cache.positions, positions])  # (n_cells + n_tokens,)
    kqv = attend(q, positions, k_all, v_all, kv_pos, causal=True)  # (n_tokens, n_head * d)
    return linear(kqv, b["attn_output"]), cache_with(cache, positions, [k_all], [v_all])
