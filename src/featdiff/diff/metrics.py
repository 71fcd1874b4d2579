"""Metrics of one aligned pair: arrays in, numbers out. Pure numpy, no I/O.

Arrays are `(R, D)`: R aligned rows (token positions), D values per row. Relative errors are
rms(run - ref) / rms(ref), over the pair (`rel`, with NMSE = rel**2) or per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from featdiff.diff.tolerance import Tolerance


def quiet_nonfinite() -> np.errstate:
    """numpy's floating-point warnings off for the block: NaN/Inf in a dump raise them by design
    (inf - inf, inf * 0, a percentile over Inf), and the metrics carry them as NaN/Inf values
    (the nonfinite finding reads them), so they are not news on stderr."""
    return np.errstate(invalid="ignore", over="ignore", divide="ignore")


@dataclass(frozen=True)
class Measurement:
    """How far run is from ref: whole-pair figures plus the per-row relative error."""

    max_abs: float
    nmse: float
    cos_min: float
    cos_median: float
    rel_p50: float
    rel_p99: float
    row_rel: tuple[float, ...]
    is_finite: bool

    @property
    def rel(self) -> float:
        return float(np.sqrt(self.nmse))

    def within(self, tol: Tolerance) -> bool:
        """Inside the tolerance: finite, NMSE <= tol.nmse and every row <= tol.row_rel."""
        worst_row = max(self.row_rel, default=0.0)
        return self.is_finite and self.nmse <= tol.nmse and worst_row <= tol.row_rel


def as_rows(array: np.ndarray) -> np.ndarray:
    """A float view with one row per leading index: (n, prod(rest)); (n,) becomes (n, 1)."""
    a = np.asarray(array)
    if a.dtype.kind != "f":
        a = a.astype(np.float64)
    return a.reshape(a.shape[0], -1) if a.ndim else a.reshape(1, 1)  # (n, D)


def _row_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", a, b).astype(np.float64)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den with 0/0 = 0 and x/0 = inf, elementwise."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(num > 0, np.inf, 0.0))
    return out


def measure(ref: np.ndarray, run: np.ndarray) -> Measurement:
    """All pair metrics of two equally shaped (R, D) arrays. NaN/Inf in either side is expected
    (the nonfinite finding reads it): its figures come out NaN or Inf, `is_finite` False, and
    numpy's warnings about them are silenced here, not printed as source lines."""
    with quiet_nonfinite():
        d = run - ref  # (R, D)
        err2, ref2, run2, dot = _row_dot(d, d), _row_dot(ref, ref), _row_dot(run, run), _row_dot(ref, run)
        is_finite = bool(np.isfinite(err2).all() and np.isfinite(ref2).all())
        row_rel = np.sqrt(_ratio(err2, ref2))
        cos = _cosine(dot, ref2, run2)
        max_abs = float(max(d.max(), -d.min())) if d.size else 0.0
        return Measurement(
            max_abs=max_abs if is_finite else float("nan"),
            nmse=float(_ratio(np.array(err2.sum()), np.array(ref2.sum()))) if is_finite else float("nan"),
            cos_min=float(cos.min()) if cos.size else 1.0,
            cos_median=float(np.median(cos)) if cos.size else 1.0,
            rel_p50=float(np.percentile(row_rel, 50)) if row_rel.size else 0.0,
            rel_p99=float(np.percentile(row_rel, 99)) if row_rel.size else 0.0,
            row_rel=tuple(float(x) for x in row_rel),
            is_finite=is_finite,
        )


def _cosine(dot: np.ndarray, ref2: np.ndarray, run2: np.ndarray) -> np.ndarray:
    """Per-row cosine; two zero rows count as 1, one zero row as 0."""
    norm = np.sqrt(ref2 * run2)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = np.where(norm > 0, dot / np.where(norm > 0, norm, 1.0), np.where(ref2 + run2 > 0, 0.0, 1.0))
    return np.nan_to_num(cos, nan=0.0)


def relative_error(ref: np.ndarray, run: np.ndarray) -> float:
    """rms(run - ref) / rms(ref) over the whole array; inf when run is not finite."""
    with quiet_nonfinite():
        d = run - ref  # (R, D)
        num, den = float(np.vdot(d, d)), float(np.vdot(ref, ref))
    if not np.isfinite(num):
        return float("inf")
    return float(np.sqrt(_ratio(np.array(num), np.array(den))))


def row_relative_error(ref: np.ndarray, run: np.ndarray) -> np.ndarray:
    """rms(run_i - ref_i) / rms(ref_i) for each row i: (R,)."""
    with quiet_nonfinite():
        d = run - ref  # (R, D)
        return np.sqrt(_ratio(_row_dot(d, d), _row_dot(ref, ref)))


def row_cosine(ref: np.ndarray, run: np.ndarray) -> np.ndarray:
    """Cosine similarity of each run row with the ref row at the same index: (R,)."""
    with quiet_nonfinite():
        return _cosine(_row_dot(ref, run), _row_dot(ref, ref), _row_dot(run, run))


def row_similarity(ref: np.ndarray, run: np.ndarray) -> np.ndarray:
    """Cosine of every run row with every ref row: (n_run, n_ref). Row shifts show as diagonals."""
    with quiet_nonfinite():  # a NaN/Inf row's cosines are NaN
        ref_n = ref / np.maximum(np.linalg.norm(ref, axis=1, keepdims=True), np.finfo(np.float32).tiny)  # (n_ref, D)
        run_n = run / np.maximum(np.linalg.norm(run, axis=1, keepdims=True), np.finfo(np.float32).tiny)  # (n_run, D)
        return run_n @ ref_n.T  # (n_run, n_ref)
