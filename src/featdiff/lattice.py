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
