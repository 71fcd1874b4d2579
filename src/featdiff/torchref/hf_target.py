"""A target run by transformers' own model code, for the architectures featdiff does not write
again in torch (issue 24): Qwen3-MoE, gpt-oss, Qwen3.5, Gemma 4, Nemotron-H, GLM-4.5, MiMo-V2-Flash
(HF_ARCHS).
Consumes a Hugging Face directory (config and safetensors); produces, per batch, the records the
native target writes (target.py): `embd`, `layer_inp-<L>`, `l_out-<il>` (under the arch's graph
names where they differ: EMBD_NAMES, L_OUT_NAMES) and `result_norm` / `result_output`; on a MoE
layer also the router's top-k margin per token, `l_out-<il>@router_margin`
(names.HYP_ROUTER_MARGIN), the evidence compare's `expert_choice` reads.

The model is transformers' (`from_pretrained`, float32 on the CPU). Two things are featdiff's:
* where it taps: a forward pre-hook on each decoder layer takes that layer's input, one on the
  final norm the state before it (layer `n_layer`), exactly llama.cpp's taps (`l_out-(L-1)`);
* attention's numerics: the model's attention calls `attention.attend` (registered with
  transformers as ATTN_IMPLEMENTATION), which emulates llama.cpp's f16 KV cache and CPU flash
  attention as the native path does; the mask is transformers' own (causal, sliding windows).
The KV cache lives in the flow's `KvCache` (one row per cell, position order), rebuilt into a
transformers DynamicCache per batch, so rolling back rejected rows is `attention.truncated`. A
hybrid target's recurrent layers (Qwen3.5's gated delta-net, Nemotron-H's Mamba2) keep their
mixer inputs per cell in the same cache and rerun over that history (`_Recurrent`), so the same
truncation rolls their state back to the accepted rows; layers with no KV of their own (Gemma 4's
shared-KV layers, Nemotron-H's MoE blocks) keep an empty row per cell. After a verify that
rejected rows, `kept_rejected_state` is the state a memory that rolled back only its attention
would hold, and the next verify's `@recurrent=kept_rejected` candidates come from it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.torchref.memory import available_bytes, check_fits
from featdiff.torchref.attention import KvCache, truncated
from featdiff.torchref.stack import Named
from featdiff.torchref.weights import Hparams, Source, Target
from featdiff.torchref.hf_taps import (
    ATTN_IMPLEMENTATION,
    KV_DTYPE_KWARG,
    L_OUT_NAMES,
    _Margin,
    _Output,
    _Recurrent,
    _Tap,
    _cache_after,
    _hf_layout,
    _margin_name,
    _register_attention,
    dense_indexers,
    _routers,
    layer_out_name,
)

log = logging.getLogger(__name__)

# HF model_type -> llama.cpp architecture, for the targets this path runs. Attention layers keep
# a KV cache that rolls back by position; Qwen3.5's gated delta-net layers keep recurrent state,
# rolled back as their history (`_Recurrent`). Qwen3.5 runs as its text model: from a text-only
# directory (`qwen3_5_text`) or a published one (`qwen3_5`: transformers' AutoModelForCausalLM
# builds Qwen3_5ForCausalLM from its text_config, takes `model.language_model.*` and skips the
# `mtp.*` and `model.visual.*` tensors, which a target's layer inputs never read).
HF_ARCHS = {
    "qwen3_moe": "qwen3moe",
    "gpt_oss": "gpt-oss",
    "qwen3_5_text": "qwen35",
    "qwen3_5": "qwen35",  # the published checkpoints' layout (image-text-to-text): its text model runs
    "qwen3_5_moe_text": "qwen35moe",  # Qwen3.5-MoE: the same trunk with a routed and a shared expert per layer
    "qwen3_5_moe": "qwen35moe",
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",  # published (image-text-to-text): Gemma4ForConditionalGeneration, run on text ids
    "nemotron_h": "nemotron_h",
    "glm4_moe": "glm4moe",  # GLM-4.5: biased attention, sigmoid-routed experts (its MTP layer is left unloaded)
    "qwen3_next": "qwen3next",  # Qwen3-Next: Qwen3.5-MoE's trunk with fused linear-attention projections
    "mimo_v2_flash": "mimo2",  # MiMo-V2-Flash: sinks, narrower value heads (its model.mtp.* layers are left unloaded)
    "deepseek_v32": "deepseek32",  # DeepSeek-V3.2: deepseek_v3's with the DSA indexer (dense here: hf_taps)
    "glm_moe_dsa": "glm-dsa",  # GLM-5: deepseek_v32's shape, interleaved RoPE in its indexer (dense here: hf_taps)
    "deepseek_v3": "deepseek2",  # DeepSeek-V3: MLA, sigmoid-routed experts (its MTP layer n_layer is left unloaded)
    "hy_v3": "hy_v3",  # Hy3: q/k norms, sigmoid-routed experts, a shared expert (its MTP layer n_layer is left unloaded)
    "cohere2_moe": "cohere2moe",  # Cohere2-MoE: parallel blocks, NoPE full layers (its MTP layer n_layer is left unloaded)
    "bailing_hybrid": "bailingmoe3",  # Ling 3.0: KDA and gated-MLA layers (its MTP layer n_layer is left unloaded)
    "qwen3": "qwen3",
    "llama": "llama",
}
# llama.cpp's architectures of these targets, as a converted GGUF names them: a Nemotron-H
# checkpoint with experts converts to nemotron_h_moe (conversion/nemotron.py)
GGUF_ARCHS = frozenset(HF_ARCHS.values()) | {"nemotron_h_moe"}
# Architectures whose graph keeps every row through the last layer and selects the output rows
# only before the final norm (src/models/openai-moe.cpp, qwen35.cpp, gemma4.cpp: the last layer's
# get_rows only under embeddings_nextn_masked, which a target context never sets): their last
# `l_out` has all rows. The others select before the last layer's FFN, as target.py says.
ALL_ROWS_LAST_LAYER = frozenset({"gpt-oss", "qwen35", "qwen35moe", "qwen3next", "gemma4", "nemotron_h", "bailingmoe3"})
# The graph callback name of layer 0's input where an arch renames llama-graph.cpp's `embd`:
# qwen35.cpp `cb(inpL, "model.input_embed", -1)`; gemma4.cpp scales the looked-up rows by
# sqrt(n_embd) into `inp_scaled` (its `embd` is the unscaled lookup, which transformers' scaled
# embedding never holds). The reference records the rows under the name the capture writes.
EMBD_NAMES = {
    "qwen35": "model.input_embed",
    "qwen35moe": "model.input_embed",
    "qwen3next": "model.embed_tokens",  # qwen3next.cpp's name of it
    "bailingmoe3": "model.input_embed",  # bailingmoe3.cpp's
    "gemma4": "inp_scaled",
}
# Architectures whose graph also names the unscaled lookup `embd` (gemma4.cpp): the reference
# records it too, so compare never pairs it with layer 0's scaled input (align.REF_ALIASES)
RAW_EMBD = frozenset({"gemma4"})
KV_REUSE = "reuse"  # transformers' kv_sharing_modes entry of a layer that reads an earlier layer's KV
MIXERLESS = frozenset({"mlp", "moe"})  # Nemotron-H's layer_types of a block with no token mixer
LINEAR_ATTENTION = "linear_attention"  # transformers' layer_types entry of a recurrent (gated delta-net) layer
MISSING_SHOWN = 3  # missing tensors named in the refusal


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
    check_fits(path, dtype, available_bytes())  # exit 2 before transformers allocates a byte
    loaded: Any = AutoModelForCausalLM.from_pretrained(  # (model, loading info)
        path,
        config=config,
        dtype=dtype,
        attn_implementation=ATTN_IMPLEMENTATION,
        local_files_only=True,
        output_loading_info=True,
    )
    model, info = loaded
    # transformers fills a parameter the checkpoint lacks with its random init and only logs it:
    # a reference of such a model would be compared as if it were the trained one
    missing = sorted(info.get("missing_keys", ())) + sorted(str(m) for m in info.get("mismatched_keys", ()))
    if missing:
        shown = ", ".join(missing[:MISSING_SHOWN]) + (" ..." if len(missing) > MISSING_SHOWN else "")
        raise InputError(
            f"{path}: the checkpoint lacks {len(missing)} of the model's tensors ({shown}), which transformers "
            "would fill with random values; pass the complete checkpoint directory"
        )
    model = model.to(device).eval()
    text = model.get_decoder()
    return HfTarget(
        source=Source(path=path, is_gguf=False),
        hparams=_hparams(model.config.get_text_config(), arch),  # a composite checkpoint's text config
        token_embd=model.get_input_embeddings().weight.detach(),
        output_norm=_final_norm(text).weight.detach(),
        output=model.get_output_embeddings().weight.detach(),
        layers=(),
        model=model,
    )


def _hparams(config: Any, arch: str) -> Hparams:
    """The dimensions the flow and the manifest read, from transformers' config."""
    # the config's own top-level values: a config with per-layer overrides (Gemma 4's wider
    # full-attention heads) refuses attribute reads of the fields a layer may override
    raw = config.to_dict()
    rope = raw.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # per layer kind (Gemma 4): the full layers' RoPE
    swa = tuple(t == "sliding_attention" for t in raw.get("layer_types") or ())
    n_head = raw["num_attention_heads"]
    return Hparams(
        arch=arch,
        n_layer=config.num_hidden_layers,  # Nemotron-H's counts its block list (not a raw field)
        n_embd=raw["hidden_size"],
        n_head=n_head,
        n_head_kv=raw.get("num_key_value_heads") or n_head,
        n_embd_head=raw.get("head_dim") or raw["hidden_size"] // n_head,
        n_ff=raw.get("intermediate_size") or raw.get("moe_intermediate_size") or 0,  # Qwen3.5-MoE has experts only
        n_vocab=raw["vocab_size"],
        rms_eps=raw["rms_norm_eps"] if "rms_norm_eps" in raw else raw["layer_norm_epsilon"],  # Nemotron-H's name
        rope_base=float(rope.get("rope_theta", raw.get("rope_theta", 0.0)) or 0.0),
        rope_type="neox",
        n_swa=int(raw.get("sliding_window") or 0) if any(swa) else 0,
        swa_layers=swa if any(swa) else (),
    )


def forward_hf(
    target: HfTarget, tokens: torch.Tensor, positions: torch.Tensor, cache: KvCache, has_outputs: bool
) -> HfPass:
    """Run `tokens` at `positions` after the cached cells through the transformers model (causal);
    all rows or none are outputs, as target.forward_target."""
    model, n_layer = target.model, target.hparams.n_layer
    # plain layers, never transformers' sliding-window ones (config=...): those keep only the last
    # `sliding_window - 1` rows, and the flow's cache holds every cell, as llama.cpp's does until
    # the window has passed them; the window is the mask's (`_visible`)
    recurrent = _recurrent_layers(model)
    kv_less = _kv_less_layers(model)
    # FFN blocks whose output the arch's graph names `l_out` (L_OUT_NAMES: Nemotron-H's MoE blocks)
    ffn_blocks = _mixerless_layers(model) if target.hparams.arch in L_OUT_NAMES else frozenset()
    past = _past_of(cache, n_layer, recurrent | kv_less, tokens.device)
    taps: list[torch.Tensor] = []  # input of layer 0 .. n_layer-1, then of the final norm
    margins: dict[int, torch.Tensor] = {}  # il -> (n_tokens, 2) router margin and rms, MoE layers only
    mixed: dict[int, torch.Tensor] = {}  # il -> (n_tokens, n_embd): a recurrent layer's mixer input
    ffn_out: dict[int, torch.Tensor] = {}  # il -> (n_tokens, n_embd): an FFN block's output (Nemotron-H's `l_out`)
    text = model.get_decoder()
    hooks = [layer.register_forward_pre_hook(_Tap(taps), with_kwargs=True) for layer in text.layers[:n_layer]]
    hooks.append(_final_norm(text).register_forward_pre_hook(_Tap(taps), with_kwargs=True))
    for il, layer in enumerate(text.layers[:n_layer]):
        hooks += [router.register_forward_hook(_Margin(margins, il, k)) for router, k in _routers(layer)]
        if il in ffn_blocks:
            hooks.append(layer.mixer.register_forward_hook(_Output(ffn_out, il)))
        if il in recurrent:
            rec = _Recurrent(cache.k[il].float().reshape(-1, target.hparams.n_embd), mixed, il)  # (n_cells, n_embd)
            mixer = _recurrent_mixer(layer)
            hooks.append(mixer.register_forward_pre_hook(rec.before, with_kwargs=True))
            hooks.append(mixer.register_forward_hook(rec.after))
    indexers = dense_indexers(model)  # DeepSeek-V3.2's: every cell, as llama.cpp below index_topk cells
    for module, dense in indexers:
        module.forward = dense
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
        for module, _ in indexers:
            del module.forward
    if len(taps) != n_layer + 1:
        raise RuntimeError(f"{target.source.path}: tapped {len(taps)} layer inputs, expected {n_layer + 1}")
    rows = slice(None) if has_outputs else slice(0, 0)
    logits = out.logits[0][rows]  # (n_outputs, n_vocab)
    records = _records_of(target, tokens, taps, rows, ffn_out, margins, _final_norm(text)(taps[n_layer][rows]))
    records += (Named(names.RESULT_OUTPUT, logits),)
    after = _cache_after(cache, positions, past, n_layer, mixed, kv_less)
    return HfPass(tuple(taps), logits, after, records)


def _past_of(cache: KvCache, n_layer: int, placeholders: frozenset[int], device: torch.device) -> Any:
    """The flow's cache as transformers' DynamicCache: each attention layer's cells in its layout, and
    a blank of the cells' length for a recurrent or KV-less layer (`placeholders`: transformers sizes
    the mask by layer 0's cache length)."""
    from transformers import DynamicCache

    past = DynamicCache()
    for il in range(n_layer):
        if not cache.k[il].shape[0]:
            continue
        if il in placeholders:
            n_cells = cache.positions.shape[0]  # the attention layers' cells (a kept state's history is longer)
            blank = torch.zeros((1, 1, n_cells, 1), device=device)  # (1, 1, n_cells, 1)
            past.update(blank, blank, il)
        else:
            past.update(_hf_layout(cache.k[il]), _hf_layout(cache.v[il]), il)
    return past


def _records_of(
    target: HfTarget,
    tokens: torch.Tensor,
    taps: list[torch.Tensor],
    rows: slice,
    ffn_out: dict[int, torch.Tensor],
    margins: dict[int, torch.Tensor],
    norm: torch.Tensor,
) -> tuple[Named, ...]:
    """The pass's records, named as the arch's graph names them: the embeddings, each layer's input
    and output (an FFN block's `l_out`, a MoE router's margin), the final norm's rows (`norm`)."""
    n_layer = target.hparams.n_layer
    last_rows = slice(None) if target.hparams.arch in ALL_ROWS_LAST_LAYER else rows
    records = [Named(EMBD_NAMES.get(target.hparams.arch, names.TARGET_EMBD), taps[0])]
    if target.hparams.arch in RAW_EMBD:
        records.append(Named(names.TARGET_EMBD, target.token_embd[tokens]))  # (n_tokens, n_embd)
    for il in range(n_layer):
        l_out = taps[il + 1] if il < n_layer - 1 else taps[n_layer][last_rows]
        records += [
            Named(names.layer_name(names.LAYER_INP, il), taps[il]),
            Named(layer_out_name(target.hparams.arch, il), l_out),
        ]
        if il in ffn_out:  # the arch's graph names the FFN block's output `l_out`
            records.append(
                Named(names.layer_name(names.L_OUT, il), ffn_out[il] if il < n_layer - 1 else ffn_out[il][last_rows])
            )
        if il in margins:  # the last layer's margin keeps the rows its l_out keeps
            margin = margins[il] if il < n_layer - 1 else margins[il][last_rows]  # (n_rows, 2)
            records.append(Named(_margin_name(target.hparams.arch, il), margin))
    return (*records, Named(names.RESULT_NORM, norm))


def kept_rejected_state(target: HfTarget, cache: KvCache, n_past: int) -> KvCache | None:
    """The cache a hybrid target holds after a verify whose rows at positions >= `n_past` were
    rejected, when its memory rolls the attention cells back but not the recurrent state (a
    port's bug; patches/llama.cpp 0004 `recurrent-keep-rejected`): attention layers truncated,
    each recurrent layer's history whole. Its recurrent histories are longer than `positions`,
    so it serves one forward (`kept_rejected_candidates`) and is never truncated. None where the
    target has no recurrent layer or nothing was rejected."""
    recurrent = _recurrent_layers(target.model)
    if not recurrent or not bool((cache.positions >= n_past).any()):
        return None
    rolled = truncated(cache, n_past)

    def kept(cut: tuple[torch.Tensor, ...], whole: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(whole[il] if il in recurrent else t for il, t in enumerate(cut))

    return KvCache(positions=rolled.positions, k=kept(rolled.k, cache.k), v=kept(rolled.v, cache.v))


def kept_rejected_candidates(
    target: HfTarget, tokens: torch.Tensor, positions: torch.Tensor, kept: KvCache
) -> tuple[Named, ...]:
    """This verify run on the `kept` state: `l_out-<il>@recurrent=kept_rejected` of the first
    recurrent layer and every layer after it (the ones the kept state reaches; under the arch's
    name of a layer's output, layer_out_name), the candidates compare's `wrong_source` tests the
    run against (names.HYP_RECURRENT_KEPT)."""
    first = min(_recurrent_layers(target.model))
    ran = forward_hf(target, tokens, positions, kept, has_outputs=True)
    wanted = {  # the layer's output, and an FFN block's output where the arch's graph names it l_out
        name
        for il in range(first, target.hparams.n_layer)
        for name in (layer_out_name(target.hparams.arch, il), names.layer_name(names.L_OUT, il))
    }
    return tuple(
        Named(names.candidate_name(r.name, names.HYP_RECURRENT_KEPT), r.array) for r in ran.records if r.name in wanted
    )


def _kv_less_layers(model: Any) -> frozenset[int]:
    """The layers that keep no KV of their own: Gemma 4's `num_kv_shared_layers`, which attend over
    an earlier layer's KV (transformers passes them that layer's keys and values within the
    forward, as llama.cpp's gemma4 graph reads that layer's cache), and Nemotron-H's MLP and MoE
    blocks, which have no token mixer."""
    modes = getattr(model.config.get_text_config(), "kv_sharing_modes", None) or ()
    return frozenset(il for il, mode in enumerate(modes) if mode == KV_REUSE) | _mixerless_layers(model)


def _mixerless_layers(model: Any) -> frozenset[int]:
    """Nemotron-H's MLP and MoE blocks, by the config's layer_types: no token mixer, no KV."""
    types = getattr(model.config.get_text_config(), "layer_types", None) or ()
    return frozenset(il for il, t in enumerate(types) if t in MIXERLESS)


def final_norm(target: HfTarget) -> Any:
    """The target's final norm module (what its graph's `h_nextn` is the output of)."""
    return _final_norm(target.model.get_decoder())


def _final_norm(text: Any) -> Any:
    """The decoder's final norm: `norm`, Nemotron-H's `norm_f`."""
    return text.norm if hasattr(text, "norm") else text.norm_f


def _recurrent_mixer(layer: Any) -> Any:
    """A recurrent layer's token mixer: Qwen3.5's `linear_attn`, Nemotron-H's Mamba2 `mixer`, Ling 3.0's
    KDA `self_attn` (its layers name either mixer so)."""
    for name in ("linear_attn", "mixer"):
        if hasattr(layer, name):
            return getattr(layer, name)
    return layer.self_attn


def _recurrent_layers(model: Any) -> frozenset[int]:
    """The layers whose token mixer is recurrent (Qwen3.5's gated delta-net), by the config's
    layer_types."""
    types = getattr(model.config.get_text_config(), "layer_types", None) or ()
    return frozenset(il for il, t in enumerate(types) if t == LINEAR_ATTENTION)
