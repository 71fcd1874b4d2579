"""Cohere2-MoE's MTP block attention as `src/models/cohere2moe.cpp` graph_mtp computes it, for
torchref/mtp/layer.py's GRAPHS entry `cohere2moe` (the rest of its head is the shared MoE decoder
layer run in parallel: the FFN reads attn_norm's rows as the attention does, experts routed by
sigmoid (the file's gating where it says one), renormalized where the file says, the shared expert
averaged in, the layer's output FFN + input + attention output; the logits times
`cohere2moe.logit_scale`; the hidden state handed over and recycled after the norms, as GLM-4.5's).

Consumes the block's weights (GGUF names without `blk.<il>.`) and the attn_norm rows
`(n_tokens, n_embd)`; produces the attention output `(n_tokens, n_embd)` and the cache after it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import GgufModel, meta
from featdiff.torchref.attention import KvCache, attend, cache_with, layer_kv
from featdiff.torchref.numerics import linear, rope
from featdiff.torchref.weights import Hparams

# cohere2moe.cpp's MTP block (load_block_mtp): q/k/v (create_tensor_qkv), attn_output and the one
# norm the parallel block has; no q/k norms, no FFN norm
COHERE2MOE_ATTENTION = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output")
KEY_LOGIT_SCALE = "{arch}.logit_scale"  # f_logit_scale: graph_mtp scales result_output by it unless 0


def cohere2moe_attention(
    hp: Hparams, b: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor, cache: KvCache
) -> tuple[torch.Tensor, KvCache]:
    """q/k/v, RoPE on the whole head in ggml's normal (interleaved, GPT-J) pairs (llama_model_rope_type
    LLAMA_ROPE_TYPE_NORM for cohere2moe; graph_mtp ropes the head whatever the trunk's pattern), causal
    attention through the cache scaled 1/sqrt(n_embd_head), attn_output. Returns the output
    `(n_tokens, n_embd)` and the cache with this eval's K/V."""
    n_tokens, d = x.shape[0], hp.n_embd_head
    q = linear(x, b["attn_q"]).reshape(n_tokens, hp.n_head, d)
    k = linear(x, b["attn_k"]).reshape(n_tokens, hp.n_head_kv, d)
    v = linear(x, b["attn_v"]).reshape(n_tokens, hp.n_head_kv, d)
    interleaved = replace(hp, rope_type="normal")
    q, k = rope(q, positions, interleaved), rope(k, positions, interleaved)
    k_all, v_all = layer_kv(cache, 0, k, v)
    kv_pos = torch.cat([cache.positions, positions])  # (n_cells + n_tokens,)
    kqv = attend(q, positions, k_all, v_all, kv_pos, causal=True)  # (n_tokens, n_head * d)
    return linear(kqv, b["attn_output"]), cache_with(cache, positions, [k_all], [v_all])


def refuse_layer_norm(g: GgufModel) -> None:
    """InputError for a file whose norms are LayerNorm (no RMS epsilon, or 0: cohere2moe.cpp then
    runs LLM_NORM), which this reference's RMS norms do not compute."""
    if not float(meta(g, names.KEY_RMS_EPS, 0.0) or 0.0):
        raise InputError(
            f"{g.path}: {names.KEY_RMS_EPS.format(arch=g.arch)} is missing or 0, so llama.cpp runs the head's norms "
            "as LayerNorm, which featdiff's cohere2moe reference does not model; convert a checkpoint with rms_norm_eps"
        )
