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
from featdiff.diff.detectors import detect_divergence_by_margin, detect_wrong_source_of_drafts
from featdiff.diff.partings import Parting, _read_from

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
