"""The per-token building blocks of both stacks, written to follow ggml's CPU kernels where the
order of float32 operations is cheap to reproduce (RMS norm, the RoPE angle cache).

Shapes are in numpy order: `(n_tokens, n_embd)`, `(n_tokens, n_head, n_embd_head)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from featdiff.reference.weights import Layer, RopeType

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


def rope_cache(positions: torch.Tensor, n_dims: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, `(n_tokens, n_dims / 2)` float32, as ggml_rope_cache_init builds them.

    ggml grows the angle by repeated float32 multiplication, `theta *= powf(base, -2.0f/n_dims)`,
    and takes cosf/sinf of it; float64 cos rounded to float32 is the correctly rounded cosf.
    """
    exponent = np.float32(-2.0) / np.float32(n_dims)
    theta_scale = np.float32(np.float64(np.float32(base)) ** np.float64(exponent))
    theta = positions.cpu().numpy().astype(np.float32)
    columns = []
    for _ in range(n_dims // 2):
        columns.append(theta)
        theta = theta * theta_scale
    thetas = np.stack(columns, axis=-1).astype(np.float64)  # (n_tokens, n_dims / 2)
    return np.cos(thetas).astype(np.float32), np.sin(thetas).astype(np.float32)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float, rope_type: RopeType) -> torch.Tensor:
    """Rotate `(n_tokens, n_head, n_embd_head)` at `positions`.

    NeoX pairs dims (i, i + d/2) (HF rotate-half, qwen3, dflash); normal pairs (2i, 2i + 1)
    (ggml's GGML_ROPE_TYPE_NORMAL, llama GGUFs whose q/k rows the converter permuted).
    """
    n_tokens, n_head, d = x.shape
    cos_np, sin_np = rope_cache(positions, d, base)
    cos = torch.from_numpy(cos_np).to(x)[:, None, :]  # (n_tokens, 1, d/2)
    sin = torch.from_numpy(sin_np).to(x)[:, None, :]  # (n_tokens, 1, d/2)
    if rope_type == "neox":
        x0, x1 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # (n_tokens, n_head, d)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    pairs = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # (n_tokens, n_head, d/2, 2)
    return pairs.reshape(n_tokens, n_head, d)  # (n_tokens, n_head, d)
