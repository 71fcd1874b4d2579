"""How llama.cpp picks a DFlash2 drafter's drafts from its candidate lattice, shared by both
producers (plain Python: the in-process driver imports it without torch).

upstream `common_speculative_impl_draft_dflash::draft` (common/speculative.cpp, `is_dflash2`):
the lattice (`dflash2_lattice`, read through `llama_get_embeddings_nextn`, one row of n_embd
floats per block row) holds at row i >= 1 the top-k candidate ids, then top_k x top_k scores
indexed [predecessor][successor]. The walk starts at predecessor 0 (row 1's scores are the same
for every predecessor: its predecessor is the anchor), takes the best successor of each row, and
stops below `--spec-draft-p-min` (the softmax of that row's scores at the pick).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def lattice_drafts(rows: Sequence[Sequence[float]], top_k: int, n_rows: int, p_min: float) -> list[int]:
    """The drafts of one block of `n_rows` rows (anchor included) from its lattice `rows`."""
    out: list[int] = []
    predecessor = 0
    for i in range(1, n_rows):
        row = rows[i]
        scores = [float(s) for s in row[top_k + predecessor * top_k : top_k + (predecessor + 1) * top_k]]
        predecessor = scores.index(max(scores))  # std::max_element: the first best
        if p_min > 0.0 and 1.0 / sum(math.exp(s - scores[predecessor]) for s in scores) < p_min:
            break
        out.append(int(row[predecessor]))
    return out


def lattice_top_k(row: Sequence[float]) -> int | None:
    """The top_k a lattice row was written with: its k ids and k x k scores are the row's values up
    to the last non-zero one (the rest of n_embd is zeros); None for a row of zeros (the anchor's)
    or one whose length fits no k."""
    n = max((i + 1 for i, v in enumerate(row) if v != 0.0), default=0)
    k = (math.isqrt(4 * n + 1) - 1) // 2  # k + k * k = n
    return k if n and k + k * k == n else None


def canonical_rows(rows: list[list[float]], orders: list[list[int] | None]) -> list[list[float]]:
    """The lattice rows with each row's candidates in the order `orders[i]` gives (None: kept),
    its scores' successor axis in the same order and the next row's predecessor axis too, so two
    lattices that list the same candidates in another order (a near-tie of their logits) read alike."""
    out = [list(r) for r in rows]
    before: list[int] | None = None  # the previous row's order: this row's predecessor axis
    for i, (row, order) in enumerate(zip(rows, orders)):
        k = lattice_top_k(row)
        if k is None:  # an anchor row: the next block starts
            before = None
            continue
        succ = order or list(range(k))
        pred = before if before is not None and len(before) == k else list(range(k))
        out[i][:k] = [row[j] for j in succ]
        out[i][k : k + k * k] = [row[k + p * k + s] for p in pred for s in succ]
        before = succ
    return out


def candidate_orders(ref: list[list[float]], run: list[list[float]]) -> list[list[int] | None] | None:
    """Per row, the order that sorts the run's candidates as the reference lists them, where both
    rows hold the same k candidates (None: the row is kept as it is); None when the two lattices
    list the same candidates in the same order everywhere, or in no way one order can mend."""
    orders: list[list[int] | None] = []
    for ref_row, run_row in zip(ref, run):
        k = lattice_top_k(run_row)
        if k is None or lattice_top_k(ref_row) != k:
            orders.append(None)
            continue
        ids_ref, ids_run = [int(v) for v in ref_row[:k]], [int(v) for v in run_row[:k]]
        same = sorted(ids_ref) == sorted(ids_run) and len(set(ids_run)) == k
        orders.append([ids_run.index(t) for t in ids_ref] if same and ids_ref != ids_run else None)
    return orders if any(o is not None for o in orders) else None
