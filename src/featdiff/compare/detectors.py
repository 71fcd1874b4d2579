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
from featdiff.compare.dependence import Gap
from featdiff.compare.metrics import relative_error, row_relative_error
from featdiff.compare.partings import Parting
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


def detect_misplaced_rows(ev: Evidence) -> Finding | None:
    """Hypothesis: some run rows, not all and not by one shift, hold the ref rows of other
    positions of the batch, the rest their own: a driver that staged the wrong rows for part of a
    batch (a chunked inject reading another chunk's rows). Evidence: every run row matches its own
    ref row or another ref row of the group within the row tolerance, and at least one does not
    match its own."""
    if ev.ref_all is None or not ev.positions or not same_shape(ev) or ev.ref.ndim != 2:
        return None
    own = row_relative_error(ev.ref, ev.run) <= ev.tolerance.row_rel  # (R,)
    if own.all() or not own.any():
        return None
    sources = [_matching_row(ev.ref_all, ev.run[i], ev.tolerance.row_rel) for i in np.flatnonzero(~own)]
    if any(j is None for j in sources):
        return None
    rows = _labels(ev, ~own)
    held = [int(ev.ref_all_positions[j]) for j in sources if j is not None]
    return error_finding(
        "misplaced_rows",
        ev,
        f"{ev.tensor} {_span(rows)} hold the reference's rows of positions {_span(held)}, the other "
        f"rows their own: the driver staged the wrong rows for part of the batch; check how it "
        f"indexes rows past the first chunk (n_ubatch) or sequence",
        rows=rows,
        sources=held,
    )


def _matching_row(rows: np.ndarray, row: np.ndarray, row_rel: float) -> int | None:
    """Index of the first of `rows` (N, D) that `row` (D,) equals within `row_rel`, else None."""
    err = row_relative_error(rows, np.broadcast_to(row, rows.shape))  # (N,)
    hits = np.flatnonzero(err <= row_rel)
    return int(hits[0]) if hits.size else None


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


# --- what the reference left out ----------------------------------------------------------------


def detect_unmodelled(gap: Gap | None, not_judged: tuple[str, ...], diverged: tuple[str, ...]) -> Finding | None:
    """Hypothesis: the run's models use a feature the reference does not compute, so every record
    computed after its first read may differ for that reason alone. Evidence: the manifests'
    `models.<role>.unmodelled` (the Gap); `not_judged` are the record sets the rule of
    compare/dependence.py takes out of the verdict, `diverged` those of them beyond tolerance."""
    if gap is None:
        return None
    found = gap.draft + gap.target
    who = "the drafter" if gap.draft else "the target"
    uses = sorted({f"{name} ({phase})" for phase, name in gap.uses if phase != "*"})
    start = f" from {', '.join(uses)} on" if uses else ""
    differ = f", {len(diverged)} of them beyond tolerance" if diverged else ", all within tolerance"
    counted = f" ({len(not_judged)} record sets{differ})" if not_judged else ""
    scope = "records" if gap.target else "draft records"
    return Finding(
        kind="unmodelled",
        tensor=found[0],
        severity="info",
        message=f"{who} uses {', '.join(found)}, which featdiff's reference does not model: no verdict on the "
        f"{scope} that depend on it{start}{counted}; the rest was judged (docs/modelled.md says what is modelled)",
        fields={
            "names": list(found),
            "role": "draft" if gap.draft else "target",
            "first_use": uses,
            "not_judged": list(not_judged),
            "diverged": list(diverged),
        },
    )


# --- where the tokens part -----------------------------------------------------------------------


def _parting_where(p: Parting) -> str:
    batch = "the draft block" if p.phase == "draft" else "the verify"
    return f"round {p.round}, row {p.row} ({batch}, position {p.position})"


def _parting_fields(p: Parting) -> dict[str, object]:
    return {
        "phase": p.phase,
        "round": p.round,
        "row": p.row,
        "position": p.position,
        "eval": p.eval,
        "expected": p.expected,
        "observed": p.observed,
    }


def detect_near_tie(p: Parting) -> Finding | None:
    """Hypothesis: run and reference chose different tokens on a row where the reference's own
    two candidates are closer than the numerics can tell apart, so either choice is right.
    Evidence: the reference's margin between its argmax and the run's token on that row is at
    most the noise bound that row's tolerance allows (partings.MARGIN_SPREAD)."""
    if not p.is_near_tie:
        return None
    return Finding(
        kind="near_tie",
        tensor=p.tensor,
        severity="info",
        message=f"near-tie at {_parting_where(p)}: the run chose token {p.observed}, the reference "
        f"{p.expected}, by a reference margin {p.margin:.3g} <= noise bound {p.bound:.3g}: either token is "
        "right, so the run's is not an error",
        fields={**_parting_fields(p), "margin": p.margin, "bound": p.bound},
    )


def parting_divergence(p: Parting) -> Finding | None:
    """A parting beyond the noise that no value explains: the run's token is not what its
    logits say (a `divergence` by margin); None for a near-tie."""
    if p.is_near_tie:
        return None
    return Finding(
        kind="divergence",
        tensor=p.tensor,
        severity="error",
        message=f"at {_parting_where(p)} the run chose token {p.observed} where the reference's argmax is "
        f"{p.expected} by a margin {p.margin:.3g}, beyond the noise bound {p.bound:.3g}; check which rows the "
        "driver drafts from and that it samples greedily",
        fields={**_parting_fields(p), "metric": "margin", "value": p.margin, "tolerance": p.bound},
    )


# --- what a converter gets wrong: a norm's weight, the RoPE's angles -----------------------------

MIN_CHANNEL_ROWS = 4  # rows: below this a factor per channel fits almost any pair of rows


def detect_scale_per_channel(ev: Evidence) -> Finding | None:
    """Hypothesis: run = ref x c_j, one factor per channel j, the same on every row (a norm's weight
    missing, written as ones, or another norm's). Evidence: the least-squares c_j explain at least
    MIN_CHANNEL_ROWS rows within tolerance, and c is not one factor (that is `detect_scale`'s); a
    RoPE'd record is tried before its rotation too (plain RoPE at each row's position)."""
    if not same_shape(ev) or ev.ref.ndim != 2 or len(ev.ref) < MIN_CHANNEL_ROWS:
        return None
    for ref, run, where in _unroped_views(ev):
        c = _channel_factors(ref, run)  # (D,)
        if np.allclose(c, c.mean(), rtol=ev.tolerance.rel) or not explains(ref * c, run, ev.tolerance):
            continue
        head = ev.rope.head_dim if ev.rope is not None else 0
        per_head = head > 0 and len(c) % head == 0 and np.allclose(c.reshape(-1, head), c[:head], rtol=ev.tolerance.rel)
        spread = c[:head] if per_head else c
        norm = "a per-head norm (attn_q_norm, attn_k_norm)" if per_head else "a norm over the row"
        return error_finding(
            "scale",
            ev,
            f"{ev.tensor} is the reference times one factor per channel{where}, the same on every row "
            f"({spread.min():.3g}..{spread.max():.3g}{f', repeating every {head} values' if per_head else ''}): "
            f"the weight of {norm} is missing or another one; check that the GGUF's norm weight feeding it is the "
            f"checkpoint's (a converter that drops a norm's weights writes ones)",
            factor=round(float(np.mean(spread)), 6),
            factors=[round(float(x), 6) for x in spread],
            detail=f"per channel{where}" + (f", per head of {head}" if per_head else ""),
        )
    return None


def _channel_factors(ref: np.ndarray, run: np.ndarray) -> np.ndarray:
    """Least-squares factor of each column: (R, D) x 2 -> (D,); 1 where a ref column is all zero."""
    den = np.einsum("ij,ij->j", ref, ref)  # (D,)
    num = np.einsum("ij,ij->j", ref, run)  # (D,)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)


def _unroped_views(ev: Evidence):
    """(ref, run, where) as stored, then, for a RoPE'd record, both rotated back by each row's
    position (NeoX and adjacent pairs), since a factor per channel before RoPE is none after it."""
    yield ev.ref, ev.run, ""
    if ev.rope is None or not ev.positions or ev.ref.shape[1] != ev.rope.n_head * ev.rope.head_dim:
        return
    for neox in (True, False):
        ref, run = (_unrotated(x, ev.positions, ev.rope, neox) for x in (ev.ref, ev.run))
        yield ref, run, " before RoPE"


def _unrotated(rows: np.ndarray, positions: tuple[int, ...], rope: Rope, neox: bool) -> np.ndarray:
    """Each row rotated back by its own position with plain RoPE: (R, n_head * head_dim) -> same."""
    return np.concatenate(
        [rotate(rows[i : i + 1], -p, rope, neox) for i, p in enumerate(positions)], axis=0
    )  # (R, n_head * head_dim)


def detect_divergence_in_rope(ev: Evidence) -> Finding | None:
    """Hypothesis: the run rotated the reference's vectors by other RoPE angles (another base,
    scaling or `rope_freqs` than the checkpoint's). Evidence: in every rotated pair the run's length
    is one factor c x the reference's (1, or YaRN's attention factor on cos and sin) while run is not
    c x ref: only the angles differ. A `divergence` whose message says which frequencies differ."""
    if ev.rope is None or not same_shape(ev) or ev.ref.shape[1] != ev.rope.n_head * ev.rope.head_dim:
        return None
    for neox in (True, False):
        z_ref, z_run = _rope_pairs(ev.ref, ev.rope, neox), _rope_pairs(ev.run, ev.rope, neox)  # (R, H, half)
        len_ref, len_run = np.abs(z_ref).reshape(len(ev.ref), -1), np.abs(z_run).reshape(len(ev.run), -1)
        c = float(np.vdot(len_ref, len_run)) / max(float(np.vdot(len_ref, len_ref)), np.finfo(np.float64).tiny)
        if not explains(c * len_ref, len_run, ev.tolerance) or explains(c * ev.ref, ev.run, ev.tolerance):
            continue
        angle = np.abs(np.angle(z_run * np.conj(z_ref)))  # (R, H, half): radians
        # a rotation by d radians is a relative error of d: pairs turned further than the tolerance's rel
        differ = np.flatnonzero(angle.max(axis=(0, 1)) > ev.tolerance.rel)
        return error_finding(
            "divergence",
            ev,
            _rope_message(ev.tensor, differ, angle.shape[2], c, ev.rope.base, ev.tolerance),
            metric="nmse",
            value=float(relative_error(ev.ref, ev.run) ** 2),
            tolerance=ev.tolerance.nmse,
            detail="rope",
            pairs=[int(i) for i in differ],
        )
    return None


def _rope_pairs(rows: np.ndarray, rope: Rope, neox: bool) -> np.ndarray:
    """The rotated pairs of each head as complex numbers: (R, n_head * head_dim) -> (R, n_head, half)."""
    x = rows.reshape(len(rows), rope.n_head, rope.head_dim).astype(np.float64)  # (R, n_head, head_dim)
    half = rope.head_dim // 2
    a, b = (x[..., :half], x[..., half:]) if neox else (x[..., 0::2], x[..., 1::2])  # (R, n_head, half) each
    return a + 1j * b


def _rope_message(tensor: str, differ: np.ndarray, half: int, c: float, base: float, tol: Tolerance) -> str:
    which = f"frequency pair{'s' * (len(differ) > 1)} {_pair_span(differ)} of {half} differ"
    amp = f"; cos and sin are scaled by {c:.4g} (YaRN's attention factor)" if abs(c - 1.0) > tol.rel else ""
    arch = names.ARCH_DFLASH
    return (
        f"{tensor} holds the reference's vectors rotated by other RoPE angles ({which}{amp}): the drafter's "
        f"RoPE in the GGUF ({names.KEY_ROPE_FREQ_BASE.format(arch=arch)}, {arch}.rope.scaling.*, "
        f"{names.T_ROPE_FREQS}) does not match the checkpoint's config.json (rope_theta {base:g}, rope_scaling); a converter "
        f"that takes them from the target, or drops llama3's rope_freqs, does this"
    )


def _pair_span(pairs: np.ndarray) -> str:
    if len(pairs) > 1 and np.array_equal(pairs, np.arange(pairs[0], pairs[-1] + 1)):
        return f"{pairs[0]}..{pairs[-1]}"
    return ", ".join(map(str, pairs[:8])) + (" ..." if len(pairs) > 8 else "")


# --- MoE routing: a near-tie between experts -----------------------------------------------------

# The router's logits are a matrix times the layer's normed input, whose error on one row may reach
# the pair's row tolerance; the errors of the two logits around the top-k cut add in quadrature
# (as partings.MARGIN_SPREAD): a margin below sqrt(2) x row_rel x rms(router logits) is a near-tie.
ROUTER_MARGIN_SPREAD = float(np.sqrt(2.0))


def detect_expert_choice(ev: Evidence) -> Finding | None:
    """Hypothesis: the run routed some tokens of this MoE layer to other experts than the reference,
    on a near-tie where either choice is right. Evidence: every row over the row tolerance has a
    reference router margin (`<record>@router_margin`: the gap between the k-th and (k+1)-th router
    logit, and the rms of the row's logits) at most ROUTER_MARGIN_SPREAD x row_rel x that rms."""
    record = ev.record or ev.tensor
    margins = ev.candidates.get(names.candidate_name(record, names.HYP_ROUTER_MARGIN))
    if margins is None or not same_shape(ev) or ev.ref.ndim != 2 or margins.shape != (len(ev.ref), 2):
        return None
    bad = row_relative_error(ev.ref, ev.run) > ev.tolerance.row_rel  # (R,)
    margin, rms = margins[:, 0].astype(np.float64), margins[:, 1].astype(np.float64)  # (R,) each
    bound = ROUTER_MARGIN_SPREAD * ev.tolerance.row_rel * rms  # (R,)
    if not bad.any() or not np.all(margin[bad] <= bound[bad]):
        return None
    rows = np.flatnonzero(bad)
    tokens = _labels(ev, bad)
    layer = record.rsplit("-", 1)[-1]
    more = f" and {len(rows) - 1} more token{'s' * (len(rows) > 2)}" if len(rows) > 1 else ""
    return Finding(
        kind="expert_choice",
        tensor=ev.tensor,
        severity="info",
        message=f"expert choice differs at layer {layer}, token {tokens[0]} (router margin {margin[rows[0]]:.3g} "
        f"<= noise bound {bound[rows[0]]:.3g}){more}: the router's top-k cut is a near-tie there, so either "
        f"expert is right and {ev.tensor} differs on those rows only; the layers after it inherit the difference",
        fields={
            "layer": int(layer) if layer.isdigit() else layer,
            "rows": tokens,
            "margins": [float(margin[i]) for i in rows],
            "bounds": [float(bound[i]) for i in rows],
        },
    )
