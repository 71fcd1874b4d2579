"""Applying an alignment (STYLE §1: plan, then execute): align.py plans how two records correspond, this
module pairs their arrays row by row as the plan says."""

from __future__ import annotations

import numpy as np

from featdiff.core import names
from featdiff.diff.metrics import as_rows
from featdiff.diff.result import Alignment
from featdiff.kinds.dflash import dflash2 as lattice


def side_rows(arrays: list[np.ndarray]) -> np.ndarray:
    """The records of one side stacked along rows: (sum of n_tokens, D)."""
    rows = [as_rows(a) for a in arrays]
    return rows[0] if len(rows) == 1 else np.concatenate(rows, axis=0)  # (n_rows, D)


def pair_arrays(
    alignment: Alignment, ref_rows: np.ndarray, run_rows: np.ndarray, name: str = ""
) -> tuple[np.ndarray, np.ndarray]:
    """Apply an alignment: the compared (R, D) rows of ref and run, in the same order, with the
    values that carry no evidence zeroed on both sides (`comparable_values`)."""
    if not alignment.comparable:
        raise ValueError(f"{alignment.run_key}: not comparable ({alignment.layout})")
    if alignment.positions:
        ref_rows, run_rows = _take(ref_rows, alignment.rows), _take(run_rows, alignment.run_rows)  # (R, D) each
    ref_rows, run_rows = comparable_values(name, ref_rows, run_rows)
    return ref_rows, in_ref_candidate_order(name, ref_rows, run_rows)


def in_ref_candidate_order(name: str, ref: np.ndarray, run: np.ndarray) -> np.ndarray:
    """`run`, a DFlash2 `dflash2_lattice`, with each row's candidates in the reference's order
    where both list the same candidates (featdiff.kinds.dflash.dflash2.candidate_orders): the selector lists
    its top-k by logit, and two nearly equal logits swap places with the f16 cache, which changes
    no draft the walk takes; other records, and candidates that differ, are left as they are."""
    if name != names.DFLASH2_LATTICE or ref.shape != run.shape or ref.ndim != 2:
        return run
    orders = lattice.candidate_orders(ref.tolist(), run.tolist())
    if orders is None:
        return run
    return np.asarray(lattice.canonical_rows(run.tolist(), orders), dtype=run.dtype)  # (R, D)


def comparable_values(name: str, ref: np.ndarray, run: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`ref`, `run` with the values that carry no evidence set to 0 on both sides:

    * the same infinity on both sides: a reduced-vocabulary drafter's logits (`d2t`) are -inf off
      its rows by construction, in the graph and in the reference alike;
    * -inf in the run's `draft_logits` where the reference is finite: llama.cpp's backend sampler
      (its default for the draft) keeps its top-k candidates only, so the preload reads back those
      and nothing else (docs/records.md).

    An infinity (or NaN) the run alone holds anywhere else stays: that is a fault.
    """
    if ref.shape != run.shape or ref.dtype.kind != "f" or np.isfinite(run).all():
        return ref, run
    blank = np.isinf(ref) & (ref == run)
    if name in names.TRUNCATED_READBACKS:
        blank |= np.isneginf(run) & np.isfinite(ref)
    if not blank.any():
        return ref, run
    return np.where(blank, 0.0, ref).astype(ref.dtype), np.where(blank, 0.0, run).astype(run.dtype)


def _take(rows: np.ndarray, index: tuple[int, ...]) -> np.ndarray:
    """rows[index], without a copy when index is every row in order."""
    if len(index) == len(rows) and np.array_equal(index, np.arange(len(rows))):
        return rows
    return rows[list(index)]  # (len(index), D)
