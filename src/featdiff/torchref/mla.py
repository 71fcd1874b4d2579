"""Multi-head latent attention (MLA: DeepSeek-V2/V3, GLM-4.7-Flash, GLM-5) as llama.cpp's MLA
graphs compute it, the absorbed form (upstream `src/models/deepseek2.cpp`, graph_mtp and the
trunk with `hparams.is_mla()`):

    q        = q_b(q_a_norm(q_a x))  (or attn_q x)      per head [q_nope (nope), q_pe (n_rot)]
    [c, k_pe] = kv_a_mqa x                              c: the compressed KV (kv_lora), k_pe one head
    c        = kv_a_norm(c)
    q_pe, k_pe = RoPE on interleaved pairs (LLAMA_ROPE_TYPE_NORM)
    Q = [k_b q_nope, q_pe]   K = [c, k_pe]   V = c      per head; K/V one head (MQA), cached
    out = wo (v_b (softmax(Q K^T kq_scale) V))          v_b per head

`k_b`/`v_b` are the converter's split of the checkpoint's kv_b (conversion/deepseek.py): k_b
`(n_head, kv_lora, nope)`, v_b `(n_head, v, kv_lora)`. kq_scale is 1/sqrt(nope + n_rot), the
query's width before the absorption (DeepSeek's YaRN mscale is not modelled: RoPE is plain). The
cache holds K rows `(n_cells, 1, kv_lora + n_rot)` and V rows `(n_cells, 1, kv_lora)` in its type
(f16 in a run: the compressed latent is what llama.cpp rounds, not per-head K/V).

Consumes a block's weights (GGUF names without `blk.<il>.`, numpy order) and the attention norm's
rows `(n_tokens, n_embd)`; produces the attention's output and the cache after it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from featdiff.torchref.attention import KvCache, attend, cache_with, layer_kv
from featdiff.torchref.numerics import linear, rms_norm, rope
from featdiff.torchref.weights import Hparams

# The block's MLA tensors the MTP graph requires (deepseek2.cpp graph_mtp asserts q_a/q_a_norm/q_b)
MLA_ATTENTION = (
    "attn_norm",
    "attn_q_a",
    "attn_q_a_norm",
    "attn_q_b",
    "attn_kv_a_mqa",
    "attn_kv_a_norm",
    "attn_k_b",
    "attn_v_b",
    "attn_output",
    "ffn_norm",
)
# DeepSeek-V3.2's sparse-attention indexer (DSA) in a head block: the converter writes it, and
# deepseek32.cpp's graph_mtp reads none of it (its head attends densely, as deepseek2's)
DSA_INDEXER = ("indexer.k_norm", "indexer.k_norm.bias", "indexer.proj", "indexer.attn_k", "indexer.attn_q_b")
MLA_PLAIN_Q = "attn_q"  # a model without q_lora (DeepSeek-V2-Lite): one projection to the heads


def mla_attention(
    hp: Hparams,
    b: dict[str, torch.Tensor],
    x: torch.Tensor,
    positions: torch.Tensor,
    cache: KvCache,
    rope_first: bool = False,
) -> tuple[torch.Tensor, KvCache]:
    """MLA over the attention norm's rows `x` `(n_tokens, n_embd)` at `positions`, causal over the
    cache (module docstring). Returns the output `(n_tokens, n_embd)` and the cache with this eval's
    rows. `rope_first`: each head's query and the compressed KV row read as [rope, nope] instead
    (the hypothesis names.HYP_HALVES_ROPE_FIRST)."""
    heads, cache_after = mla_heads(hp, b, x, positions, cache, rope_first)  # (n_tokens, n_head, v)
    return linear(heads.reshape(x.shape[0], -1), b["attn_output"]), cache_after


def mla_heads(
    hp: Hparams,
    b: dict[str, torch.Tensor],
    x: torch.Tensor,
    positions: torch.Tensor,
    cache: KvCache,
    rope_first: bool = False,
) -> tuple[torch.Tensor, KvCache]:
    """mla_attention before its output projection: each head's output `(n_tokens, n_head, v)`
    (v_b of its attention over the latent), and the cache with this eval's rows."""
    n_tokens, n_rot = x.shape[0], int(hp.n_rot or 0)
    k_b, v_b = b["attn_k_b"], b["attn_v_b"]  # (n_head, kv_lora, nope), (n_head, v, kv_lora)
    n_head, kv_lora, nope = k_b.shape
    q = _query(hp, b, x).reshape(n_tokens, n_head, nope + n_rot)  # per head [q_nope, q_pe]
    kv = linear(x, b["attn_kv_a_mqa"])  # (n_tokens, kv_lora + n_rot): [c, k_pe]
    q_nope, q_pe = _halves(q, nope, rope_first)  # (n_tokens, n_head, nope), (n_tokens, n_head, n_rot)
    latent, k_pe = _halves(kv[:, None, :], kv_lora, rope_first)  # (n_tokens, 1, kv_lora), (n_tokens, 1, n_rot)
    c = rms_norm(latent[:, 0], b["attn_kv_a_norm"], hp.rms_eps)  # (n_tokens, kv_lora)
    normal = replace(hp, rope_type="normal", n_rot=n_rot)  # deepseek2: LLAMA_ROPE_TYPE_NORM
    q_pe = rope(q_pe, positions, normal)  # (n_tokens, n_head, n_rot)
    k_pe = rope(k_pe, positions, normal)  # (n_tokens, 1, n_rot)
    absorbed = torch.einsum("thn,hrn->thr", q_nope, k_b)  # (n_tokens, n_head, kv_lora): k_b q_nope
    q_full = torch.cat([absorbed, q_pe], dim=-1)  # (n_tokens, n_head, kv_lora + n_rot)
    k = torch.cat([c[:, None, :], k_pe], dim=-1)  # (n_tokens, 1, kv_lora + n_rot)
    k_all, v_all = layer_kv(cache, 0, k, c[:, None, :])  # V: the cached latent, (n_cells, 1, kv_lora)
    kv_pos = torch.cat([cache.positions, positions])  # (n_cells + n_tokens,)
    kq_scale = float(np.float32(1.0) / np.sqrt(np.float32(nope + n_rot)))  # 1/sqrtf(n_embd_head_k_mla)
    latent = attend(
        q_full, positions, k_all, v_all, kv_pos, causal=True, scale=kq_scale
    )  # (n_tokens, n_head * kv_lora)
    heads = torch.einsum("thr,hvr->thv", latent.reshape(n_tokens, n_head, kv_lora), v_b)  # (n_tokens, n_head, v)
    return heads, cache_with(cache, positions, [k_all], [v_all])


def _halves(rows: torch.Tensor, first: int, rope_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `(..., first + n_rot)` laid out [nope, rope] split into their no-RoPE part (`first`
    wide) and their RoPE part; `rope_first`: the same widths read from a [rope, nope] layout."""
    n_rot = rows.shape[-1] - first
    if rope_first:
        return rows[..., n_rot:], rows[..., :n_rot]
    return rows[..., :first], rows[..., first:]


def _query(hp: Hparams, b: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The heads' queries `(n_tokens, n_head * (nope + n_rot))`: through the low-rank q_a, its norm
    and q_b, or the plain attn_q where the block has no q_a."""
    if MLA_PLAIN_Q in b:
        return linear(x, b[MLA_PLAIN_Q])
    return linear(rms_norm(linear(x, b["attn_q_a"]), b["attn_q_a_norm"], hp.rms_eps), b["attn_q_b"])
