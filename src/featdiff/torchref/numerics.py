"""The per-token building blocks of both stacks, written to follow ggml's CPU kernels where the
order of float32 operations is cheap to reproduce (RMS norm, the RoPE angle cache).

Shapes are in numpy order: `(n_tokens, n_embd)`, `(n_tokens, n_head, n_embd_head)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from featdiff.torchref.rope_params import PLAIN, RopeScaling
from featdiff.torchref.weights import Hparams, Layer

KvDtype = Literal["f16", "f32"]
KV_DTYPES: tuple[KvDtype, ...] = ("f16", "f32")
COMPUTE_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class Numerics:
    """How the reference computes: torch dtype and device, and the KV cache type it emulates."""

    dtype: torch.dtype
    device: torch.device
    kv_dtype: KvDtype


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """ggml_mul_mat(w, x): `x @ w.T`, w in (out, in) orientation."""
    return x @ w.T  # (n_tokens, in) @ (in, out) -> (n_tokens, out)


def f32_scalar(value: float) -> float:
    """`value` rounded to float32, as ggml_scale's float parameter holds it: a float32 tensor times
    it is then the one float32 product ggml computes."""
    return float(np.float32(value))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ggml_rms_norm then ggml_mul over the last axis (ggml-cpu ops.cpp rms_norm_f32).

    ggml sums the squares in double, then takes `scale = 1.0f/sqrtf(mean + eps)` in float.
    """
    mean = (x * x).double().sum(-1, keepdim=True).div(x.shape[-1]).to(x.dtype)
    scale = 1.0 / torch.sqrt(mean + eps)
    return x * scale * weight


def ffn(x: torch.Tensor, layer: Layer) -> torch.Tensor:
    """SwiGLU (LLM_FFN_SILU, LLM_FFN_PAR): `down(silu(gate x) * up x)`."""
    gate = linear(x, layer.ffn_gate)
    return linear(gate / (1.0 + torch.exp(-gate)) * linear(x, layer.ffn_up), layer.ffn_down)


def rope_cache(
    positions: torch.Tensor, n_dims: int, base: float, scaling: RopeScaling = PLAIN
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, `(n_tokens, n_dims / 2)` float32, as ggml_rope_cache_init builds them.

    ggml grows the angle by repeated float32 multiplication, `theta *= powf(base, -2.0f/n_dims)`;
    per pair i it divides by the frequency factor (`rope_freqs`), and `rope_yarn` mixes the
    interpolated angle `freq_scale * theta` with the extrapolated one by YaRN's ramp over the
    correction dims, scaling cos and sin by `attn_factor` (times `1 + 0.1 ln(1/freq_scale)` under
    YaRN). All in float32, as the C does; float64 cos rounded to float32 is the correctly rounded cosf.
    """
    f32 = np.float32
    exponent = f32(-2.0) / f32(n_dims)
    theta_scale = f32(np.float64(f32(base)) ** np.float64(exponent))
    low, high = _yarn_corr_dims(n_dims, scaling.n_ctx_orig, base, scaling.beta_fast, scaling.beta_slow)
    freq_scale, ext_factor = f32(scaling.freq_scale), f32(scaling.ext_factor)
    mscale = f32(scaling.attn_factor)
    if ext_factor != 0:
        mscale = f32(mscale * (f32(1.0) + f32(0.1) * np.log(f32(1.0) / freq_scale)))
    theta = positions.cpu().numpy().astype(np.float32)
    columns = []
    for i in range(n_dims // 2):
        ff = f32(scaling.freq_factors[i]) if scaling.freq_factors is not None else f32(1.0)
        extrap = theta / ff
        angle = freq_scale * extrap
        if ext_factor != 0:
            y = f32((f32(i) - low) / f32(max(0.001, float(high - low))))
            ramp = f32(1.0) - f32(min(1.0, max(0.0, float(y))))
            mix = f32(ramp * ext_factor)
            angle = angle * (f32(1.0) - mix) + extrap * mix
        columns.append(angle.astype(np.float32))
        theta = theta * theta_scale
    thetas = np.stack(columns, axis=-1).astype(np.float64)  # (n_tokens, n_dims / 2)
    cos = (np.cos(thetas).astype(np.float32) * mscale).astype(np.float32)
    sin = (np.sin(thetas).astype(np.float32) * mscale).astype(np.float32)
    return cos, sin


def _yarn_corr_dims(
    n_dims: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float
) -> tuple[np.float32, np.float32]:
    """ggml_rope_yarn_corr_dims: the pair range YaRN's ramp runs over, in float32."""
    f32 = np.float32
    if n_ctx_orig <= 0:
        return f32(0.0), f32(n_dims - 1)

    def corr_dim(n_rot: float) -> np.float32:
        return f32(
            f32(n_dims) * np.log(f32(n_ctx_orig) / (f32(n_rot) * f32(2) * f32(np.pi))) / (f32(2) * np.log(f32(base)))
        )

    start, end = np.floor(corr_dim(beta_fast)), np.ceil(corr_dim(beta_slow))
    return f32(max(0.0, start)), f32(min(n_dims - 1.0, end))


def rope(x: torch.Tensor, positions: torch.Tensor, hp: Hparams) -> torch.Tensor:
    """Rotate `(n_tokens, n_head, n_embd_head)` at `positions` with the stack's RoPE (`hp`):
    its base, type, scaling and rotated dims (the first `hp.n_rot`; the rest pass through).

    NeoX pairs dims (i, i + n_rot/2) (HF rotate-half, qwen3, dflash); normal pairs (2i, 2i + 1)
    (ggml's GGML_ROPE_TYPE_NORMAL, llama GGUFs whose q/k rows the converter permuted).
    """
    n_tokens, n_head, d = x.shape
    n_rot = hp.n_rot or d
    cos_np, sin_np = rope_cache(positions, n_rot, hp.rope_base, hp.rope_scaling)
    cos = torch.from_numpy(cos_np).to(x)[:, None, :]  # (n_tokens, 1, n_rot/2)
    sin = torch.from_numpy(sin_np).to(x)[:, None, :]  # (n_tokens, 1, n_rot/2)
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    if hp.rope_type == "neox":
        x0, x1 = rot[..., : n_rot // 2], rot[..., n_rot // 2 :]
        rotated = torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # (n_tokens, n_head, n_rot)
    else:
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        pairs = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # (n_tokens, n_head, n_rot/2, 2)
        rotated = pairs.reshape(n_tokens, n_head, n_rot)
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated  # (n_tokens, n_head, d)
