"""The hooks the Hugging Face target's forward taps llama.cpp's records with (layer outputs, routers, recurrent
mixers), and featdiff's ggml attention registered with transformers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
import numpy as np
import torch
from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.torchref.attention import KvCache, attend


# The callback name of a layer's output where an arch's graph gives `l_out` to something else:
# nemotron-h.cpp names the FFN block's output (before the residual) `l_out` and the layer's output
# `nemotron_h_block_out`. The reference records the layer's output under the latter.
L_OUT_NAMES = {"nemotron_h": "nemotron_h_block_out"}


ATTN_IMPLEMENTATION = "featdiff_ggml"  # the name featdiff's attention is registered under
KV_DTYPE_KWARG = "featdiff_kv_dtype"  # passed through the model's **kwargs to the attention call


@dataclass(frozen=True)
class _Recurrent:
    """A recurrent layer's mixer run over its whole history: the mixer inputs of the cells kept
    (`history`, (n_cells, n_embd)) then this batch's, without transformers' cache; the batch's
    rows of the output are kept. The state after the cells is a function of their mixer inputs
    only, so a cache truncated to the accepted cells (`attention.truncated`) holds exactly the
    state llama.cpp's rollback restores (llama-memory-recurrent.cpp seq_rm: the snapshot of the
    last accepted row): rejected rows leave nothing behind. Costs one pass over the history per
    batch, which the tiny and test-sized flows afford."""

    history: torch.Tensor  # (n_cells, n_embd) float32
    mixed: dict[int, torch.Tensor]
    il: int

    def before(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs.pop("hidden_states")  # (1, n_tokens, n_embd)
        self.mixed[self.il] = hidden[0].detach().clone()  # (n_tokens, n_embd)
        full = torch.cat([self.history.to(hidden.dtype)[None], hidden], dim=1)  # (1, n_cells + n_tokens, n_embd)
        return (full,), {**kwargs, "cache_params": None, "attention_mask": None}

    def after(self, module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output[:, -self.mixed[self.il].shape[0] :]  # (1, n_tokens, n_embd)


@dataclass(frozen=True)
class _Output:
    """A forward hook keeping its module's output `(n_tokens, n_embd)` as `outputs[il]`."""

    outputs: dict[int, torch.Tensor]
    il: int

    def __call__(self, module: Any, args: tuple, output: torch.Tensor) -> None:
        self.outputs[self.il] = output[0].detach().clone()  # (n_tokens, n_embd)


@dataclass(frozen=True)
class _Tap:
    """A forward pre-hook appending its module's hidden-state input `(n_tokens, n_embd)` to `taps`."""

    taps: list[torch.Tensor]

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.taps.append(hidden[0].detach().clone())  # (n_tokens, n_embd)


def _routers(layer: Any) -> list[tuple[Any, int]]:
    """The MoE routers of a decoder layer, each as (the module whose output is the router logits,
    how many experts a token takes): transformers' top-k routers (`Qwen3MoeTopKRouter`, gpt-oss's),
    modules with `top_k` and `num_experts` whose forward returns the logits first; Gemma 4's router
    (`Gemma4TextRouter`) returns softmax probabilities, so its logits are its `proj`'s output."""
    found: list[tuple[Any, int]] = []
    for m in layer.modules():
        if hasattr(m, "top_k") and hasattr(m, "num_experts"):
            found.append((m, int(m.top_k)))
        elif hasattr(m, "proj") and hasattr(m, "per_expert_scale") and hasattr(m, "config"):
            found.append((m.proj, int(m.config.top_k_experts)))
    return found


@dataclass(frozen=True)
class _DenseIndexer:
    """DeepSeek-V3.2's sparse-attention indexer (transformers' DeepseekV32Indexer; GLM-5's
    GlmMoeDsaIndexer, the same call) run as llama.cpp's deepseek32 and glm-dsa graphs run it while
    the cache holds at most index_topk cells: its top-k (min(n_kv, top_k), deepseek32.cpp,
    glm-dsa.cpp) is then every cell, whatever the scores, so every cell is
    chosen; more cells than index_topk are refused (the reference does not model the sparse choice)."""

    index_topk: int

    def __call__(self, hidden_states: torch.Tensor, q_resid: Any, position_embeddings: Any, mask: torch.Tensor,
                 *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        n_batch, n_tokens, n_cells = mask.shape  # (1, n_tokens, n_cells)
        if n_cells > self.index_topk:
            raise InputError(
                f"the target's sparse-attention indexer (DeepSeek-V3.2's or GLM-5's DSA) chooses {self.index_topk} "
                f"of {n_cells} cells here; featdiff runs it dense, as llama.cpp does up to index_topk cells: "
                "keep the run shorter"
            )
        cells = torch.arange(n_cells, dtype=torch.int32, device=mask.device)  # (n_cells,)
        return cells.expand(n_batch, n_tokens, n_cells)  # (1, n_tokens, n_cells): the top-k, every cell


def dense_indexers(model: Any) -> list[tuple[Any, _DenseIndexer]]:
    """The model's sparse-attention indexers (modules with `index_topk`), each with its dense stand-in."""
    return [(m, _DenseIndexer(int(m.index_topk))) for m in model.modules() if hasattr(m, "index_topk")]


def _margin_name(arch: str, il: int) -> str:
    """`l_out-<il>@router_margin`: evidence on layer il's output (names.HYP_ROUTER_MARGIN), reference-only."""
    return names.candidate_name(layer_out_name(arch, il), names.HYP_ROUTER_MARGIN)


def layer_out_name(arch: str, il: int) -> str:
    """The callback name of layer il's output in `arch`'s graph: `l_out-<il>`, or the arch's own."""
    return names.layer_name(L_OUT_NAMES.get(arch, names.L_OUT), il)


@dataclass(frozen=True)
class _Margin:
    """A forward hook on layer `il`'s router: per token, its top-k margin (the gap between the
    k-th and (k+1)-th router logit) and the rms of its router logits, into `margins[il]` (n_tokens, 2). A near-zero gap is a
    near-tie: llama.cpp may route that token to the other expert within its float noise. A router
    that chooses by sigmoid(logit) + a correction bias (Nemotron-H) has its margin taken there."""

    margins: dict[int, torch.Tensor]
    il: int
    k: int  # experts per token

    def __call__(self, module: Any, args: tuple, output: Any) -> None:
        logits = output[0] if isinstance(output, tuple) else output  # (n_tokens, n_expert)
        logits = logits.reshape(-1, logits.shape[-1])  # a Linear's output keeps the batch dim
        k = self.k
        if logits.shape[-1] <= k:
            return  # every expert is used: no choice to make
        x = logits.detach().float()  # (n_tokens, n_expert)
        bias = getattr(module, "e_score_correction_bias", None)  # Nemotron-H, DeepSeek-V3: choice by sigmoid + bias
        if bias is not None:
            x = x.sigmoid() + bias.detach().float()
        top = torch.topk(x, k + 1, dim=-1).values  # (n_tokens, k + 1), descending
        rms = x.pow(2).mean(dim=-1).sqrt()  # (n_tokens,): the scale the margin's noise bound is of
        self.margins[self.il] = torch.stack([top[:, k - 1] - top[:, k], rms], dim=-1)  # (n_tokens, 2)


def _hf_layout(t: torch.Tensor) -> torch.Tensor:
    """A cached layer `(n_cells, n_head_kv, d)` (store dtype) as transformers holds it, float32."""
    return t.float().permute(1, 0, 2)[None]  # (1, n_head_kv, n_cells, d)


def _cache_after(
    cache: KvCache,
    positions: torch.Tensor,
    past: Any,
    n_layer: int,
    mixed: dict[int, torch.Tensor],
    kv_less: frozenset[int] = frozenset(),
) -> KvCache:
    """The flow's cache after this batch: every attention layer's K/V, rows rounded to the store
    dtype; a recurrent layer's mixer inputs (`_Recurrent`), float32 `(n_cells, 1, n_embd)` in
    both its K and V slots, so truncating the cache by position rolls its state back; a layer
    keeping no KV (`kv_less`) an empty `(n_cells, 0, 1)`, one row per cell."""
    store = next(cache.k[il].dtype for il in range(n_layer) if il not in mixed)
    n_cells = cache.positions.shape[0] + positions.shape[0]
    k: list[torch.Tensor] = []
    v: list[torch.Tensor] = []
    for il in range(n_layer):
        if il in kv_less:
            k.append(torch.zeros((n_cells, 0, 1), dtype=store, device=positions.device))
            v.append(k[-1])
            continue
        if il in mixed:
            history = torch.cat([cache.k[il].float().reshape(-1, mixed[il].shape[-1]), mixed[il].float()])
            k.append(history[:, None])  # (n_cells, 1, n_embd)
            v.append(history[:, None])
            continue
        k.append(past.layers[il].keys[0].permute(1, 0, 2).to(store))  # (n_cells, n_head_kv, d)
        v.append(past.layers[il].values[0].permute(1, 0, 2).to(store))  # (n_cells, n_head_kv, d)
    return KvCache(positions=torch.cat([cache.positions, positions]), k=tuple(k), v=tuple(v))  # (n_cells,)


def ggml_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface over `attention.attend`: query `(1, n_head,
    n_tokens, d)`, key/value `(1, n_head_kv, n_cells, d)` (the cache and this batch), the mask
    transformers built `(1, 1, n_tokens, n_cells)`; returns `(1, n_tokens, n_head, d)`. A module
    with `sinks` `(n_head,)` (gpt-oss) adds them to each head's softmax (`attend`)."""
    sinks = getattr(module, "sinks", None)
    _, n_head, n_tokens, d = query.shape
    store = kwargs.get(KV_DTYPE_KWARG, torch.float32)
    q = query[0].transpose(0, 1)  # (n_tokens, n_head, d)
    if scaling is not None and not np.isclose(scaling, 1.0 / np.sqrt(d), rtol=0, atol=0):
        q = q * float(np.float32(scaling) * np.sqrt(np.float32(d)))  # attend scales by 1/sqrt(d)
    k = key[0].transpose(0, 1).to(store)  # (n_cells, n_head_kv, d): rows as the cache stores them
    v = value[0].transpose(0, 1).to(store)  # (n_cells, n_head_kv, d)
    visible = _visible(attention_mask, n_tokens, k.shape[0], query.device)
    cells = torch.zeros(k.shape[0], dtype=torch.int64, device=query.device)  # unused: `visible` decides
    sink = None if sinks is None else sinks.detach()  # (n_head,)
    out = attend(q, cells[:n_tokens], k, v, cells, causal=True, visible=visible, sinks=sink)  # (n_tokens, n_head * d_v)
    return out.reshape(1, n_tokens, n_head, v.shape[-1]), None  # (1, n_tokens, n_head, d_v)


def _visible(mask: torch.Tensor | None, n_tokens: int, n_cells: int, device: torch.device) -> torch.Tensor:
    """Which cells each row sees `(n_tokens, n_cells)`, from transformers' additive or boolean mask."""
    if mask is None:
        if n_tokens != 1:
            raise RuntimeError(f"transformers passed no attention mask for a batch of {n_tokens} rows")
        return torch.ones((1, n_cells), dtype=torch.bool, device=device)
    m = mask[0, 0, :, -n_cells:]  # (n_tokens, n_cells)
    return m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2


def _register_attention() -> None:
    """Register `ggml_attention` (with transformers' eager mask) under ATTN_IMPLEMENTATION:
    transformers' own registry, the one way a model takes an attention function by name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, ggml_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)
