"""Diagnosis: separate a tensor's own error from error it inherited, then name the cause.

`find_roots` walks the pairs in eval and graph order and keeps each pair beyond tolerance whose
inputs are all within it (the first is the first divergence). `diagnose_root` runs the detector
chain on one root's evidence. `unpaired_findings` and `parting_findings` say which of the plan's
skips and the token partings become findings, and how severe (the detectors: detectors/).

What a pair's inputs are, from the run node's recorded sources:
* every source a captured pair of its eval, a weight (`x.weight`) or a leaf (`inp_*`, `leaf_*`):
  those captured pairs, nothing else (e.g. `inp_noise_embd` = get_rows(token_embd, tokens));
* no source and op NONE (a leaf, e.g. `inp_target_features`): the evals that feed its eval;
* otherwise (an uncaptured node in between): every earlier pair of the eval and the evals that
  feed it. Which evals feed which is the protocol's (featdiff.core.phases.FEEDERS, docs/flow.md): a
  target eval reads the earlier target evals (KV cache), an inject eval the target evals
  (features), a draft eval the inject evals.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from featdiff.core.names import ROLE_DRAFT, Role
from featdiff.core.phases import ROUND_OPENER, Phase, feeders, role_of
from featdiff.diff import detectors as d
from featdiff.diff.align import GroupKey, Pair, Plan
from featdiff.diff.batches import batch_label
from featdiff.diff.dependence import Gap
from featdiff.diff.detectors.kvcache import KEPT_ROW_SOURCE, RESTORED_SOURCE
from featdiff.diff.detectors.numeric import STALE_PENDING_SOURCE
from featdiff.diff.detectors.pairing import (
    absent_keys,
    explained_by_near_tie,
    explained_by_unmodelled,
    is_wiring,
)
from featdiff.diff.fields import ChainChoiceFields, ExpertChoiceFields, UnmodelledFields
from featdiff.diff.partings import Parting
from featdiff.diff.result import INFO_SKIPS, Finding, Skip
from featdiff.dump.manifest import Manifest

LEAF_PREFIXES = ("inp_", "leaf_")  # graph inputs: no captured producer to inherit from
LEAF_OPS = ("NONE", "")  # ggml's op of a leaf (an input tensor)
OWN_CACHE_READER = (ROLE_DRAFT, Phase.INJECT.value)  # a step drafter's inject: attends to its earlier inject rows
MAX_ROOT_FINDINGS = 8  # roots diagnosed; later ones are almost always the same fault again

# The detector chain, most specific evidence first; the first to return a Finding names the cause.
CHAIN: tuple[Callable[[d.Evidence], Finding | None], ...] = (
    d.detect_wrong_source_of_vocabulary,  # before nonfinite: a head scattered to other ids leaves -inf where it wrote
    d.detect_wrong_source_of_vocabulary_map,  # the same, the map inferred from the values (d2t dropped, shifted)
    d.detect_wrong_source_of_sampled_logits,
    d.detect_nonfinite,
    d.detect_zeros_of_step_state,  # before zeros: a draft step fed a state row the driver never wrote
    d.detect_zeros,
    d.detect_wrong_source_of_zero_rows,  # the inverse: a sequence's zero first row (MTP) holding a state
    d.detect_wrong_source_of_pending_row,  # the first row past a kept prefix (MTP) handed another request's hidden
    d.detect_wrong_source_of_another_sequence,  # a step fed the row another sequence's step made beside it
    d.detect_layout_transpose,
    d.detect_expert_choice,  # info: a MoE near-tie, before any fault is tried on its few rows
    d.detect_layer_offset,
    d.detect_layer_offset_of_handed_state,  # an MTP head handed an earlier layer's output (its candidates)
    d.detect_slot_permutation,
    d.detect_missing_term,
    d.detect_extra_term,
    d.detect_wrong_source_of_chain_weights,  # before the generic: a head's candidates name the head it ran
    d.detect_wrong_source,
    d.detect_chain_choice,  # info: DSpark's in-graph chain on a near-tie, before a row read elsewhere is tried
    d.detect_wrong_source_of_sampled_block_rows,  # after the drafter's own hypotheses of a block's values
    d.detect_wrong_source_of_step_state,  # before stale rows: a step fed the seed's state repeats step 1's
    d.detect_wrong_source_of_chain_state,  # a chained step's rows all the pending row
    d.detect_stale_rows,
    d.detect_row_shift,
    d.detect_misplaced_rows,
    d.detect_position_offset_of_record,
    d.detect_scale,
    d.detect_scale_per_channel,
    d.detect_divergence_in_rope,
)

# A parting beyond the noise, most specific cause first; the first detector that names one wins.
PARTING_CHAIN: tuple[Callable[[Parting], Finding | None], ...] = (
    d.detect_position_offset_after_accept,  # a kept draft, then the target's token: n_past past the accept
    d.detect_wrong_source_of_drafts,
    d.detect_wrong_source_of_sampled_draft,
    d.detect_divergence_by_margin,
)


@dataclass(frozen=True)
class Walk:
    """The roots (own error) and the inherited pairs, as indices into the plan's pairs."""

    roots: tuple[int, ...]
    inherited: tuple[int, ...]
    # the roots whose inputs were not all captured in their eval (a node left unnamed between them
    # and it): that its inputs agree with the reference, the graph's evidence, is not known for them
    unchecked: tuple[int, ...] = ()

    @property
    def first_divergence(self) -> int | None:
        return self.roots[0] if self.roots else None


def _is_resolved(src: str, captured: set[str]) -> bool:
    return src in captured or "." in src or src.startswith(LEAF_PREFIXES)


def _inputs(pair: Pair, earlier: list[int], pairs: tuple[Pair, ...]) -> tuple[list[int], bool]:
    """The earlier pairs of its own eval `pair` reads, and whether it reads other evals' data."""
    captured = {pairs[i].name for i in earlier}
    if _is_leaf(pair):
        return [], True  # a graph input: its data was copied in from another eval (the features)
    if pair.run_srcs and all(_is_resolved(s, captured) for s in pair.run_srcs):
        return [i for i in earlier if pairs[i].name in pair.run_srcs], False
    return earlier, True  # an uncaptured node in between: anything before it may feed it


def _is_leaf(pair: Pair) -> bool:
    """A paired graph input: no recorded source, op NONE."""
    return not pair.run_srcs and pair.run.records[0].op in LEAF_OPS


def graph_inputs(plan: Plan) -> frozenset[str]:
    """The run names of the paired graph inputs: leaves (no recorded source, op NONE) whose values
    were copied in (the features, positions, a recycled state), not computed by the graph."""
    return frozenset(p.run_name for p in plan.pairs if _is_leaf(p))


def record_roles(plan: Plan) -> dict[str, Role]:
    """The role of each paired run name that only one role's graph computes (`result_output`,
    `l_out-0` of both the target and the drafter have none)."""
    seen: dict[str, set[Role]] = defaultdict(set)
    for p in plan.pairs:
        seen[p.run_name].add(p.group[0])
    return {name: next(iter(roles)) for name, roles in seen.items() if len(roles) == 1}


def find_roots(pairs: tuple[Pair, ...], within: list[bool], reads_own_cache: bool = False) -> Walk:
    """Walk pairs in order; a divergent pair is a root when none of its inputs diverges, nor carries
    what a divergent pair before it in its eval computed (a norm or a concat can bring a wrong row
    back under the tolerance for one record: what follows still inherits it).
    `reads_own_cache`: the drafter's inject attends to the rows its earlier injects wrote (a step
    drafter: EAGLE3's decoder, an MTP head), so a row gone wrong there feeds every later inject."""
    roots: list[int] = []
    inherited: list[int] = []
    unchecked: list[int] = []
    carried: set[int] = set()  # within tolerance, but computed from a divergent pair of its eval
    by_group: dict[tuple, list[int]] = {}
    first_bad: dict[tuple[str, str], int] = {}  # (role, phase) -> first eval holding a divergence
    for i, pair in enumerate(pairs):
        earlier = by_group.setdefault(pair.group, [])
        same_eval, reads_others = _inputs(pair, earlier, pairs)
        # carried only along the graph's own edges: a node whose sources were not captured is
        # judged, as before, by whether anything before it in its eval diverged
        carries = not reads_others and any(j in carried for j in same_eval)
        bad_input = carries or any(not within[j] for j in same_eval)
        if within[i] and bad_input and not reads_others:
            carried.add(i)
        if not within[i]:
            bad_feeder = reads_others and any(
                first_bad.get(f, pair.first_eval) < pair.first_eval
                for f in _feeders(pair.group[:2], reads_own_cache) or tuple(first_bad)
            )
            if bad_input or bad_feeder:
                inherited.append(i)
            else:
                roots.append(i)
                if reads_others and not _is_leaf(pair):
                    unchecked.append(i)
            first_bad.setdefault(pair.group[:2], pair.first_eval)
        earlier.append(i)
    return Walk(tuple(roots), tuple(inherited), tuple(unchecked))


def _feeders(group: tuple[str, str], reads_own_cache: bool) -> tuple[tuple[str, str], ...] | None:
    """The protocol's feeders of an eval group (featdiff.core.phases.FEEDERS), with the drafter's own
    earlier injects where its inject attends to its cache (a step drafter's decoder; a block
    drafter's inject only projects features to K/V, docs/flow.md)."""
    fed = feeders(*group)
    if fed is not None and reads_own_cache and group == OWN_CACHE_READER:
        return (*fed, OWN_CACHE_READER)
    return fed


def diagnose_root(ev: d.Evidence, nmse: float) -> Finding:
    """The first detector of the chain that explains the pair, else `divergence`."""
    for detect in CHAIN:
        finding = detect(ev)
        if finding is not None:
            return finding
    return d.detect_divergence(ev, nmse)


# wrong_source's sources that say the drafter's cache or pending state, when a flow began, was not
# what its history prescribes (a prompt cache, a slot file, upstream's pending hidden)
DRAFTER_STATE_SOURCES = (RESTORED_SOURCE, KEPT_ROW_SOURCE, STALE_PENDING_SOURCE)


def names_drafter_state(f: Finding) -> bool:
    """`f` says the drafter's state when the flow began was not its history's."""
    return f.severity == "error" and (
        f.kind == "not_conditioned" or (f.kind == "wrong_source" and f.fields.get("source") in DRAFTER_STATE_SOURCES)
    )


def after_drafter_state(root: Finding, pair: Pair, state: Finding | None) -> Finding:
    """A drafter `divergence` no detector explains, in a flow whose drafter began with a state its
    history does not prescribe (`state`, named above): the drafter attends to those rows, so the
    difference follows from that state; information saying so, not a second error."""
    if state is None or root.kind != "divergence" or pair.group[0] != ROLE_DRAFT:
        return root
    why = state.fields.get("source") or state.kind
    return replace(
        root,
        severity="info",
        message=f"{root.message.split(' and no known')[0]}, where the drafter began this flow with rows or a "
        f"pending state its history does not prescribe ({state.kind} {why}, named above): it attends to them, so "
        "the difference follows from that state",
    )


def check_features(ev: d.Evidence) -> Finding | None:
    """Layer offsets and slot orders on a feature pair that is *within* tolerance: quantization
    noise can be as large as the difference between neighbouring layers, the layer match is not."""
    return d.detect_layer_offset(ev) or d.detect_slot_permutation(ev)


def first_routed(found: list[Finding | None]) -> int | None:
    """The earliest position an `expert_choice` finding names (a MoE near-tie routed it to other
    experts), or None when there is none."""
    routed = [f for f in found if f is not None and f.kind == ExpertChoiceFields.KIND]
    return min((min(ExpertChoiceFields.from_json(f.fields).rows) for f in routed), default=None)


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
        return d.detect_position_offset_of_record(ev) or d.detect_divergence(ev, float("inf"))
    return None


# --- records that depend on a feature the reference left out ------------------------------------


def set_aside_unmodelled(plan: Plan, walk: Walk, gap: Gap | None) -> tuple[Plan, Walk, Finding | None]:
    """The plan and walk without the records that depend on an unmodelled feature
    (diff/dependence.py), and the one `unmodelled` finding that says so: no root, skip or
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
        *(tuple(i for i in indices if i not in out) for indices in (walk.roots, walk.inherited, walk.unchecked))
    )
    finding = d.detect_unmodelled(
        gap, tuple(_set_name(plan.pairs[i]) for i in sorted(out)), tuple(_set_name(plan.pairs[i]) for i in diverged)
    )
    return kept, judged, finding


def _set_name(p: Pair) -> str:
    return f"{p.name} ({batch_label(p.group)})"


def judged_partings(
    partings: tuple[Parting, ...], gap: Gap | None, chained: frozenset[tuple[int, int]] = frozenset()
) -> tuple[Parting, ...]:
    """The partings compare may judge: not those on logits that depend on an unmodelled feature
    (a drafted token, when the drafter's logits do), nor the drafts of rows a DSpark chain biased
    after a near-tie (`chained`: (round, position), chain_rows)."""
    kept = tuple(p for p in partings if not (p.phase == Phase.DRAFT and (p.round, p.position) in chained))
    if gap is None:
        return kept
    return tuple(p for p in kept if not gap.depends(role_of(p.phase), p.phase, p.tensor))


def chain_rows(root: Finding, group: GroupKey) -> frozenset[tuple[int, int]]:
    """The (round, position) of the draft rows a `chain_choice` root leaves unjudged (the rows
    after the near-tie carry the other token's bias); none for another finding."""
    if root.kind != ChainChoiceFields.KIND:
        return frozenset()
    return frozenset((group[2], p) for p in ChainChoiceFields.from_json(root.fields).rows)


# --- wiring records the run's graph lacks, and those the plan could not pair ---------------------


def absent_records(plan: Plan, run: Manifest) -> dict[GroupKey, tuple[str, ...]]:
    """absent_keys by eval group: the names each group's run graph lacks."""
    out: dict[GroupKey, dict[str, None]] = defaultdict(dict)
    for group, name, _ in absent_keys(plan, run):
        out[group][name] = None
    return {group: tuple(found) for group, found in out.items()}


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
    the two token histories part (positions.history_divergence). An `unmodelled` drafter feature explains
    rows of another token history too: the reference drafts without it, so its drafts may differ."""
    by_cause: dict[tuple[str, str], list[Skip]] = {}
    for skip in plan.skips:
        if is_wiring(skip.name, plan.wiring) and (not skip.is_expected or skip.reason in INFO_SKIPS):
            by_cause.setdefault((skip.reason, skip.side), []).append(skip)
    rounds = (_last_round(plan.ref_groups), _last_round(plan.run_groups))
    found = [d.detect_unpaired(tuple(skips), explained, parting, rounds) for skips in by_cause.values()]
    drafter_gap = unmodelled is not None and UnmodelledFields.from_json(unmodelled.fields).role == ROLE_DRAFT
    if near_tie is not None and not explained:
        found = [explained_by_near_tie(f, near_tie) if f is not None else None for f in found]
    elif unmodelled is not None and drafter_gap and not explained:
        found = [explained_by_unmodelled(f, unmodelled) if f is not None else None for f in found]
    return [f for f in found if f is not None]


def parting_findings(partings: tuple[Parting, ...], explained: bool) -> list[Finding]:
    """The first sampled choice a chain featdiff does not compute left unjudged (info), the
    near-ties (info), and the first parting beyond the noise as an error unless other error
    findings (`explained`) already say why the run chose other tokens."""
    unjudged = [f for f in map(d.detect_unmodelled_sampler, partings) if f is not None][:1]
    partings = tuple(p for p in partings if not p.unmodelled)
    found = [f for f in map(d.detect_near_tie, partings) if f is not None]
    beyond = next((fs for fs in ([f for f in map(det, partings) if f] for det in PARTING_CHAIN) if fs), [])
    return unjudged + found + ([] if explained or not beyond else beyond[:1])


def _last_round(groups: tuple[GroupKey, ...]) -> int:
    return max((g[2] for g in groups if g[:2] == ROUND_OPENER), default=0)
