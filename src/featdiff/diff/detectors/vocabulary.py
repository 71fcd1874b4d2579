"""Detector of a reduced-vocabulary mapping (an EAGLE3 drafter's `d2t`) tested as a mapping: the run's
logits put the head's rows on other target ids than the reference's. Consumes one logits pair's
`Evidence` (`result_output`, vocabulary-wide, -inf off the head's rows); returns `Finding | None`.

The reference's open ids (finite, not blanked on both sides) are the GGUF's d2t in ascending order,
so the i-th open id is the head's row i (trainers write d2t ascending; llama.cpp scatters row i to
d2t[i]). Each open id of the run is matched, over every row, with the reference's id whose logits it
carries; the map from the reference's row to the run's id is then named: row i at id i (d2t never
applied), row i at the id of row i + k (the table read k entries off), or another one-to-one table.
"""

from __future__ import annotations

import numpy as np

from featdiff.diff.detectors.base import Evidence, error_finding, fix_by_place, same_shape
from featdiff.diff.fields import WrongSourceFields
from featdiff.diff.result import Finding

MAX_MATCHED = 256  # open ids of the run matched to infer the map (evenly spread)
MIN_MATCHED = 0.95  # the share of them that must carry one reference id's logits
SOURCE_NO_D2T = "no_d2t"  # row i at target id i
SOURCE_D2T_SHIFT = "d2t_shift"  # row i at d2t[i + k]: `d2t_shift+1`
SOURCE_ANOTHER_D2T = "another_d2t"  # a one-to-one map that is neither


def detect_wrong_source_of_vocabulary_map(ev: Evidence) -> Finding | None:
    """Hypothesis: a reduced head's rows land on other target ids than its d2t's (d2t dropped, read
    some entries off, or another table). Evidence: the pair is a reduced head's logits (ids off the
    head on the reference's side, -inf or blanked), the run's open ids differ from the reference's
    or carry other ids' values, and each open id of the run carries, on every row, the logits of
    one open id of the reference (within tolerance), one to one."""
    if not same_shape(ev) or ev.ref.ndim != 2 or ev.is_integer or ev.ref.shape[1] < 2:
        return None
    blank = (ev.ref == 0).all(axis=0) & (ev.run == 0).all(axis=0)  # (V,): off the head on both sides
    ref_on = np.isfinite(ev.ref).all(axis=0) & ~blank  # (V,)
    run_on = np.isfinite(ev.run).all(axis=0) & ~blank  # (V,)
    if ref_on.all() or not ref_on.any() or not run_on.any():
        return None
    ref_ids, run_ids = np.flatnonzero(ref_on), np.flatnonzero(run_on)
    matched = _matched_rows(ev.ref[:, ref_ids], ev.run, run_ids, ev.tolerance.row_rel)
    if matched is None:
        return None
    rows, ids = matched  # the reference's row (rank of its open id) carried by each run id
    if np.array_equal(ref_ids[rows], ids):
        return None  # the same map: not this fault
    source, how = _named_map(rows, ids, ref_ids)
    missing = np.setdiff1d(ref_ids, run_ids)
    lost = f"; target id{'s' if missing.size > 1 else ''} {_ids(missing)} get{'' if missing.size > 1 else 's'} no logit"
    lost = lost if missing.size else ""
    graph_fix = (
        "the graph scatters the head's rows through another map than the GGUF's d2t: write row i at d2t[i] "
        "(llama.cpp's eagle3.cpp: ggml_set_rows of the head's rows at d2t)"
    )
    export_fix = "the GGUF's d2t is not the checkpoint's map: re-export it as absolute target ids, offset + row index"
    return error_finding(
        ev,
        f"{ev.tensor} puts the reduced head's rows on other target ids than the reference's d2t: {how}{lost} "
        f"(each of the run's ids carries one reference id's logits on every row); {fix_by_place(ev, export_fix, graph_fix)}",
        WrongSourceFields(source=source, candidate=ev.record or ev.tensor),
    )


def _matched_rows(ref_open: np.ndarray, run: np.ndarray, run_ids: np.ndarray, row_rel: float):
    """For up to MAX_MATCHED of the run's open ids (evenly spread), the reference row (column of
    `ref_open`, (R, N)) whose logits it carries within `row_rel` of the logits' scale; None unless
    MIN_MATCHED of them carry one and no two carry the same. Returns (rows, ids), sorted by id."""
    take = run_ids[np.linspace(0, run_ids.size - 1, min(MAX_MATCHED, run_ids.size)).round().astype(int)]
    take = np.unique(take)
    cols = run[:, take].astype(np.float64)  # (R, S)
    ref = ref_open.astype(np.float64)  # (R, N)
    scale = float(np.sqrt(np.mean(ref**2))) or 1.0
    # squared distance of every sampled run column to every reference column: (S, N)
    dist = (cols**2).sum(0)[:, None] + (ref**2).sum(0)[None, :] - 2.0 * cols.T @ ref
    best = np.argmin(dist, axis=1)  # (S,)
    err = np.sqrt(np.maximum(dist[np.arange(take.size), best], 0.0) / ref.shape[0]) / scale  # (S,)
    ok = err <= row_rel
    if ok.mean() < MIN_MATCHED or np.unique(best[ok]).size != ok.sum():
        return None
    return best[ok], take[ok]


def _named_map(rows: np.ndarray, ids: np.ndarray, ref_ids: np.ndarray) -> tuple[str, str]:
    """The source name and the sentence of the map row `rows[j]` -> target id `ids[j]`."""
    if np.array_equal(rows, ids):
        return SOURCE_NO_D2T, "row i sits at target id i, as if d2t were never applied"
    rank = {int(t): r for r, t in enumerate(ref_ids)}
    moved = [rank.get(int(u), -1) - int(r) for r, u in zip(rows, ids)]
    if all(u in rank for u in ids.tolist()) and len(set(moved)) == 1:
        k = moved[0]
        entries = f"{abs(k)} entr{'y' if abs(k) == 1 else 'ies'} {'ahead' if k > 0 else 'behind'}"
        return (
            f"{SOURCE_D2T_SHIFT}{k:+d}",
            f"row i sits at d2t[i {'+' if k > 0 else '-'} {abs(k)}], the table read {entries}",
        )
    pairs = ", ".join(f"row {int(r)} at {int(u)} (not {int(ref_ids[r])})" for r, u in list(zip(rows, ids))[:3])
    return SOURCE_ANOTHER_D2T, f"another one-to-one table ({pairs})"


def _ids(ids: np.ndarray) -> str:
    shown = ", ".join(str(int(i)) for i in ids[:4])
    return shown + (f" and {ids.size - 4} more" if ids.size > 4 else "")
