"""Cheap sketches for the layer-match search: every feature slot against every target layer.

A fixed-seed Gaussian random projection (Johnson-Lindenstrauss) maps each n_embd-wide row to
SKETCH_DIM numbers; distances and cosines between rows survive it to within ~1/sqrt(SKETCH_DIM),
and a row compared with itself stays exact. Rows are subsampled evenly. So a 64-layer x 4096-wide
x 2048-token search costs 64 small matrix products, not 64 full comparisons. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from featdiff.diff.metrics import quiet_nonfinite

SKETCH_SEED = 20240917  # fixed: the same dumps always give the same matrix and findings
SKETCH_DIM = 64
MAX_SKETCH_ROWS = 256


@dataclass(frozen=True, eq=False)
class LayerMatch:
    """Slot x layer comparison of a concatenated feature row with the target's layer inputs:
    what the layer-offset and slot detectors read, and what the report draws.

    `rel_err[k, j]`: rms(slot k - layer_inp-layers[j]) / rms(layer_inp-layers[j]), sketched.
    `similarity[k, j]`: mean cosine of the sketched rows. Both `(n_extract, len(layers))`.
    `expected_layers`: the reference manifest's `target_layers` (slot k expects [k]);
    `run_layers`: what the run's manifest says (its GGUF), when compare knows it.
    """

    tensor: str
    layers: tuple[int, ...]
    expected_layers: tuple[int, ...]
    rel_err: np.ndarray
    similarity: np.ndarray
    positions: tuple[int, ...]  # the token positions of the sketched rows
    run_layers: tuple[int, ...] = ()

    @property
    def closest_layers(self) -> tuple[int, ...]:
        """For each slot, the layer whose input it is closest to."""
        return tuple(self.layers[j] for j in np.argmin(self.rel_err, axis=1))

    def closest_error(self, slot: int) -> float:
        return float(np.min(self.rel_err[slot]))

    def expected_columns(self) -> tuple[int | None, ...]:
        """The column of each slot's expected layer; None when not stated or not recorded."""
        n_slots = self.rel_err.shape[0]
        expected = self.expected_layers + (-1,) * (n_slots - len(self.expected_layers))
        return tuple(self.layers.index(L) if L in self.layers else None for L in expected[:n_slots])

    def to_json(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "layers": list(self.layers),
            "expected_layers": list(self.expected_layers),
            "run_layers": list(self.run_layers),
            "closest_layers": list(self.closest_layers),
            "rel_err": self.rel_err.tolist(),
            "similarity": self.similarity.tolist(),
            "positions": list(self.positions),
        }


def projection(n: int, dim: int = SKETCH_DIM) -> np.ndarray:
    """The fixed random projection for rows of width n: (n, dim), scaled to keep norms."""
    rng = np.random.default_rng(SKETCH_SEED)
    return (rng.standard_normal((n, dim)) / np.sqrt(dim)).astype(np.float32)  # (n, dim)


def sample_rows(n_rows: int, limit: int = MAX_SKETCH_ROWS) -> np.ndarray:
    """At most `limit` row indices, evenly spread, always the same for the same n_rows."""
    if n_rows <= limit:
        return np.arange(n_rows)
    return np.unique(np.linspace(0, n_rows - 1, limit).round().astype(np.int64))


def sketch(rows: np.ndarray, proj: np.ndarray) -> np.ndarray:
    """Project (R, n) rows to (R, dim); a NaN/Inf row sketches to NaN/Inf, without a warning."""
    with quiet_nonfinite():
        return np.asarray(rows, dtype=np.float32) @ proj  # (R, dim)


def slot_sketches(features: np.ndarray, n_extract: int, proj: np.ndarray) -> np.ndarray:
    """Sketch each slot of token-major feature rows: (R, n_extract * n) -> (n_extract, R, dim)."""
    n_rows = features.shape[0]
    slots = features.reshape(n_rows, n_extract, -1).transpose(1, 0, 2)  # (n_extract, R, n)
    return np.stack([sketch(s, proj) for s in slots])  # (n_extract, R, dim)


def compare_sketches(slots: np.ndarray, layers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Relative error and mean row cosine of every slot against every layer.

    `slots` (n_extract, R, dim), `layers` (n_layer, R, dim) -> two (n_extract, n_layer) arrays.
    """
    s = slots.astype(np.float64)
    lay = layers.astype(np.float64)
    with quiet_nonfinite():  # NaN/Inf rows give NaN cells, which the detectors read as no match
        ss = np.einsum("krd,krd->k", s, s)  # (n_extract,)
        ll = np.einsum("lrd,lrd->l", lay, lay)  # (n_layer,)
        sl = np.einsum("krd,lrd->kl", s, lay)  # (n_extract, n_layer)
        err = np.sqrt(np.maximum(ss[:, None] + ll[None, :] - 2 * sl, 0.0) / np.maximum(ll[None, :], 1e-30))
        s_rows = s / np.maximum(np.linalg.norm(s, axis=2, keepdims=True), 1e-30)  # (n_extract, R, dim)
        l_rows = lay / np.maximum(np.linalg.norm(lay, axis=2, keepdims=True), 1e-30)  # (n_layer, R, dim)
        cos = np.einsum("krd,lrd->kl", s_rows, l_rows) / max(s.shape[1], 1)  # (n_extract, n_layer)
    return err, cos
