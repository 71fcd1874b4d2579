"""One decoder layer, shared by the target (causal) and the DFlash drafter (non-causal), keeping
every intermediate the dump may record. Mirrors upstream `src/models/qwen3.cpp`,
`src/models/llama.cpp` and the token branch of `src/models/dflash.cpp`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from featdiff.torchref.attention import KvCache, attend, layer_kv
from featdiff.torchref.numerics import f32_scalar, ffn, linear, rms_norm, rope
from featdiff.torchref.weights import Hparams, Layer


@dataclass(frozen=True)
class Named:
    """One reference record before it goes into the dump: callback name and array (numpy order)."""

    name: str
    array: torch.Tensor


@dataclass(frozen=True)
class LayerTrace:
    """A layer's intermediates, named after llama.cpp's callbacks; shapes in numpy order."""

    attn_norm: torch.Tensor  # (n_tokens, n_embd): the drafter's noise_norm
    q: torch.Tensor  # (n_tokens, n_head, n_embd_head) after q_norm and RoPE
    k: torch.Tensor  # (n_tokens, n_head_kv, n_embd_head) after k_norm and RoPE
    v: torch.Tensor  # (n_tokens, n_head_kv, n_embd_head)
    kqv_out: torch.Tensor  # (n_tokens, n_head * n_embd_head): attention before wo
    ffn_inp: torch.Tensor  # (n_out, n_embd)
    ffn_out: torch.Tensor  # (n_out, n_embd)
    l_out: torch.Tensor  # (n_out, n_embd)
    k_cache: torch.Tensor  # (n_cells + n_tokens, n_head_kv, n_embd_head): the layer's cache after this batch
    v_cache: torch.Tensor


def windowed(
    q_pos: torch.Tensor, kv_pos: torch.Tensor, n_swa: int, causal: bool, visible: torch.Tensor | None
) -> torch.Tensor:
    """The cells a sliding-window layer's queries see, `(n_tokens, n_cells)`: what they see
    without the window, less every key `n_swa` or more positions behind (llama-hparams.h
    is_masked_swa, LLAMA_SWA_TYPE_STANDARD: masked when p1 - p0 >= n_swa). A key ahead of its query
    (the non-causal draft block) is never behind, so the window never hides it."""
    behind = q_pos[:, None] - kv_pos[None, :]  # (n_tokens, n_cells)
    if visible is None:
        visible = (
            behind >= 0 if causal else torch.ones(behind.shape, dtype=torch.bool, device=behind.device)
        )  # (n_tokens, n_cells)
    return visible & (behind < n_swa)


def layer_forward(
    hp: Hparams,
    layer: Layer,
    x: torch.Tensor,
    positions: torch.Tensor,
    cache: KvCache,
    il: int,
    causal: bool,
    out_rows: slice = slice(None),
    visible: torch.Tensor | None = None,
) -> LayerTrace:
    """One layer over `x` `(n_tokens, n_embd)`; the batch's K/V go through the cache first.

    `out_rows` keeps only the output rows after attention (llama.cpp's last target layer);
    `visible` `(n_tokens, n_cells + n_tokens)` overrides `causal` (see `attend`).
    """
    h = rms_norm(x, layer.attn_norm, hp.rms_eps)
    a = self_attention(hp, layer, h, positions, cache, il, causal, visible)
    attn_out = scaled_output(hp, linear(a.kqv_out, layer.wo)[out_rows])  # (n_out, n_embd)
    ffn_inp = attn_out + x[out_rows]
    ffn_out = ffn(rms_norm(ffn_inp, layer.ffn_norm, hp.rms_eps), layer)
    return layer_trace(h, a, ffn_inp, ffn_out, ffn_out + ffn_inp)


def layer_trace(
    h: torch.Tensor, a: Attention, ffn_inp: torch.Tensor, ffn_out: torch.Tensor, l_out: torch.Tensor
) -> LayerTrace:
    """The trace of a layer whose attention was `a` over the normed rows `h`."""
    return LayerTrace(
        attn_norm=h,
        q=a.q,
        k=a.k,
        v=a.v,
        kqv_out=a.kqv_out,
        ffn_inp=ffn_inp,
        ffn_out=ffn_out,
        l_out=l_out,
        k_cache=a.k_cache,
        v_cache=a.v_cache,
    )


@dataclass(frozen=True)
class Attention:
    """One layer's attention over a batch: its projections, the cache it read and its output."""

    q: torch.Tensor  # (n_tokens, n_head, n_embd_head), normed and RoPE'd
    k: torch.Tensor  # (n_tokens, n_head_kv, n_embd_head)
    v: torch.Tensor
    kqv_out: torch.Tensor  # (n_tokens, n_head * n_embd_head)
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def self_attention(
    hp: Hparams,
    layer: Layer,
    h: torch.Tensor,
    positions: torch.Tensor,
    cache: KvCache,
    il: int,
    causal: bool,
    visible: torch.Tensor | None = None,
) -> Attention:
    """Q/K/V of the normed rows `h` (QK-norm, RoPE), through the cache, attended (a sliding-window
    layer sees only its window: `windowed`)."""
    n_tokens = h.shape[0]
    q = linear(h, layer.wq).reshape(n_tokens, hp.n_head, hp.n_embd_head)  # (n_tokens, n_head, n_embd_head)
    k = linear(h, layer.wk).reshape(n_tokens, hp.n_head_kv, hp.n_embd_head)  # (n_tokens, n_head_kv, n_embd_head)
    v = linear(h, layer.wv).reshape(n_tokens, hp.n_head_kv, hp.n_embd_head)  # (n_tokens, n_head_kv, n_embd_head)
    if layer.q_norm is not None:
        q = rms_norm(q, layer.q_norm, hp.rms_eps)
    if layer.k_norm is not None:
        k = rms_norm(k, layer.k_norm, hp.rms_eps)
    q = rope(q, positions, hp)
    k = rope(k, positions, hp)
    k_cache, v_cache = layer_kv(cache, il, k, v)
    kv_pos = torch.cat([cache.positions, positions])  # (n_cells + n_tokens,)
    if hp.is_swa(il):
        visible = windowed(positions, kv_pos, hp.n_swa, causal, visible)
    kqv_out = attend(q, positions, k_cache, v_cache, kv_pos, causal, visible, layer.attn_sinks)
    return Attention(q, k, v, kqv_out, k_cache, v_cache)


def scaled_output(hp: Hparams, attn_out: torch.Tensor) -> torch.Tensor:
    """The attention output times `attention.value_scale` where set (dflash.cpp: ggml_scale of
    build_attn's output, "attn_out_scaled")."""
    return attn_out * f32_scalar(hp.attn_value_scale) if hp.attn_value_scale != 0.0 else attn_out
