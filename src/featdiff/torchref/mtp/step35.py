"""Step-3.5's MTP block attention as `src/models/step35.cpp` graph_mtp computes it, for
torchref/mtp/layer.py's GRAPHS entry `step35` (the rest of its head is the shared MoE decoder
layer: ffn_norm, sigmoid-routed experts plus `exp_probs_b`, an ungated shared expert; the hidden
state handed over and recycled before the norms, as MiMo-V2's).

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
from featdiff.torchref.numerics import linear, rms_norm, rope
from featdiff.torchref.stack import Named, windowed
from featdiff.torchref.weights import Hparams

# step35.cpp's MTP block (load_block_mtp): q/k/v (create_tensor_qkv), the head-wise gate
# (`attn_gate`, self_attn.g_proj: one logit per head), attn_output and the FFN's norm; the q/k
# norms where the file has them (layer.ATTENTION_OPTIONAL)
STEP35_ATTENTION = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_gate", "attn_output", "ffn_norm")
# per-layer SwiGLU clamps of the experts and the shared expert (llama-graph.cpp clamps gate and up
# before the product): 0 is no clamp, as the converter writes an MTP layer's
KEYS_SWIGLU_CLAMP = ("{arch}.swiglu_clamp_exp", "{arch}.swiglu_clamp_shexp")


def step35_attention(
    hp: Hparams, b: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor, cache: KvCache
) -> tuple[torch.Tensor, KvCache]:
    """q/k/v, the per-head q/k RMS norms where the block has them, NeoX RoPE on the layer's
    rotated dims (a full-attention layer's are half of rope.dimension_count: step35.cpp's
    load_arch_hparams halves n_rot_full; a sliding layer's all of them, within the window),
    causal attention scaled 1/sqrt(n_embd_head), each head's output times sigmoid of its gate
    logit, attn_output. Returns the output `(n_tokens, n_embd)` and the cache with this eval's K/V."""
    n_tokens, d = x.shape[0], hp.n_embd_head
    q = linear(x, b["attn_q"]).reshape(n_tokens, hp.n_head, d)
    k = linear(x, b["attn_k"]).reshape(n_tokens, hp.n_head_kv, d)
    v = linear(x, b["attn_v"]).reshape(n_tokens, hp.n_head_kv, -1)  # (n_tokens, n_head_kv, n_embd_head_v)
    if "attn_q_norm" in b:
        q = rms_norm(q, b["attn_q_norm"], hp.rms_eps)
    if "attn_k_norm" in b:
        k = rms_norm(k, b["attn_k_norm"], hp.rms_eps)
    is_swa = hp.is_swa(0)
    n_rot = hp.n_rot or d  # None: every dim rotates
    rotated = hp if is_swa else replace(hp, n_rot=n_rot // 2)
    q, k = rope(q, positions, rotated), rope(k, positions, rotated)
    k_all, v_all = layer_kv(cache, 0, k, v)
    kv_pos = torch.cat([cache.positions, positions])  # (n_cells + n_tokens,)
    visible = windowed(positions, kv_pos, hp.n_swa, True, None) if is_swa else None  # (n_tokens, n_cells)
    kqv = attend(q, positions, k_all, v_all, kv_pos, causal=True, visible=visible)  # (n_tokens, n_head * d_v)
    gate = torch.sigmoid(linear(x, b["attn_gate"]))  # (n_tokens, n_head)
    gated = (kqv.reshape(n_tokens, hp.n_head, -1) * gate[..., None]).reshape(n_tokens, -1)  # (n_tokens, n_head * d_v)
    return linear(gated, b["attn_output"]), cache_with(cache, positions, [k_all], [v_all])


def refuse_unmodelled(g: GgufModel) -> None:
    """InputError naming what of a Step-3.5 file the reference does not compute: a non-zero SwiGLU
    clamp, or llama3 RoPE factors (`rope_freqs`, which step35.cpp applies on full-attention layers)."""
    for key in (k.format(arch=g.arch) for k in KEYS_SWIGLU_CLAMP):
        value = meta(g, key, None)
        if value is not None and any(float(x) != 0.0 for x in (value if isinstance(value, list) else [value])):
            raise InputError(f"{g.path}: {key} = {value}; featdiff's step35 MTP reference does not clamp SwiGLU")
    if names.T_ROPE_FREQS in g.tensors:
        raise InputError(
            f"{g.path}: carries {names.T_ROPE_FREQS} (llama3 RoPE factors); featdiff's step35 MTP reference does "
            "not apply them"
        )


# step35.cpp's trunk names each layer's input `attn_norm_in-<il>` (cb on inpL, the same tensor as
# the previous layer's l_out, or the embeddings for layer 0: the last name given wins) and the last
# layer's output `h_nextn`: its graph has no node named embd or l_out
ATTN_NORM_IN = "attn_norm_in"


def trunk_names(records: tuple[Named, ...]) -> tuple[Named, ...]:
    """The target's records under step35.cpp's names: `embd` and `l_out-<il>` as `attn_norm_in-<il + 1>`."""
    return tuple(Named(_trunk_name(r.name), r.array) for r in records)


def _trunk_name(name: str) -> str:
    if name == names.TARGET_EMBD:
        return names.layer_name(ATTN_NORM_IN, 0)
    base, _, il = name.rpartition("-")
    return names.layer_name(ATTN_NORM_IN, int(il) + 1) if base == names.L_OUT and il.isdigit() else name
