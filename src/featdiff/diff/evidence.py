"""Gather what the detectors need for one divergent pair: its rows, the reference's candidates
(`<record>@<hypothesis>`, the terms the checkpoint adds such as `dspark_log_snr_fc2`), the same
record in earlier evals, and the sketched slot x layer matrix against every `layer_inp-<L>`. The
only part of diagnosis that reads dumps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from featdiff.core import names
from featdiff.core.phases import Phase
from featdiff.diff.align import Pair, Side, drafter_arch, row_contexts
from featdiff.diff.aligned import pair_arrays, side_rows
from featdiff.diff.arrays import MemberIndex, index_members, read_array
from featdiff.diff.detectors.base import Evidence, Rope
from featdiff.diff.fields import Where
from featdiff.diff.sketch import LayerMatch, compare_sketches, projection, sample_rows, sketch, slot_sketches
from featdiff.diff.tolerance import EXACT, Tolerance
from featdiff.dump.manifest import Manifest
from featdiff.dump.reader import Dump
from featdiff.dump.records import Eval, Record
from featdiff.kinds import registry as kinds

MAX_STALE_ROWS = 512  # earlier rows searched for stale data: the latest evals first
ROPE_OP = "ROPE"


@dataclass(frozen=True)
class Source:
    """One opened dump, its member offsets and the token-history id of every row."""

    dump: Dump
    index: MemberIndex
    contexts: dict[int, tuple[int | None, ...]]
    evals: dict[int, Eval]
    view: Manifest | None = None  # the part of the dump compared (one flow of several), else all of it

    @property
    def manifest(self) -> Manifest:
        return self.view if self.view is not None else self.dump.manifest

    def array(self, record: Record) -> np.ndarray:
        return read_array(self.dump, self.index, record)

    def rows(self, side: Side) -> np.ndarray:
        """One side's records stacked along rows: (n_rows, D)."""
        return side_rows([self.array(r) for r in side.records])


def open_source(dump: Dump, view: Manifest | None = None, index: MemberIndex | None = None) -> Source:
    """The dump opened for compare; `view` (dump.flow_view) limits it to one flow."""
    m = view if view is not None else dump.manifest
    return Source(dump, index or index_members(dump), row_contexts(m), {e.eval: e for e in m.evals}, view)


def target_layers(manifest: Manifest) -> tuple[int, ...]:
    """The drafter's `target_layers` (GGUF input-of-layer ids) as the manifest states them."""
    draft = manifest.model("draft")
    return draft.target_layers if draft is not None else ()


def build_evidence(
    ref: Source, run: Source, pair: Pair, tol: Tolerance, absent: tuple[str, ...] = (), weights_where: Where = "unknown"
) -> Evidence:
    """Everything the detectors may use for `pair`; `absent` names the reference records of its
    eval group that the run's graph lacks (diagnose.absent_records); `weights_where` where a node
    computed wrong from right inputs lives (attribution.where_of): what a fix sentence follows."""
    ref_all, run_all = ref.rows(pair.ref), run.rows(pair.run)
    al = pair.alignment
    ref_rows, run_rows = pair_arrays(al, ref_all, run_all, pair.name) if al.comparable else (ref_all, run_all)
    n_extract = _n_extract(ref.manifest, ref_rows.shape[1])
    earlier, earlier_evals = _earlier(ref, run, pair)
    siblings, sibling_rows = _siblings(run, pair)
    return Evidence(
        tensor=pair.run_name,
        ref=ref_rows,
        run=run_rows,
        tolerance=tol,
        positions=al.positions,
        ref_all=ref_all,
        ref_all_positions=pair.ref.positions,
        run_raw=_run_raw(run, pair, run_rows),
        candidates=_candidates(ref, pair),
        n_extract=n_extract,
        layers=layer_match(ref, pair, run_rows, n_extract) if n_extract and al.positions else None,
        rope=_rope(ref.manifest, pair),
        is_integer=pair.is_integer,
        earlier=earlier,
        earlier_evals=earlier_evals,
        record=pair.name,
        absent=absent,
        kind=kinds.of_arch(drafter_arch(run.manifest) or drafter_arch(ref.manifest)),
        sampled=_sampled(run, pair, run_all),
        checkpoint=_checkpoint(ref.manifest),
        weights_where=weights_where,
        kept=_kept(run.manifest),
        siblings=siblings,
        sibling_rows=sibling_rows,
    )


def _kept(manifest: Manifest) -> int:
    """The positions a flow's sequence held when its prefill began (the one flow of a flow view)."""
    return manifest.flows[0].n_cached if len(manifest.flows) == 1 else 0


def _checkpoint(manifest: Manifest) -> dict | None:
    """The reference's HF checkpoint entry (models.draft.checkpoint), where its manifest has one."""
    draft = manifest.models.get(names.ROLE_DRAFT) or {}
    entry = draft.get("checkpoint") if isinstance(draft, dict) else None
    return entry if isinstance(entry, dict) else None


def _sampled(run: Source, pair: Pair, read: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """At a draft_logits pair: its run rows as stored (`read`, infinities kept) and the run graph's
    result_output rows of the same evals, both aligned like the pair's run rows; else None."""
    if pair.name != names.DRAFT_LOGITS or not pair.alignment.comparable:
        return None
    graph = {r.eval: r for r in run.manifest.records if r.name == names.RESULT_OUTPUT and r.occurrence == 0}
    evals = [e.eval for e in pair.run.evals]
    if not all(e in graph for e in evals):
        return None
    own = side_rows([run.array(graph[e]) for e in evals])  # (n_rows, n_vocab), as `read`
    if read.shape != own.shape:
        return None
    rows = list(pair.alignment.run_rows) if pair.alignment.positions else slice(None)
    return read[rows], own[rows]


def _n_extract(manifest: Manifest, width: int) -> int:
    """n_extract when rows `width` wide are concatenated feature rows, else 0."""
    n = len(target_layers(manifest))
    target = manifest.model("target")
    n_embd = target.n_embd if target is not None else 0
    if not n or width % n:
        return 0
    return n if not n_embd or width == n * n_embd else 0


def _run_raw(run: Source, pair: Pair, run_rows: np.ndarray) -> np.ndarray | None:
    """The run record as stored, when the pair is that one record with every row in order."""
    al = pair.alignment
    if len(pair.run.records) != 1:
        return None
    if al.positions and al.run_rows != tuple(range(len(pair.run.positions))):
        return None
    return np.asarray(run.array(pair.run.records[0]))


def _candidates(ref: Source, pair: Pair) -> dict[str, np.ndarray]:
    """The pair's `<record>@<hypothesis>` candidates and the terms of its evals, aligned like the
    pair's ref rows; terms by their current name (an old dump's `log_snr_embed` is
    `dspark_log_snr_fc2`: names.OLD_RECORD_NAMES)."""
    by_name: dict[str, list[Record]] = defaultdict(list)
    eval_ids = [e.eval for e in pair.ref.evals]
    for r in ref.manifest.records:
        if r.eval in eval_ids and _is_candidate_for(r.name, pair.name) and r.occurrence == 0:
            by_name[names.current_name(r.name)].append(r)
    out = {}
    for name, records in by_name.items():
        if [r.eval for r in records] != eval_ids:
            continue
        rows = side_rows([ref.array(r) for r in records])  # (n_rows, D')
        out[name] = rows[list(pair.alignment.rows)] if pair.alignment.positions else rows
    return out


def _is_candidate_for(name: str, pair_name: str) -> bool:
    if names.CANDIDATE_SEP in name:
        return name.split(names.CANDIDATE_SEP, 1)[0] == pair_name
    return names.current_name(name) in names.TERM_RECORDS and names.current_name(name) != pair_name


def _earlier(ref: Source, run: Source, pair: Pair) -> tuple[np.ndarray | None, tuple[int | None, ...]]:
    """Rows of the same ref record in earlier evals of the same role and phase, latest first,
    (E, D), and for each row the run's eval that computed it (run_eval_of; None: none did)."""
    if not pair.alignment.positions:
        return None, ()
    role, phase, _ = pair.group
    records = [
        r
        for r in reversed(ref.manifest.records)
        if r.name == pair.name
        and r.occurrence == pair.occurrence
        and r.eval < pair.first_eval
        and r.role == role
        and r.phase == phase
    ]
    in_run = run_eval_of(run.manifest)
    rows: list[np.ndarray] = []
    evals: list[int | None] = []
    for r in records:
        if len(evals) >= MAX_STALE_ROWS:
            break
        rows.append(side_rows([ref.array(r)]))  # (n_tokens, D)
        ev = ref.evals[r.eval]
        at = ev.positions if len(ev.positions) == len(rows[-1]) else (None,) * len(rows[-1])
        evals += [in_run.get((ev.role, ev.phase, ev.round, p)) for p in at]
    if not rows:
        return None, ()
    return np.concatenate(rows, axis=0), tuple(evals)  # (E, D)


def _siblings(run: Source, pair: Pair) -> tuple[np.ndarray | None, tuple[tuple[int, int, int | None], ...]]:
    """In a run of several flows: the run's rows of the pair's record in the evals of the other
    flows beside each of the pair's run evals (within as many evals as the run has flows: the
    other sequences of a decode the program split per sequence, docs/flow.md), (S, D), and each
    row's (flow, sequence, position)."""
    whole = run.dump.manifest
    if run.view is None or not whole.flows or not pair.alignment.positions or not kinds.is_step_state(pair.name):
        return None, ()  # only the state a draft step is fed is held against its siblings
    own = {e.flow for e in run.manifest.evals}
    seq_of = {f.flow: f.seq_id for f in whole.flows}
    window = len(whole.flows)
    near = {e for r in pair.run.records for e in range(r.eval - window, r.eval + window + 1)}
    by_eval = {e.eval: e for e in whole.evals}
    rows: list[np.ndarray] = []
    labels: list[tuple[int, int, int | None]] = []
    for r in whole.records:
        ev = by_eval.get(r.eval)
        if (
            ev is None
            or r.eval not in near
            or ev.flow in own
            or ev.flow is None
            or r.name != pair.run_name
            or r.occurrence != pair.run.records[0].occurrence
            or (ev.role, ev.phase) != (pair.run.evals[0].role, pair.run.evals[0].phase)
        ):
            continue
        block = side_rows([run.array(r)])  # (n_tokens, D)
        if block.shape[1:] != (pair.run.width,):
            continue
        at = ev.positions if len(ev.positions) == len(block) else (None,) * len(block)
        rows.append(block)
        labels += [(ev.flow, seq_of.get(ev.flow, -1), p) for p in at]
    if not rows:
        return None, ()
    return np.concatenate(rows, axis=0), tuple(labels)  # (S, D)


def run_eval_of(run: Manifest) -> dict[tuple[str, str, int, int | None], int]:
    """(role, phase, round, position) -> the run's latest eval of that role, phase and round that
    computed the row of that position: where a reference row's values sit in the run's numbering
    (the two sides number their evals apart: a run has warm-ups, a reference follows its flow)."""
    return {(e.role, e.phase, e.round, p): e.eval for e in run.evals for p in e.positions}


def _rope(manifest: Manifest, pair: Pair) -> Rope | None:
    record = pair.ref.records[0]
    if pair.run.records[0].op != ROPE_OP or len(record.shape) != 3:
        return None
    model = manifest.model(pair.group[0])
    # a base that is no positive number (a hand-edited manifest) is taken as absent, not trusted
    base = model.rope_freq_base if model is not None and model.rope_freq_base > 0 else names.ROPE_FREQ_BASE_DEFAULT
    return Rope(n_head=record.shape[1], head_dim=record.shape[2], base=base)


# --- the layer-match search ----------------------------------------------------------------------


def layer_match(ref: Source, pair: Pair, run_rows: np.ndarray, n_extract: int) -> LayerMatch | None:
    """Sketch each slot of the run's feature rows against the ref's `layer_inp-<L>` at the same
    token histories; None when the reference recorded no layer inputs for those rows."""
    pick = sample_rows(len(run_rows))
    ref_idx = [pair.alignment.rows[i] for i in pick]
    sources = _target_rows(
        ref, [pair.ref.contexts[i] for i in ref_idx], [pair.ref.positions[i] for i in ref_idx], pair.first_eval
    )
    width = run_rows.shape[1] // n_extract
    layer_inp = _layer_inputs(ref.manifest, {ev for ev, _ in sources or ()}, width)
    if sources is None or not layer_inp:
        return None
    proj = projection(width)
    layer_sk = np.stack(
        [sketch(_gather(ref, records, sources), proj) for records in layer_inp.values()]
    )  # (n_layer, R, dim)
    slots = slot_sketches(run_rows[pick], n_extract, proj)  # (n_extract, R, dim)
    err, sim = compare_sketches(slots, layer_sk)
    return LayerMatch(
        tensor=pair.run_name,
        layers=tuple(layer_inp),
        expected_layers=target_layers(ref.manifest),
        rel_err=err,
        similarity=sim,
        positions=tuple(pair.alignment.positions[i] for i in pick),
    )


def _target_rows(
    ref: Source, contexts: list[int | None], positions: list[int], before: int
) -> list[tuple[int, int]] | None:
    """(target eval, row) holding each requested token history (by position when unknown)."""
    by_ctx: dict[int, tuple[int, int]] = {}
    by_pos: dict[int, tuple[int, int]] = {}
    for ev in ref.manifest.evals:
        if ev.role != "target" or ev.eval >= before:
            continue
        for row, (p, c) in enumerate(zip(ev.positions, ref.contexts.get(ev.eval, ()))):
            by_pos[p] = (ev.eval, row)
            if c is not None:
                by_ctx[c] = (ev.eval, row)
    found = [by_ctx.get(c) if c is not None else by_pos.get(p) for c, p in zip(contexts, positions)]
    out = [o for o in found if o is not None]
    return out if out and len(out) == len(found) else None


def _layer_inputs(manifest: Manifest, evals: set[int], width: int) -> dict[int, dict[int, Record]]:
    """layer L -> {eval: its `layer_inp-<L>` record}, for the layers recorded in every one of
    `evals` with rows `width` wide, in layer order."""
    prefix = names.LAYER_INP + "-"
    found: dict[int, dict[int, Record]] = defaultdict(dict)
    for r in manifest.records:
        suffix = r.name[len(prefix) :]
        if (
            r.eval in evals
            and r.name.startswith(prefix)
            and suffix.isdigit()
            and r.occurrence == 0
            and int(np.prod(r.shape[1:])) == width
        ):
            found[int(suffix)][r.eval] = r
    return {L: found[L] for L in sorted(found) if len(found[L]) == len(evals) and evals}


def _gather(ref: Source, records: dict[int, Record], sources: list[tuple[int, int]]) -> np.ndarray:
    """The rows of one layer input at each (eval, row), in order: (R, n_embd)."""
    arrays = {ev: side_rows([ref.array(r)]) for ev, r in records.items()}  # eval -> (n_tokens, n_embd)
    return np.stack([arrays[ev][row] for ev, row in sources])  # (R, n_embd)


def first_feature_pair(pairs: tuple[Pair, ...], eval_index: int | None = None) -> Pair | None:
    """The pair of the injected features (`inp_target_features`) of the first inject eval, or of
    the inject eval `eval_index` of the run."""
    for p in pairs:
        if p.name != names.INP_TARGET_FEATURES or p.group[1] != Phase.INJECT:
            continue
        if eval_index is None or eval_index in (e.eval for e in p.run.evals):
            return p
    return None


def position_evidence(ref: Source, run: Source) -> list[Evidence]:
    """Per eval group where both sides batched the same positions: the run's recorded `inp_pos`
    (what the graph computed with) against those positions. The reference records no `inp_pos`;
    groups whose batches differ (other accepted drafts, another split) are not compared here."""
    ref_groups, run_groups = _groups(ref.manifest), _groups(run.manifest)
    inp_pos = {r.eval: r for r in run.manifest.records if r.name == names.INP_POS and r.occurrence == 0}
    out = []
    for key, evals in run_groups.items():
        positions = tuple(p for ev in evals for p in ev.positions)
        if key not in ref_groups or positions != tuple(p for ev in ref_groups[key] for p in ev.positions):
            continue
        if not positions or not all(ev.eval in inp_pos for ev in evals):
            continue
        got = np.concatenate(
            [np.asarray(run.array(inp_pos[ev.eval]), dtype=np.float64).reshape(-1)[: ev.n_tokens] for ev in evals]
        )[:, None]  # (n_tokens, 1): M-RoPE's extra sections dropped
        expected = np.asarray(positions, dtype=np.float64)[:, None]  # (n_tokens, 1)
        out.append(
            Evidence(tensor=names.INP_POS, ref=expected, run=got, tolerance=EXACT, positions=positions, is_integer=True)
        )
    return out


def _groups(manifest: Manifest) -> dict[tuple[str, str, int], list[Eval]]:
    """(role, phase, round) -> its evals, in order."""
    out: dict[tuple[str, str, int], list[Eval]] = defaultdict(list)
    for ev in manifest.evals:
        out[(ev.role, ev.phase, ev.round)].append(ev)
    return out
