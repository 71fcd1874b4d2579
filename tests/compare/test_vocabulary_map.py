"""A reduced head's d2t map tested as a map (issue 42 item 2): logits whose rows land on other target
ids than the reference's are a `wrong_source` naming the map (d2t never applied, the table read k
entries off, another table), never `nonfinite`; a right map, a full-vocabulary head and values that
are no reference id's are left to the other detectors."""

from __future__ import annotations

import numpy as np
import pytest

from featdiff.diff import detectors as d
from featdiff.diff.aligned import comparable_values
from featdiff.diff.detectors import Evidence
from featdiff.diff.diagnose import CHAIN
from featdiff.diff.tolerance import Tolerance

TOL = Tolerance(rel=4e-3, sources=("test",))
R, V, N = 6, 64, 24  # rows, target vocabulary, head rows
RNG = np.random.default_rng(7)
D2T = np.sort(RNG.choice(np.arange(N // 2, V), N, replace=False))  # ascending absolute ids, past row N
HEAD = RNG.standard_normal((R, N)).astype(np.float32)  # (R, N): the reduced head's logits


def scattered(ids: np.ndarray, head: np.ndarray = HEAD) -> np.ndarray:
    """The head's columns at target ids `ids` (one per head row kept), -inf elsewhere: (R, V)."""
    out = np.full((R, V), -np.inf, dtype=np.float32)
    out[:, ids] = head[:, : ids.size]
    return out


def evidence(run: np.ndarray, ref: np.ndarray | None = None, **kw) -> Evidence:
    """The pair as compare hands it to the chain: the same infinities blanked on both sides."""
    ref, run = comparable_values("result_output", scattered(D2T) if ref is None else ref, run)
    return Evidence(tensor="result_output", record="result_output", ref=ref, run=run, tolerance=TOL, **kw)


def noisy(a: np.ndarray) -> np.ndarray:
    return a + np.where(np.isfinite(a), 1e-5 * RNG.standard_normal(a.shape), 0).astype(np.float32)


def test_d2t_never_applied_is_a_wrong_source_no_d2t_with_the_graphs_fix():
    f = d.detect_wrong_source_of_vocabulary_map(evidence(noisy(scattered(np.arange(N))), weights_where="graph"))
    assert f is not None and f.kind == "wrong_source" and f.fields["source"] == "no_d2t", f
    assert "row i sits at target id i" in f.message and "the graph scatters" in f.message
    assert "re-export" not in f.message  # the GGUF is the reference's own: never tell the user to rewrite it


@pytest.mark.parametrize("k", [1, -1, 2])
def test_the_table_read_k_entries_off_is_a_wrong_source_naming_the_shift(k):
    rows = np.arange(max(0, -k), N - max(0, k))  # the head rows that still land somewhere
    run = np.full((R, V), -np.inf, dtype=np.float32)
    run[:, D2T[rows + k]] = HEAD[:, rows]
    f = d.detect_wrong_source_of_vocabulary_map(evidence(noisy(run)))
    assert f is not None and f.fields["source"] == f"d2t_shift{k:+d}", f
    assert f"d2t[i {'+' if k > 0 else '-'} {abs(k)}]" in f.message
    assert str(int(D2T[0 if k > 0 else -1])) in f.message  # the id no row lands on any more


def test_another_one_to_one_table_is_named_as_such_with_the_export_fix():
    perm = np.random.default_rng(3).permutation(V)[:N]  # ids drawn anew, unordered
    run = np.full((R, V), -np.inf, dtype=np.float32)
    run[:, perm] = HEAD
    f = d.detect_wrong_source_of_vocabulary_map(evidence(run, weights_where="export"))
    assert f is not None and f.fields["source"] == "another_d2t", f
    assert "re-export" in f.message


def test_the_right_map_with_noise_is_not_claimed():
    assert d.detect_wrong_source_of_vocabulary_map(evidence(noisy(scattered(D2T)))) is None


def test_a_full_vocabulary_head_is_not_claimed():
    ref = RNG.standard_normal((R, V)).astype(np.float32)
    assert d.detect_wrong_source_of_vocabulary_map(evidence(ref[:, ::-1].copy(), ref=ref)) is None


def test_values_no_reference_id_carries_are_not_claimed():
    run = scattered(np.arange(N), head=RNG.standard_normal((R, N)).astype(np.float32))  # another head's logits
    assert d.detect_wrong_source_of_vocabulary_map(evidence(run)) is None


def test_the_chain_names_a_dropped_map_before_nonfinite():
    ev = evidence(scattered(np.arange(N)))
    assert d.detect_nonfinite(ev) is not None  # what compare said before the map was tested
    first = next(f for f in (detect(ev) for detect in CHAIN) if f is not None)
    assert (first.kind, first.fields["source"]) == ("wrong_source", "no_d2t")
