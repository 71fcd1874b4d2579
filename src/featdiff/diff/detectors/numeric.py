"""Detectors of values: rows that are plainly broken (NaN/Inf, never written, an earlier eval's),
a scale (one factor, or one per channel: a norm's weight), RoPE angles, and the divergence and
numeric noise no cause explains. Each `detect_<kind>(ev)` tests one hypothesis on one divergent
pair's `Evidence` and returns `Finding | None`; its sentence is written beside it.
"""

from __future__ import annotations

import numpy as np

from featdiff.core import names
from featdiff.diff.detectors.base import (
    Evidence,
    Rope,
    at_positions,
    error_finding,
    explains,
    fix_by_place,
    labels,
    rotate,
    same_shape,
)
from featdiff.diff.fields import (
    DivergenceFields,
    NonfiniteFields,
    NumericNoiseFields,
    ScaleFields,
    StaleFields,
    WrongSourceFields,
    ZerosFields,
)
from featdiff.diff.metrics import relative_error, row_relative_error
from featdiff.diff.result import Finding
from featdiff.diff.tolerance import Tolerance

# wrong_source's `source` at an MTP head's input: a pending hidden kept from an earlier request
STALE_PENDING_SOURCE = "stale_pending"
MIN_CHANNEL_ROWS = 4  # rows: below this a factor per channel fits almost any pair of rows


# --- values that are plainly broken --------------------------------------------------------------


def detect_nonfinite(ev: Evidence) -> Finding | None:
    """Hypothesis: the run wrote NaN/Inf. Evidence: non-finite values in run rows."""
    bad = ~np.isfinite(ev.run).all(axis=1)
    if not bad.any():
        return None
    rows = labels(ev, bad)
    return error_finding(
        ev,
        f"{ev.tensor} holds NaN/Inf at {at_positions(rows)} while its inputs are finite; "
        f"check the op that writes it (an uninitialized or overrun buffer, a division by zero)",
        NonfiniteFields(rows=rows),
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
    rows = labels(ev, zero)
    return error_finding(
        ev,
        f"{ev.tensor} is all zeros at {at_positions(rows)}; the rows were never written: "
        f"check that the buffer is filled before this eval",
        ZerosFields(rows=rows),
    )


def detect_wrong_source_of_zero_rows(ev: Evidence) -> Finding | None:
    """Hypothesis: rows the convention leaves zero hold a state: an MTP head's first row of a
    sequence (no hidden before it) handed a pending row a driver kept from an earlier request.
    Evidence: all-zero ref rows where the run's are not, at an MTP head's hidden input, and every
    other row within tolerance."""
    if ev.record != names.MTP_H_INPUT and not ev.record.startswith(f"{names.MTP_HNORM}-") or not same_shape(ev):
        return None
    zero = ~np.any(ev.ref, axis=1) & np.any(ev.run, axis=1)
    rest_ok = not (~zero).any() or explains(ev.ref[~zero], ev.run[~zero], ev.tolerance)
    if not zero.any() or not rest_ok:
        return None
    return error_finding(
        ev,
        f"{ev.tensor} at {at_positions(labels(ev, zero))} pairs the first token of a sequence with a hidden state "
        "where the head takes zeros (no position before it): the driver kept a pending row from an earlier request "
        "or sequence (upstream's MTP driver keeps its pending hidden, pending_h, past a llama-server request and "
        "hands it to the slot's next prompt: common_speculative_impl_draft_mtp::process); reset the pending hidden "
        "when a sequence starts",
        WrongSourceFields(source=STALE_PENDING_SOURCE, candidate=f"{ev.record} (zeros)"),
    )


def detect_wrong_source_of_pending_row(ev: Evidence) -> Finding | None:
    """Hypothesis: an MTP head's first row past a kept prefix (a prompt cache kept positions
    0 .. kept-1) was handed a pending hidden the driver kept from another request, where the head
    takes the hidden of position kept-1. Evidence: at the head's hidden input, the row at position
    `kept` is the only one outside tolerance."""
    is_head_input = ev.record == names.MTP_H_INPUT or ev.record.startswith(f"{names.MTP_HNORM}-")
    if not is_head_input or not ev.kept or ev.kept not in ev.positions or not same_shape(ev):
        return None
    bad = row_relative_error(ev.ref, ev.run) > ev.tolerance.row_rel
    first = np.asarray(ev.positions) == ev.kept
    if not np.array_equal(bad, first):
        return None
    return error_finding(
        ev,
        f"{ev.tensor} at position {ev.kept}, the first past the {ev.kept} positions the program kept for this "
        f"request, holds another hidden state than that of position {ev.kept - 1}: upstream's MTP driver hands a "
        "batch's first token the pending hidden of its last process() call on the sequence "
        "(common_speculative_impl_draft_mtp::process, pending_h), here another request's; hand it the hidden of "
        "the last kept position",
        WrongSourceFields(source=STALE_PENDING_SOURCE, candidate=f"{ev.record} (the hidden of position {ev.kept - 1})"),
    )


def detect_stale_rows(ev: Evidence) -> Finding | None:
    """Hypothesis: rows hold data of an earlier eval (a buffer not refreshed). Evidence: every
    divergent run row equals, within tolerance, a ref row of this record from an earlier eval;
    `source_eval` is the run's eval that computed that row (the run's numbering, docs/findings.md).
    (The draft KV cache's stale rows: kvcache.detect_stale_cache.) Not on token rows (EAGLE3's
    decoder `inp_embd`): the same token embeds alike in every round, and token ids are compared
    exactly (diff/positions.py)."""
    if ev.earlier is None or not len(ev.earlier) or not same_shape(ev) or ev.record == names.ENC_INP_EMBD:
        return None
    bad = row_relative_error(ev.ref, ev.run) > ev.tolerance.row_rel
    best, err = _nearest_rows(ev.run[bad], ev.earlier)
    if not bad.any() or not np.all(err <= ev.tolerance.row_rel):
        return None
    rows = labels(ev, bad)
    source = ev.earlier_evals[int(best[0])] if ev.earlier_evals else None
    came_from = f"eval {source}, an earlier round" if source is not None else "an earlier round the run has no eval of"
    return error_finding(
        ev,
        f"{ev.tensor} at {at_positions(rows)} repeats data from {came_from}; "
        f"the buffer is not refreshed before this eval",
        StaleFields(rows=rows, source_eval=source),
    )


def _nearest_rows(rows: np.ndarray, pool: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each row, the index of the nearest pool row and their relative distance."""
    r, p = rows.astype(np.float64), pool.astype(np.float64)
    pp = np.einsum("ij,ij->i", p, p)  # (E,)
    dist2 = np.einsum("ij,ij->i", r, r)[:, None] + pp[None, :] - 2 * r @ p.T  # (n, E)
    rel = np.sqrt(np.maximum(dist2, 0.0) / np.maximum(pp[None, :], 1e-30))  # (n, E)
    best = np.argmin(rel, axis=1) if rel.size else np.zeros(0, dtype=np.int64)
    return best, rel[np.arange(len(best)), best]


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
        ev,
        f"{ev.tensor} is {c:.4g} x the reference; look for a missing or "
        f"doubled scale (embedding scale, attention scale, norm weight)",
        ScaleFields(factor=round(c, 6)),
    )


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
            ev,
            f"{ev.tensor} is the reference times one factor per channel{where}, the same on every row "
            f"({spread.min():.3g}..{spread.max():.3g}{f', repeating every {head} values' if per_head else ''}): "
            f"the weight of {norm} is missing or another one; "
            + fix_by_place(
                ev,
                "the GGUF's norm weight feeding it is not the checkpoint's (a converter that drops a norm's weights "
                "writes ones): export it from the checkpoint",
                "the graph multiplies it by another norm's weight, or none (the GGUF's weights are the "
                "reference's): check which norm tensor the graph reads there",
            ),
            ScaleFields(
                factor=round(float(np.mean(spread)), 6),
                factors=tuple(round(float(x), 6) for x in spread),
                detail=f"per channel{where}" + (f", per head of {head}" if per_head else ""),
            ),
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


# --- RoPE angles ---------------------------------------------------------------------------------


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
            ev,
            _rope_message(ev.tensor, differ, angle.shape[2], c, ev.rope.base, ev.tolerance),
            DivergenceFields(
                metric="nmse",
                value=float(relative_error(ev.ref, ev.run) ** 2),
                tolerance=ev.tolerance.nmse,
                detail="rope",
                pairs=tuple(int(i) for i in differ),
            ),
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


# --- no specific cause ---------------------------------------------------------------------------


def detect_divergence(ev: Evidence, nmse: float) -> Finding:
    """Hypothesis: none the chain knows; the pair differs beyond tolerance (or its shapes could not
    be reconciled). Evidence: the metric against its tolerance; always a finding, the chain's last."""
    tol = ev.tolerance
    if not same_shape(ev):
        return error_finding(
            ev,
            f"{ev.tensor} has {ev.run.shape[0]} rows of {ev.run.shape[1]} values where the "
            f"reference has {ev.ref.shape[0]} of {ev.ref.shape[1]}; check the tensor's shape in the run's graph",
            DivergenceFields(metric="shape", value=tuple(ev.run.shape), tolerance=tuple(ev.ref.shape)),
        )
    return error_finding(
        ev,
        f"{ev.tensor} differs from the reference (NMSE {nmse:.3g}, tolerance "
        f"{tol.nmse:.3g} from {', '.join(tol.sources)}) and no known wiring fault explains it; "
        f"open the report to compare it row by row",
        DivergenceFields(metric="nmse", value=nmse, tolerance=tol.nmse),
    )


def detect_numeric_noise(tensor: str, nmse: float, tol: Tolerance) -> Finding | None:
    """Hypothesis: the largest difference left is what the dtypes explain. Evidence: the worst
    within-tolerance pair has NMSE > 0 (identical dumps give no finding)."""
    if not nmse > 0.0:
        return None
    return Finding.of(
        NumericNoiseFields(metric="nmse", value=nmse, tolerance=tol.nmse),
        tensor=tensor,
        severity="info",
        message=f"the largest difference, at {tensor} (NMSE {nmse:.3g}), is within what "
        f"{', '.join(tol.sources)} explain (tolerance {tol.nmse:.3g})",
    )
