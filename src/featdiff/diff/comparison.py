"""compare_dumps: align -> measure -> diagnose, from two dump paths to one `Comparison`.

Pairs stream one at a time (read, align, measure, drop), so memory is bounded by the largest
pair; only the roots are read again, with their candidates, for the detectors. The findings
open with what the token ids and positions say (positions.py), and the comparison carries its
coverage: what was compared and what was left out, and why, and what the report draws of it:
the layer match of the first injected features and the row shift of the first divergence.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from featdiff.core.errors import InputError
from featdiff.diff import detectors, diagnose, positions
from featdiff.diff.align import GroupKey, Pair, Plan, drafter_arch, plan_pairs
from featdiff.diff.aligned import pair_arrays
from featdiff.diff.attribution import attributed, where_of
from featdiff.diff.dependence import gap_of
from featdiff.diff.evidence import (
    Source,
    build_evidence,
    first_feature_pair,
    index_members,
    layer_match,
    open_source,
    position_evidence,
    target_layers,
)
from featdiff.diff.export import NO_EXPORT, Export, export_of
from featdiff.diff.fields import ABSENT, FlowFields, FlowNoteFields, PositionOffsetFields
from featdiff.diff.metrics import Measurement, measure
from featdiff.diff.namemap import NameMap, read_name_map
from featdiff.diff.partings import find_partings
from featdiff.diff.provenance import provenance_problem
from featdiff.diff.result import Comparison, Coverage, Finding, PairMetrics
from featdiff.diff.rowshift import RowShift, measure_row_shift
from featdiff.diff.sketch import LayerMatch
from featdiff.diff.tolerance import FLOAT_TYPES, Tolerance, TypeInfo, describe, tolerance_for, type_info
from featdiff.dump.manifest import Manifest, flow_view
from featdiff.dump.reader import read_dump
from featdiff.dump.records import FlowInfo
from featdiff.kinds import registry as kinds
from featdiff.version import VERSION

NOT_MEASURED = Measurement(
    max_abs=float("nan"),
    nmse=float("nan"),
    cos_min=float("nan"),
    cos_median=float("nan"),
    rel_p50=float("nan"),
    rel_p99=float("nan"),
    row_rel=(),
    is_finite=False,
)
# findings that say what was not compared or inferred, not why the run differs
UNEXPLAINING = ("unpaired", "flow_note", "missing_tensor", "unexpected_tensor")


def compare_dumps(ref: Path, run: Path, name_map: Path | None = None) -> Comparison:
    """Compare a run dump against a reference dump; InputError when they share nothing. A run of
    several flows (requests, sequences: docs/flow.md) is compared flow by flow against the
    reference's flow of the same number, and each finding says which flow it is about."""
    rules = read_name_map(name_map)
    with read_dump(ref) as ref_dump, read_dump(run) as run_dump:
        run_m = run_dump.manifest
        manifests = (ref_dump.manifest, run_m)  # kept on the result: the report reads no dump again
        mismatch = provenance_problem(ref, run, ref_dump.manifest, run_m)  # before any record is read
        if mismatch:
            raise InputError(mismatch)
        flows = run_m.flow_ids()
        export = export_of(ref_dump.manifest, run_m)
        if len(flows) == 1:
            one = _compare(ref, run, open_source(ref_dump), open_source(run_dump), rules, name_map, export)
            return replace(one, manifests=manifests)
        unfollowed = {k: run_m.flow_info(k).why_unreplayable() for k in flows}
        check_flows(ref, run, ref_dump.manifest, run_m, frozenset(k for k, why in unfollowed.items() if why))
        ref_index, run_index = index_members(ref_dump), index_members(run_dump)
        first = next((k for k in flows if not unfollowed[k]), None)  # its view holds the run's flow notes
        parts: list[Comparison] = []
        for k in flows:
            if unfollowed[k]:
                continue
            ref_src = open_source(ref_dump, flow_view(ref_dump.manifest, k), ref_index)
            run_src = open_source(run_dump, flow_view(run_m, k, first), run_index)
            plan = plan_pairs(ref_src.manifest, run_src.manifest, rules)
            if not plan.pairs:  # one flow featdiff cannot pair does not take the others down
                unfollowed[k] = _unpaired_flow(run_m.flow_info(k), run_src.manifest)
                continue
            parts.append(_compare(ref, run, ref_src, run_src, rules, name_map, export, run_m.flow_info(k), plan))
    if not parts:
        raise InputError(f"{run}: no flow of the run can be compared: {next(w for w in unfollowed.values() if w)}")
    flows_of = [(run_m.flow_info(k), why) for k, why in unfollowed.items() if why]
    return replace(_with_unfollowed(merged(parts), flows_of), manifests=manifests)


def _unpaired_flow(flow: FlowInfo, run_view: Manifest) -> str:
    """Why one flow of several shares no record pair with the reference's flow of its number: a
    decode the program failed (a request the server answered with an error), else no record of the
    same role, phase, round, name and token history; a sentence naming the flow."""
    failed = [e for e in run_view.evals if e.rc != 0]
    if failed:
        e = failed[0]
        what = f"llama.cpp refused its {e.role} {e.phase} decode at eval {e.eval} (rc {e.rc}: the request failed)"
    elif not run_view.records:
        what = "the capture holds no record of it (the program decoded nothing the reference replays)"
    else:
        what = "no record of it pairs with the reference's flow (same role, phase, round, name and token history)"
    return f"{_of_flow(flow)}{what}"


def _with_unfollowed(c: Comparison, flows: list[tuple[FlowInfo, str]]) -> Comparison:
    """The flows left out because what their sequences held is not modelled, named as
    information with their flow and sequence: no verdict rests on them."""
    notes = tuple(_unfollowed_note(f, why) for f, why in flows)
    return replace(c, findings=c.findings + notes) if notes else c


def _unfollowed_note(flow: FlowInfo, why: str) -> Finding:
    note = Finding.of(
        FlowNoteFields(notes=(why,)),
        tensor="flows",
        message=f"{why}; the flow was not compared, and the verdict rests on the other flows",
        severity="info",
    )
    return replace(note, fields={**note.fields, **FlowFields(flow=flow.flow, seq_id=flow.seq_id).to_json()})


def check_flows(
    ref: Path, run: Path, ref_m: Manifest, run_m: Manifest, unfollowed: frozenset[int] = frozenset()
) -> None:
    """A run of several flows needs a reference of the same flows (`reference --run` or
    `--follow` of that run), but the run's flows no reference can replay (`unfollowed`):
    InputError naming both otherwise."""
    if set(ref_m.flow_ids()) != set(run_m.flow_ids()) - unfollowed:
        raise InputError(
            f"{ref}: holds flows {list(ref_m.flow_ids())}, {run} flows {list(run_m.flow_ids())} (one per request "
            f"and sequence); make the reference of this run with `featdiff reference ... --follow {run}` "
            f"(or --run {run}), which replays each of its flows"
        )


def _compare(
    ref: Path,
    run: Path,
    ref_src: Source,
    run_src: Source,
    rules: NameMap,
    name_map: Path | None,
    export: Export = NO_EXPORT,
    flow: FlowInfo | None = None,
    plan: Plan | None = None,
) -> Comparison:
    plan = plan or plan_pairs(ref_src.manifest, run_src.manifest, rules)
    if not plan.pairs:
        raise InputError(_of_flow(flow) + _nothing_paired(ref, run, plan, ref_src.manifest, run_src.manifest))
    types = type_info(ref_src.manifest, run_src.manifest)
    tols = [pair_tolerance(p, types) for p in plan.pairs]
    measured = [measure_pair(ref_src, run_src, p) for p in plan.pairs]
    within = [m.within(t) for m, t in zip(measured, tols)]
    walk = diagnose.find_roots(plan.pairs, within, reads_own_cache=_is_step_drafter(ref_src.manifest, run_src.manifest))
    findings = _findings(ref_src, run_src, plan, walk, measured, tols, types, rules, export)
    metrics = tuple(
        pair_metrics(p, m, t, ok, i in walk.inherited)
        for i, (p, m, t, ok) in enumerate(zip(plan.pairs, measured, tols, within))
    )
    match = first_layer_match(ref_src, run_src, plan)
    shift = (
        row_shift_of(ref_src, run_src, plan.pairs[walk.first_divergence], metrics[walk.first_divergence])
        if walk.first_divergence is not None
        else None
    )
    return Comparison(
        ref_path=str(ref),
        run_path=str(run),
        findings=findings if flow is None else tuple(of_flow(f, flow) for f in findings),
        pairs=metrics,
        alignments=tuple(p.alignment for p in plan.pairs),
        first_divergence=walk.first_divergence,
        skipped=plan.skipped,
        types=describe(types),
        coverage=coverage(plan),
        map_path=None if name_map is None else str(name_map),
        versions=versions(run_src.manifest),
        layer_match=match,
        row_shift=shift,
    )


def _is_step_drafter(ref: Manifest, run: Manifest) -> bool:
    """The drafter decodes one token per row against its own cache (EAGLE3, MTP: its kind's
    `row_token`), not a block of features projected to K/V."""
    return kinds.of_arch(drafter_arch(run) or drafter_arch(ref)).row_token is not None


def _of_flow(flow: FlowInfo | None) -> str:
    return "" if flow is None else f"flow {flow.flow} (sequence {flow.seq_id}): "


def of_flow(f: Finding, flow: FlowInfo) -> Finding:
    """A finding of one flow of several: says so in its sentence and in its `flow` / `seq_id`."""
    tag = FlowFields(flow=flow.flow, seq_id=flow.seq_id)
    return replace(f, message=_of_flow(flow) + f.message, fields={**f.fields, **tag.to_json()})


def merged(parts: list[Comparison]) -> Comparison:
    """The comparisons of each flow as one: findings in flow order (errors first within each, as
    each flow ordered them), records and coverage added up; the layer match and row shift are
    those of the first flow that has them."""
    first = next((i for i, c in enumerate(parts) if c.first_divergence is not None), None)
    offset = sum(len(c.pairs) for c in parts[:first]) if first is not None else 0
    head = parts[0]
    return replace(
        head,
        findings=_deduplicated([f for c in parts for f in c.findings]),
        pairs=tuple(p for c in parts for p in c.pairs),
        alignments=tuple(a for c in parts for a in c.alignments),
        first_divergence=None if first is None else offset + (parts[first].first_divergence or 0),
        skipped=tuple(s for c in parts for s in c.skipped),
        coverage=Coverage(
            pairs=sum(c.coverage.pairs for c in parts),
            rows=sum(c.coverage.rows for c in parts),
            skips=tuple(s for c in parts for s in c.coverage.skips),
            ref_only=sum(c.coverage.ref_only for c in parts),
            run_only=sum(c.coverage.run_only for c in parts),
        ),
        layer_match=next((c.layer_match for c in parts if c.layer_match is not None), None),
        row_shift=None if first is None else parts[first].row_shift,
    )


def versions(run: Manifest) -> dict[str, str | None]:
    """featdiff's version, and the llama.cpp version the run's build states (None: unknown)."""
    llama = run.build_info.llama
    return {"featdiff": VERSION, "llama_cpp": llama if llama and llama != "unknown" else None}


def _nothing_paired(ref: Path, run: Path, plan: Plan, ref_manifest: Manifest, run_manifest: Manifest) -> str:
    """The one-line reason two dumps share no pair, naming the prompt when that is why."""
    prompt = detectors.detect_unpaired_prompt(ref_manifest, run_manifest)
    if prompt is not None:
        return f"{run}: no record pairs with {ref}: {prompt.message}"
    why = f" ({len(plan.skipped)} left out, e.g. {plan.skipped[0]})" if plan.skipped else ""
    return (
        f"{run}: no record pairs with {ref} (same role, phase, round, name and token history){why}; "
        f"make both from the same prompt and models, or pass --map for a fork"
    )


def coverage(plan: Plan) -> Coverage:
    """What the plan compares (record sets, rows) and what it leaves out, and why."""
    rows = sum(_compared_rows(p) for p in plan.pairs)
    return Coverage(
        pairs=len(plan.pairs), rows=rows, skips=plan.skips, ref_only=len(plan.ref_only), run_only=len(plan.run_only)
    )


def _compared_rows(pair: Pair) -> int:
    """Rows a pair compares: its aligned positions, or the stacked first axis when not row-wise."""
    if not pair.alignment.comparable:
        return 0
    if pair.alignment.positions:
        return len(pair.alignment.positions)
    return sum(r.shape[0] if r.shape else 1 for r in pair.ref.records)


def pair_tolerance(pair: Pair, types: TypeInfo) -> Tolerance:
    return tolerance_for(pair.name, pair.is_integer, types)


def measure_pair(ref: Source, run: Source, pair: Pair) -> Measurement:
    """Read, align and measure one pair; a pair whose shapes cannot be aligned is not measured."""
    if not pair.alignment.comparable:
        return NOT_MEASURED
    ref_rows, run_rows = pair_arrays(pair.alignment, ref.rows(pair.ref), run.rows(pair.run), pair.name)
    return measure(ref_rows, run_rows)


def pair_metrics(pair: Pair, m: Measurement, tol: Tolerance, within: bool, inherited: bool) -> PairMetrics:
    role, phase, rnd = pair.group
    return PairMetrics(
        role=role,
        phase=phase,
        eval=pair.first_eval,
        name=pair.name,
        occurrence=pair.occurrence,
        max_abs=m.max_abs,
        nmse=m.nmse,
        cos_min=m.cos_min,
        cos_median=m.cos_median,
        rel_p50=m.rel_p50,
        rel_p99=m.rel_p99,
        tolerance=tol.nmse,
        within=within,
        row_rel_err=m.row_rel,
        positions=pair.alignment.positions,
        round=rnd,
        run_name=pair.run_name if pair.run_name != pair.name else "",
        row_tolerance=tol.row_rel,
        inherited=inherited,
        tolerance_sources=tol.sources,
    )


def _findings(
    ref: Source,
    run: Source,
    plan: Plan,
    walk: diagnose.Walk,
    measured: list[Measurement],
    tols: list[Tolerance],
    types: TypeInfo,
    rules: NameMap,
    export: Export = NO_EXPORT,
) -> tuple[Finding, ...]:
    """What the token ids and positions say (protocol order), manifest-level findings, one per root,
    then the wiring records left out (`unpaired`), then info; deduplicated, errors first, each error
    placed (`where`: diff/attribution.py). Records that depend on a feature the reference left out
    are not judged (diagnose.set_aside_unmodelled)."""
    gap = gap_of(ref.manifest, run.manifest)
    noise = _noise(plan, walk, measured, tols)  # over the within-tolerance pairs, whatever depends on the gap
    plan, walk, unmodelled = diagnose.set_aside_unmodelled(plan, walk, gap)
    batch_found = positions.check_batches(ref.manifest, run.manifest)
    found: list[Finding | None] = [
        *batch_found,
        detectors.detect_not_conditioned(ref.manifest, run.manifest, rules),
        detectors.detect_missing_tensor(plan, run.manifest),
        detectors.detect_unexpected_tensor(plan, ref.manifest),
    ]
    misplaced = _misplaced_groups(batch_found)
    state = next((f for f in batch_found if diagnose.names_drafter_state(f)), None)
    absent = diagnose.absent_records(plan, run.manifest)
    chained: frozenset[tuple[int, int]] = frozenset()  # draft rows a DSpark chain biased after a near-tie
    for i in walk.roots[: diagnose.MAX_ROOT_FINDINGS]:
        where = where_of(export.of_role(plan.pairs[i].group[0]))  # what the fix sentences follow
        ev = build_evidence(ref, run, plan.pairs[i], tols[i], absent.get(plan.pairs[i].group, ()), where)
        root = diagnose.diagnose_root(ev, measured[i].nmse)
        # rows of a batch placed at offset positions look shifted: the position_offset above says why
        root = diagnose.after_drafter_state(root, plan.pairs[i], state)
        state = state or (root if diagnose.names_drafter_state(root) else None)
        chained |= diagnose.chain_rows(root, plan.pairs[i].group)
        found.append(None if root.kind == "row_shift" and plan.pairs[i].group in misplaced else root)
    routed = diagnose.first_routed(found)  # where a MoE near-tie took other experts: faults may hide behind it
    found.append(_quantized_feature_check(ref, run, plan, walk, tols, types, routed))
    found.append(diagnose.check_positions(position_evidence(ref, run)))
    explained = any(f is not None and f.severity == "error" and f.kind not in UNEXPLAINING for f in found)
    partings = diagnose.parting_findings(
        diagnose.judged_partings(find_partings(ref.manifest, ref.array, run.manifest, types, run.array), gap, chained),
        explained,
    )
    near_tie = next((f for f in partings if f.kind == "near_tie"), None)
    found += partings
    explained = explained or any(f.severity == "error" for f in partings)
    found += diagnose.unpaired_findings(
        plan, explained, positions.history_divergence(ref.manifest, run.manifest), near_tie, unmodelled
    )
    found = [_settled(f, explained) for f in found if f is not None]
    found += [unmodelled, noise, detectors.detect_unexpected_tensor_outside_wiring(plan)]
    named = _deduplicated([f for f in found if f is not None])
    unchecked = frozenset(plan.pairs[i].run_name for i in walk.unchecked)
    return attributed(named, export, diagnose.graph_inputs(plan), diagnose.record_roles(plan), unchecked)


def _misplaced_groups(batch_found: tuple[Finding, ...]) -> set[GroupKey]:
    """The eval groups (role, phase, round) the batch checks found at offset positions (a
    `position_offset` of a batch: one of a record's values has no group)."""
    offsets = [PositionOffsetFields.from_json(f.fields) for f in batch_found if f.kind == PositionOffsetFields.KIND]
    return {
        (o.role, o.phase, o.round)
        for o in offsets
        if o.role is not ABSENT and o.phase is not ABSENT and o.round is not ABSENT
    }


def _settled(f: Finding, explained: bool) -> Finding:
    """A flow note is info when an error finding already explains the run; alone, it is an error:
    an OK must not rest on a flow the capture had to guess."""
    return replace(f, severity="info") if f.kind == "flow_note" and explained else f


def _quantized_feature_check(
    ref: Source,
    run: Source,
    plan: Plan,
    walk: diagnose.Walk,
    tols: list[Tolerance],
    types: TypeInfo,
    routed: int | None = None,
) -> Finding | None:
    """With quantized weights the tolerance can swallow a neighbouring layer: check the first
    features' layer match even when they are within tolerance. (Runs on float weights never need
    it: f32, f16 and bf16 tolerances are far below the difference between two layers.) Beside an
    `expert_choice` (`routed`: its first position) the features inherit it, so the walk never
    makes them a root: their layer match on the rows before it still names a wiring fault."""
    feature = first_feature_pair(plan.pairs)
    quantized = [t for t in types.quant_types if t not in FLOAT_TYPES]
    if not (quantized or routed is not None) or feature is None or not feature.alignment.comparable:
        return None
    i = plan.pairs.index(feature)
    if i in walk.roots:
        return None
    feature = feature if routed is None else diagnose.rows_before(feature, routed)
    return diagnose.check_features(build_evidence(ref, run, feature, tols[i]))


def _noise(plan: Plan, walk: diagnose.Walk, measured: list[Measurement], tols: list[Tolerance]) -> Finding | None:
    """`numeric_noise` for the within-tolerance pair closest to its tolerance."""
    bad = set(walk.roots) | set(walk.inherited)
    ratios = [
        (m.nmse / t.nmse if t.nmse > 0 else 0.0, i)
        for i, (m, t) in enumerate(zip(measured, tols))
        if i not in bad and np.isfinite(m.nmse)
    ]
    if not ratios:
        return None
    _, i = max(ratios)
    return detectors.detect_numeric_noise(plan.pairs[i].run_name, measured[i].nmse, tols[i])


def _deduplicated(findings: list[Finding]) -> tuple[Finding, ...]:
    """Errors first, in order; one finding per (kind, tensor, reason, phase): the same fault seen
    again at a later root is dropped, an `unpaired` of another cause or a batch of another phase is not.
    A `divergence` (no cause found) of a tensor another finding already names a cause for is dropped."""
    seen: set[tuple] = set()
    named = {(f.tensor, f.fields.get("flow")) for f in findings if f.severity == "error" and f.kind != "divergence"}
    out = []
    for f in sorted(findings, key=lambda f: f.severity != "error"):
        if f.kind == "divergence" and (f.tensor, f.fields.get("flow")) in named:
            continue
        key = (f.kind, f.tensor, f.fields.get("reason"), f.fields.get("phase"), f.fields.get("flow"))
        if key not in seen:
            seen.add(key)
            out.append(f)
    return tuple(out)


# --- what the report draws: compare's own layer match and row shift ---------------------------


def first_layer_match(ref: Source, run: Source, plan: Plan, eval_index: int | None = None) -> LayerMatch | None:
    """Slot x layer match of the run's injected features against every ref `layer_inp-<L>`: of
    the first inject eval (or the run's inject eval `eval_index`), with the layers each manifest
    names; None when the dumps have no feature pair or the reference recorded no layer inputs."""
    pair = first_feature_pair(plan.pairs, eval_index)
    if pair is None or not pair.alignment.comparable or not pair.alignment.positions:
        return None
    _, run_rows = pair_arrays(pair.alignment, ref.rows(pair.ref), run.rows(pair.run))
    n_extract = len(target_layers(ref.manifest))
    match = layer_match(ref, pair, run_rows, n_extract) if n_extract else None
    return None if match is None else replace(match, run_layers=target_layers(run.manifest))


def row_shift_of(ref: Source, run: Source, pair: Pair, metrics: PairMetrics) -> RowShift | None:
    """Run rows x ref rows of one pair as compare aligned them (by position), around its first
    row over tolerance; None when its two sides could not be aligned or hold no rows."""
    if not pair.alignment.comparable:
        return None
    ref_rows, run_rows = pair_arrays(pair.alignment, ref.rows(pair.ref), run.rows(pair.run), pair.name)  # (R, D) each
    if not len(ref_rows) or not len(run_rows):
        return None
    run_positions = pair.alignment.positions or tuple(range(len(run_rows)))
    ref_positions = pair.alignment.positions or tuple(range(len(ref_rows)))
    return measure_row_shift(
        run_rows,
        ref_rows,
        run_positions,
        ref_positions,
        f"{metrics.name} (e{metrics.eval} {metrics.role} {metrics.phase})",
        focus=metrics.first_bad_position(),
    )


def layer_match_matrix(
    ref_dump: Path | str, run_dump: Path | str, name_map: Path | None = None, eval_index: int | None = None
) -> LayerMatch | None:
    """`first_layer_match` of two dump files, without the rest of the comparison (the layer-match
    search on its own: bench/bench_compare.py times it at scale)."""
    with read_dump(ref_dump) as ref, read_dump(run_dump) as run:
        plan = plan_pairs(ref.manifest, run.manifest, read_name_map(name_map))
        return first_layer_match(open_source(ref), open_source(run), plan, eval_index)
