"""RoPE scaling as llama.cpp runs it, from a GGUF's keys or a Hugging Face config.

Consumes the scaling a model declares: GGUF `{arch}.rope.scaling.{type,factor,attn_factor,
original_context_length}` and the `rope_freqs` tensor; HF `rope_scaling` / `rope_parameters`
(`linear`, `llama3`, `yarn`) and `partial_rotary_factor`. Produces one `RopeScaling`, the
parameters llama.cpp hands ggml_rope_ext (llama-context.cpp's cparams), which
`featdiff.torchref.numerics.rope` applies. A scaling featdiff does not implement is an
InputError, never a plain rotation computed in its place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from featdiff.core.errors import InputError

# llama.cpp's scaling types (llama-model.cpp LLAMA_ROPE_SCALING_TYPES); featdiff implements these
NONE, LINEAR, YARN = "none", "linear", "yarn"
GGUF_DEFAULT_TYPE = LINEAR  # llama-model.cpp: `rope_scaling("linear")` when the key is absent
# HF rope types (transformers' modeling_rope_utils) featdiff implements, and what each is in llama.cpp
HF_DEFAULT, HF_LINEAR, HF_LLAMA3, HF_YARN = "default", "linear", "llama3", "yarn"
# HF llama3 defaults where a config leaves them out (transformers' _compute_llama3_parameters)
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_OLD_CONTEXT = 1.0, 4.0, 8192
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # llama-hparams.h (and transformers') defaults


@dataclass(frozen=True)
class RopeScaling:
    """How a stack's RoPE departs from the plain rotation by `pos * base^(-2i/n_rot)`: the
    parameters llama.cpp passes ggml_rope_ext (llama-context.cpp derives them from the GGUF keys
    `{arch}.rope.scaling.*` and the `rope_freqs` tensor). The defaults are plain RoPE."""

    freq_scale: float = 1.0  # 1 / the scaling factor (linear interpolation, YaRN)
    ext_factor: float = 0.0  # YaRN's mix of interpolated and extrapolated angles: 1 for YaRN, else 0
    attn_factor: float = 1.0  # cparams.yarn_attn_factor: multiplies cos and sin
    n_ctx_orig: int = 0  # YaRN's original context length (its correction dims)
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW
    freq_factors: tuple[float, ...] | None = None  # `rope_freqs` (llama3): angle i divided by factor i


PLAIN = RopeScaling()  # no scaling, no frequency factors


def _mscale(factor: float) -> float:
    """YaRN's magnitude correction `0.1 ln(factor) + 1` (1 for factor <= 1), llama-context.cpp get_mscale."""
    return 1.0 if factor <= 1.0 else 0.1 * math.log(factor) + 1.0


def llama_scaling(
    source: Path,
    kind: str,
    factor: float,
    n_ctx_orig: int,
    attn_factor: float = 1.0,
    freq_factors: tuple[float, ...] | None = None,
) -> RopeScaling:
    """What llama_context's constructor makes of a model's scaling: `kind` (none/linear/yarn),
    `factor` (0: none given), YaRN's original context, the `attn_factor` key, and `rope_freqs`."""
    if kind not in (NONE, LINEAR, YARN):
        raise InputError(
            f"{source}: RoPE scaling type {kind!r}; the reference implements {NONE}, {LINEAR} and "
            f"{YARN} (and llama3's rope_freqs); compare a model without it, or add it to featdiff"
        )
    freq_scale = 1.0 if kind == NONE or factor == 0.0 else 1.0 / factor
    if kind != YARN:
        return RopeScaling(
            freq_scale=freq_scale, attn_factor=attn_factor, n_ctx_orig=n_ctx_orig, freq_factors=freq_factors
        )
    scale = 1.0 / freq_scale
    # llama.cpp sets yarn_attn_factor = get_mscale(factor) / (1 + 0.1 ln factor) so that the kernel's
    # own `1 + 0.1 ln(1/freq_scale)` leaves get_mscale(factor) in cos and sin; then the attn_factor key
    yarn_attn = _mscale(scale) / (1.0 + 0.1 * math.log(scale)) if scale > 0 else 1.0
    return RopeScaling(
        freq_scale=freq_scale,
        ext_factor=1.0,
        attn_factor=yarn_attn * attn_factor,
        n_ctx_orig=n_ctx_orig,
        beta_fast=YARN_BETA_FAST,
        beta_slow=YARN_BETA_SLOW,
        freq_factors=freq_factors,
    )


def llama3_freq_factors(
    base: float, n_rot: int, factor: float, low_freq_factor: float, high_freq_factor: float, old_context: int
) -> tuple[float, ...]:
    """The `rope_freqs` llama3 scaling divides each pair's angle by (the GGUF converter's formula):
    1 for short wavelengths, `factor` for long ones, a smooth blend between."""
    low_wavelen, high_wavelen = old_context / low_freq_factor, old_context / high_freq_factor
    out = []
    for i in range(0, n_rot, 2):
        wavelen = 2 * math.pi * base ** (i / n_rot)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return tuple(out)


def hf_rope(source: Path, config: Mapping[str, Any], head_dim: int) -> tuple[float | None, RopeScaling, int]:
    """A HF config's RoPE: its base (`rope_theta`, at the top or in `rope_parameters`; None: not
    given), scaling, and rotated dims (`partial_rotary_factor` x head_dim)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise InputError(f"{source}: rope_scaling / rope_parameters is {params!r}, expected an object; fix the config")
    base = config.get("rope_theta", params.get("rope_theta"))
    partial = float(config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))
    n_rot = int(head_dim * partial)
    kind = str(params.get("rope_type", params.get("type", HF_DEFAULT)))
    factor = float(params.get("factor", 0.0) or 0.0)
    n_ctx_train = int(config.get("max_position_embeddings", 0) or 0)
    if kind == HF_DEFAULT:
        return base, PLAIN, n_rot
    if kind == HF_LINEAR:
        return base, llama_scaling(source, LINEAR, factor, n_ctx_train), n_rot
    if kind == HF_YARN:
        unsupported = [k for k in ("attention_factor", "mscale", "mscale_all_dim") if params.get(k) is not None]
        if unsupported:
            raise InputError(
                f"{source}: YaRN with {', '.join(unsupported)}; the reference implements YaRN's default "
                "attention factor only; compare a model without it, or add it to featdiff"
            )
        if (
            float(params.get("beta_fast", YARN_BETA_FAST)) != YARN_BETA_FAST
            or float(params.get("beta_slow", YARN_BETA_SLOW)) != YARN_BETA_SLOW
        ):
            raise InputError(
                f"{source}: YaRN beta_fast/beta_slow differ from llama.cpp's {YARN_BETA_FAST}/"
                f"{YARN_BETA_SLOW}, which qwen3, llama and dflash GGUFs cannot carry; use the defaults"
            )
        orig = int(params.get("original_max_position_embeddings") or n_ctx_train)
        return base, llama_scaling(source, YARN, factor, orig), n_rot
    if kind == HF_LLAMA3:
        if base is None:
            raise InputError(f"{source}: llama3 RoPE scaling needs rope_theta; add it to the config")
        factors = llama3_freq_factors(
            float(base),
            n_rot,
            factor,
            float(params.get("low_freq_factor", LLAMA3_LOW_FREQ_FACTOR)),
            float(params.get("high_freq_factor", LLAMA3_HIGH_FREQ_FACTOR)),
            int(params.get("original_max_position_embeddings", LLAMA3_OLD_CONTEXT)),
        )
        return base, RopeScaling(n_ctx_orig=n_ctx_train, freq_factors=factors), n_rot
    raise InputError(
        f"{source}: RoPE type {kind!r}; the reference implements {HF_DEFAULT}, {HF_LINEAR}, "
        f"{HF_LLAMA3} and {HF_YARN}; compare a model without it, or add it to featdiff"
    )
