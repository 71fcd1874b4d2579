"""Diagnosis: separate a tensor's own error from error it inherited, then name the cause.

`find_roots` walks the pairs in eval and graph order and keeps each pair beyond tolerance whose
inputs are all within it (the first is the first divergence). `diagnose_root` runs the detector
chain on one root's evidence. The manifest-level detectors (`not_conditioned`, one-sided
records, `unpaired` wiring records) look at the plan, not at values.

What a pair's inputs are, from the run node's recorded sources:
* every source a captured pair of its eval, a weight (`x.weight`) or a leaf (`inp_*`, `leaf_*`):
  those captured pairs, nothing else (e.g. `inp_noise_embd` = get_rows(token_embd, tokens));
* no source and op NONE (a leaf, e.g. `inp_target_features`): the evals that feed its eval;
* otherwise (an uncaptured node in between): every earlier pair of the eval and the evals that
  feed it. Which evals feed which follows docs/flow.md: a target eval reads the earlier target
  evals (KV cache), an inject eval the target evals (features), a draft eval the inject evals.
"""

from __future__ import annotations

import fnmatch
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from featdiff import names
from featdiff.compare import detectors as d
from featdiff.compare import wiring as w
from featdiff.compare.align import DRAFT_GROUP, GroupKey, Pair, Plan, RecordKey, flow_rank
from featdiff.compare.dependence import Gap
from featdiff.compare.flow import batch_label
from featdiff.compare.namemap import NameMap
from featdiff.compare.partings import Parting
from featdiff.compare.result import Finding, Kind, Severity, Skip
from featdiff.dump import Manifest

# Which (role, phase) evals feed which, per docs/flow.md.
FEEDERS: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    ("target", "prefill"): (("target", "prefill"), ("target", "verify")),
    ("target", "verify"): (("target", "prefill"), ("target", "verify")),
    ("draft", "inject"): (("target", "prefill"), ("target", "verify")),
    ("draft", "draft"): (("draft", "inject"),),
}
LEAF_PREFIXES = ("inp_", "leaf_")  # graph inputs: no captured producer to inherit from
LEAF_OPS = ("NONE", "")  # ggml's op of a leaf (an input tensor)
MAX_ROOT_FINDINGS = 8  # roots diagnosed; later ones are almost always the same fault again

# The detector chain, most specific evidence first; the first to return a Finding names the cause.
CHAIN: tuple[Callable[[d.Evidence], Finding | None], ...] = (
    d.detect_nonfinite,
    d.detect_zeros,
    d.detect_layout_transpose,
    d.detect_expert_choice,  # info: a MoE near-tie, before any fault is tried on its few rows
    w.detect_layer_offset,
    w.detect_slot_permutation,
    w.detect_missing_term,
    w.detect_extra_term,
    w.detect_wrong_source,
    d.detect_stale,
    d.detect_row_shift,
    d.detect_misplaced_rows,
    d.detect_position_offset,
    d.detect_scale,
    d.detect_scale_per_channel,
    d.detect_divergence_in_rope,
)


@dataclass(frozen=True)
class Walk:
    """The roots (own error) and the inherited pairs, as indices into the plan's pairs."""

    roots: tuple[int, ...]
    inherited: tuple[int, ...]

    @property
    def first_divergence(self) -> int | None:
        return self.roots[0] if self.roots else None


def _is_resolved(src: str, captured: set[str]) -> bool:
    return src in captured or "." in src or src.startswith(LEAF_PREFIXES)


def _inputs(pair: Pair, earlier: list[int], pairs: tuple[Pair, ...]) -> tuple[list[int], bool]:
    """The earlier pairs of its own eval `pair` reads, and whether it reads other evals' data."""
    captured = {pairs[i].name for i in earlier}
    if not pair.run_srcs and pair.run.records[0].op in LEAF_OPS:
        return [], True  # a graph input: its data was copied in from another eval (the features)
    if pair.run_srcs and all(_is_resolved(s, captured) for s in pair.run_srcs):
        return [i for i in earlier if pairs[i].name in pair.run_srcs], False
    return earlier, True  # an uncaptured node in between: anything before it may feed it


def find_roots(pairs: tuple[Pair, ...], within: list[bool]) -> Walk:
    """Walk pairs in order; a divergent pair is a root when none of its inputs diverges."""
    roots: list[int] = []
    inherited: list[int] = []
    by_group: dict[tuple, list[int]] = {}
    first_bad: dict[tuple[str, str], int] = {}  # (role, phase) -> first eval holding a divergence
    for i, pair in enumerate(pairs):
        earlier = by_group.setdefault(pair.group, [])
        if not within[i]:
            same_eval, reads_others = _inputs(pair, earlier, pairs)
            bad_input = any(not within[j] for j in same_eval)
            bad_feeder = reads_others and any(
                first_bad.get(f, pair.first_eval) < pair.first_eval
                for f in FEEDERS.get(pair.group[:2], tuple(first_bad))
            )
            (inherited if bad_input or bad_feeder else roots).append(i)
            first_bad.setdefault(pair.group[:2], pair.first_eval)
        earlier.append(i)
    return Walk(tuple(roots), tuple(inherited))


def diagnose_root(ev: d.Evidence, nmse: float) -> Finding:
    """The first detector of the chain that explains the pair, else `divergence`."""
    for detect in CHAIN:
        finding = detect(ev)
        if finding is not None:
            return finding
    return d.detect_divergence(ev, nmse)


def check_features(ev: d.Evidence) -> Finding | None:
    """Layer offsets and slot orders on a feature pair that is *within* tolerance: quantization
    noise can be as large as the difference between neighbouring layers, the layer match is not."""
    return w.detect_layer_offset(ev) or w.detect_slot_permutation(ev)


def first_routed(found: list[Finding | None]) -> int | None:
    """The earliest position an `expert_choice` finding names (a MoE near-tie routed it to other
    experts), or None when there is none."""
    return min((min(f.fields["rows"]) for f in found if f is not None and f.kind == "expert_choice"), default=None)


def rows_before(pair: Pair, position: int) -> Pair:
    """`pair` with its rows before `position` only: causal attention carries a row routed elsewhere
    into every later position of the later layers, never into an earlier one. Unchanged when it is
    not row-wise or no row (or every row) would be left."""
    al = pair.alignment
    keep = [i for i, p in enumerate(al.positions) if p < position]
    if not al.positions or len(keep) in (0, len(al.positions)):
        return pair
    rows = al.rows or tuple(range(len(al.positions)))
    run_rows = al.run_rows or tuple(range(len(al.positions)))
    kept = replace(
        al,
        positions=tuple(al.positions[i] for i in keep),
        rows=tuple(rows[i] for i in keep),
        run_rows=tuple(run_rows[i] for i in keep),
    )
    return replace(pair, alignment=kept)


def check_positions(evs: list[d.Evidence]) -> Finding | None:
    """The first eval whose recorded positions differ from the reference's."""
    for ev in evs:
        if ev.run.shape == ev.ref.shape and np.array_equal(ev.run, ev.ref):
            continue
        return d.detect_position_offset(ev) or d.detect_divergence(ev, float("inf"))
    return None


# --- records that depend on a feature the reference left out ------------------------------------


def set_aside_unmodelled(plan: Plan, walk: Walk, gap: Gap | None) -> tuple[Plan, Walk, Finding | None]:
    """The plan and walk without the records that depend on an unmodelled feature
    (compare/dependence.py), and the one `unmodelled` finding that says so: no root, skip or
    one-sided record of theirs is judged. Unchanged, and no finding, when nothing is unmodelled."""
    if gap is None:
        return plan, walk, None
    out = {i for i, p in enumerate(plan.pairs) if gap.depends(p.group[0], p.group[1], p.name)}
    diverged = [i for i in sorted(out) if i in set(walk.roots) | set(walk.inherited)]
    kept = replace(
        plan,
        ref_only=tuple(k for k in plan.ref_only if not gap.depends(k[0][0], k[0][1], k[1])),
        run_only=tuple(k for k in plan.run_only if not gap.depends(k[0][0], k[0][1], k[1])),
        skips=tuple(s for s in plan.skips if not gap.depends(s.role, s.phase, s.name)),
    )
    judged = Walk(
        roots=tuple(i for i in walk.roots if i not in out), inherited=tuple(i for i in walk.inherited if i not in out)
    )
    finding = d.detect_unmodelled(
        gap, tuple(_set_name(plan.pairs[i]) for i in sorted(out)), tuple(_set_name(plan.pairs[i]) for i in diverged)
    )
    return kept, judged, finding


def _set_name(p: Pair) -> str:
    return f"{p.name} ({batch_label(p.group)})"


def judged_partings(partings: tuple[Parting, ...], gap: Gap | None) -> tuple[Parting, ...]:
    """The partings compare may judge: not those on logits that depend on an unmodelled feature
    (a drafted token, when the drafter's logits do)."""
    if gap is None:
        return partings
    return tuple(p for p in partings if not gap.depends("draft" if p.phase == "draft" else "target", p.phase, p.tensor))


# --- manifest-level detectors --------------------------------------------------------------------


def detect_not_conditioned(ref: Manifest, run: Manifest, name_map: NameMap) -> Finding | None:
    """Hypothesis: the drafter ran without target features. Evidence: the ref injects features
    but the run has no inject eval, its inject evals carry no rows, or its features are empty."""
    ref_inject = [e for e in ref.evals if e.phase == "inject"]
    run_inject = [e for e in run.evals if e.phase == "inject"]
    if not ref_inject or not any(e.role == "draft" and e.phase == "draft" for e in run.evals):
        return None
    detail = _unconditioned(run, run_inject, name_map)
    if detail is None:
        return None
    return Finding(
        kind="not_conditioned",
        tensor=names.INP_TARGET_FEATURES,
        severity="error",
        message=f"the drafter ran with {detail}: it drafts without the target's features; "
        f"check that the target context is set (ctx_other) and features are injected",
        fields={"detail": detail},
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


def _wiring(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in names.WIRING_NAMES)


def absent_keys(plan: Plan, run: Manifest) -> list[RecordKey]:
    """Wiring records of the reference the run's graph lacks: in an eval group the run has, and
    kept by the run's recorded capture filters, exclusions included (so not merely filtered out)."""
    kept = run.build_info.filters
    return [k for k in plan.ref_only if _wiring(k[1]) and k[0] in plan.run_groups and kept.keeps(k[0][0], k[1])]


def absent_records(plan: Plan, run: Manifest) -> dict[GroupKey, tuple[str, ...]]:
    """absent_keys by eval group: the names each group's run graph lacks."""
    out: dict[GroupKey, dict[str, None]] = defaultdict(dict)
    for group, name, _ in absent_keys(plan, run):
        out[group][name] = None
    return {group: tuple(found) for group, found in out.items()}


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
    return _one_sided("missing_tensor", keys, "the run has no {name} in {where} (the reference does)")


def detect_unexpected_tensor(plan: Plan, ref: Manifest) -> Finding | None:
    """Hypothesis: the run computes a wiring tensor where the checkpoint has none. Evidence: a
    run record in the wiring set, in an eval group the ref has, that the ref lacks."""
    keys = [k for k in plan.run_only if _wiring(k[1]) and k[0] in plan.ref_groups]
    return _one_sided("unexpected_tensor", keys, "the run has {name} in {where}, the reference has not")


def _one_sided(kind: Kind, keys: list[RecordKey], template: str) -> Finding | None:
    if not keys:
        return None
    (role, phase, rnd), name, _ = keys[0]
    more = f" ({len(keys) - 1} more like it)" if len(keys) > 1 else ""
    where = f"the {role} {phase} eval of round {rnd}"
    return Finding(
        kind=kind,
        tensor=name,
        severity="error",
        message=template.format(name=name, where=where) + more + "; check the graph's callback names, or pass --map",
    )


def unpaired_info(plan: Plan) -> Finding | None:
    """One info finding listing one-sided records outside the wiring set (a wide capture filter)."""
    checked = (names.INP_POS,)  # compared with the reference's eval positions instead
    run_names = sorted({k[1] for k in plan.run_only if not _wiring(k[1]) and k[1] not in checked})
    if not run_names:
        return None
    shown = ", ".join(run_names[:6]) + (" ..." if len(run_names) > 6 else "")
    return Finding(
        kind="unexpected_tensor",
        tensor=run_names[0],
        severity="info",
        message=f"{len(run_names)} run tensor names have no reference counterpart and were not compared: {shown}",
        fields={"names": run_names},
    )


# --- wiring records the plan could not pair ------------------------------------------------------

INFO_SKIPS = ("no_rows", "no_draft", "fewer_drafts")  # expected skips worth a line among the findings
# rows another error finding can explain: the run decoded other tokens, or placed its batches elsewhere
EXPLAINABLE_SKIPS = ("token_history", "position", "failed_eval")


def unpaired_findings(
    plan: Plan,
    explained: bool,
    parting: str | None,
    near_tie: Finding | None = None,
    unmodelled: Finding | None = None,
) -> list[Finding]:
    """One `unpaired` finding per (reason, side) of the wiring record sets the plan left out:
    errors, except rows left out because the run decoded other tokens when other error findings
    (`explained`) or a near-tie where the histories part (`near_tie`, a reference that did not
    follow the run after it) say why; the expected llama-server skips as info. `parting`: where
    the two token histories part (flow.history_divergence). An `unmodelled` drafter feature explains
    rows of another token history too: the reference drafts without it, so its drafts may differ."""
    by_cause: dict[tuple[str, str], list[Skip]] = {}
    for skip in plan.skips:
        if _wiring(skip.name) and (not skip.is_expected or skip.reason in INFO_SKIPS):
            by_cause.setdefault((skip.reason, skip.side), []).append(skip)
    rounds = (_last_round(plan.ref_groups), _last_round(plan.run_groups))
    found = [detect_unpaired(tuple(skips), explained, parting, rounds) for skips in by_cause.values()]
    if near_tie is not None and not explained:
        found = [_after_near_tie(f, near_tie) if f is not None else None for f in found]
    elif unmodelled is not None and unmodelled.fields.get("role") == "draft" and not explained:
        found = [_after_unmodelled(f, unmodelled) if f is not None else None for f in found]
    return [f for f in found if f is not None]


def _after_unmodelled(f: Finding, unmodelled: Finding) -> Finding:
    """Rows left out because the histories part, when the drafter uses a feature the reference
    does not model (its drafts may differ for that reason alone): info, saying so."""
    return _explained_skip(
        f,
        f"the reference drafts without {', '.join(unmodelled.fields['names'])} (unmodelled), so its drafts may "
        "differ: make the reference follow the run (`featdiff reference --follow run.npz`) to compare them",
    )


def _after_near_tie(f: Finding, near_tie: Finding) -> Finding:
    """Rows left out because the histories part at a near-tie: info, saying so."""
    return _explained_skip(
        f,
        f"the token histories part at the near-tie of round {near_tie.fields['round']} (row "
        f"{near_tie.fields['row']}), where either token is right: make the reference follow the run "
        "(`featdiff reference --run run.npz` or `--follow run.npz`) to compare them",
    )


def _explained_skip(f: Finding, why: str) -> Finding:
    """An `unpaired` finding of rows whose histories part, as information with `why` in place of
    its advice; any other finding as it is."""
    if f.fields.get("reason") not in EXPLAINABLE_SKIPS:
        return f
    return replace(f, severity="info", message=f"{f.message.split('; ')[0]}; {why}")


def parting_findings(partings: tuple[Parting, ...], explained: bool) -> list[Finding]:
    """The near-ties (info), and the first parting beyond the noise as an error unless other
    error findings (`explained`) already say why the run chose other tokens."""
    found = [f for f in map(d.detect_near_tie, partings) if f is not None]
    beyond = [f for f in map(d.parting_divergence, partings) if f is not None]
    return found + ([] if explained or not beyond else beyond[:1])


def _last_round(groups: tuple[GroupKey, ...]) -> int:
    return max((g[2] for g in groups if g[:2] == DRAFT_GROUP), default=0)


def detect_unpaired(
    skips: tuple[Skip, ...], explained: bool, parting: str | None, rounds: tuple[int, int]
) -> Finding | None:
    """Hypothesis: wiring records of the run or the reference were not compared (one reason, one
    side), so an OK would rest on records nobody looked at. Evidence: the plan's skips of those
    record sets; `rounds` = the last drafted round of (ref, run)."""
    if not skips:
        return None
    skips = tuple(sorted(skips, key=lambda s: (flow_rank((s.role, s.phase, s.round)), s.evals[:1])))
    first = skips[0]
    reason = first.reason
    severity: Severity = "info" if first.is_expected or (explained and reason in EXPLAINABLE_SKIPS) else "error"
    more = _more(skips)
    message = _UNPAIRED_MESSAGES[reason](first, more, explained, parting, rounds)
    return Finding(
        kind="unpaired",
        tensor=first.name,
        severity=severity,
        message=message,
        fields={
            "reason": reason,
            "side": first.side,
            "records": len(skips),
            "rows": list(first.rows),
            "evals": sorted({e for s in skips for e in s.evals}),
            "role": first.role,
            "phase": first.phase,
            "round": first.round,
        },
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
