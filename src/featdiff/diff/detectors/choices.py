"""Detectors of choices: where run and reference chose another token (a parting of their token
histories: diff/partings.py) or routed a token to other experts (a MoE router's top-k cut),
and whether the numerics can tell the two choices apart. Each `detect_<kind>` is pure and
returns `Finding | None`; its sentence is written beside it.
"""

from __future__ import annotations

import numpy as np

from featdiff.core import names
from featdiff.core.phases import Phase
from featdiff.diff.detectors.base import Evidence, labels, same_shape
from featdiff.diff.fields import (
    ChainChoiceFields,
    DivergenceFields,
    ExpertChoiceFields,
    NearTieFields,
    PositionOffsetFields,
    UnmodelledFields,
    WrongSourceFields,
)
from featdiff.diff.metrics import row_relative_error
from featdiff.diff.partings import MARGIN_SPREAD, Parting
from featdiff.diff.result import Finding

# The router's logits are a matrix times the layer's normed input, whose error on one row may reach
# the pair's row tolerance; the errors of the two logits around the top-k cut add in quadrature
# (as partings.MARGIN_SPREAD): a margin below sqrt(2) x row_rel x rms(router logits) is a near-tie.
# wrong_source's `source` of drafts read from another first row of a correct block
DRAFT_ROWS_SOURCE = "rows from {row}"
# wrong_source's `source` of a draft that is not what its own row, as the run's sampler read it, puts first
ANOTHER_ROW_SAMPLED = "another_row_sampled"
ROUTER_MARGIN_SPREAD = float(np.sqrt(2.0))


# --- where the tokens part -----------------------------------------------------------------------


def _parting_where(p: Parting) -> str:
    batch = "the draft block" if p.phase == Phase.DRAFT else "the verify"
    return f"round {p.round}, row {p.row} ({batch}, position {p.position})"


def detect_near_tie(p: Parting) -> Finding | None:
    """Hypothesis: run and reference chose different tokens on a row where the reference's own
    two candidates are closer than the numerics can tell apart, so either choice is right.
    Evidence: the reference's margin between its argmax and the run's token on that row is at
    most the noise bound that row's tolerance allows (partings.MARGIN_SPREAD)."""
    if not p.is_near_tie:
        return None
    return Finding.of(
        NearTieFields(
            phase=p.phase,
            round=p.round,
            row=p.row,
            position=p.position,
            eval=p.eval,
            expected=p.expected,
            observed=p.observed,
            margin=p.margin,
            bound=p.bound,
        ),
        tensor=p.tensor,
        severity="info",
        message=f"near-tie at {_parting_where(p)}: the run chose token {p.observed}, the reference "
        f"{p.expected}, by a reference margin {p.margin:.3g} <= noise bound {p.bound:.3g}: either token is "
        "right, so the run's is not an error",
    )


def detect_unmodelled_sampler(p: Parting) -> Finding | None:
    """Hypothesis: the run sampled its target's token through a chain with a stage featdiff does
    not compute (penalties, DRY, typical-p, top-n-sigma, XTC, mirostat), so whether it could draw
    a token the reference does not put first is unknown. Evidence: the parting's `unmodelled`
    stages (partings.sampled_parting); the choice is said not judged, never failed."""
    if not p.unmodelled:
        return None
    return Finding.of(
        UnmodelledFields(
            names=p.unmodelled,
            role=names.ROLE_TARGET,
            first_use=(f"{p.tensor} ({p.phase})",),
            not_judged=(f"the token choice at {_parting_where(p)}",),
            diverged=(),
        ),
        tensor=p.tensor,
        severity="info",
        message=f"at {_parting_where(p)} the run sampled token {p.observed} where the reference's argmax is "
        f"{p.expected}; its sampler ({p.sampler}) has stages featdiff does not compute, so this choice and "
        "the sampled choices after it are not judged (the logits are); rerun without them to judge the choices",
    )


def detect_divergence_by_margin(p: Parting) -> Finding | None:
    """Hypothesis: the run chose a token its logits do not put first, beyond the noise (a parting
    no value explains). Evidence: the reference's margin between its argmax and the run's token on
    that row is above the noise bound; None for a near-tie (`detect_near_tie`'s)."""
    if p.is_near_tie:
        return None
    advice = (
        f"which its sampler ({p.sampler}) could not draw from the reference's logits; check the row the "
        "sampler reads and the parameters it was given"
        if p.sampler
        else "check which rows the driver drafts from and that it samples greedily"
    )
    return Finding.of(
        DivergenceFields(
            metric="margin",
            value=p.margin,
            tolerance=p.bound,
            phase=p.phase,
            round=p.round,
            row=p.row,
            position=p.position,
            eval=p.eval,
            expected=p.expected,
            observed=p.observed,
        ),
        tensor=p.tensor,
        message=f"at {_parting_where(p)} the run chose token {p.observed} where the reference's argmax is "
        f"{p.expected} by a margin {p.margin:.3g}, beyond the noise bound {p.bound:.3g}; {advice}",
    )


def detect_position_offset_after_accept(p: Parting) -> Finding | None:
    """Hypothesis: after a verify the driver moved the target's n_past past what the target
    accepted (n_past += accepted + 1 with one too many), so the sequence keeps a draft the target
    rejected and the target's own token lands that many positions late, with the next round.
    Evidence (a greedy run): on the verify's first parting row the run's token is the draft there,
    beyond the noise from the reference's argmax, and the token after the drafts it kept is that
    argmax (`Parting.kept_past`)."""
    if not p.kept_past or p.is_near_tie:
        return None
    k = p.kept_past
    late = "one position" if k == 1 else f"{k} positions"
    return Finding.of(
        PositionOffsetFields(offset=k, role=names.ROLE_TARGET, phase=Phase.VERIFY, round=p.round + 1),
        tensor=names.INP_POS,
        message=f"n_past moved {late} past the accept of round {p.round}: the target rejected draft "
        f"{p.observed} at row {p.row} (position {p.position}; its argmax is {p.expected} by a margin "
        f"{p.margin:.3g}), yet the run kept it and decoded {p.expected} {late} late, so round "
        f"{p.round + 1} starts off by {k:+d}; check the driver's n_past after an accept (pos0 + accepted + 1)",
    )


def detect_wrong_source_of_drafts(p: Parting) -> Finding | None:
    """Hypothesis: the run read its drafts from the wrong rows of a correct block: a DSpark
    drafter run as plain DFlash (`--spec-type draft-dflash`: drafts from the row after the anchor)
    where it samples from the anchor, or the other way round. Evidence: the block's records agree,
    its first draft is no near-tie, and every draft the run made is the reference's argmax of
    `draft_logits` read from the other first row (`Parting.other_first_row`)."""
    if p.phase != Phase.DRAFT or p.other_first_row is None or p.is_near_tie:
        return None
    own = p.row
    reading = (
        "the row after the anchor, as plain DFlash reads a block"
        if p.other_first_row == 1
        else "the anchor row on, as an anchor-first DSpark block reads"
    )
    return Finding.of(
        WrongSourceFields(source=DRAFT_ROWS_SOURCE.format(row=p.other_first_row), candidate=p.tensor),
        tensor=p.tensor,
        message=f"at {_parting_where(p)} the run's drafts are the reference's argmax of {p.tensor} from row "
        f"{p.other_first_row} on ({reading}), where this drafter's drafts start at row {own} "
        f"({names.KEY_SAMPLE_FROM_ANCHOR} of the GGUF): the block is computed right and read from the wrong "
        "rows; a DSpark drafter needs llama.cpp's --spec-type draft-dspark (draft-dflash reads DFlash's rows)",
    )


def detect_wrong_source_of_sampled_draft(p: Parting) -> Finding | None:
    """Hypothesis: the driver sampled this draft from another row than the block's own (another
    slot's block in the same batch, an index off by some rows): the graph computed the row right,
    its own logits say another token. Evidence: the logits the run's sampler read back for this
    row (`draft_logits` of the run, `Parting.own_choice`) put another token first than the run
    drafted, by more than the noise bound on a margin; the reference's argmax is then beside the
    point (the run's own numbers already disagree with its choice)."""
    if p.phase != Phase.DRAFT or p.own_choice is None or p.own_choice == p.observed or p.own_margin <= p.bound:
        return None
    own = "the reference's argmax too" if p.own_choice == p.expected else f"the reference's is {p.expected}"
    by = (
        f"by a margin {p.own_margin:.3g}"
        if np.isfinite(p.own_margin)
        else f"and do not hold token {p.observed} among their candidates"
    )
    return Finding.of(
        WrongSourceFields(source=ANOTHER_ROW_SAMPLED, candidate=p.tensor),
        tensor=p.tensor,
        message=f"at {_parting_where(p)} the run drafted token {p.observed}, where that row's own logits, as the "
        f"run's sampler read them back, put token {p.own_choice} first ({own}) {by}: "
        "the graph computed the row, and the draft was sampled from another row; check the row index the "
        "driver hands its sampler for each sequence's block (common_sampler_sample's idx: the sequence's "
        "first block row plus the draft's offset)",
    )


# --- MoE routing: a near-tie between experts -----------------------------------------------------


def detect_expert_choice(ev: Evidence) -> Finding | None:
    """Hypothesis: the run routed some tokens of this MoE layer to other experts than the reference,
    on a near-tie where either choice is right. Evidence: every row over the row tolerance has a
    reference router margin (`<record>@router_margin`: the gap between the k-th and (k+1)-th router
    logit, and the rms of the row's logits) at most ROUTER_MARGIN_SPREAD x row_rel x that rms."""
    record = ev.record or ev.tensor
    margins = ev.candidates.get(names.candidate_name(record, names.HYP_ROUTER_MARGIN))
    if margins is None or not same_shape(ev) or ev.ref.ndim != 2 or margins.shape != (len(ev.ref), 2):
        return None
    bad = row_relative_error(ev.ref, ev.run) > ev.tolerance.row_rel  # (R,)
    margin, rms = margins[:, 0].astype(np.float64), margins[:, 1].astype(np.float64)  # (R,) each
    bound = ROUTER_MARGIN_SPREAD * ev.tolerance.row_rel * rms  # (R,)
    if not bad.any() or not np.all(margin[bad] <= bound[bad]):
        return None
    rows = np.flatnonzero(bad)
    tokens = labels(ev, bad)
    layer = record.rsplit("-", 1)[-1]
    more = f" and {len(rows) - 1} more token{'s' * (len(rows) > 2)}" if len(rows) > 1 else ""
    return Finding.of(
        ExpertChoiceFields(
            layer=int(layer) if layer.isdigit() else layer,
            rows=tokens,
            margins=tuple(float(margin[i]) for i in rows),
            bounds=tuple(float(bound[i]) for i in rows),
        ),
        tensor=ev.tensor,
        severity="info",
        message=f"expert choice differs at layer {layer}, token {tokens[0]} (router margin {margin[rows[0]]:.3g} "
        f"<= noise bound {bound[rows[0]]:.3g}){more}: the router's top-k cut is a near-tie there, so either "
        f"expert is right and {ev.tensor} differs on those rows only; the layers after it inherit the difference",
    )


# --- DSpark's Markov chain: a near-tie between tokens inside the graph ---------------------------


def detect_chain_choice(ev: Evidence) -> Finding | None:
    """Hypothesis: DSpark's Markov head chained row i's bias from another token than the
    reference's, on a near-tie: the graph takes `prev` = argmax of row i-1's biased logits
    (upstream `build_dspark_markov_head`), so where two tokens are closer than the numerics can
    tell apart either is right, and the rows after it carry the other token's bias. Evidence, at
    `draft_logits` of a block drafter with the reference's `dspark_markov_bias`: the rows before
    row i read what the reference computes; row i does not; the run's argmax of row i-1 (what its
    sampler read back: `ev.sampled`) is not the reference's, by a reference margin at most the
    row's noise bound (partings.MARGIN_SPREAD x the pair's rel x the rms of the row's logits, the
    graph's row plus the bias: the reference's row as the pair blanks none of it)."""
    bias = ev.candidates.get(names.DSPARK_MARKOV_BIAS)
    if (ev.record or ev.tensor) != names.DRAFT_LOGITS or not ev.kind.block_flow or ev.sampled is None:
        return None
    read, graph = ev.sampled
    if bias is None or not same_shape(ev) or ev.ref.ndim != 2 or not read.shape == graph.shape == bias.shape:
        return None
    differ = list(row_relative_error(ev.ref, ev.run) > ev.tolerance.row_rel)  # (R,)
    if not any(differ) or differ.index(True) == 0:
        return None
    i = differ.index(True)
    kept = np.isfinite(read[i - 1])  # (V,): the tokens the run's sampler read back
    ref_row = np.where(kept, ev.ref[i - 1], -np.inf).astype(np.float64)
    expected, observed = int(np.argmax(ref_row)), int(np.argmax(np.where(kept, read[i - 1], -np.inf)))
    if expected == observed:
        return None
    full = (graph[i - 1] + bias[i - 1]).astype(np.float64)  # (V,)
    margin = float(ref_row[expected] - ref_row[observed])
    bound = MARGIN_SPREAD * ev.tolerance.rel * float(np.sqrt(np.mean(full * full)))
    if not margin <= bound:
        return None
    where = labels(ev, np.arange(len(ev.ref)) == i - 1)[0]
    after = labels(ev, np.arange(len(ev.ref)) >= i)
    return Finding.of(
        ChainChoiceFields(position=where, expected=expected, observed=observed, margin=margin, bound=bound, rows=after),
        tensor=ev.tensor,
        severity="info",
        message=f"DSpark's Markov chain took token {observed} at position {where}, the reference {expected}, by a "
        f"reference margin {margin:.3g} <= noise bound {bound:.3g}: either is right, and the rows after it "
        f"({', '.join(map(str, after))}) carry that token's bias, so they are not judged",
    )
