"""torchref/mla.py: llama.cpp's absorbed MLA equals DeepSeek's decompressed multi-head attention
(kv_b applied to the latent, per-head K/V) on seeded weights, over two evals through the cache;
the halves read the other way (`rope_first`, the candidate `@halves=rope_first` names a fault by) are
the attention of a file whose query and compressed KV rows are reordered [rope, nope]; and the
DeepSeek-V3.2 indexer stand-in (hf_taps._DenseIndexer) keeps every cell up to index_topk and refuses
more by name."""

from __future__ import annotations

import pytest
import torch

from featdiff.core.errors import InputError
from featdiff.torchref.attention import empty_cache
from featdiff.torchref.hf_taps import _DenseIndexer
from featdiff.torchref.mla import mla_attention
from featdiff.torchref.mtp.hf_mla import split_kv_b
from featdiff.torchref.numerics import linear, rms_norm, rope
from featdiff.torchref.weights import Hparams

N_EMBD, N_HEAD, Q_LORA, KV_LORA, NOPE, ROT, V = 32, 4, 16, 16, 8, 4, 8
EPS = 1e-6
HP = Hparams(
    arch="deepseek2", n_layer=1, n_embd=N_EMBD, n_head=N_HEAD, n_head_kv=1, n_embd_head=KV_LORA + ROT, n_ff=0,
    n_vocab=0, rms_eps=EPS, rope_base=10000.0, rope_type="normal", n_rot=ROT,
)  # fmt: skip
AGREE = 1e-5  # float32 both ways: the absorption only reorders the products


def _block(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Seeded MLA weights as the GGUF holds them, and the checkpoint's kv_b `(n_head (nope + v), kv_lora)`."""

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) / shape[-1] ** 0.5

    kv_b = w(N_HEAD * (NOPE + V), KV_LORA)
    block = {
        "attn_q_a": w(Q_LORA, N_EMBD),
        "attn_q_a_norm": 1.0 + 0.1 * torch.randn(Q_LORA, generator=g),
        "attn_q_b": w(N_HEAD * (NOPE + ROT), Q_LORA),
        "attn_kv_a_mqa": w(KV_LORA + ROT, N_EMBD),
        "attn_kv_a_norm": 1.0 + 0.1 * torch.randn(KV_LORA, generator=g),
        "attn_output": w(N_EMBD, N_HEAD * V),
        **split_kv_b(kv_b, N_HEAD, NOPE),
    }
    return block, kv_b


def _decompressed(b: dict[str, torch.Tensor], kv_b: torch.Tensor, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """DeepSeek's MLA as its model code computes it: per-head K = [kv_b's nope rows of c, k_pe],
    V = kv_b's v rows of c, causal softmax at 1/sqrt(nope + rope), then wo."""
    n = x.shape[0]
    q = linear(rms_norm(linear(x, b["attn_q_a"]), b["attn_q_a_norm"], EPS), b["attn_q_b"]).reshape(n, N_HEAD, -1)
    kv = linear(x, b["attn_kv_a_mqa"])  # (n, kv_lora + rope)
    c = rms_norm(kv[:, :KV_LORA], b["attn_kv_a_norm"], EPS)
    per_head = linear(c, kv_b).reshape(n, N_HEAD, NOPE + V)  # (n, n_head, nope + v)
    q_pe, k_pe = rope(q[..., NOPE:], pos, HP), rope(kv[:, None, KV_LORA:], pos, HP)  # (n, n_head, rope), (n, 1, rope)
    k = torch.cat([per_head[..., :NOPE], k_pe.expand(n, N_HEAD, ROT)], dim=-1)  # (n, n_head, nope + rope)
    qq = torch.cat([q[..., :NOPE], q_pe], dim=-1)  # (n, n_head, nope + rope)
    scores = torch.einsum("thd,shd->hts", qq, k) / (NOPE + ROT) ** 0.5  # (n_head, n, n)
    scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    out = torch.einsum("hts,shv->thv", torch.softmax(scores, -1), per_head[..., NOPE:])  # (n, n_head, v)
    return linear(out.reshape(n, -1), b["attn_output"])


def test_absorbed_mla_equals_deepseeks_decompressed_attention_through_the_cache():
    g = torch.Generator().manual_seed(0)
    block, kv_b = _block(g)
    x = torch.randn(7, N_EMBD, generator=g)  # (n_tokens, n_embd)
    pos = torch.arange(7)
    cache = empty_cache(1, 1, KV_LORA + ROT, "f32", torch.device("cpu"))
    first, cache = mla_attention(HP, block, x[:5], pos[:5], cache)  # a prefill, then two rows after it
    second, cache = mla_attention(HP, block, x[5:], pos[5:], cache)
    want = _decompressed(block, kv_b, x, pos)
    assert torch.allclose(torch.cat([first, second]), want, atol=AGREE, rtol=AGREE)
    assert cache.k[0].shape == (7, 1, KV_LORA + ROT) and cache.v[0].shape == (7, 1, KV_LORA)  # the latent, one head


def test_the_halves_read_rope_first_are_the_attention_of_rows_reordered_rope_first():
    g = torch.Generator().manual_seed(1)
    block, _ = _block(g)
    x = torch.randn(6, N_EMBD, generator=g)
    pos = torch.arange(6)
    cache = empty_cache(1, 1, KV_LORA + ROT, "f32", torch.device("cpu"))
    # the rows each half would be read from under [rope, nope], moved to where [nope, rope] reads them
    reordered = dict(block)
    q_b = block["attn_q_b"].reshape(N_HEAD, NOPE + ROT, Q_LORA)
    reordered["attn_q_b"] = torch.cat([q_b[:, ROT:], q_b[:, :ROT]], dim=1).reshape(-1, Q_LORA)
    kv_a = block["attn_kv_a_mqa"]
    reordered["attn_kv_a_mqa"] = torch.cat([kv_a[ROT:], kv_a[:ROT]])
    crossed, _ = mla_attention(HP, block, x, pos, cache, rope_first=True)
    want, _ = mla_attention(HP, reordered, x, pos, cache)
    assert torch.allclose(crossed, want, atol=AGREE, rtol=AGREE)
    right, _ = mla_attention(HP, block, x, pos, cache)
    assert not torch.allclose(crossed, right, atol=1e-2)  # the hypothesis differs from the right attention


def test_the_dense_indexer_keeps_every_cell_and_refuses_more_than_its_top_k():
    mask = torch.zeros(1, 3, 5)  # (1, n_tokens, n_cells)
    assert _DenseIndexer(5)(torch.zeros(1, 3, 8), None, None, mask).tolist() == [[list(range(5))] * 3]
    with pytest.raises(InputError, match="chooses 4 of 5 cells"):
        _DenseIndexer(4)(torch.zeros(1, 3, 8), None, None, mask)
