"""GIDD log-SNR conditioning of the noise block: the per-row embedding added to the noise
embeddings of a conditioned drafter (docs/records.md: the names of the fork that implements it).

Anchor rows sit at `max_log_snr`, mask rows at `min_log_snr`; the log-SNR is normalized to
`tau` in 0..1000, expanded into 64 sines then 64 cosines of `tau * 10000^(-j/64)`, and passed
through `fc1 -> SiLU -> fc2` (both with bias). Each stage is a record under the graph's name
(`dspark_log_snr_feat`, `dspark_log_snr_fc1`, `dspark_log_snr_fc2`; docs/records.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from featdiff.core import names
from featdiff.torchref.numerics import linear
from featdiff.torchref.weights import LogSnr

TAU_MAX = 1000.0  # the normalized log-SNR spans 0 .. TAU_MAX
FREQ_BASE = 10000.0  # f_j = FREQ_BASE^(-j / n_half)


def log_snr_tau(snr: LogSnr, is_mask: torch.Tensor) -> torch.Tensor:
    """Normalized log-SNR per row, float64 `(n_tokens,)`: TAU_MAX for anchor rows, 0 for mask rows."""
    lam = torch.where(is_mask, snr.min_log_snr, snr.max_log_snr).double()
    return TAU_MAX * (lam - snr.min_log_snr) / (snr.max_log_snr - snr.min_log_snr)


def log_snr_features(tau: torch.Tensor) -> torch.Tensor:
    """Sinusoidal features, float64 `(n_tokens, LOG_SNR_N_FREQ)`: sines first, then cosines."""
    n_half = names.LOG_SNR_N_FREQ // 2
    freqs = FREQ_BASE ** (-torch.arange(n_half, dtype=torch.float64, device=tau.device) / n_half)
    angles = tau[:, None] * freqs[None, :]  # (n_tokens, n_half)
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)  # (n_tokens, 2 * n_half)


@dataclass(frozen=True)
class LogSnrEmbedding:
    """The stages of the log-SNR embedding of one block, in the weights' dtype."""

    feat: torch.Tensor  # (n_tokens, LOG_SNR_N_FREQ): dspark_log_snr_feat
    fc1: torch.Tensor  # (n_tokens, n_embd): dspark_log_snr_fc1 = silu(fc1 feat + b1)
    term: torch.Tensor  # (n_tokens, n_embd): dspark_log_snr_fc2 = fc2 fc1 + b2, added to each row


def log_snr_embed(snr: LogSnr, is_mask: torch.Tensor) -> LogSnrEmbedding:
    """The embedding added to each noise-block row, with the stages that compute it.

    The features are computed in float64 (angles reach 1000 rad) and then cast.
    """
    phi = log_snr_features(log_snr_tau(snr, is_mask)).to(snr.fc1_w.dtype)  # (n_tokens, LOG_SNR_N_FREQ)
    hidden = linear(phi, snr.fc1_w) + snr.fc1_b
    hidden = hidden / (1.0 + torch.exp(-hidden))  # SiLU
    return LogSnrEmbedding(feat=phi, fc1=hidden, term=linear(hidden, snr.fc2_w) + snr.fc2_b)
