"""Build the reference's `Target` / `Draft` records from GGUF files (through featdiff.core.gguf_reader).

llama-arch GGUF q/k rows are permuted for ggml's normal (interleaved) RoPE by the upstream
converter, so a llama target from GGUF runs with `rope_type="normal"`; qwen3 and dflash use NeoX.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from featdiff.core import names
from featdiff.kinds.dflash.dspark import DSPARK_FILE_TENSORS, dspark_problems
from featdiff.kinds.problems import d2t_problems
from featdiff.kinds.dflash.checks import log_snr_problems
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import GgufModel, array_from_tensor, array_len, meta, read_gguf_weights, release_pages
from featdiff.kinds.unmodelled import gguf_unmodelled
from featdiff.llama import ggml_dequant
from featdiff.kinds.dflash.modelled import (
    KEY_ATTN_VALUE_SCALE,
    KEY_EMBEDDING_SCALE,
    KEY_SLIDING_WINDOW,
    KEY_SLIDING_WINDOW_PATTERN,
    LAYER_ATTN_SINKS,
    T_FC_SCALE,
    refusal,
)
from featdiff.core.blocks import DEFAULT_BLOCK_SIZE
from featdiff.torchref.dflash import dflash2
from featdiff.torchref import rope_params
from featdiff.torchref.rope_params import RopeScaling, llama_scaling
from featdiff.torchref.weights import (
    DSpark,
    Draft,
    Hparams,
    Layer,
    LayerStream,
    LogSnr,
    RopeType,
    Source,
    Target,
    aligned,
    layer_from_tensors,
)


def target_from_gguf(path: Path, dtype: torch.dtype, device: torch.device, llama_dir: Path | None = None) -> Target:
    """A qwen3 or llama target from its GGUF; quantized weights dequantized by the build
    `llama_dir`'s ggml when one is named (gguf_reader.read_gguf_weights)."""
    g = read_gguf_weights(path, llama_dir, ggml_dequant.load)
    if g.arch not in names.TARGET_ARCHS:
        raise InputError(
            f"{path}: architecture {g.arch!r}, the reference runs targets of {names.TARGET_ARCHS}; "
            "pass a qwen3 or llama target"
        )
    rope_type: RopeType = "normal" if g.arch == names.ARCH_LLAMA else "neox"
    n_vocab = g.tensors[names.T_TOKEN_EMBD].ne[1] if names.T_TOKEN_EMBD in g.tensors else 0
    hp = _hparams(g, rope_type, n_vocab)
    token_embd = _tensor(g, names.T_TOKEN_EMBD, dtype, device)
    has_head = names.T_OUTPUT in g.tensors
    return Target(
        source=Source(Path(path), is_gguf=True, dequantized_by=g.dequantized_by),
        hparams=hp,
        token_embd=token_embd,
        output_norm=_tensor(g, names.T_OUTPUT_NORM, dtype, device),
        output=_tensor(g, names.T_OUTPUT, dtype, device) if has_head else token_embd,
        layers=_layers(g, hp.n_layer, dtype, device),
    )


def draft_from_gguf(path: Path, dtype: torch.dtype, device: torch.device, llama_dir: Path | None = None) -> Draft:
    """A DFlash (or DSpark) drafter from its GGUF (dequantized as `target_from_gguf` does);
    InputError for an inconsistent log-SNR or DSpark export, or a `d2t` llama.cpp cannot use."""
    g = read_gguf_weights(path, llama_dir, ggml_dequant.load)
    if g.arch != names.ARCH_DFLASH:
        raise InputError(
            f"{path}: architecture {g.arch!r}, expected {names.ARCH_DFLASH!r}; pass the drafter as --model"
        )
    unmodelled = gguf_unmodelled(g)
    if unmodelled:
        raise InputError(refusal(str(path), unmodelled))
    token_embd = _optional(g, names.T_TOKEN_EMBD, dtype, device)
    output = _optional(g, names.T_OUTPUT, dtype, device)
    hp = replace(
        _hparams(g, "neox", _draft_n_vocab(g)), attn_value_scale=float(meta(g, KEY_ATTN_VALUE_SCALE, 0.0)), **_swa(g)
    )
    head = output if output is not None else token_embd
    return Draft(
        source=Source(Path(path), is_gguf=True, dequantized_by=g.dequantized_by),
        hparams=hp,
        target_layers=tuple(int(i) for i in meta(g, names.KEY_TARGET_LAYERS)),
        block_size=int(meta(g, names.KEY_BLOCK_SIZE, DEFAULT_BLOCK_SIZE)),
        mask_token_id=int(meta(g, names.KEY_MASK_TOKEN)),
        fc=_tensor(g, names.T_FC, dtype, device),
        enc_norm=_tensor(g, names.T_ENC_NORM, dtype, device),
        output_norm=_tensor(g, names.T_OUTPUT_NORM, dtype, device),
        token_embd=token_embd,
        output=head,  # llama.cpp: the head falls back to the drafter's own embeddings
        layers=_layers(g, hp.n_layer, dtype, device),
        log_snr=_log_snr(g, dtype, device),
        dspark=_dspark(g, hp, dtype, device),
        causal=bool(meta(g, names.KEY_CAUSAL, False)),
        d2t=_d2t(g, hp.n_vocab, head.shape[0] if head is not None else hp.n_vocab, device),
        embedding_scale=float(meta(g, KEY_EMBEDDING_SCALE, 0.0)),
        dflash2=_dflash2(g, hp, dtype, device),
        fc_scale=_optional(g, T_FC_SCALE, dtype, device),
    )


def _swa(g: GgufModel) -> dict[str, Any]:
    """Hparams' sliding window, as llama_model_dflash::load_arch_hparams reads it: a window > 0
    requires the per-layer pattern (a bool per layer)."""
    n_swa = int(meta(g, KEY_SLIDING_WINDOW, 0))
    if n_swa <= 0:
        return {}
    pattern = meta(g, KEY_SLIDING_WINDOW_PATTERN, None)
    n_layer = int(meta(g, names.KEY_BLOCK_COUNT))
    if pattern is None or len(pattern) != n_layer:
        found = "none" if pattern is None else f"{len(pattern)} entries"
        raise InputError(
            f"{g.path}: {KEY_SLIDING_WINDOW} = {n_swa} needs {KEY_SLIDING_WINDOW_PATTERN} with one bool per "
            f"layer ({n_layer}), found {found}; re-export the drafter with its layer pattern"
        )
    return {"n_swa": n_swa, "swa_layers": tuple(bool(x) for x in pattern)}


def _dflash2(g: GgufModel, hp: Hparams, dtype: torch.dtype, device: torch.device) -> dflash2.DFlash2 | None:
    """DFlash2's convs and selector (dflash2.py); None for a drafter without `selector_hidden`."""
    keys = {k: meta(g, k, None) for k in dflash2.KEYS}
    block_size = int(meta(g, names.KEY_BLOCK_SIZE, DEFAULT_BLOCK_SIZE))
    tensor = partial(_optional, g, dtype=dtype, device=device)
    return dflash2.of_tensors(keys, tensor, hp.n_layer, hp.n_embd, block_size, str(g.path))


def _hparams(g: GgufModel, rope_type: RopeType, n_vocab: int) -> Hparams:
    n_embd, n_head = int(meta(g, names.KEY_EMBEDDING_LENGTH)), int(meta(g, names.KEY_HEAD_COUNT))
    n_embd_head = int(meta(g, names.KEY_KEY_LENGTH, n_embd // n_head))
    n_rot = int(meta(g, names.KEY_ROPE_DIMS, n_embd_head))
    if not 0 < n_rot <= n_embd_head or n_rot % 2:
        raise InputError(
            f"{g.path}: {names.KEY_ROPE_DIMS.format(arch=g.arch)} = {n_rot} but the head size is "
            f"{n_embd_head}; expected an even count of rotated dims up to it; re-export the GGUF"
        )
    return Hparams(
        arch=g.arch,
        n_layer=int(meta(g, names.KEY_BLOCK_COUNT)),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(meta(g, names.KEY_HEAD_COUNT_KV, n_head)),
        n_embd_head=n_embd_head,
        n_ff=int(meta(g, names.KEY_FEED_FORWARD_LENGTH)),
        n_vocab=n_vocab,
        rms_eps=float(meta(g, names.KEY_RMS_EPS)),
        rope_base=float(meta(g, names.KEY_ROPE_FREQ_BASE, names.ROPE_FREQ_BASE_DEFAULT)),
        rope_type=rope_type,
        rope_scaling=_rope_scaling(g, n_rot),
        n_rot=n_rot,
    )


def _rope_scaling(g: GgufModel, n_rot: int) -> RopeScaling:
    """The GGUF's RoPE scaling keys and `rope_freqs` (read by the llama and dflash graphs only;
    qwen3's passes no frequency factors), as llama.cpp turns them into ggml_rope_ext's parameters."""
    if float(meta(g, names.KEY_ROPE_YARN_LOG_MUL, 0.0)) != 0.0:
        raise InputError(
            f"{g.path}: {names.KEY_ROPE_YARN_LOG_MUL.format(arch=g.arch)} is set; the reference does not "
            "implement YaRN's log multiplier (DeepSeek's); compare a model without it, or add it to featdiff"
        )
    factor = float(meta(g, names.KEY_ROPE_SCALING_FACTOR, meta(g, names.KEY_ROPE_SCALE_LINEAR, 0.0)))
    freq_factors = None
    if names.T_ROPE_FREQS in g.tensors and g.arch in (names.ARCH_LLAMA, names.ARCH_DFLASH):
        freq_factors = tuple(float(x) for x in array_from_tensor(g, names.T_ROPE_FREQS).reshape(-1)[: n_rot // 2])
    n_ctx_train = int(meta(g, names.KEY_CONTEXT_LENGTH, 0))
    return llama_scaling(
        g.path,
        str(meta(g, names.KEY_ROPE_SCALING_TYPE, rope_params.GGUF_DEFAULT_TYPE)),
        factor,
        int(meta(g, names.KEY_ROPE_SCALING_ORIG_CTX, n_ctx_train)),
        float(meta(g, names.KEY_ROPE_SCALING_ATTN_FACTOR, 1.0)),
        freq_factors,
    )


def _draft_n_vocab(g: GgufModel) -> int:
    """The drafter's vocabulary size: its token list (what llama.cpp uses), else its own table."""
    n = array_len(g, names.KEY_TOKEN_LIST)
    if n is not None:
        return n
    if names.T_TOKEN_EMBD in g.tensors:
        return g.tensors[names.T_TOKEN_EMBD].ne[1]
    raise InputError(
        f"{g.path}: neither {names.KEY_TOKEN_LIST} nor {names.T_TOKEN_EMBD}; re-export the drafter with its vocabulary"
    )


def _layer(g: GgufModel, il: int, dtype: torch.dtype, device: torch.device) -> Layer:
    """Layer `il` in the compute dtype, built now; the pages of the file it read are released."""
    prefix = names.GGUF_LAYER_PREFIX.format(il=il)
    t = {k: _optional(g, f"{prefix}{k}.weight", dtype, device) for k in names.GGUF_TO_HF_LAYER}
    t[LAYER_ATTN_SINKS] = _optional(g, f"{prefix}{LAYER_ATTN_SINKS}.weight", torch.float32, device)  # (n_head,) F32
    layer = layer_from_tensors(t)
    release_pages(g)
    return layer


def _check_layer(g: GgufModel, il: int) -> None:
    """InputError when layer `il` lacks a required tensor: checked at load, from the header."""
    prefix = names.GGUF_LAYER_PREFIX.format(il=il)
    for k in names.GGUF_TO_HF_LAYER:
        if f"{prefix}{k}.weight" not in g.tensors and k not in names.GGUF_OPTIONAL_LAYER:
            raise InputError(f"{g.path}: tensor {prefix}{k}.weight is missing; re-export the GGUF with it")


def _log_snr(g: GgufModel, dtype: torch.dtype, device: torch.device) -> LogSnr | None:
    flag = bool(meta(g, names.KEY_LOG_SNR, False))
    lo, hi = meta(g, names.KEY_MIN_LOG_SNR, None), meta(g, names.KEY_MAX_LOG_SNR, None)
    problems = log_snr_problems(names.KEY_LOG_SNR, flag, lo, hi, set(g.tensors))
    if problems:
        raise InputError(f"{g.path}: " + "; ".join(problems))
    if not flag:
        return None
    t = [_tensor(g, name, dtype, device) for name in names.LOG_SNR_TENSORS]
    return LogSnr(min_log_snr=float(lo), max_log_snr=float(hi), fc1_w=t[0], fc1_b=t[1], fc2_w=t[2], fc2_b=t[3])


def _dspark(g: GgufModel, hp: Hparams, dtype: torch.dtype, device: torch.device) -> DSpark | None:
    """The Markov and confidence heads; None without `markov_w1`, as llama.cpp runs such a file as
    plain DFlash whatever its `dflash.*` keys say (`featdiff lint` flags those keys)."""
    shapes = {t: tuple(reversed(g.tensors[t].ne)) for t in DSPARK_FILE_TENSORS if t in g.tensors}  # numpy order
    problems = dspark_problems(shapes, hp.n_embd, hp.n_vocab)
    if problems:
        raise InputError(f"{g.path}: " + "; ".join(problems))
    if names.T_MARKOV_W1 not in shapes:
        return None
    t = {name: aligned(_optional(g, name, dtype, device)) for name in DSPARK_FILE_TENSORS if name != names.T_D2T}
    return DSpark.of_tensors(t, bool(meta(g, names.KEY_SAMPLE_FROM_ANCHOR, True)))  # absent: anchor-first


def _d2t(g: GgufModel, n_vocab: int, head_rows: int, device: torch.device) -> torch.Tensor | None:
    """The reduced vocabulary's absolute target ids, `(n_vocab_draft,)` int64, as stored."""
    if names.T_D2T not in g.data:
        return None
    ids = np.asarray(g.data[names.T_D2T].data).reshape(-1)  # (n_vocab_draft,): I64 is read raw, not dequantized
    problems = d2t_problems(ids, n_vocab, head_rows)
    if problems:
        raise InputError(f"{g.path}: " + "; ".join(problems))
    return torch.from_numpy(ids.copy()).to(device)


def _layers(g: GgufModel, n_layer: int, dtype: torch.dtype, device: torch.device) -> LayerStream:
    """The layers, streamed: each is dequantized (or upcast) from the mapped file when the forward
    reaches it, so the compute-dtype weights of one layer are resident at a time."""
    for il in range(n_layer):
        _check_layer(g, il)
    release_pages(g)  # what loading the embeddings and heads read
    return LayerStream(n_layer, partial(_layer, g, dtype=dtype, device=device))


def _tensor(g: GgufModel, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array_from_tensor(g, name)).to(dtype=dtype, device=device)


def _optional(g: GgufModel, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    return _tensor(g, name, dtype, device) if name in g.tensors else None
