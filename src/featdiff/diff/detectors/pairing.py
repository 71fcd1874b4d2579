"""Detectors of pairing: what was compared and what was not. The run without (or with empty)
target features, wiring records one side's graph lacks, record sets the plan left out (`unpaired`,
one per reason and side), and the records that depend on a feature the reference does not model.
Each `detect_<kind>` is pure, reads the manifests and the plan (diff/align.py) only, and
returns `Finding | None`; its sentence is written beside it.
"""

from __future__ import annotations

import fnmatch
from dataclasses import replace

from featdiff.core import names
from featdiff.core.names import ROLE_DRAFT, ROLE_TARGET
from featdiff.core.phases import ROUND_OPENER, Phase, phase_order
from featdiff.diff.align import GroupKey, Plan, RecordKey
from featdiff.diff.batches import batch_label
from featdiff.diff.dependence import Gap
from featdiff.diff.fields import (
    Fields,
    MissingTensorFields,
    NearTieFields,
    NotConditionedFields,
    UnexpectedTensorFields,
    UnmodelledFields,
    UnpairedFields,
)
from featdiff.diff.namemap import NameMap
from featdiff.diff.result import EXPLAINABLE_SKIPS, Finding, Severity, Skip
from featdiff.dump.manifest import Manifest

# --- the run's conditioning ----------------------------------------------------------------------


def detect_not_conditioned(ref: Manifest, run: Manifest, name_map: NameMap) -> Finding | None:
    """Hypothesis: the drafter ran without target features. Evidence: the ref injects features
    but the run has no inject eval, its inject evals carry no rows, or its features are empty."""
    ref_inject = [e for e in ref.evals if e.phase == Phase.INJECT]
    run_inject = [e for e in run.evals if e.phase == Phase.INJECT]
    if not ref_inject or not any((e.role, e.phase) == ROUND_OPENER for e in run.evals):
        return None
    detail = _unconditioned(run, run_inject, name_map)
    if detail is None:
        return None
    return Finding.of(
        NotConditionedFields(detail=detail),
        tensor=names.INP_TARGET_FEATURES,
        message=f"the drafter ran with {detail}: it drafts without the target's features; "
        f"check that the target context is set (ctx_other) and features are injected",
    )


def _unconditioned(run: Manifest, run_inject: list, name_map: NameMap) -> str | None:
    """What is missing from the run's conditioning, or None when its features are there."""
    if not run_inject:
        return "no inject eval"
    if all(e.n_tokens == 0 for e in run_inject):
        return "inject evals with no rows"
    inject = {e.eval for e in run_inject}
    features = [
        r for r in run.records if r.eval in inject and name_map.pairing_name(r.name) == names.INP_TARGET_FEATURES
    ]
    if features and all(0 in r.shape for r in features):
        return "empty injected features"
    return None


# --- records one side's graph lacks --------------------------------------------------------------


def is_wiring(name: str, wiring: tuple[str, ...] = names.WIRING_NAMES) -> bool:
    """Whether a record name is in the wiring set (the drafter kind's, `Plan.wiring`; globs): never
    left out unsaid."""
    return any(fnmatch.fnmatchcase(name, g) for g in wiring)


def absent_keys(plan: Plan, run: Manifest) -> list[RecordKey]:
    """Wiring records of the reference the run's graph lacks: in an eval group the run has, and
    kept by the run's recorded capture filters, exclusions included (so not merely filtered out)."""
    kept = run.build_info.filters
    return [
        k
        for k in plan.ref_only
        if is_wiring(k[1], plan.wiring) and k[0] in plan.run_groups and kept.keeps(k[0][0], k[1])
    ]


def _without_log_snr(plan: Plan) -> set[GroupKey]:
    """Eval groups where the reference has log-SNR records and the run none of them."""
    ref = {k[0] for k in plan.ref_only if k[1] in names.LOG_SNR_RECORDS}
    run = {p.group for p in plan.pairs if p.name in names.LOG_SNR_RECORDS} | {
        k[0] for k in plan.run_only if k[1] in names.LOG_SNR_RECORDS
    }
    return ref - run


def detect_missing_tensor(plan: Plan, run: Manifest) -> Finding | None:
    """Hypothesis: the run never computed a wiring tensor the checkpoint has. Evidence: a ref
    record in the wiring set, in an eval group the run has, that the run's filters would keep.
    A group whose graph has none of the log-SNR nodes ignores the conditioning as a whole: that
    is a `missing_term` (wiring.detect_missing_term), not missing tensors."""
    unconditioned = _without_log_snr(plan)
    keys = [k for k in absent_keys(plan, run) if not (k[1] in names.LOG_SNR_RECORDS and k[0] in unconditioned)]
    return _one_sided(MissingTensorFields(), keys, "the run has no {name} in {where} (the reference does)")


def detect_unexpected_tensor(plan: Plan, ref: Manifest) -> Finding | None:
    """Hypothesis: the run computes a wiring tensor where the checkpoint has none. Evidence: a
    run record in the wiring set, in an eval group the ref has, that the ref lacks."""
    keys = [k for k in plan.run_only if is_wiring(k[1], plan.wiring) and k[0] in plan.ref_groups]
    return _one_sided(UnexpectedTensorFields(), keys, "the run has {name} in {where}, the reference has not")


def _one_sided(fields: Fields, keys: list[RecordKey], template: str) -> Finding | None:
    if not keys:
        return None
    (role, phase, rnd), name, _ = keys[0]
    more = f" ({len(keys) - 1} more like it)" if len(keys) > 1 else ""
    where = f"the {role} {phase} eval of round {rnd}"
    return Finding.of(
        fields,
        tensor=name,
        message=template.format(name=name, where=where) + more + "; check the graph's callback names, or pass --map",
    )


def detect_unexpected_tensor_outside_wiring(plan: Plan) -> Finding | None:
    """Hypothesis: the run recorded tensors the reference has no counterpart of, outside the wiring
    set (a wide capture filter): not a fault, but not compared either. Evidence: the plan's run-only
    names outside names.WIRING_NAMES; one info finding lists them."""
    checked = (names.INP_POS,)  # compared with the reference's eval positions instead
    run_names = sorted({k[1] for k in plan.run_only if not is_wiring(k[1], plan.wiring) and k[1] not in checked})
    if not run_names:
        return None
    shown = ", ".join(run_names[:6]) + (" ..." if len(run_names) > 6 else "")
    return Finding.of(
        UnexpectedTensorFields(names=tuple(run_names)),
        tensor=run_names[0],
        severity="info",
        message=f"{len(run_names)} run tensor names have no reference counterpart and were not compared: {shown}",
    )


# --- record sets the plan left out -------------------------------------------------------------


def detect_unpaired(
    skips: tuple[Skip, ...], explained: bool, parting: str | None, rounds: tuple[int, int]
) -> Finding | None:
    """Hypothesis: wiring records of the run or the reference were not compared (one reason, one
    side), so an OK would rest on records nobody looked at. Evidence: the plan's skips of those
    record sets; `rounds` = the last drafted round of (ref, run)."""
    if not skips:
        return None
    skips = tuple(sorted(skips, key=lambda s: (phase_order(s.phase, s.round), s.evals[:1])))
    first = skips[0]
    reason = first.reason
    severity: Severity = "info" if first.is_expected or (explained and reason in EXPLAINABLE_SKIPS) else "error"
    more = _more(skips)
    message = _UNPAIRED_MESSAGES[reason](first, more, explained, parting, rounds)
    return Finding.of(
        UnpairedFields(
            reason=reason,
            side=first.side,
            records=len(skips),
            rows=tuple(first.rows),
            evals=tuple(sorted({e for s in skips for e in s.evals})),
            role=first.role,
            phase=Phase(first.phase),
            round=first.round,
        ),
        tensor=first.name,
        severity=severity,
        message=message,
    )


def _more(skips: tuple[Skip, ...]) -> str:
    if len(skips) == 1:
        return ""
    k, rows = len(skips) - 1, sum(len(s.rows) for s in skips[1:])
    return f" (and {k} more record set{'s' * (k > 1)}" + (f", {rows} rows" if rows else "") + ")"


def _where(s: Skip) -> str:
    return f"{s.name} ({batch_label((s.role, s.phase, s.round))})"


def _tail(why: str, explained: bool, parting: str | None) -> str:
    """What to do about rows left out: the findings above say `why`, or where the histories part."""
    at = f" (the token histories part at {parting})" if parting else ""
    if explained:
        return f"the error findings above say why {why}{at}"
    return (
        f"the token histories part at {parting}; nothing else explains it: check that run and reference "
        f"come from the same prompt, rounds and models"
        if parting
        else "check that run and reference come from the same prompt, rounds and models"
    )


def _token_history_message(s: Skip, more: str, explained: bool, parting: str | None, rounds) -> str:
    return (
        f"{len(s.rows)} rows of {_where(s)} have a different token history from the reference's, so they "
        f"were not compared{more}; {_tail('the run decoded other tokens', explained, parting)}"
    )


def _position_message(s: Skip, more: str, explained: bool, parting: str | None, rounds) -> str:
    return (
        f"{len(s.rows)} rows of {_where(s)} sit at positions ({_positions(s.rows)}) where the other side has "
        f"no row in that batch, so they were not compared{more}; "
        f"{_tail('the batches sit at other positions', explained, parting)}"
    )


def _missing_eval_message(s: Skip, more: str, explained: bool, parting: str | None, rounds) -> str:
    ref_last, run_last = rounds
    lacking, having = ("reference", "run") if s.side == "run" else ("run", "reference")
    head = f"the {lacking} has no {s.phase} eval of round {s.round}, so the {having}'s {s.name} there was not compared{more}"
    if s.side == "run" and s.round > ref_last:
        return f"{head}: rerun `featdiff reference` with --rounds {run_last}"
    if s.side == "ref" and s.round > run_last:
        fix = f"capture with --rounds {ref_last}, or rerun `featdiff reference` with --rounds {run_last}"
        return (
            f"{head}: the run stopped early (after the failure the error findings above name) or was made "
            f"with fewer rounds ({fix})"
            if explained
            else f"{head}: {fix}"
        )
    return f"{head}: make both sides decode the flow of docs/flow.md (a {s.phase} eval in every round)"


def _failed_eval_message(s: Skip, more: str, explained: bool, parting: str | None, rounds) -> str:
    return (
        f"the run's {s.phase} eval of round {s.round} failed (llama.cpp refused the batch the driver built), so "
        f"the reference's {s.name} there was not compared{more}; "
        + (
            "the error findings above say what is wrong with that batch"
            if explained
            else "see the flow notes and the program's log for why the batch was refused"
        )
    )


def _no_rows_message(s: Skip, more: str, explained: bool, parting: str | None, rounds) -> str:
    return (
        f"{s.name} ({s.role} {s.phase}) has output rows in the run and none in the reference "
        f"(llama-server's prefill outputs its last row to sample the first token), so it was not compared{more}"
    )


def _no_draft_message(s: Skip, more: str, explained: bool, parting: str | None, rounds) -> str:
    return (
        f"round {s.round} of the run decoded without drafting (llama-server's last verify, with no room left "
        f"to draft), and the reference drafts every round, so {s.name}{more} was not compared"
    )


def _fewer_drafts_message(s: Skip, more: str, explained: bool, parting: str | None, rounds) -> str:
    why = (
        "the error findings above say why the run drafted differently"
        if explained
        else "llama.cpp drafts no more tokens than are left to generate"
    )
    return (
        f"the run verified fewer drafts than the reference in round {s.round} ({why}), so {len(s.rows)} rows of "
        f"{_where(s)} at the end of the reference's batch were not compared{more}"
    )


def _positions(rows: tuple[int, ...]) -> str:
    return ", ".join(map(str, rows[:8])) + (" ..." if len(rows) > 8 else "")


_UNPAIRED_MESSAGES = {
    "token_history": _token_history_message,
    "position": _position_message,
    "missing_eval": _missing_eval_message,
    "failed_eval": _failed_eval_message,
    "no_rows": _no_rows_message,
    "no_draft": _no_draft_message,
    "fewer_drafts": _fewer_drafts_message,
}


def explained_by_unmodelled(f: Finding, unmodelled: Finding) -> Finding:
    """An `unpaired` of rows left out because the histories part, when the drafter uses a feature
    the reference does not model (its drafts may differ for that reason alone): info, saying so."""
    gap = UnmodelledFields.from_json(unmodelled.fields)
    return _explained_skip(
        f,
        f"the reference drafts without {', '.join(gap.names)} (unmodelled), so its drafts may "
        "differ: make the reference follow the run (`featdiff reference --follow run.npz`) to compare them",
    )


def explained_by_near_tie(f: Finding, near_tie: Finding) -> Finding:
    """An `unpaired` of rows left out because the histories part at a near-tie: info, saying so."""
    tie = NearTieFields.from_json(near_tie.fields)
    return _explained_skip(
        f,
        f"the token histories part at the near-tie of round {tie.round} (row "
        f"{tie.row}), where either token is right: make the reference follow the run "
        "(`featdiff reference --run run.npz` or `--follow run.npz`) to compare them",
    )


def _explained_skip(f: Finding, why: str) -> Finding:
    """An `unpaired` finding of rows whose histories part, as information with `why` in place of
    its advice; any other finding as it is."""
    if f.kind != UnpairedFields.KIND or UnpairedFields.from_json(f.fields).reason not in EXPLAINABLE_SKIPS:
        return f
    return replace(f, severity="info", message=f"{f.message.split('; ')[0]}; {why}")


# --- what the reference left out ----------------------------------------------------------------


def detect_unmodelled(gap: Gap | None, not_judged: tuple[str, ...], diverged: tuple[str, ...]) -> Finding | None:
    """Hypothesis: the run's models use a feature the reference does not compute, so every record
    computed after its first read may differ for that reason alone. Evidence: the manifests'
    `models.<role>.unmodelled` (the Gap); `not_judged` are the record sets the rule of
    diff/dependence.py takes out of the verdict, `diverged` those of them beyond tolerance."""
    if gap is None:
        return None
    found = gap.draft + gap.target
    who = "the drafter" if gap.draft else "the target"
    uses = sorted({f"{name} ({phase})" for phase, name in gap.uses if phase != "*"})
    start = f" from {', '.join(uses)} on" if uses else ""
    differ = f", {len(diverged)} of them beyond tolerance" if diverged else ", all within tolerance"
    counted = f" ({len(not_judged)} record sets{differ})" if not_judged else ""
    scope = "records" if gap.target else "draft records"
    return Finding.of(
        UnmodelledFields(
            names=tuple(found),
            role=ROLE_DRAFT if gap.draft else ROLE_TARGET,
            first_use=tuple(uses),
            not_judged=tuple(not_judged),
            diverged=tuple(diverged),
        ),
        tensor=found[0],
        severity="info",
        message=f"{who} uses {', '.join(found)}, which featdiff's reference does not model: no verdict on the "
        f"{scope} that depend on it{start}{counted}; the rest was judged (docs/modelled.md says what is modelled)",
    )
