"""A correct block read from the wrong rows: a DSpark drafter run as plain DFlash (llama.cpp's
`--spec-type draft-dflash`) drafts from the row after the anchor, an anchor-first DSpark block from
row 0. compare names it `wrong_source` at `draft_logits` instead of a generic divergence
(detect_wrong_source_of_drafts; the real run: tests/test_converter.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from featdiff.core.names import DRAFT_LOGITS, KEY_SAMPLE_FROM_ANCHOR
from featdiff.core.phases import Phase
from featdiff.diff import diagnose
from featdiff.diff.attribution import attributed
from featdiff.diff.detectors import (
    detect_divergence_by_margin,
    detect_wrong_source_of_drafts,
    detect_wrong_source_of_sampled_draft,
)
from featdiff.diff.export import Export
from featdiff.diff.partings import Parting, _own_choice, _read_from
from featdiff.dump.manifest import Manifest
from featdiff.dump.records import Eval, Record

# An anchor-first block of 4 rows whose argmaxes are 5, 6, 7, 8
LOGITS = np.full((4, 16), -1.0)
LOGITS[np.arange(4), [5, 6, 7, 8]] = 3.0


def _parting(other: int | None, margin: float = 4.0) -> Parting:
    return Parting(Phase.DRAFT, 1, 0, 12, 7, DRAFT_LOGITS, 5, 6, margin, 0.01, other_first_row=other)


def test_drafts_read_from_the_row_after_the_anchor_are_found():
    assert _read_from(LOGITS, (6, 7, 8), 1) == 1  # what draft-dflash drafts from this block
    assert _read_from(LOGITS, (6, 7, 9), 1) is None  # one draft off: not that reading
    assert _read_from(LOGITS, (5, 6, 7, 8), 1) is None  # more drafts than rows after row 1
    assert _read_from(LOGITS, (), 1) is None and _read_from(LOGITS, (5,), -1) is None


def test_the_other_reading_is_a_wrong_source_naming_the_spec_type():
    f = detect_wrong_source_of_drafts(_parting(1))
    assert f is not None and (f.kind, f.severity, f.tensor) == ("wrong_source", "error", DRAFT_LOGITS)
    assert f.fields == {"source": "rows from 1", "candidate": DRAFT_LOGITS}
    assert "--spec-type draft-dspark" in f.message and KEY_SAMPLE_FROM_ANCHOR in f.message


def test_no_other_reading_or_a_near_tie_is_left_to_the_margin_detectors():
    assert detect_wrong_source_of_drafts(_parting(None)) is None
    assert detect_wrong_source_of_drafts(_parting(1, margin=0.001)) is None  # within the noise
    assert detect_wrong_source_of_drafts(replace(_parting(1), phase=Phase.VERIFY)) is None


def test_the_named_reading_replaces_the_generic_divergence():
    found = diagnose.parting_findings((_parting(1),), explained=False)
    assert [f.kind for f in found] == ["wrong_source"]
    plain = diagnose.parting_findings((_parting(None),), explained=False)
    assert [f.kind for f in plain] == ["divergence"] and detect_divergence_by_margin(_parting(None)) is not None


# A draft the driver sampled from another row: the run's own read-back row puts another token first.


def _sampled_elsewhere(own: int | None, own_margin: float, observed: int = 6) -> Parting:
    p = _parting(None)
    return replace(p, observed=observed, own_choice=own, own_margin=own_margin)


def test_a_draft_its_own_row_does_not_put_first_is_sampled_from_another_row_in_the_driver():
    f = detect_wrong_source_of_sampled_draft(_sampled_elsewhere(own=5, own_margin=9.0))
    assert f is not None and (f.kind, f.tensor) == ("wrong_source", DRAFT_LOGITS)
    assert f.fields == {"source": "another_row_sampled", "candidate": DRAFT_LOGITS}
    assert "token 5 first (the reference's argmax too)" in f.message and "idx" in f.message
    placed = attributed((f,), Export(roles={}, gguf={}), ())[0]
    assert placed.fields["where"] == "driver"
    found = diagnose.parting_findings((_sampled_elsewhere(own=5, own_margin=9.0),), explained=False)
    assert [(g.kind, g.fields.get("source")) for g in found] == [("wrong_source", "another_row_sampled")]


def test_a_draft_its_own_row_puts_first_or_within_the_noise_is_left_to_the_margin():
    assert detect_wrong_source_of_sampled_draft(_sampled_elsewhere(own=6, own_margin=0.0)) is None
    assert detect_wrong_source_of_sampled_draft(_sampled_elsewhere(own=5, own_margin=0.005)) is None
    assert detect_wrong_source_of_sampled_draft(_sampled_elsewhere(own=None, own_margin=0.0)) is None
    verify = replace(_sampled_elsewhere(own=5, own_margin=9.0), phase=Phase.VERIFY)
    assert detect_wrong_source_of_sampled_draft(verify) is None


def test_the_own_choice_is_read_from_the_runs_draft_logits_of_that_eval():
    ev = Eval(7, "draft", Phase.DRAFT, 4, (12, 13, 14, 15), (1, 0, 0, 0), (0, 0, 0, 0), round=1)
    rec = Record("r0", "draft", Phase.DRAFT, 7, DRAFT_LOGITS, 0, "API", "f32", (16, 4), (), "float32", (4, 16))
    run = Manifest(source="llama.cpp", models={}, build={}, evals=(ev,), records=(rec,))
    own = _own_choice(_parting(None), run, lambda r: LOGITS.astype(np.float32))
    assert (own.own_choice, own.own_margin) == (5, 4.0)  # row 0 puts 5 first; the run drafted 6 (-1 there)
    assert _own_choice(_parting(None), run, None).own_choice is None  # no reader of the run
    assert _own_choice(replace(_parting(None), eval=8), run, lambda r: LOGITS).own_choice is None  # no such eval
