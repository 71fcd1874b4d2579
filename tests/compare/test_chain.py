"""Chained MTP heads (diff/detectors/chain.py): draft step k runs head k, the graph's layer
n_layer + k, over the round's rows so far. On synthetic manifests of that flow the head detector
names a step that ran another head (head k for step k + 1, the same head every step) and stays
silent on the clean chain and a single head; on synthetic rows the weights detector names a head
computed with another head's weights (placed by the export evidence) and the state detector a
chain handed the pending row at every position."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from featdiff.core.phases import Phase
from featdiff.diff import detectors as d
from featdiff.diff import positions
from featdiff.diff.attribution import place
from featdiff.diff.detectors.chain import CHAIN_HEAD_SOURCE, CHAIN_STATE_SOURCE
from featdiff.diff.export import Export
from featdiff.diff.tolerance import Tolerance
from featdiff.dump import Manifest
from featdiff.dump.records import Eval
from featdiff.dump.writer import record_from_array

PROMPT = (5, 6, 7, 8, 9)
N_LAYER = 4  # the target's layers: head k is layer 4 + k
STEPS = (2, 3, 4)  # evals of round 1's draft: step k decodes k + 1 rows from position 4
TOL = Tolerance(rel=1e-3, sources=("test",))


def chain_evals() -> list[Eval]:
    """Prefill 0..3, the catch-up decode, round 1's three chained steps (step k: positions 4..4+k)."""
    rows = [
        ("target", Phase.PREFILL, (0, 1, 2, 3), PROMPT[:4], 0),
        ("draft", Phase.INJECT, (0, 1, 2, 3), PROMPT[:4], 0),
        ("draft", Phase.DRAFT, (4,), (9,), 1),
        ("draft", Phase.DRAFT, (4, 5), (9, 11), 1),
        ("draft", Phase.DRAFT, (4, 5, 6), (9, 11, 12), 1),
        ("target", Phase.VERIFY, (4, 5, 6, 7), (9, 11, 12, 13), 1),
    ]
    return [
        Eval(i, role, phase, len(pos), pos, toks, (0,) * len(pos), rnd)  # type: ignore[arg-type]
        for i, (role, phase, pos, toks, rnd) in enumerate(rows)
    ]


def chain_manifest(heads: tuple[int, ...], source: str = "llama.cpp") -> Manifest:
    """The round's steps each recording the head's records under layer N_LAYER + heads[k]."""
    records = tuple(
        record_from_array(f"r{ev}_{name}", "draft", Phase.DRAFT, ev, f"{name}-{N_LAYER + head}", 0, np.zeros((1, 4)))[0]
        for ev, head in zip(STEPS, heads, strict=True)
        for name in ("mtp_enorm", "mtp_hnorm", "h_nextn")
    )
    return Manifest(source, {"draft": {"architecture": "mimo2"}}, {}, tuple(chain_evals()), records, (), PROMPT)


REF = chain_manifest((0, 1, 2), source="reference")


def test_the_same_head_for_every_step_is_named_at_the_first_step_it_ran_for():
    f = d.detect_wrong_source_of_chain_head(REF, chain_manifest((0, 0, 0)))
    assert f is not None and (f.kind, f.tensor, f.fields["eval"]) == ("wrong_source", "mtp_enorm-4", STEPS[1])
    assert (f.fields["source"], f.fields["candidate"], f.fields["where"]) == (
        CHAIN_HEAD_SOURCE,
        "layer 5 (head 1)",
        "driver",
    )
    assert f.message.startswith("head 0 ran for draft step 1 of round 1 (its records name layer 4")
    assert "every step ran head 0: the same head for every step" in f.message


def test_head_k_run_for_step_k_plus_1_is_named_as_the_lagging_offset():
    f = d.detect_wrong_source_of_chain_head(REF, chain_manifest((0, 0, 1)))
    assert f is not None and f.message.startswith("head 0 ran for draft step 1 of round 1")
    assert "ran the head of the step before (head k for step k + 1)" in f.message
    f = d.detect_wrong_source_of_chain_head(REF, chain_manifest((2, 1, 0)))
    assert f is not None and f.message.startswith("head 2 ran for draft step 0")
    assert "the steps ran heads 2, 1, 0" in f.message


def test_chain_head_silent_on_the_clean_chain_and_a_single_head():
    assert d.detect_wrong_source_of_chain_head(REF, chain_manifest((0, 1, 2))) is None
    single = chain_manifest((0, 0, 0), source="reference")  # one head for every step: not a chain
    assert d.detect_wrong_source_of_chain_head(single, chain_manifest((0, 0, 0))) is None
    no_head = replace(chain_manifest((0, 0, 0)), records=())  # a run without the head's records: nothing to say
    assert d.detect_wrong_source_of_chain_head(REF, no_head) is None


def test_check_batches_names_the_head_a_step_ran():
    found = positions.check_batches(REF, chain_manifest((0, 0, 0)))
    assert [(f.kind, f.fields["source"], f.fields["eval"]) for f in found] == [
        ("wrong_source", CHAIN_HEAD_SOURCE, STEPS[1])
    ]
    assert positions.check_batches(REF, chain_manifest((0, 1, 2))) == ()


# --- whose weights, and what state -------------------------------------------------------------


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)


def _evidence(record: str, ref: np.ndarray, run: np.ndarray, candidates=None, where="unknown") -> d.Evidence:
    pos = tuple(range(20, 20 + len(ref)))
    return d.Evidence(
        record, ref, run, TOL, positions=pos, record=record, candidates=candidates or {}, weights_where=where
    )


def test_a_head_computed_with_another_heads_weights_is_named_with_the_export_fix():
    heads = {j: _rows(2, seed=j) for j in range(3)}
    cands = {f"h_nextn@head={j}": a for j, a in heads.items()}
    f = d.detect_wrong_source_of_chain_weights(_evidence("h_nextn", heads[1], heads[2], cands, where="export"))
    assert f is not None and (f.kind, f.fields) == (
        "wrong_source",
        {"source": CHAIN_HEAD_SOURCE, "candidate": "h_nextn@head=2"},
    )
    assert f.message.startswith(
        "h_nextn is what head 2 computes from these inputs, where layer n_layer + 1 is head 1's"
    )
    assert "the GGUF's block of head 1 holds head 2's weights" in f.message
    assert place(f, Export({}, {}), ()).where != "driver"  # another weight, not a state handed over


def test_chain_weights_silent_when_the_run_is_its_own_head_or_no_head():
    heads = {j: _rows(2, seed=j) for j in range(3)}
    cands = {f"h_nextn@head={j}": a for j, a in heads.items()}
    assert d.detect_wrong_source_of_chain_weights(_evidence("h_nextn", heads[1], heads[1], cands)) is None
    assert d.detect_wrong_source_of_chain_weights(_evidence("h_nextn", heads[1], _rows(2, 9), cands)) is None
    assert d.detect_wrong_source_of_chain_weights(_evidence("h_nextn", heads[1], heads[2])) is None  # no candidates


def test_a_chain_handed_the_pending_row_everywhere_is_a_wrong_source_chain_state():
    for record in ("mtp_h_input", "mtp_hnorm-4"):
        ref = _rows(3, seed=0)
        run = np.repeat(ref[:1], 3, axis=0)
        f = d.detect_wrong_source_of_chain_state(_evidence(record, ref, run))
        assert f is not None and (f.kind, f.tensor) == ("wrong_source", record)
        assert f.fields == {"source": CHAIN_STATE_SOURCE, "candidate": f"{record} row 0 (position 20)"}
        assert f.message.startswith(f"{record} of draft step 2 (positions 20..22) holds the pending row")
        assert place(f, Export({}, {}), ()).where == "driver"


def test_chain_state_silent_on_the_clean_chain_other_records_and_other_rows():
    ref = _rows(3, seed=0)
    pending = np.repeat(ref[:1], 3, axis=0)
    assert d.detect_wrong_source_of_chain_state(_evidence("mtp_h_input", ref, ref.copy())) is None
    assert d.detect_wrong_source_of_chain_state(_evidence("l_out-0", ref, pending)) is None
    noise = ref.copy()
    noise[1:] = _rows(2, seed=5)
    assert d.detect_wrong_source_of_chain_state(_evidence("mtp_h_input", ref, noise)) is None
    assert d.detect_wrong_source_of_chain_state(_evidence("mtp_h_input", ref[:1], pending[:1])) is None
