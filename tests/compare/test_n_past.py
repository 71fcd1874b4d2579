"""n_past moved past the accept (FEATDIFF_FAULT=npast-drift; issue 48): a greedy run whose verify
kept a draft its target rejected and decoded the target's own token one position later. The
capture infers the round from the positions (accepted 1 where the target took 0), so the run's
token on the verify's first row is the draft; against a reference that follows the run's rounds
(check's), this is named a position_offset of the next round's verify, not a bare divergence."""

from __future__ import annotations

from dataclasses import replace

from featdiff.core.names import RESULT_OUTPUT
from featdiff.diff.detectors import detect_divergence_by_margin
from featdiff.diff.detectors.choices import detect_position_offset_after_accept
from featdiff.diff.partings import Parting, _kept_past
from featdiff.dump.records import Round

DRAFTS = (96, 12, 40)
TARGET_TOKEN = 321  # the target's argmax on the verify's row 0


def _round(accepted: int, target_tokens: tuple[int, ...]) -> Round:
    return Round(round=1, pos0=3, anchor=7, drafts=DRAFTS, accepted=accepted, target_tokens=target_tokens)


def _parting(kept: int, margin: float = 3.0) -> Parting:
    p = Parting("verify", 1, 0, 3, 9, RESULT_OUTPUT, expected=TARGET_TOKEN, observed=96, margin=margin, bound=0.01)
    return replace(p, kept_past=kept)


def test_a_kept_draft_followed_by_the_targets_token_counts_the_rows_kept():
    assert _kept_past(_round(1, (96, TARGET_TOKEN)), 0, TARGET_TOKEN) == 1
    assert _kept_past(_round(2, (96, 12, TARGET_TOKEN)), 0, TARGET_TOKEN) == 2


def test_other_token_histories_are_not_a_drift():
    assert _kept_past(_round(1, (96, 55)), 0, TARGET_TOKEN) == 0  # the next token is not the target's
    assert _kept_past(_round(0, (55,)), 0, TARGET_TOKEN) == 0  # nothing kept: a plain parting
    assert _kept_past(_round(1, (96, TARGET_TOKEN)), 1, TARGET_TOKEN) == 0  # the parting is past the kept rows


def test_the_drift_is_a_position_offset_of_the_next_verify_in_the_driver():
    f = detect_position_offset_after_accept(_parting(1))
    assert f is not None and f.kind == "position_offset" and f.severity == "error"
    assert (f.fields["offset"], f.fields["phase"], f.fields["round"], f.fields["role"]) == (1, "verify", 2, "target")
    assert "kept it and decoded 321 one position late" in f.message


def test_no_drift_without_kept_rows_or_within_the_noise():
    assert detect_position_offset_after_accept(_parting(0)) is None
    assert detect_position_offset_after_accept(_parting(1, margin=0.001)) is None  # a near-tie: either token is right
    assert detect_divergence_by_margin(_parting(0)) is not None  # a plain parting stays a divergence
