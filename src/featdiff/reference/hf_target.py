"""A target run by transformers' own model code, for the architectures featdiff does not write
again in torch (issue 24): Qwen3-MoE and the like. Consumes a Hugging Face directory (config and
safetensors); produces, per batch, the records the native target writes (target.py): `embd`,
`layer_inp-<L>`, `l_out-<il>` and `result_norm` / `result_output`; on a MoE layer also the
router's top-k margin per token, `l_out-<il>@router_margin` (names.HYP_ROUTER_MARGIN), the
evidence compare's `expert_choice` reads.

The model is transformers' (`from_pretrained`, float32 on the CPU). Two things are featdiff's:
* where it taps: a forward pre-hook on each decoder layer takes that layer's input, one on the
  final norm the state before it (layer `n_layer`), exactly llama.cpp's taps (`l_out-(L-1)`);
* attention's numerics: the model's attention calls `attention.attend` (registered with
  transformers as ATTN_IMPLEMENTATION), which emulates llama.cpp's f16 KV cache and CPU flash
  attention as the native path does; the mask is transformers' own (causal, sliding windows).
The KV cache lives in the flow's `KvCache` (one row per cell, position order), rebuilt into a
transformers DynamicCache per batch, so rolling back rejected rows is `attention.truncated`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from featdiff import names
from featdiff.errors import InputError
from featdiff.reference.attention import KvCache, attend
from featdiff.reference.stack import Named
from featdiff.reference.weights import Hparams, Source, Target

log = logging.getLogger(__name__)

# HF model_type -> llama.cpp architecture, for the targets this path runs: every layer is full
# (or sliding-window) attention with a KV cache, so the cache rolls back by position. Hybrid
# recurrent targets (qwen3_5, nemotron_h: state that a rejected row updates) and attention sinks
# (gpt_oss) are not run yet (issue 24, items 2 and 4).
HF_ARCHS = {"qwen3_moe": "qwen3moe", "qwen3": "qwen3", "llama": "llama"}
ATTN_IMPLEMENTATION = "featdiff_ggml"  # the name featdiff's attention is registered under
KV_DTYPE_KWARG = "featdiff_kv_dtype"  # passed through the model's **kwargs to the attention call


@dataclass(frozen=True)
class HfTarget(Target):
    """A target whose forward is transformers' module `model`; `layers` is empty (the module has
    them), `token_embd` and `output` are the module's own tensors (a drafter borrows them)."""

    model: Any = None  # a transformers PreTrainedModel (…ForCausalLM)


@dataclass(frozen=True)
class HfPass:
    """One eval of a transformers target: what target.TargetPass holds."""

    layer_inputs: tuple[torch.Tensor, ...]  # input of layer L, (n_tokens, n_embd), L = 0 .. n_layer
    logits: torch.Tensor  # (n_outputs, n_vocab)
    cache: KvCache
    records: tuple[Named, ...]


def hf_arch(path: Path, model_type: object) -> str:
    """llama.cpp's architecture of a HF `model_type` this path runs, else an InputError naming
    what is supported."""
    if not isinstance(model_type, str) or model_type not in HF_ARCHS:
        raise InputError(
            f"{path / names.HF_CONFIG}: model_type {model_type!r}: the reference runs targets of model_type "
            f"{', '.join(HF_ARCHS)} (qwen3 and llama natively, the others through transformers); "
            "pass one of those checkpoints"
        )
    return HF_ARCHS[model_type]


def target_from_transformers(path: Path, dtype: torch.dtype, device: torch.device) -> HfTarget:
    """The HF directory `path` loaded by transformers (`from_pretrained`, local files only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _register_attention()
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    arch = hf_arch(path, config.model_type)
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, local_files_only=True
    )
    model = model.to(device).eval()  # type: ignore[arg-type]  # transformers types .to by its wrapper
    text = model.get_decoder()
    return HfTarget(
        source=Source(path=path, is_gguf=False),
        hparams=_hparams(config, arch),
        token_embd=model.get_input_embeddings().weight.detach(),
        output_norm=text.norm.weight.detach(),
        output=model.get_output_embeddings().weight.detach(),
        layers=(),
        model=model,
    )


def _hparams(config: Any, arch: str) -> Hparams:
    """The dimensions the flow and the manifest read, from transformers' config."""
    rope = getattr(config, "rope_parameters", None) or {}
    n_head = config.num_attention_heads
    return Hparams(
        arch=arch,
        n_layer=config.num_hidden_layers,
        n_embd=config.hidden_size,
        n_head=n_head,
        n_head_kv=getattr(config, "num_key_value_heads", None) or n_head,
        n_embd_head=getattr(config, "head_dim", None) or config.hidden_size // n_head,
        n_ff=config.intermediate_size,
        n_vocab=config.vocab_size,
        rms_eps=config.rms_norm_eps,
        rope_base=float(rope.get("rope_theta", getattr(config, "rope_theta", 0.0)) or 0.0),
        rope_type="neox",
    )


def forward_hf(
    target: HfTarget, tokens: torch.Tensor, positions: torch.Tensor, cache: KvCache, has_outputs: bool
) -> HfPass:
    """Run `tokens` at `positions` after the cached cells through the transformers model (causal);
    all rows or none are outputs, as target.forward_target."""
    from transformers import DynamicCache

    model, n_layer = target.model, target.hparams.n_layer
    past = DynamicCache(config=model.config)
    for il in range(n_layer):
        if cache.k[il].shape[0]:
            past.update(_hf_layout(cache.k[il]), _hf_layout(cache.v[il]), il)
    taps: list[torch.Tensor] = []  # input of layer 0 .. n_layer-1, then of the final norm
    margins: dict[int, torch.Tensor] = {}  # il -> (n_tokens, 2) router margin and rms, MoE layers only
    text = model.get_decoder()
    hooks = [layer.register_forward_pre_hook(_Tap(taps), with_kwargs=True) for layer in text.layers[:n_layer]]
    hooks.append(text.norm.register_forward_pre_hook(_Tap(taps), with_kwargs=True))
    for il, layer in enumerate(text.layers[:n_layer]):
        hooks += [router.register_forward_hook(_Margin(margins, il)) for router in _routers(layer)]
    try:
        out = model(
            input_ids=tokens[None],
            position_ids=positions[None],
            past_key_values=past,
            use_cache=True,
            **{KV_DTYPE_KWARG: cache.k[0].dtype},
        )
    finally:
        for h in hooks:
            h.remove()
    if len(taps) != n_layer + 1:
        raise RuntimeError(f"{target.source.path}: tapped {len(taps)} layer inputs, expected {n_layer + 1}")
    rows = slice(None) if has_outputs else slice(0, 0)
    x = taps[n_layer][rows]  # (n_outputs, n_embd): the last l_out keeps the output rows only
    norm = text.norm(x)  # (n_outputs, n_embd)
    logits = out.logits[0][rows]  # (n_outputs, n_vocab)
    records = [Named(names.TARGET_EMBD, taps[0])]
    for il in range(n_layer):
        l_out = taps[il + 1] if il < n_layer - 1 else x
        records += [
            Named(names.layer_name(names.LAYER_INP, il), taps[il]),
            Named(names.layer_name(names.L_OUT, il), l_out),
        ]
        if il in margins:  # the last layer's l_out keeps the output rows only, and so its margin
            margin = margins[il] if il < n_layer - 1 else margins[il][rows]  # (n_rows, 2)
            records.append(Named(_margin_name(il), margin))
    records += [Named(names.RESULT_NORM, norm), Named(names.RESULT_OUTPUT, logits)]
    after = _cache_after(cache, positions, past, n_layer)
    return HfPass(tuple(taps), logits, after, tuple(records))


@dataclass(frozen=True)
class _Tap:
    """A forward pre-hook appending its module's hidden-state input `(n_tokens, n_embd)` to `taps`."""

    taps: list[torch.Tensor]

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.taps.append(hidden[0].detach().clone())  # (n_tokens, n_embd)


def _routers(layer: Any) -> list[Any]:
    """The MoE routers of a decoder layer: transformers' top-k routers (`Qwen3MoeTopKRouter`),
    modules with `top_k` and `num_experts` whose forward returns the router logits first."""
    return [m for m in layer.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts")]


def _margin_name(il: int) -> str:
    """`l_out-<il>@router_margin`: evidence on l_out-<il> (names.HYP_ROUTER_MARGIN), reference-only."""
    return names.candidate_name(names.layer_name(names.L_OUT, il), names.HYP_ROUTER_MARGIN)


@dataclass(frozen=True)
class _Margin:
    """A forward hook on layer `il`'s router: per token, its top-k margin (the gap between the
    k-th and (k+1)-th router logit) and the rms of its router logits, into `margins[il]` (n_tokens, 2). A near-zero gap is a
    near-tie: llama.cpp may route that token to the other expert within its float noise."""

    margins: dict[int, torch.Tensor]
    il: int

    def __call__(self, module: Any, args: tuple, output: Any) -> None:
        logits = output[0] if isinstance(output, tuple) else output  # (n_tokens, n_expert)
        k = int(module.top_k)
        if logits.shape[-1] <= k:
            return  # every expert is used: no choice to make
        x = logits.detach().float()  # (n_tokens, n_expert)
        top = torch.topk(x, k + 1, dim=-1).values  # (n_tokens, k + 1), descending
        rms = x.pow(2).mean(dim=-1).sqrt()  # (n_tokens,): the scale the margin's noise bound is of
        self.margins[self.il] = torch.stack([top[:, k - 1] - top[:, k], rms], dim=-1)  # (n_tokens, 2)


def _hf_layout(t: torch.Tensor) -> torch.Tensor:
    """A cached layer `(n_cells, n_head_kv, d)` (store dtype) as transformers holds it, float32."""
    return t.float().permute(1, 0, 2)[None]  # (1, n_head_kv, n_cells, d)


def _cache_after(cache: KvCache, positions: torch.Tensor, past: Any, n_layer: int) -> KvCache:
    """The flow's cache after this batch: every layer's K/V, rows rounded to the store dtype."""
    store = cache.k[0].dtype
    k = [past.layers[il].keys[0].permute(1, 0, 2).to(store) for il in range(n_layer)]  # (n_cells, n_head_kv, d)
    v = [past.layers[il].values[0].permute(1, 0, 2).to(store) for il in range(n_layer)]  # (n_cells, n_head_kv, d)
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
    transformers built `(1, 1, n_tokens, n_cells)`; returns `(1, n_tokens, n_head, d)`."""
    if getattr(module, "sinks", None) is not None:
        raise InputError("attention sinks (gpt-oss): the transformers reference does not run them yet (issue 24)")
    _, n_head, n_tokens, d = query.shape
    store = kwargs.get(KV_DTYPE_KWARG, torch.float32)
    q = query[0].transpose(0, 1)  # (n_tokens, n_head, d)
    if scaling is not None and not np.isclose(scaling, 1.0 / np.sqrt(d), rtol=0, atol=0):
        q = q * float(np.float32(scaling) * np.sqrt(np.float32(d)))  # attend scales by 1/sqrt(d)
    k = key[0].transpose(0, 1).to(store)  # (n_cells, n_head_kv, d): rows as the cache stores them
    v = value[0].transpose(0, 1).to(store)  # (n_cells, n_head_kv, d)
    visible = _visible(attention_mask, n_tokens, k.shape[0], query.device)
    cells = torch.zeros(k.shape[0], dtype=torch.int64, device=query.device)  # unused: `visible` decides
    out = attend(q, cells[:n_tokens], k, v, cells, causal=True, visible=visible)  # (n_tokens, n_head * d)
    return out.reshape(1, n_tokens, n_head, d), None  # (1, n_tokens, n_head, d)


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
