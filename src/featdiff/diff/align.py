"""Alignment: which run record answers which ref record, and which rows line up.

Plan, then execute: `plan_pairs` reads only the two manifests and returns `Pair`s, each with the
`Alignment` it assumes (name map, layout, rows); `pair_arrays` applies one to the arrays.

Records pair by (role, phase, round, name, occurrence). The evals of one (role, phase, round)
form a group; a record's rows are concatenated over the group's evals and matched by position,
so chunked prefills and differently split batches line up. A row is compared only when both
sides computed it from the same token history (its context), so rounds that accepted different
drafts do not compare unrelated tokens.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from featdiff.core import names
from featdiff.core.names import ROLE_TARGET, Role
from featdiff.core.phases import ROUND_OPENER, TOKEN_PHASES, VERIFY_PHASES, Phase, phase_order
from featdiff.core.words import plural
from featdiff.diff.namemap import NameMap
from featdiff.diff.result import WARMUP_SKIP, Alignment, Skip, SkipReason, SkipSide
from featdiff.dump.manifest import Manifest
from featdiff.dump.records import Eval, Record
from featdiff.kinds import registry as kinds

GroupKey = tuple[Role, str, int]  # (role, phase, round)
RecordKey = tuple[GroupKey, str, int]  # (group, ref name, occurrence)
# Run names the reference records under another name (run name -> the reference's): the input of
# target layer 0 is the token embeddings, `embd` in llama.cpp, `layer_inp-0` in the reference; the
# older generation's encoder input `inp_embd` is the injected features (docs/flow.md).
REF_ALIASES = {names.TARGET_EMBD: names.layer_name(names.LAYER_INP, 0), names.ENC_INP_EMBD: names.INP_TARGET_FEATURES}
ROOT_CONTEXT = 0  # the context before position 0


@dataclass(frozen=True)
class Side:
    """One side of a pair: the records of one (group, name, occurrence), in eval order."""

    records: tuple[Record, ...]
    evals: tuple[Eval, ...]  # the eval of each record
    positions: tuple[int, ...] = ()  # position of each concatenated row; () = not row-wise
    contexts: tuple[int | None, ...] = ()  # token-history id of each row; None = unknown

    @property
    def is_rows(self) -> bool:
        return bool(self.positions)

    @property
    def width(self) -> int:
        return int(np.prod(self.records[0].shape[1:])) if self.records[0].shape else 1


@dataclass(frozen=True)
class Pair:
    """A ref record set and the run record set that answers it, with the alignment assumed."""

    group: GroupKey
    name: str  # the reference's name
    run_name: str  # the run's name (differs when a name map applied)
    occurrence: int
    ref: Side
    run: Side
    alignment: Alignment
    order: tuple[int, int]  # walk order: (first ref eval, run graph index)
    run_srcs: tuple[str, ...]  # the run node's sources, mapped to ref names

    @property
    def first_eval(self) -> int:
        return self.ref.evals[0].eval

    @property
    def is_integer(self) -> bool:
        """Integer data (positions, token ids): compared exactly."""
        return self.ref.records[0].dtype.startswith("int")


@dataclass(frozen=True)
class Plan:
    """Every pair to compare, in eval and graph order, and what could not be paired."""

    pairs: tuple[Pair, ...]
    ref_only: tuple[RecordKey, ...]  # ref records the run lacks, in eval groups both sides have
    run_only: tuple[RecordKey, ...]  # run records (mapped names) the ref lacks, in shared groups
    skips: tuple[Skip, ...]  # record sets (or rows) not compared, and why
    ref_groups: tuple[GroupKey, ...]
    run_groups: tuple[GroupKey, ...]
    wiring: tuple[str, ...] = names.WIRING_NAMES  # the drafter kind's wiring names (kinds.wiring_names)

    @property
    def skipped(self) -> tuple[str, ...]:
        """The skips, one line each."""
        return tuple(s.line() for s in self.skips)


def is_reference_only(name: str) -> bool:
    """Records only the reference writes, as candidates: `layer_inp-<L>`, `x@h`, DSpark's
    `dspark_markov_bias`, and the old names of graph records (`log_snr_embed`,
    names.OLD_RECORD_NAMES) in older reference dumps."""
    return (
        names.CANDIDATE_SEP in name
        or name in names.OLD_RECORD_NAMES
        or name == names.DSPARK_MARKOV_BIAS
        or name.startswith(names.LAYER_INP + "-")
    )


def is_unnamed(name: str) -> bool:
    """ggml's default name for a node nobody named (`node_<n>`): never paired."""
    return name.startswith(names.UNNAMED_NODE_PREFIX) or name == ""


def group_key(ev: Eval) -> GroupKey:
    return (ev.role, ev.phase, ev.round)


def row_contexts(manifest: Manifest) -> dict[int, tuple[int | None, ...]]:
    """A token-history id for each row of each eval (docs/flow.md: what each row was computed from).

    Target rows: hash of the tokens at positions 0..p. Inject rows: the target row they carry.
    Draft rows: the history before the block plus the block's tokens and the row's index. A history
    is the tokens the sequence holds: a draft step after the first of its round (EAGLE3's, MTP's
    one-token steps) continues the previous step's history, never the row the target last decoded
    at that position in an earlier round (a rejected draft, or none: which depends on how the
    earlier rounds went, not on the tokens this step was drafted from).
    """
    target: dict[int, int] = {}
    drafted: dict[int, int] = {}  # position -> history of this round's draft steps so far
    out: dict[int, tuple[int | None, ...]] = {}
    for ev in manifest.evals:
        if (ev.role, ev.phase) != ROUND_OPENER:
            drafted.clear()  # a round's steps are consecutive evals: anything else ends them
        out[ev.eval] = _eval_contexts(ev, target, drafted)
    return out


def _eval_contexts(ev: Eval, target: dict[int, int], drafted: dict[int, int]) -> tuple[int | None, ...]:
    has_tokens = len(ev.token_ids) == len(ev.positions)
    if ev.phase == Phase.INJECT:
        return tuple(target.get(p) for p in ev.positions)
    if ev.role == ROLE_TARGET and ev.phase in TOKEN_PHASES and has_tokens:
        ctx = []
        for p, tok in zip(ev.positions, ev.token_ids):
            prev = ROOT_CONTEXT if p == 0 else target.get(p - 1)
            target[p] = hash((prev, tok)) if prev is not None else hash((p, tok, "unknown"))
            ctx.append(target[p])
        return tuple(ctx)
    if (ev.role, ev.phase) == ROUND_OPENER and has_tokens and ev.positions:
        p0 = ev.positions[0]
        before = ROOT_CONTEXT if p0 == 0 else drafted.get(p0 - 1, target.get(p0 - 1))
        drafts = tuple(hash((before, tuple(ev.token_ids), i)) for i in range(len(ev.positions)))
        drafted.update(zip(ev.positions, drafts))
        return drafts
    return (None,) * len(ev.positions)


def _is_row_record(record: Record, ev: Eval) -> bool:
    return len(record.shape) >= 1 and record.shape[0] == ev.n_tokens and ev.n_tokens > 0


def _side(entries: list[tuple[Eval, Record]], contexts: dict[int, tuple[int | None, ...]]) -> Side:
    evals = tuple(ev for ev, _ in entries)
    records = tuple(r for _, r in entries)
    if not all(_is_row_record(r, ev) for ev, r in entries):
        return Side(records, evals)
    positions = tuple(p for ev in evals for p in ev.positions)
    ctx = tuple(c for ev in evals for c in contexts.get(ev.eval, (None,) * ev.n_tokens))
    return Side(records, evals, positions, ctx)


def _index(manifest: Manifest, rename: Callable[[str], str | None]) -> dict[RecordKey, list[tuple[Eval, Record, int]]]:
    """(group, name, occurrence) -> [(eval, record, manifest index)], skipping unnamed nodes."""
    evals = {ev.eval: ev for ev in manifest.evals}
    out: dict[RecordKey, list[tuple[Eval, Record, int]]] = defaultdict(list)
    for i, r in enumerate(manifest.records):
        ev = evals.get(r.eval)
        name = rename(r.name)
        if ev is None or name is None or is_unnamed(r.name) or 0 in r.shape:
            continue  # unnamed nodes and empty records (no output rows) never pair
        out[(group_key(ev), in_graph_of(name, ev), r.occurrence)].append((ev, r, i))
    return out


def in_graph_of(name: str, ev: Eval) -> str:
    """The name a record pairs under in the graph of `ev`: an encoder graph's `inp_embd` is the
    features (`inp_target_features`), a decoder's (EAGLE3) its token rows."""
    return names.INP_TARGET_FEATURES if name == names.ENC_INP_EMBD and ev.call == names.CALL_ENCODE else name


def _empty_keys(manifest: Manifest) -> set[RecordKey]:
    """Record sets that exist with no rows (a prefill that output no logits)."""
    evals = {ev.eval: ev for ev in manifest.evals}
    return {
        (group_key(evals[r.eval]), r.name, r.occurrence) for r in manifest.records if r.eval in evals and 0 in r.shape
    }


def _named(name: str) -> str | None:
    """Every ref record indexes under its own name (candidates too: aliases pair with them)."""
    return name


def _ref_key(run_key: RecordKey, ref_idx: dict) -> RecordKey | None:
    """The ref record set a run record set answers: same name, else the name's alias."""
    group, name, occurrence = run_key
    if run_key in ref_idx and not is_reference_only(name):
        return run_key
    alias = (group, REF_ALIASES.get(name, ""), occurrence)
    return alias if alias in ref_idx and (group, name, occurrence) not in ref_idx else None


def plan_pairs(ref: Manifest, run: Manifest, name_map: NameMap) -> Plan:
    """Pair every ref record with its run record, plan how their rows align, and say what is
    left out: record sets with no common row, rows left out of a pair, eval groups one side lacks."""
    ref_idx = _index(ref, _named)
    run_idx = _index(run, name_map.pairing_name)
    ref_ctx, run_ctx = row_contexts(ref), row_contexts(run)
    matches = {k: r for k in run_idx if (r := _ref_key(k, ref_idx)) is not None}
    pairs, skips = [], []
    for run_key in sorted(matches, key=lambda k: (ref_idx[matches[k]][0][0].eval, run_idx[k][0][2])):
        pair, left_out = _pair(
            matches[run_key], ref_idx[matches[run_key]], run_idx[run_key], ref_ctx, run_ctx, name_map
        )
        pairs += [pair] if pair is not None else []
        skips += left_out
    ref_groups = tuple(dict.fromkeys(group_key(e) for e in ref.evals))
    # a group whose decodes all failed (llama.cpp refused the batch) computed nothing
    failed = {group_key(e) for e in run.evals if e.rc} - {group_key(e) for e in run.evals if not e.rc}
    run_groups = tuple(g for g in dict.fromkeys(group_key(e) for e in run.evals) if g not in failed)
    # the run output rows where the reference output none (llama-server's prefill samples its
    # last row): the tensor exists on both sides, there is just nothing to compare
    ref_empty = _empty_keys(ref) & (set(run_idx) - set(matches))
    skips += [_one_side_skip(k, run_idx[k], "run", "no_rows") for k in sorted(ref_empty)]
    ref_only = set(ref_idx) - set(matches.values()) - {k for k in ref_idx if is_reference_only(k[1])}
    run_only = set(run_idx) - set(matches) - ref_empty
    skips += _group_skips(ref_only, ref_idx, run_only, run_idx, ref_groups, run_groups, failed)
    return Plan(
        pairs=tuple(pairs),
        ref_only=tuple(sorted((k for k in ref_only if k[0] in run_groups), key=lambda k: ref_idx[k][0][2])),
        run_only=tuple(sorted((k for k in run_only if k[0] in ref_groups), key=lambda k: run_idx[k][0][2])),
        skips=tuple(sorted(skips, key=lambda s: (phase_order(s.phase, s.round), s.evals[:1], s.reason))),
        ref_groups=ref_groups,
        run_groups=run_groups,
        wiring=kinds.wiring_names(drafter_arch(run) or drafter_arch(ref)),
    )


def drafter_arch(manifest: Manifest) -> str | None:
    """The architecture of the dump's drafter, where its manifest says."""
    draft = manifest.models.get(names.ROLE_DRAFT) or {}
    arch = draft.get("architecture") if isinstance(draft, dict) else None
    return arch if isinstance(arch, str) else None


def _group_skips(
    ref_only: set[RecordKey],
    ref_idx: dict,
    run_only: set[RecordKey],
    run_idx: dict,
    ref_groups: tuple[GroupKey, ...],
    run_groups: tuple[GroupKey, ...],
    failed: set[GroupKey],
) -> list[Skip]:
    """Record sets in an eval group the other side lacks (or whose run decodes all `failed`):
    warm-up decodes and llama-server's verify of no drafts (a run round without a draft eval)
    are expected, any other is not."""
    rounds_drafted = {g[2] for g in run_groups if g[:2] == ROUND_OPENER}
    out = []
    for k in sorted(k for k in ref_only if k[0] not in run_groups):
        reason: SkipReason = (
            WARMUP_SKIP  # the reference's decode of a prefix the run held in its prompt cache
            if k[0][1] == Phase.WARMUP
            else "failed_eval"
            if k[0] in failed
            else "missing_eval"
        )
        out.append(_one_side_skip(k, ref_idx[k], "ref", reason))
    for k in sorted(k for k in run_only if k[0] not in ref_groups):
        role, phase, rnd = k[0]
        reason = (
            WARMUP_SKIP
            if phase == Phase.WARMUP
            else "no_draft"
            if phase != Phase.PREFILL and rnd not in rounds_drafted
            else "missing_eval"
        )
        out.append(_one_side_skip(k, run_idx[k], "run", reason))
    return out


def _one_side_skip(key: RecordKey, entries: list[tuple[Eval, Record, int]], side: SkipSide, reason: SkipReason) -> Skip:
    """A record set only one side has: every row of it left out."""
    (role, phase, rnd), name, occurrence = key
    rows = tuple(p for ev, r, _ in entries if _is_row_record(r, ev) for p in ev.positions)
    return Skip(
        role=role,
        phase=phase,
        round=rnd,
        name=name,
        occurrence=occurrence,
        reason=reason,
        side=side,
        whole=True,
        records=len(entries),
        rows=rows,
        evals=tuple(ev.eval for ev, _, _ in entries),
    )


def _pair(
    key: RecordKey, ref_entries, run_entries, ref_ctx, run_ctx, name_map: NameMap
) -> tuple[Pair | None, list[Skip]]:
    """The pair of one ref key, or None when no row of it can be compared; and what was left out."""
    group, name, occurrence = key  # the ref's key
    ref = _side([(ev, r) for ev, r, _ in ref_entries], ref_ctx)
    run = _side([(ev, r) for ev, r, _ in run_entries], run_ctx)
    run_name = run.records[0].name
    alignment = plan_alignment(ref, run, name if run_name == name else f"{run_name} -> {name}")
    nothing = alignment.comparable and (
        (alignment.positions == () and ref.is_rows and bool(ref.positions)) or _n_compared(ref, alignment) == 0
    )
    skips = _row_skips(key, alignment, ref, run, whole=nothing)
    if nothing:  # with no row skip to say why: the run's records are not row-wise, or hold nothing
        why = "position" if ref.positions else "empty"
        return None, skips or [_skip(key, why, len(run.records), ref.positions, run, whole=True)]
    srcs = tuple(in_graph_of(name_map.ref_name(s), run.evals[0]) for s in run.records[0].srcs)
    order = (ref_entries[0][0].eval, run_entries[0][2])
    return Pair(group, name, run_name, occurrence, ref, run, alignment, order, srcs), skips


def _row_skips(key: RecordKey, alignment: Alignment, ref: Side, run: Side, whole: bool) -> list[Skip]:
    """A skip per reason rows of this pair were left out (token history, no row at that position)."""
    unmatched = "fewer_drafts" if _verified_fewer(key[0], ref, run) else "position"
    out: list[Skip] = []
    for reason, rows in (("token_history", alignment.history_rows), (unmatched, alignment.unmatched_rows)):
        if rows:
            out.append(_skip(key, reason, len(run.records), rows, run, whole=whole and not out))
    return out


def is_cut_short(phase: str, n_run: int, n_ref: int) -> bool:
    """Whether a run batch of `n_run` rows may be the reference's batch of `n_ref` rows cut short:
    a verify (or the inject carrying it), since llama.cpp drafts no more tokens than are left to
    generate (upstream common/speculative.cpp) and the reference drafts a full block every round."""
    return phase in VERIFY_PHASES and 0 < n_run < n_ref


def _verified_fewer(group: GroupKey, ref: Side, run: Side) -> bool:
    """The run's verify (or the inject carrying it) is the reference's cut short."""
    n = len(run.positions)
    return is_cut_short(group[1], n, len(ref.positions)) and run.positions == ref.positions[:n]


def _skip(key: RecordKey, reason: str, records: int, rows: tuple[int, ...], run: Side, whole: bool) -> Skip:
    (role, phase, rnd), name, occurrence = key
    return Skip(
        role=role,
        phase=phase,
        round=rnd,
        name=name,
        occurrence=occurrence,
        reason=reason,  # type: ignore[arg-type]
        side="both",
        whole=whole,
        records=records,
        rows=rows,
        evals=tuple(ev.eval for ev in run.evals),
    )


def _n_compared(ref: Side, alignment: Alignment) -> int:
    if alignment.positions:
        return len(alignment.positions)
    return sum(int(np.prod(r.shape)) for r in ref.records)


def plan_alignment(ref: Side, run: Side, name_map: str) -> Alignment:
    """How run rows meet ref rows: by position and context when both sides are row-wise."""
    ref_keys, run_keys = ",".join(r.key for r in ref.records), ",".join(r.key for r in run.records)
    base = Alignment(ref_key=ref_keys, run_key=run_keys, name_map="" if " -> " not in name_map else name_map)
    if ref.positions and run.positions:
        if ref.width != run.width:
            return _mismatch(base, ref, run)
        return _row_alignment(base, ref, run)
    ref_shape = _stacked_shape(ref.records)
    run_shape = _stacked_shape(run.records)
    if ref_shape != run_shape:
        return _mismatch(base, ref, run)
    return base


def _stacked_shape(records: Iterable[Record]) -> tuple[int, ...]:
    shapes = [r.shape for r in records]
    return (sum(s[0] if s else 1 for s in shapes),) + tuple(shapes[0][1:]) if shapes else ()


def _mismatch(base: Alignment, ref: Side, run: Side) -> Alignment:
    layout = f"run {run.records[0].shape} vs ref {ref.records[0].shape}: cannot be aligned"
    return Alignment(**{**base.__dict__, "layout": layout, "comparable": False})


def _layout(ref: Side, run: Side) -> str:
    """`same`, or the flattening that makes the two row shapes agree, in numpy order."""
    ref_row, run_row = ref.records[0].shape[1:], run.records[0].shape[1:]
    if ref_row == run_row:
        return "same"
    return f"{('T',) + run_row} -> {('T',) + ref_row}".replace("'", "")


def _row_alignment(base: Alignment, ref: Side, run: Side) -> Alignment:
    """Match rows by (position, how many times that position was seen before), then context;
    record the positions of the rows left out: another token history, or no row there at all."""
    if ref.positions == run.positions and ref.contexts == run.contexts:  # the common case, at C speed
        every = tuple(range(len(ref.positions)))
        return Alignment(
            **{
                **base.__dict__,
                "layout": _layout(ref, run),
                "rows": every,
                "run_rows": every,
                "positions": ref.positions,
            }
        )
    ref_at = {k: i for i, k in enumerate(_occurrence_keys(ref.positions))}
    rows: list[int] = []
    run_rows: list[int] = []
    positions: list[int] = []
    history: list[int] = []
    unmatched: list[int] = []
    met: set[int] = set()
    for j, k in enumerate(_occurrence_keys(run.positions)):
        i = ref_at.get(k)
        if i is None:
            unmatched.append(k[0])
            continue
        met.add(i)
        if not _same_context(ref.contexts[i], run.contexts[j]):
            history.append(k[0])
            continue
        rows.append(i)
        run_rows.append(j)
        positions.append(k[0])
    unmatched += [p for i, p in enumerate(ref.positions) if i not in met]
    note = "; ".join(
        x
        for x in (
            f"{plural(len(history), 'row')} left out: different token history" if history else "",
            f"{plural(len(unmatched), 'row')} left out: no row at that position on the other side" if unmatched else "",
        )
        if x
    )
    return Alignment(
        **{
            **base.__dict__,
            "layout": _layout(ref, run),
            "rows": tuple(rows),
            "run_rows": tuple(run_rows),
            "positions": tuple(positions),
            "note": note,
            "history_rows": tuple(history),
            "unmatched_rows": tuple(sorted(set(unmatched))),
        }
    )


def _occurrence_keys(positions: tuple[int, ...]) -> list[tuple[int, int]]:
    """(position, n-th time this position appears) for each row."""
    seen: dict[int, int] = defaultdict(int)
    keys = []
    for p in positions:
        keys.append((p, seen[p]))
        seen[p] += 1
    return keys


def _same_context(a: int | None, b: int | None) -> bool:
    return a is None or b is None or a == b


# --- execute -------------------------------------------------------------------------------------
