"""Detectors: one pure function per finding kind, `detect_<kind>(ev) -> Finding | None`.

Each takes the `Evidence` of one divergent pair (its aligned rows plus the reference candidates
evidence.py gathered) and tests one hypothesis about why run differs from ref; the docstring
states the hypothesis and the evidence it needs. No I/O, no randomness, no printing. This module
holds the evidence record and the detectors of values, rows and layouts; wiring.py those of
feature slots, terms and sources.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from featdiff import names
from featdiff.compare.metrics import relative_error, row_relative_error
from featdiff.compare.result import Finding, Kind
from featdiff.compare.sketch import LayerMatch
from featdiff.compare.tolerance import Tolerance

MAX_ROW_SHIFT = 8  # rows: a block is 4..16 rows; a shift past that is not a shift
MAX_POSITION_OFFSET = 8  # RoPE positions tried on either side


@dataclass(frozen=True)
class Rope:
    """How a RoPE'd tensor was rotated: enough to rotate it by k more positions."""

    n_head: int
    head_dim: int
    base: float = names.ROPE_FREQ_BASE_DEFAULT


@dataclass(frozen=True)
class Evidence:
    """What the detectors may look at for one divergent pair. Arrays are (rows, values)."""

    tensor: str  # the run record's name
    ref: np.ndarray  # (R, D) aligned ref rows
    run: np.ndarray  # (R, D) aligned run rows (shape may differ when not comparable)
    tolerance: Tolerance
    positions: tuple[int, ...] = ()  # position of each aligned row; () = not row-wise
    ref_all: np.ndarray | None = None  # (Rr, D) every ref row of the group, for shifts
    ref_all_positions: tuple[int, ...] = ()
    run_raw: np.ndarray | None = None  # the run record as stored, for layout checks
    candidates: Mapping[str, np.ndarray] = field(default_factory=dict)  # ref-only, aligned rows
    earlier: np.ndarray | None = None  # (E, D) ref rows of this record in earlier evals
    earlier_evals: tuple[int, ...] = ()  # eval of each earlier row
    layers: LayerMatch | None = None
    n_extract: int = 0
    rope: Rope | None = None
    is_integer: bool = False  # integer data (positions, token ids): compared exactly
    record: str = ""  # the reference's name of the pair (`tensor` is the run's)
    absent: tuple[str, ...] = ()  # ref records of this eval group the run's graph lacks


# --- helpers -------------------------------------------------------------------------------------


def same_shape(ev: Evidence) -> bool:
    return ev.ref.shape == ev.run.shape


def explains(expected: np.ndarray, run: np.ndarray, tol: Tolerance) -> bool:
    """run equals `expected` within tolerance: over the whole array and row by row."""
    if expected.shape != run.shape or run.size == 0:
        return False
    if relative_error(expected, run) > tol.rel:
        return False
    return bool(np.all(row_relative_error(expected, run) <= tol.row_rel))


def _labels(ev: Evidence, mask: np.ndarray) -> list[int]:
    """Positions of the masked rows (row indices when the pair is not row-wise)."""
    idx = np.flatnonzero(mask)
    return [int(ev.positions[i]) for i in idx] if ev.positions else [int(i) for i in idx]


def _span(rows: list[int]) -> str:
    if len(rows) > 1 and rows == list(range(rows[0], rows[-1] + 1)):
        return f"positions {rows[0]}..{rows[-1]}"
    return f"position{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows[:8]))}{' ...' if len(rows) > 8 else ''}"


def error_finding(kind: Kind, ev: Evidence, message: str, **fields: object) -> Finding:
    return Finding(kind=kind, tensor=ev.tensor, severity="error", message=message, fields=dict(fields))


# --- values that are plainly broken --------------------------------------------------------------


def detect_nonfinite(ev: Evidence) -> Finding | None:
    """Hypothesis: the run wrote NaN/Inf. Evidence: non-finite values in run rows."""
    bad = ~np.isfinite(ev.run).all(axis=1)
    if not bad.any():
        return None
    rows = _labels(ev, bad)
    return error_finding(
        "nonfinite",
        ev,
        f"{ev.tensor} holds NaN/Inf at {_span(rows)} while its inputs are finite; "
        f"check the op that writes it (an uninitialized or overrun buffer, a division by zero)",
        rows=rows,
    )


def detect_zeros(ev: Evidence) -> Finding | None:
    """Hypothesis: rows were never written. Evidence: all-zero run rows where ref rows are not,
    and every other row within tolerance."""
    if not same_shape(ev):
        return None
    zero = ~np.any(ev.run, axis=1) & np.any(ev.ref, axis=1)
    rest_ok = not (~zero).any() or explains(ev.ref[~zero], ev.run[~zero], ev.tolerance)
    if not zero.any() or not rest_ok:
        return None
    rows = _labels(ev, zero)
    return error_finding(
        "zeros",
        ev,
        f"{ev.tensor} is all zeros at {_span(rows)}; the rows were never written: "
        f"check that the buffer is filled before this eval",
        rows=rows,
    )


def detect_stale(ev: Evidence) -> Finding | None:
    """Hypothesis: rows hold data of an earlier eval (a buffer not refreshed). Evidence: every
    divergent run row equals, within tolerance, a ref row of this record from an earlier eval."""
    if ev.earlier is None or not len(ev.earlier) or not same_shape(ev):
        return None
    bad = row_relative_error(ev.ref, ev.run) > ev.tolerance.row_rel
    best, err = _nearest_rows(ev.run[bad], ev.earlier)
    if not bad.any() or not np.all(err <= ev.tolerance.row_rel):
        return None
    rows = _labels(ev, bad)
    source = int(ev.earlier_evals[int(best[0])]) if ev.earlier_evals else -1
    return error_finding(
        "stale",
        ev,
        f"{ev.tensor} at {_span(rows)} repeats data from eval {source}, an earlier round; "
        f"the buffer is not refreshed before this eval",
        rows=rows,
        source_eval=source,
    )


def _nearest_rows(rows: np.ndarray, pool: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each row, the index of the nearest pool row and their relative distance."""
    r, p = rows.astype(np.float64), pool.astype(np.float64)
    pp = np.einsum("ij,ij->i", p, p)  # (E,)
    dist2 = np.einsum("ij,ij->i", r, r)[:, None] + pp[None, :] - 2 * r @ p.T  # (n, E)
    rel = np.sqrt(np.maximum(dist2, 0.0) / np.maximum(pp[None, :], 1e-30))  # (n, E)
    best = np.argmin(rel, axis=1) if rel.size else np.zeros(0, dtype=np.int64)
    return best, rel[np.arange(len(best)), best]


# --- rows, layouts, positions --------------------------------------------------------------------


def detect_row_shift(ev: Evidence) -> Finding | None:
    """Hypothesis: run row at position p holds the ref row of p + s, one s != 0 for all rows.
    Evidence: every run row whose p + s exists in the ref group matches it; at most |s| rows fall off."""
    if ev.ref_all is None or not ev.positions or not same_shape(ev):
        return None
    ref_at = {p: i for i, p in enumerate(ev.ref_all_positions)}
    for s in _shifts(MAX_ROW_SHIFT):
        pairs = [(j, ref_at[p + s]) for j, p in enumerate(ev.positions) if p + s in ref_at]
        if not pairs or len(ev.positions) - len(pairs) > abs(s):
            continue
        run_j, ref_i = (list(x) for x in zip(*pairs))
        if explains(ev.ref_all[ref_i], ev.run[run_j], ev.tolerance):
            return error_finding(
                "row_shift",
                ev,
                f"{ev.tensor} rows are shifted by {s:+d}: the run's row at position p "
                f"holds the reference's row at p{s:+d}; check the anchor row and the block offset",
                shift=s,
            )
    return None


def _shifts(limit: int) -> list[int]:
    return [s for k in range(1, limit + 1) for s in (k, -k)]


def detect_layout_transpose(ev: Evidence) -> Finding | None:
    """Hypothesis: the run's buffer holds the right values in another axis order (layer-major
    staging, head-major, swapped axes). Evidence: some reinterpretation of the run buffer matches ref."""
    if ev.run_raw is None or ev.run_raw.size != ev.ref.size or ev.ref.ndim != 2:
        return None
    for detail, candidate in _reinterpretations(np.asarray(ev.run_raw), ev.ref.shape, ev.n_extract):
        if explains(ev.ref, candidate, ev.tolerance):
            return error_finding(
                "layout_transpose",
                ev,
                f"{ev.tensor} is {detail}; stage it token-major, one row of {ev.ref.shape[1]} values per token",
                detail=detail,
            )
    return None


def _reinterpretations(raw: np.ndarray, shape: tuple[int, int], n_extract: int):
    """(description, (T, D) array) for each other reading of the run's buffer."""
    n_rows, width = shape
    if raw.ndim == 2 and raw.shape == (width, n_rows):
        yield f"transposed: stored ({width}, {n_rows}) where ({n_rows}, {width}) is expected", raw.T  # (T, D)
    flat = raw.reshape(-1)
    for k in _major_counts(width, n_extract):
        major = flat.reshape(k, n_rows, width // k)  # (k, T, D / k): k blocks of T rows each
        what = "staged layer-major" if k == n_extract else f"stored {k}-block-major"
        yield (
            f"{what}: a ({k}, {n_rows}, {width // k}) buffer read as ({n_rows}, {width})",
            major.transpose(1, 0, 2).reshape(n_rows, width),
        )  # (T, k * D / k)


def _major_counts(width: int, n_extract: int) -> list[int]:
    """Block counts to try: n_extract first, then the small divisors of the row width."""
    ks = [n_extract] if n_extract > 1 and width % n_extract == 0 else []
    return ks + [k for k in range(2, 65) if width % k == 0 and k not in ks]


def detect_position_offset(ev: Evidence) -> Finding | None:
    """Hypothesis: the tensor was computed at positions off by k. Evidence: integer positions
    differ from ref by one constant k, or RoPE'd rows equal ref rows rotated by k more positions."""
    if not same_shape(ev) or not ev.ref.size:
        return None
    if ev.is_integer:
        diff = np.unique(np.asarray(ev.run, dtype=np.int64) - np.asarray(ev.ref, dtype=np.int64))
        k = int(diff[0]) if diff.size == 1 and diff[0] != 0 else None
    else:
        k = _rope_offset(ev)
    if k is None:
        return None
    return error_finding(
        "position_offset",
        ev,
        f"{ev.tensor} was computed at positions off by {k:+d}; check the positions passed with this batch",
        offset=k,
    )


def _rope_offset(ev: Evidence) -> int | None:
    if ev.rope is None or ev.ref.shape[1] != ev.rope.n_head * ev.rope.head_dim:
        return None
    for k in _shifts(MAX_POSITION_OFFSET):
        for neox in (True, False):
            if explains(rotate(ev.ref, k, ev.rope, neox), ev.run, ev.tolerance):
                return k
    return None


def rotate(rows: np.ndarray, k: int, rope: Rope, neox: bool) -> np.ndarray:
    """RoPE'd rows rotated by k more positions: (R, n_head * head_dim) -> same shape.

    neox pairs dims (i, i + head_dim/2) (qwen3, ggml NEOX); otherwise adjacent (2i, 2i+1) (llama, NORM).
    """
    n, half = rows.shape[0], rope.head_dim // 2
    theta = k * rope.base ** (-np.arange(half) * 2.0 / rope.head_dim)  # (half,)
    x = rows.reshape(n, rope.n_head, rope.head_dim).astype(np.float64)  # (R, n_head, head_dim)
    if neox:
        a, b = x[..., :half], x[..., half:]  # (R, n_head, half) each
    else:
        a, b = x[..., 0::2], x[..., 1::2]  # (R, n_head, half) each
    c, s = np.cos(theta), np.sin(theta)
    ra, rb = a * c - b * s, a * s + b * c
    out = (
        np.concatenate([ra, rb], axis=-1) if neox else np.stack([ra, rb], axis=-1)
    )  # (R, n_head, head_dim) or (R, n_head, half, 2)
    return out.reshape(n, -1).astype(rows.dtype)  # (R, n_head * head_dim)


# --- scale ---------------------------------------------------------------------------------------


def detect_scale(ev: Evidence) -> Finding | None:
    """Hypothesis: run = c * ref for one factor c != 1. Evidence: least-squares c fits within
    tolerance and |c - 1| is beyond it."""
    if not same_shape(ev):
        return None
    den = float(np.vdot(ev.ref, ev.ref))
    c = float(np.vdot(ev.ref, ev.run)) / den if den > 0 else 0.0
    if abs(c - 1.0) <= ev.tolerance.rel or c == 0.0 or not explains(c * ev.ref, ev.run, ev.tolerance):
        return None
    return error_finding(
        "scale",
        ev,
        f"{ev.tensor} is {c:.4g} x the reference; look for a missing or "
        f"doubled scale (embedding scale, attention scale, norm weight)",
        factor=round(c, 6),
    )


# --- no specific cause ---------------------------------------------------------------------------


def detect_divergence(ev: Evidence, nmse: float) -> Finding:
    """No detector explained the pair: report the metric against its tolerance (always a finding)."""
    tol = ev.tolerance
    if not same_shape(ev):
        return error_finding(
            "divergence",
            ev,
            f"{ev.tensor} has {ev.run.shape[0]} rows of {ev.run.shape[1]} values where the "
            f"reference has {ev.ref.shape[0]} of {ev.ref.shape[1]}; check the tensor's shape in the run's graph",
            metric="shape",
            value=list(ev.run.shape),
            tolerance=list(ev.ref.shape),
        )
    return error_finding(
        "divergence",
        ev,
        f"{ev.tensor} differs from the reference (NMSE {nmse:.3g}, tolerance "
        f"{tol.nmse:.3g} from {', '.join(tol.sources)}) and no known wiring fault explains it; "
        f"open the report to compare it row by row",
        metric="nmse",
        value=nmse,
        tolerance=tol.nmse,
    )


def detect_numeric_noise(tensor: str, nmse: float, tol: Tolerance) -> Finding | None:
    """Hypothesis: the largest difference left is what the dtypes explain. Evidence: the worst
    within-tolerance pair has NMSE > 0 (identical dumps give no finding)."""
    if not nmse > 0.0:
        return None
    return Finding(
        kind="numeric_noise",
        tensor=tensor,
        severity="info",
        message=f"the largest difference, at {tensor} (NMSE {nmse:.3g}), is within what "
        f"{', '.join(tol.sources)} explain (tolerance {tol.nmse:.3g})",
        fields={"metric": "nmse", "value": nmse, "tolerance": tol.nmse},
    )
