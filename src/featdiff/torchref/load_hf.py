"""Build the reference's `Target` / `Draft` records from Hugging Face directories
(`config.json` + `*.safetensors`).

The drafter is in the DFlash reference layout: `fc`, `hidden_norm`, `layers.*`, `norm`, optional
`embed_tokens`/`lm_head`, and `dflash_config.target_layer_ids` naming layer *outputs*; GGUF ids
name layer inputs, so the reference stores `hf + 1` (what the upstream converter writes).
HF q/k rows are in rotate-half order, so every HF stack runs NeoX RoPE (a drafter saying
`rope_is_neox_style: false` has its q/k rows permuted into that order, as the converter does). A DSpark checkpoint adds
`markov_head.*`, `confidence_head.proj.*` and optionally `d2t`, stored as offsets (target id =
d2t[i] + i; the record holds the absolute ids, as the GGUF does).
"""

from __future__ import annotations

import json
from dataclasses import replace
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.kinds.dflash.modelled import (
    MASK_EMBEDDING_FILE,
    HF_ATTN_SINKS,
    HF_FC_SCALE,
    HF_ROPE_IS_NEOX,
    LAYER_ATTN_SINKS,
    KEY_ATTN_VALUE_SCALE,
    KEY_EMBEDDING_SCALE,
    KEY_SLIDING_WINDOW,
    KEY_SLIDING_WINDOW_PATTERN,
    TABLE,
    converter_keys,
    refusal,
    unmodelled_in_hf,
    unread_hf_keys,
)
from featdiff.torchref.dflash import dflash2
from featdiff.kinds.problems import d2t_problems
from featdiff.kinds.dflash.dspark import dspark_problems
from featdiff.kinds.dflash.checks import log_snr_problems
from featdiff.torchref.rope_params import hf_rope
from featdiff.torchref.weights import (
    DSpark,
    Draft,
    Hparams,
    Layer,
    LayerStream,
    LogSnr,
    Source,
    Target,
    aligned,
    layer_from_tensors,
)

_FLAG_KEY = f"{names.HF_DFLASH_CONFIG}.{names.HF_LOG_SNR}"
# GGUF name -> HF name of the DSpark tensors (upstream conversion/qwen.py DSparkModel)
_HF_DSPARK = {
    names.T_MARKOV_W1: names.HF_MARKOV_W1,
    names.T_MARKOV_W2: names.HF_MARKOV_W2,
    names.T_MARKOV_W2_SCALE: names.HF_MARKOV_W2_SCALE,
    names.T_CONF_PROJ_W: names.HF_CONF_PROJ_W,
    names.T_CONF_PROJ_B: names.HF_CONF_PROJ_B,
    names.T_D2T: names.HF_D2T,
}
MARKOV_HEAD_TYPE = "markov_head_type"  # config.json; the converter and llama.cpp run "vanilla" only
MARKOV_VANILLA = "vanilla"
# a drafter's per-layer tensors the converter permutes for an interleaved-RoPE checkpoint
# (DFlashModel._ROPE_PERMUTE_SUFFIXES), by GGUF name
_ROPE_PERMUTED = ("attn_q", "attn_k", "attn_q_norm", "attn_k_norm")
DFLASH_CAUSAL = "causal"  # dflash_config's spelling of the top-level is_causal (the converter reads both)
# DSpark checkpoints' config.json schemas (conversion/qwen.py DSparkModel, registered for these)
HF_ARCHITECTURES = "architectures"
DSPARK_ARCHITECTURES = (
    "Qwen3DSparkModel",
    "DSparkDraftModel",
    "DSparkSpeculator",
    "Lfm2DSparkDraftModel",
    "LingDSparkModel",
)
HF_AUX_LAYER_IDS = "aux_hidden_state_layer_ids"  # EAGLE3 style: ids of layer inputs (GGUF ids)
HF_LAYER_CONFIG = "transformer_layer_config"  # EAGLE3 style: the stack's sizes
# dflash_config's fields this loader reads besides those featdiff.kinds.dflash.modelled's table names
DFLASH_CONFIG_READ = (
    names.HF_TARGET_LAYER_IDS,
    names.HF_MASK_TOKEN_ID,
    names.HF_BLOCK_SIZE,
    names.HF_LOG_SNR,
    names.HF_MIN_LOG_SNR,
    names.HF_MAX_LOG_SNR,
    DFLASH_CAUSAL,
)


def target_from_hf(path: Path, dtype: torch.dtype, device: torch.device) -> Target:
    """A qwen3 or llama target from its HF directory."""
    config = read_config(path)
    arch = config.get(names.HF_MODEL_TYPE)
    if arch not in names.TARGET_ARCHS:
        raise InputError(
            f"{path / names.HF_CONFIG}: model_type {arch!r}, the reference runs targets of "
            f"{names.TARGET_ARCHS}; pass a qwen3 or llama checkpoint"
        )
    w = _weights(path, dtype, device)
    token_embd = _required(w, path, names.HF_TARGET_PREFIX + names.HF_EMBED_TOKENS)
    tied = config.get(names.HF_TIE_EMBEDDINGS, False) or names.HF_LM_HEAD not in w
    hp = _hparams(path, config, arch)
    layer_prefix = names.HF_TARGET_PREFIX + names.HF_LAYER_PREFIX
    return Target(
        source=Source(Path(path), is_gguf=False),
        hparams=hp,
        token_embd=token_embd,
        output_norm=_required(w, path, names.HF_TARGET_PREFIX + names.HF_NORM),
        output=token_embd if tied else _required(w, path, names.HF_LM_HEAD),
        layers=_layers(w, path, layer_prefix, hp.n_layer),
    )


def draft_from_hf(path: Path, dtype: torch.dtype, device: torch.device) -> Draft:
    """A DFlash (or DSpark) drafter from its HF directory, its config.json read as the converter
    reads it (`converter_config`: DSpark's flat and EAGLE3-style schemas too); InputError for an
    inconsistent log-SNR or DSpark checkpoint."""
    config = converter_config(read_config(path))
    dflash = config.get(names.HF_DFLASH_CONFIG)
    if not isinstance(dflash, dict) or names.HF_TARGET_LAYER_IDS not in dflash:
        raise InputError(
            f"{path / names.HF_CONFIG}: no {names.HF_DFLASH_CONFIG}.{names.HF_TARGET_LAYER_IDS}; "
            "pass a DFlash drafter checkpoint as --model"
        )
    w = _weights(path, dtype, device)
    unmodelled = unmodelled_in_hf(config, w, (f.name for f in Path(path).iterdir()))
    if unmodelled:
        raise InputError(refusal(str(path), unmodelled))
    unread = (*unread_hf_keys(config), *unread_dflash_fields(dflash))
    if unread:
        raise InputError(
            f"{path / names.HF_CONFIG}: {', '.join(unread)}: no field the converter or featdiff's reference reads "
            "(a comparison would silently leave it out); drop it, or model it or list it as irrelevant with its "
            "reason in src/featdiff/kinds/dflash/modelled.py (HF_IRRELEVANT_KEYS)"
        )
    keys = converter_keys(config)  # what the converter would write: the GGUF's view of this config
    hp = replace(
        _hparams(path, config, names.ARCH_DFLASH),
        attn_value_scale=keys.get(KEY_ATTN_VALUE_SCALE, 0.0),
        n_swa=keys.get(KEY_SLIDING_WINDOW, 0),
        swa_layers=tuple(keys.get(KEY_SLIDING_WINDOW_PATTERN, ())),
    )
    token_embd = w.get(names.HF_EMBED_TOKENS)
    output = w.get(names.HF_LM_HEAD)
    mask_token_id = int(_setting(path, config, dflash, names.HF_MASK_TOKEN_ID))
    mask_row = _mask_row(path, dflash, hp, dtype, device)
    # with a mask row the converter writes the target's head as output (never the patched table)
    head = output if output is not None or mask_row is not None else token_embd
    causal = config.get(names.HF_IS_CAUSAL, dflash.get(DFLASH_CAUSAL, False))
    d2t = _d2t(
        path, config, w, hp.n_vocab, head.shape[0] if head is not None else hp.n_vocab
    )  # first: a missing d2t says more than markov_w2's rows
    return Draft(
        source=Source(Path(path), is_gguf=False),
        hparams=hp,
        target_layers=tuple(int(i) + 1 for i in dflash[names.HF_TARGET_LAYER_IDS]),  # gguf = hf + 1
        block_size=int(_setting(path, config, dflash, names.HF_BLOCK_SIZE)),
        mask_token_id=mask_token_id,
        fc=_required(w, path, names.HF_FC),
        enc_norm=_required(w, path, names.HF_HIDDEN_NORM),
        output_norm=_required(w, path, names.HF_NORM),
        token_embd=token_embd,
        output=head,
        layers=_layers(w, path, names.HF_LAYER_PREFIX, hp.n_layer, _interleaved_head(path, config, hp)),
        log_snr=_log_snr(path, dflash, w),
        dspark=_dspark(path, config, w, hp),
        causal=bool(causal),
        d2t=d2t,
        embedding_scale=keys.get(KEY_EMBEDDING_SCALE, 0.0),
        dflash2=_dflash2(path, config, dflash, keys, w, hp),
        fc_scale=_fc_scale(w),
        mask_row=mask_row,
    )


def unread_dflash_fields(dflash: Mapping[str, Any]) -> tuple[str, ...]:
    """`dflash_config`'s fields that neither the converter (featdiff.kinds.dflash.modelled's table, which names
    each field a GGUF key is written from) nor this loader reads, as `dflash_config.<field>`."""
    table = {h.split(".", 1)[1] for e in TABLE for h in e.hf if h.startswith(f"{names.HF_DFLASH_CONFIG}.")}
    known = table | set(DFLASH_CONFIG_READ)
    return tuple(f"{names.HF_DFLASH_CONFIG}.{k}" for k in dflash if k not in known)


def _mask_row(
    path: Path, dflash: dict[str, Any], hp: Hparams, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """The drafter's own mask row `(n_embd,)` from `mask_embedding.pt` ({mask_token_id, embedding}),
    checked as the converter checks it (conversion/qwen.py DFlashModel.generate_extra_tensors); None
    without the file."""
    file = path / MASK_EMBEDDING_FILE
    if not file.is_file():
        return None
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a pickle torch refuses, a truncated file: any of torch's errors
        raise InputError(
            f"{file}: not a torch file of a mask row ({type(e).__name__}); re-save it with torch.save"
        ) from e
    if not isinstance(saved, dict) or not {"mask_token_id", "embedding"} <= saved.keys():
        raise InputError(f"{file}: expected a dict with mask_token_id and embedding; re-save the drafter's mask row")
    if int(saved["mask_token_id"]) != dflash.get(names.HF_MASK_TOKEN_ID):
        raise InputError(
            f"{file}: mask_token_id {int(saved['mask_token_id'])} but config.json's "
            f"{names.HF_DFLASH_CONFIG}.{names.HF_MASK_TOKEN_ID} is {dflash.get(names.HF_MASK_TOKEN_ID)}; "
            "they must agree (the converter refuses it too)"
        )
    row = torch.as_tensor(saved["embedding"])
    if tuple(row.shape) != (hp.n_embd,):
        raise InputError(f"{file}: embedding of shape {tuple(row.shape)}, the drafter's width is {hp.n_embd}")
    return row.to(dtype=dtype, device=device)


def converter_config(config: dict[str, Any]) -> dict[str, Any]:
    """A drafter's config.json as the pinned converter reads it: a DSpark checkpoint's
    (`architectures[0]` one of DSPARK_ARCHITECTURES) normalized as conversion/qwen.py
    DSparkModel.__init__ does, any other unchanged.

    * `sample_from_anchor`: as stated, else true unless the config is EAGLE3-style
      (`transformer_layer_config` or `aux_hidden_state_layer_ids`: a 1+N bonus-anchor block);
    * `transformer_layer_config`'s fields (the stack's sizes) override the top level's;
    * without a `dflash_config`, one is made: from `aux_hidden_state_layer_ids` (ids of layer
      inputs, as the GGUF's: hf = id - 1) and `mask_token_id`, else from the DFlash lineage's flat
      `target_layer_ids` and `mask_token_id`.
    """
    archs = config.get(HF_ARCHITECTURES) or [None]
    if archs[0] not in DSPARK_ARCHITECTURES:
        return config
    bonus_style = HF_LAYER_CONFIG in config or HF_AUX_LAYER_IDS in config
    sample_from_anchor = config.get(names.HF_SAMPLE_FROM_ANCHOR, not bonus_style)
    out = {**config, **(config.get(HF_LAYER_CONFIG) or {})}
    out[names.HF_SAMPLE_FROM_ANCHOR] = sample_from_anchor
    if HF_AUX_LAYER_IDS in out:
        made = {
            names.HF_MASK_TOKEN_ID: out.get(names.HF_MASK_TOKEN_ID),
            names.HF_TARGET_LAYER_IDS: [int(i) - 1 for i in out[HF_AUX_LAYER_IDS]],
        }
    else:
        made = {k: out[k] for k in (names.HF_TARGET_LAYER_IDS, names.HF_MASK_TOKEN_ID) if k in out}
    out.setdefault(names.HF_DFLASH_CONFIG, {k: v for k, v in made.items() if v is not None})
    return out


def _fc_scale(w: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """fc's per-tensor scale `(1,)`: the checkpoint's `fc.weight_scale_2` (ModelOpt), which the
    converter writes as `fc.scale` (conversion/base.py _repack_nvfp4); None without one."""
    if HF_FC_SCALE not in w:
        return None
    return w[HF_FC_SCALE].reshape(1).to(torch.float32)  # (1,)


def _dflash2(
    path: Path,
    config: dict[str, Any],
    dflash: dict[str, Any],
    keys: dict[str, Any],
    w: Mapping[str, torch.Tensor],
    hp: Hparams,
) -> dflash2.DFlash2 | None:
    """DFlash2's convs and selector under their HF names (dflash2.py); None without the selector."""
    block_size = int(_setting(path, config, dflash, names.HF_BLOCK_SIZE))
    tensor = partial(_hf_tensor, w)
    return dflash2.of_tensors(keys, tensor, hp.n_layer, hp.n_embd, block_size, str(path))


def _hf_tensor(w: Mapping[str, torch.Tensor], gguf_name: str) -> torch.Tensor | None:
    return w.get(dflash2.hf_name(gguf_name, names.HF_LAYER_PREFIX))


def read_config(path: Path) -> dict[str, Any]:
    f = Path(path) / names.HF_CONFIG
    try:
        config = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise InputError(
            f"{f}: unreadable ({e}); a Hugging Face directory needs config.json and *.safetensors"
        ) from None
    if not isinstance(config, dict):
        raise InputError(f"{f}: expected a JSON object, found {type(config).__name__}; pass a Hugging Face checkpoint")
    return config


class _Weights(Mapping[str, torch.Tensor]):
    """A HF directory's tensors by name, each read from its safetensors file when looked up
    (in the compute dtype; integer tensors such as d2t stay int) and not kept."""

    def __init__(self, files: dict[str, Path], dtype: torch.dtype, device: torch.device) -> None:
        self._files = files  # tensor name -> the safetensors file holding it
        self._dtype = dtype
        self._device = device

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self._files[name]), "pt") as st:  # opened per read: no map outlives it
            t = st.get_tensor(name)
        return t.to(dtype=self._dtype if t.is_floating_point() else t.dtype, device=self._device)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _weights(path: Path, dtype: torch.dtype, device: torch.device) -> _Weights:
    files = sorted(Path(path).glob(names.HF_WEIGHTS_GLOB))
    if not files:
        raise InputError(f"{path}: no {names.HF_WEIGHTS_GLOB} files; a Hugging Face directory needs its weights")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            where.update({k: f for k in st.keys()})
    return _Weights(where, dtype, device)


def _required(w: Mapping[str, torch.Tensor], path: Path, name: str) -> torch.Tensor:
    if name not in w:
        raise InputError(f"{path}: tensor {name!r} is missing from the safetensors; pass a complete checkpoint")
    return w[name]


def _setting(path: Path, config: dict[str, Any], dflash: dict[str, Any], key: str) -> Any:
    """A DFlash setting from `dflash_config`, else the top level of config.json."""
    if key in dflash:
        return dflash[key]
    if key in config:
        return config[key]
    raise InputError(
        f"{path / names.HF_CONFIG}: no {key!r} in {names.HF_DFLASH_CONFIG} or at the top level; add the trained value"
    )


def _config_value(path: Path, config: dict[str, Any], key: str, default: Any = None) -> Any:
    if key in config:
        return config[key]
    if default is None:
        raise InputError(f"{path / names.HF_CONFIG}: {key!r} is missing; pass a complete config.json")
    return default


def _hparams(path: Path, config: dict[str, Any], arch: str) -> Hparams:
    n_embd = int(_config_value(path, config, names.HF_HIDDEN_SIZE))
    n_head = int(_config_value(path, config, names.HF_NUM_HEADS))
    n_embd_head = int(_config_value(path, config, names.HF_HEAD_DIM, n_embd // n_head))
    base, scaling, n_rot = hf_rope(path / names.HF_CONFIG, config, n_embd_head)
    return Hparams(
        arch=arch,
        n_layer=int(_config_value(path, config, names.HF_NUM_LAYERS)),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(_config_value(path, config, names.HF_NUM_KV_HEADS, n_head)),
        n_embd_head=n_embd_head,
        n_ff=int(_config_value(path, config, names.HF_INTERMEDIATE_SIZE)),
        n_vocab=int(_config_value(path, config, names.HF_VOCAB_SIZE)),
        rms_eps=float(_config_value(path, config, names.HF_RMS_EPS)),
        rope_base=float(base if base is not None else names.ROPE_FREQ_BASE_DEFAULT),
        rope_type="neox",
        rope_scaling=scaling,
        n_rot=n_rot,
    )


def neox_rows(t: torch.Tensor, n_embd_head: int) -> torch.Tensor:
    """An interleaved-RoPE checkpoint's q/k projection or norm with its rows in NeoX order, as the
    converter permutes them (conversion/qwen.py DFlashModel.modify_tensors): per head, the even
    dims, then the odd. RoPE of pair (2i, 2i+1) becomes NeoX RoPE of pair (i, i + d/2), and q.k
    is unchanged, as q and k are permuted alike."""
    shape = t.shape
    pairs = t.reshape(-1, n_embd_head // 2, 2, *shape[1:])  # (n_head, n_embd_head / 2, 2, ...)
    return pairs.transpose(1, 2).reshape(shape)  # (n_head * n_embd_head, ...): evens, then odds


def _layer(w: Mapping[str, torch.Tensor], prefix: str, interleaved_head: int, il: int) -> Layer:
    """Layer `il` in the compute dtype, read from the safetensors now; `interleaved_head` (the
    head size, 0: none): q/k rows permuted into NeoX order (`neox_rows`)."""
    p = prefix.format(il=il)
    t = {k: w.get(f"{p}{hf}.weight") for k, hf in names.GGUF_TO_HF_LAYER.items()}
    if interleaved_head:
        t.update({k: neox_rows(x, interleaved_head) for k in _ROPE_PERMUTED if (x := t[k]) is not None})
    sinks = w.get(f"{p}{HF_ATTN_SINKS}")  # (n_head,): the converter writes it as attn_sinks.weight, F32
    t[LAYER_ATTN_SINKS] = sinks.to(torch.float32) if sinks is not None else None
    return layer_from_tensors(t)


def _layers(
    w: Mapping[str, torch.Tensor], path: Path, prefix: str, n_layer: int, interleaved_head: int = 0
) -> LayerStream:
    """The layers, streamed (weights.LayerStream); a missing tensor is an InputError now, at load."""
    for il in range(n_layer):
        for k, hf in names.GGUF_TO_HF_LAYER.items():
            name = f"{prefix.format(il=il)}{hf}.weight"
            if name not in w and k not in names.GGUF_OPTIONAL_LAYER:
                _required(w, path, name)
    return LayerStream(n_layer, partial(_layer, w, prefix, interleaved_head))


def _interleaved_head(path: Path, config: dict[str, Any], hp: Hparams) -> int:
    """The head size whose q/k rows the converter permutes (`rope_is_neox_style: false`), else 0;
    InputError for partial rotary, where the converter's whole-head permutation does not pair the
    rotated dims as the checkpoint's interleaved RoPE does."""
    if config.get(HF_ROPE_IS_NEOX, True) is not False:
        return 0
    if hp.n_rot is not None and hp.n_rot != hp.n_embd_head:
        found = f"config.json {HF_ROPE_IS_NEOX} = false with partial rotary ({hp.n_rot} of {hp.n_embd_head} dims)"
        raise InputError(refusal(str(path), (found,)))
    return hp.n_embd_head


def _log_snr(path: Path, dflash: dict[str, Any], w: Mapping[str, torch.Tensor]) -> LogSnr | None:
    flag = bool(dflash.get(names.HF_LOG_SNR, False))
    lo, hi = dflash.get(names.HF_MIN_LOG_SNR), dflash.get(names.HF_MAX_LOG_SNR)
    problems = log_snr_problems(_FLAG_KEY, flag, lo, hi, set(w))
    if problems:
        raise InputError(f"{path}: " + "; ".join(problems))
    if not flag:
        return None
    t = [w[name] for name in names.LOG_SNR_TENSORS]  # same tensor names in HF and GGUF
    assert lo is not None and hi is not None  # log_snr_problems: a flagged drafter has both
    return LogSnr(min_log_snr=float(lo), max_log_snr=float(hi), fc1_w=t[0], fc1_b=t[1], fc2_w=t[2], fc2_b=t[3])


def _dspark(path: Path, config: dict[str, Any], w: Mapping[str, torch.Tensor], hp: Hparams) -> DSpark | None:
    """The Markov and confidence heads; None for a checkpoint without `markov_head.markov_w1`."""
    shapes = {t: tuple(w[hf].shape) for t, hf in _HF_DSPARK.items() if hf in w}
    problems = dspark_problems(shapes, hp.n_embd, hp.n_vocab, _HF_DSPARK)
    kind = config.get(MARKOV_HEAD_TYPE, MARKOV_VANILLA)
    if names.HF_MARKOV_W1 in w and kind != MARKOV_VANILLA:
        problems.append(
            f"{MARKOV_HEAD_TYPE} = {kind!r}, the converter and llama.cpp run {MARKOV_VANILLA!r} only; "
            "retrain or convert with a vanilla Markov head"
        )
    if problems:
        raise InputError(f"{path}: " + "; ".join(problems))
    if names.HF_MARKOV_W1 not in w:
        return None
    t = {name: aligned(w.get(hf)) for name, hf in _HF_DSPARK.items() if name != names.T_D2T}
    return DSpark.of_tensors(t, bool(config.get(names.HF_SAMPLE_FROM_ANCHOR, True)))  # absent: anchor-first


def _d2t(
    path: Path, config: dict[str, Any], w: Mapping[str, torch.Tensor], n_vocab: int, head_rows: int
) -> torch.Tensor | None:
    """The reduced vocabulary's absolute target ids, `(n_vocab_draft,)` int64, from HF offsets."""
    n_vocab_draft = config.get(names.HF_DRAFT_VOCAB_SIZE) or n_vocab
    if names.HF_D2T not in w:
        if n_vocab_draft < n_vocab:
            raise InputError(
                f"{path / names.HF_CONFIG}: {names.HF_DRAFT_VOCAB_SIZE} = {n_vocab_draft} < "
                f"vocab_size {n_vocab} but there is no {names.HF_D2T}; add the checkpoint's d2t table"
            )
        return None
    offsets = w[names.HF_D2T].cpu().numpy().astype(np.int64).reshape(-1)  # (n_vocab_draft,), cast as the converter does
    ids = offsets + np.arange(offsets.size, dtype=np.int64)  # HF offsets: target id = d2t[i] + i
    problems = d2t_problems(ids, n_vocab, head_rows)
    if names.HF_DRAFT_VOCAB_SIZE in config and offsets.size != n_vocab_draft:
        problems.append(
            f"{names.HF_D2T} has {offsets.size} entries but {names.HF_DRAFT_VOCAB_SIZE} = "
            f"{n_vocab_draft}; save the d2t table of this head"
        )
    if problems:
        raise InputError(f"{path}: " + "; ".join(problems))
    return torch.from_numpy(ids).to(w[names.HF_D2T].device)
