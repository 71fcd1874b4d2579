"""The KV cache and attention, with the run's numerics emulated where they matter.

llama.cpp stores K and V rows in an f16 cache and, on CPU, runs flash attention
(ggml-cpu ops.cpp `flash_attn_ext_f16`). For batches under `FA_TILE_Q` rows the kernel converts
Q to f16, takes f16 dot products, and accumulates softmax(KQ) V online in an **f16** accumulator,
cell by cell in cache order; from `FA_TILE_Q` rows on it runs a tiled float32 kernel on the f16
K/V. `kv_dtype="f16"` reproduces both paths; `"f32"` is plain float32 attention (an ideal run).
Cells sit in position order, as llama.cpp's cache fills freed cells from the lowest one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from featdiff.torchref.numerics import KvDtype

FA_TILE_Q = 64  # ggml-cpu common.h GGML_FA_TILE_Q: batches of at least this many rows take the tiled path


@dataclass(frozen=True)
class KvCache:
    """One sequence's cache: cell positions and per-layer K/V, `(n_cells, n_head_kv, n_embd_head)`."""

    positions: torch.Tensor  # (n_cells,) int64
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]


def empty_cache(n_layer: int, n_head_kv: int, n_embd_head: int, kv_dtype: KvDtype, device: torch.device) -> KvCache:
    """A cache with no cells, storing K/V as float16 (`kv_dtype="f16"`) or float32."""
    dtype = torch.float16 if kv_dtype == "f16" else torch.float32
    empty = torch.zeros((0, n_head_kv, n_embd_head), dtype=dtype, device=device)
    return KvCache(
        positions=torch.zeros(0, dtype=torch.int64, device=device), k=(empty,) * n_layer, v=(empty,) * n_layer
    )


def cache_with(cache: KvCache, positions: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor]) -> KvCache:
    """The cache with new cells appended; `k`/`v` are the full per-layer tensors after `layer_kv`."""
    return KvCache(positions=torch.cat([cache.positions, positions]), k=tuple(k), v=tuple(v))  # (n_cells,)


def layer_kv(cache: KvCache, il: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `il`'s cached K/V with this batch's rows stored (rounded to the cache type) after them."""
    store = cache.k[il].dtype
    if not cache.k[il].shape[0]:  # no cells yet: the first rows decide the widths (MiMo-V2's narrower V)
        return k.to(store), v.to(store)
    k_all = torch.cat([cache.k[il], k.to(store)])  # (n_cells + n_tokens, n_head_kv, n_embd_head)
    v_all = torch.cat([cache.v[il], v.to(store)])  # (n_cells + n_tokens, n_head_kv, n_embd_head_v)
    return k_all, v_all


def truncated(cache: KvCache, n_past: int) -> KvCache:
    """seq_rm(n_past, -1): drop the cells at positions >= n_past."""
    keep = cache.positions < n_past
    return KvCache(
        positions=cache.positions[keep], k=tuple(t[keep] for t in cache.k), v=tuple(t[keep] for t in cache.v)
    )


def attend(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_pos: torch.Tensor,
    causal: bool,
    visible: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of `(n_tokens, n_head, d)` queries over the cache's cells, `(n_tokens, n_head * d_v)`
    (values `(n_cells, n_head_kv, d_v)` may be narrower than keys: MiMo-V2's n_embd_head_v).

    Causal: a query sees the cells at positions <= its own; otherwise every cell of the
    sequence. An explicit `visible` mask `(n_tokens, n_cells)` replaces both (training packs
    many sequences and blocks into one batch). Scale `1/sqrt(d)`, or the graph's own `scale`
    (MLA's absorbed queries are wider than the heads it scales by: torchref/mla.py); GQA: query head h reads KV
    head `h // (n_head / n_head_kv)`. `sinks` `(n_head,)`: head h's softmax has one more logit,
    `sinks[h]` (unscaled), whose value row is zero (`attn_sinks`). The cache type decides the
    numerics (module docstring).
    """
    n_tokens, n_head, d = q.shape
    if visible is None:
        visible = (
            kv_pos[None, :] <= q_pos[:, None]
            if causal
            else torch.ones((n_tokens, kv_pos.shape[0]), dtype=torch.bool, device=q.device)
        )  # (n_tokens, n_cells)
    group = n_head // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (n_cells, n_head, d)
    v = v.repeat_interleave(group, dim=1)  # (n_cells, n_head, d)
    if scale is None:
        scale = float(np.float32(1.0) / np.sqrt(np.float32(d)))  # 1.0f/sqrtf(float(n_embd_head))
    sink = sinks.to(device=q.device, dtype=torch.float32) if sinks is not None else None  # (n_head,)
    if k.dtype == torch.float16 and n_tokens < FA_TILE_Q:
        out = _flash_f16(q, k, v, visible, scale, sink)
    else:
        out = _softmax_attention(q, k.to(q.dtype), v.to(q.dtype), visible, scale, sink)
    return out.to(q.dtype).reshape(n_tokens, n_head * v.shape[-1])  # (n_tokens, n_head * d_v)


def _softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, sink: torch.Tensor | None
) -> torch.Tensor:
    """Plain masked softmax attention in q's dtype, `(n_tokens, n_head, d)`; a sink logit joins
    each head's softmax as one more column whose value row is zero (ggml_soft_max_add_sinks)."""
    scores = torch.einsum("thd,chd->thc", q, k) * scale  # (n_tokens, n_head, n_cells)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    if sink is None:
        return torch.einsum("thc,chd->thd", torch.softmax(scores, dim=-1), v)  # (n_tokens, n_head, d)
    column = sink.to(scores.dtype)[None, :, None].expand(scores.shape[0], -1, 1)  # (n_tokens, n_head, 1)
    p = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]  # (n_tokens, n_head, n_cells)
    return torch.einsum("thc,chd->thd", p, v)  # (n_tokens, n_head, d)


def _exp_f32(x: torch.Tensor) -> torch.Tensor:
    """expf, correctly rounded (as glibc's): exp in double rounded to float."""
    return torch.exp(x.double()).float()


def _flash_f16(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, sink: torch.Tensor | None
) -> torch.Tensor:
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk with an f16 K/V cache, `(n_tokens, n_head, d)`.

    Per cell, in cache order: s = dot(f16 q, f16 k) * scale; on a new maximum the f16
    accumulator is rescaled by expf(M_old - M); then acc = f16(acc + v * expf(s - M)) and
    S = S * ms + vs; finally acc / S in float32. Cells hidden by the mask are skipped. A head's
    sink comes after the cells, on the float32 accumulator (`_fold_sink`).
    """
    n_tokens, n_head, d = q.shape
    products = torch.einsum("thd,chd->thc", q.to(torch.float16).double(), k.double())  # (n_tokens, n_head, n_cells)
    scores = products.float() * torch.tensor(scale, dtype=torch.float32)  # scale rounded to f32 first
    m = torch.full((n_tokens, n_head), float("-inf"), device=q.device)
    s_sum = torch.zeros((n_tokens, n_head), device=q.device)
    acc = torch.zeros((n_tokens, n_head, v.shape[-1]), dtype=torch.float16, device=q.device)  # d_v wide
    for c in range(k.shape[0]):
        live = visible[:, c][:, None].expand(n_tokens, n_head)  # (n_tokens, n_head)
        s = scores[:, :, c]
        is_max = live & (s > m)
        ms = torch.where(is_max, _exp_f32(m - s), torch.ones_like(s))
        vs = torch.where(is_max, torch.ones_like(s), _exp_f32(s - m))
        m = torch.where(is_max, s, m)
        acc = torch.where(is_max[..., None], (acc.float() * ms[..., None]).half(), acc)
        added = (acc.float() + v[c].float()[None] * vs[..., None]).half()  # (n_tokens, n_head, d)
        acc = torch.where(live[..., None], added, acc)
        s_sum = torch.where(live, s_sum * ms + vs, s_sum)
    out = acc.float()  # VKQ32: the f16 accumulator widened
    if sink is not None:
        out, s_sum = _fold_sink(out, m, s_sum, sink)
    return out * (1.0 / s_sum)[..., None]


def _fold_sink(
    acc: torch.Tensor, m: torch.Tensor, s_sum: torch.Tensor, sink: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sink logit of each head `(n_head,)` folded into the float32 accumulator `(n_tokens,
    n_head, d)` and the running sum, as ops.cpp does after the cells ("sinks - apply only on the
    first kv-chunk"): a sink above the running max M rescales acc and S by expf(M - sink) and adds
    1; otherwise S gains expf(sink - M)."""
    s = sink[None, :].expand_as(m)  # (n_tokens, n_head)
    is_max = s > m
    ms = torch.where(is_max, _exp_f32(m - s), torch.ones_like(s))
    vs = torch.where(is_max, torch.ones_like(s), _exp_f32(s - m))
    return acc * ms[..., None], s_sum * ms + vs
