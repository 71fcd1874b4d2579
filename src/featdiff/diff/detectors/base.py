"""What the value detectors look at, and what they share: the `Evidence` of one divergent pair
(its aligned rows plus the reference candidates diff/evidence.py gathered), the test that an
expected array explains the run's within tolerance, RoPE rotation, and how rows are named in a
sentence. Pure: no I/O, no randomness, no printing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from featdiff.core import names
from featdiff.diff.fields import Fields, Where
from featdiff.diff.metrics import relative_error, row_relative_error
from featdiff.diff.result import Finding
from featdiff.diff.sketch import LayerMatch
from featdiff.diff.tolerance import Tolerance
from featdiff.kinds.registry import KINDS, DrafterKind


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
    earlier_evals: tuple[int | None, ...] = ()  # the run's eval of each earlier row (None: the run has none)
    layers: LayerMatch | None = None
    n_extract: int = 0
    rope: Rope | None = None
    is_integer: bool = False  # integer data (positions, token ids): compared exactly
    record: str = ""  # the reference's name of the pair (`tensor` is the run's)
    absent: tuple[str, ...] = ()  # ref records of this eval group the run's graph lacks
    kind: DrafterKind = KINDS[0]  # the drafter's kind (featdiff.kinds): its layer key and rule
    # at draft_logits: (what the run's sampler read, as stored; the run graph's own result_output)
    # rows of the same evals, aligned like `run`; None elsewhere, or when the run lacks either
    sampled: tuple[np.ndarray, np.ndarray] | None = None
    # where a node computed wrong from right inputs lives (diff/attribution.py): `export` when the
    # run's GGUF differs from what the reference read, `graph` when it read the same keys and
    # tensors, else `unknown`; a fix sentence that names the GGUF or the graph follows it
    weights_where: Where = "unknown"
    # an EAGLE3 reference's HF checkpoint (the ref manifest's models.draft.checkpoint: its trainer and
    # what its layer ids mean, docs/dump.md); None: the reference read a GGUF, or another kind
    checkpoint: Mapping[str, object] | None = None
    # the positions the flow's sequence held from an earlier request when its prefill began (its
    # `n_cached`: a prompt cache kept or restored them); 0: none, or a dump of one flow from position 0
    kept: int = 0
    # in a run of several flows: the run's rows of the same record in the other flows' evals beside
    # the pair's (the other sequences of the decodes a program split per sequence), (S, D), and
    # each row's (flow, sequence, position); None: one flow, or none beside it
    siblings: np.ndarray | None = None
    sibling_rows: tuple[tuple[int, int, int | None], ...] = ()


def same_shape(ev: Evidence) -> bool:
    return ev.ref.shape == ev.run.shape


def explains(expected: np.ndarray, run: np.ndarray, tol: Tolerance) -> bool:
    """run equals `expected` within tolerance: over the whole array and row by row."""
    if expected.shape != run.shape or run.size == 0:
        return False
    if relative_error(expected, run) > tol.rel:
        return False
    return bool(np.all(row_relative_error(expected, run) <= tol.row_rel))


def error_finding(ev: Evidence, message: str, fields: Fields) -> Finding:
    """The error finding of `fields`' kind about the pair's run record."""
    return Finding.of(fields, tensor=ev.tensor, message=message)


def fix_by_place(ev: Evidence, export_fix: str, graph_fix: str) -> str:
    """The fix a user acts on, by where the evidence puts a node's fault (`ev.weights_where`): the
    GGUF's, the graph's, or both named with what tells them apart when it is not known."""
    if ev.weights_where == "export":
        return export_fix
    if ev.weights_where == "graph":
        return graph_fix
    return f"either {export_fix}, or {graph_fix} (a reference made from the run's own GGUF tells which)"


def labels(ev: Evidence, mask: np.ndarray) -> tuple[int, ...]:
    """Positions of the masked rows (row indices when the pair is not row-wise)."""
    idx = np.flatnonzero(mask)
    return tuple(int(ev.positions[i]) for i in idx) if ev.positions else tuple(int(i) for i in idx)


def at_positions(rows: tuple[int, ...]) -> str:
    """`positions 3..5`, `position 3`, `positions 3, 7`: rows as a sentence names them."""
    if len(rows) > 1 and rows == tuple(range(rows[0], rows[-1] + 1)):
        return f"positions {rows[0]}..{rows[-1]}"
    return f"position{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows[:8]))}{' ...' if len(rows) > 8 else ''}"


def span(positions) -> str:
    """`3..5` for consecutive positions, else the first eight comma-separated."""
    p = list(positions)
    if len(p) > 1 and p == list(range(p[0], p[0] + len(p))):
        return f"{p[0]}..{p[-1]}"
    return ", ".join(map(str, p[:8])) + (" ..." if len(p) > 8 else "")


def shifts(limit: int) -> list[int]:
    """1, -1, 2, -2, ... up to `limit`: the nearest shifts first."""
    return [s for k in range(1, limit + 1) for s in (k, -k)]


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
