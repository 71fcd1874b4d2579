"""A DFlash2 lattice whose rows list the same candidates in another order (two nearly equal
logits swapped by the f16 cache) reads like the reference's once put in its order; one with
other candidates is left as it is. Pure: hand-made lattices of top_k 2."""

from __future__ import annotations

import numpy as np

from featdiff.core.names import DFLASH2_LATTICE
from featdiff.diff.aligned import in_ref_candidate_order
from featdiff.kinds.dflash.dflash2 import candidate_orders, canonical_rows, lattice_drafts, lattice_top_k

K = 2
ANCHOR = [0.0] * 8
# row 1: candidates 10, 11 (scores the same for each predecessor); row 2: 20, 21, scores [pred][succ]
REF = [ANCHOR, [10.0, 11.0, 1.0, 5.0, 1.0, 5.0, 0.0, 0.0], [20.0, 21.0, 9.0, 2.0, 3.0, 7.0, 0.0, 0.0]]


def _swapped(rows: list[list[float]]) -> list[list[float]]:
    """The same lattice with row 1's two candidates listed the other way round."""
    r1, r2 = list(rows[1]), list(rows[2])
    r1[:6] = [11.0, 10.0, 5.0, 1.0, 5.0, 1.0]  # ids and both predecessors' successor scores swapped
    r2[2:6] = [3.0, 7.0, 9.0, 2.0]  # predecessor axis swapped: its rows follow row 1's order
    return [rows[0], r1, r2]


def test_a_rows_top_k_is_read_from_its_values():
    assert lattice_top_k(REF[1]) == K and lattice_top_k(ANCHOR) is None
    assert lattice_top_k([1.0, 2.0, 3.0, 0.0]) is None  # 3 values fit no k + k * k


def test_candidates_in_another_order_read_like_the_references_and_walk_alike():
    run = _swapped(REF)
    orders = candidate_orders(REF, run)
    assert orders == [None, [1, 0], None]
    assert canonical_rows(run, orders) == REF
    assert lattice_drafts(run, K, 3, 0.0) == lattice_drafts(REF, K, 3, 0.0) == [11, 21]
    mended = in_ref_candidate_order(DFLASH2_LATTICE, np.array(REF), np.array(run))
    assert np.array_equal(mended, np.array(REF))


def test_other_candidates_or_other_records_are_left_as_they_are():
    other = [REF[0], [10.0, 12.0, *REF[1][2:]], REF[2]]
    assert candidate_orders(REF, other) is None
    run = np.array(_swapped(REF))
    assert np.array_equal(in_ref_candidate_order("result_output", np.array(REF), run), run)
