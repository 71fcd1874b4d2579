"""Detectors of the drafter's KV cache, as kvcache.py follows it through the run's decodes and
`memory_ops`: `stale` (rows the flow removes, still held) and `duplicate_rows` (a position held
twice). Each `detect_<kind>(run)` is pure, reads the run's `Manifest` only, and returns the first
such fault in eval order, or None; its sentence is written beside it. Without `memory_ops` (older
dumps, the in-process capture) only what the evals show is checked: an inject batch, or two of
one round, carrying a position twice.
"""

from __future__ import annotations

from collections import defaultdict

from featdiff.core import names
from featdiff.core.phases import Phase
from featdiff.diff.detectors.base import span
from featdiff.diff.fields import DuplicateRowsFields, NotConditionedFields, StaleFields, WrongSourceFields
from featdiff.diff.kvcache import CacheState, draft_cache_states
from featdiff.diff.result import Finding
from featdiff.dump.manifest import Manifest
from featdiff.dump.records import NO_ROW, Eval, FlowInfo

KV_TENSOR = f"{names.KCUR_INJECTED}-*"  # what the draft KV cache holds: the injected K/V rows


def _block_seqs(state: CacheState) -> set[int]:
    return set(state.block.seq_ids) or {0}


def detect_stale_cache(run: Manifest) -> Finding | None:
    """Hypothesis: rows the flow removes stayed in the drafter's KV cache (the rejected rows of a
    verify, an earlier draft block), so the drafter attends to them. Evidence: following the
    run's `memory_ops`, the cache holds a position >= n_past when a draft block starts at n_past.
    (A record's rows repeating an earlier eval's values: numeric.detect_stale_rows.)"""
    for state in draft_cache_states(run):
        left = sorted(
            {
                (pos, evs[-1])
                for (seq, pos), evs in state.held.items()
                if seq in _block_seqs(state) and pos >= state.n_past
            }
        )
        if left:
            rows = sorted({p for p, _ in left})
            source = left[0][1]
            detail = (
                f"the draft KV cache holds positions {span(rows)} (written by eval {source}) when the draft "
                f"block of round {state.block.round} starts at n_past {state.n_past}"
            )
            return Finding.of(
                StaleFields(
                    rows=tuple(rows), source_eval=source, detail=detail, round=state.block.round, eval=state.block.eval
                ),
                tensor=KV_TENSOR,
                message=f"{detail}; the flow removes every row at or beyond n_past after the accept "
                f"and after each draft block (llama_memory_seq_rm(seq, n_past, -1))",
            )
    return None


def detect_duplicate_rows(run: Manifest) -> Finding | None:
    """Hypothesis: the same positions were injected twice without a removal in between, so the
    drafter attends to two rows per position. Evidence: following `memory_ops`, a position < n_past
    held more than once when a draft block starts; without ops, two inject evals of one round
    carrying the same positions."""
    found = _batch_repeats(run)
    if found is not None or not run.memory_ops:
        return found or _injected_twice(run)
    for state in draft_cache_states(run):
        twice = {
            pos: evs
            for (seq, pos), evs in state.held.items()
            if seq in _block_seqs(state) and pos < state.n_past and len(evs) > 1
        }
        if twice:
            rows = sorted(twice)
            sources = sorted({e for evs in twice.values() for e in evs})
            return _duplicate_finding(
                rows,
                sources,
                state.block.round,
                state.block.eval,
                f"positions {span(rows)} are held twice in the draft KV cache when the draft "
                f"block of round {state.block.round} starts (written by evals "
                f"{', '.join(map(str, sources))})",
            )
    return None


def _batch_repeats(run: Manifest) -> Finding | None:
    """An inject batch that carries a position twice for one sequence (llama.cpp refuses such a
    batch; a build that does not would hold both rows)."""
    for ev in run.evals:
        if ev.role != names.ROLE_DRAFT or ev.phase != Phase.INJECT:
            continue
        seen: set[tuple[int, int]] = set()
        again: set[int] = set()
        for seq, p in zip(ev.seq_ids or (0,) * len(ev.positions), ev.positions):
            if (seq, p) in seen:
                again.add(p)
            seen.add((seq, p))
        if again:
            held = (
                f"the inject batch of round {ev.round} carries positions {span(sorted(again))} twice; llama.cpp "
                f"refused it (rc {ev.rc})"
                if ev.rc
                else f"positions {span(sorted(again))} are held twice in the draft KV cache: the inject batch of "
                f"round {ev.round} carries each of them twice"
            )
            return _duplicate_finding(sorted(again), [ev.eval], ev.round, ev.eval, held)
    return None


def _injected_twice(run: Manifest) -> Finding | None:
    injects: dict[int, list[Eval]] = defaultdict(list)
    for ev in run.evals:
        if ev.role == names.ROLE_DRAFT and ev.phase == Phase.INJECT and ev.writes_cache:
            injects[ev.round].append(ev)
    for rnd in sorted(injects):
        seen: dict[int, int] = {}  # position -> the inject eval that carried it first
        for ev in injects[rnd]:
            again: dict[int, int] = {}
            for p in ev.positions:
                if p in seen:
                    again.setdefault(p, seen[p])
                seen.setdefault(p, ev.eval)
            if again:
                sources = sorted(set(again.values()) | {ev.eval})
                rows = sorted(again)
                return _duplicate_finding(
                    rows,
                    sources,
                    rnd,
                    ev.eval,
                    f"positions {span(rows)} are held twice in the draft KV cache by two inject "
                    f"evals of round {rnd} (evals {', '.join(map(str, sources))})",
                )
    return None


def _duplicate_finding(rows: list[int], sources: list[int], rnd: int, eval_index: int, what: str) -> Finding:
    return Finding.of(
        DuplicateRowsFields(rows=tuple(rows), source_evals=tuple(sources), round=rnd, eval=eval_index),
        tensor=KV_TENSOR,
        message=f"{what}; inject each target row once (remove rows with llama_memory_seq_rm before "
        f"injecting the same positions again)",
    )


RESTORED_SOURCE = "another_saved_prompt"  # wrong_source's `source`: the drafter's cache restored from another prompt


def _restored_rows(run: Manifest, empty: bool) -> tuple[FlowInfo, list[int]] | None:
    """The first flow whose cached positions hold, in the drafter's cache, no row (`empty`) or
    another token's features than the target's, with those positions; None when no flow does."""
    for flow in run.flows:
        pairs = enumerate(zip(flow.prompt_tokens[: flow.n_cached], flow.draft_cached or ()))
        rows = [p for p, (t, d) in pairs if t >= 0 and (d == NO_ROW if empty else 0 <= d != t)]
        if rows:
            return flow, rows
    return None


def detect_wrong_source_restored(run: Manifest) -> Finding | None:
    """Hypothesis: the program restored the target's cache of a flow without the drafter's (a
    prompt cache that pairs the two contexts' states wrongly, a slot file holding the target's
    alone), so the drafter reads another prompt's features at the cached positions. Evidence: the
    flow's `draft_cached` (the target token whose features each cached drafter row holds, followed
    through the saved and restored states' bytes by the capture) differs from the target's tokens."""
    found = _restored_rows(run, empty=False)
    if found is None:
        return None
    flow, rows = found
    detail = (
        f"the drafter's cache held the features of other tokens than the target's at positions "
        f"{span(rows)} of the {flow.n_cached} the program restored or kept for flow {flow.flow}"
    )
    return Finding.of(
        WrongSourceFields(source=RESTORED_SOURCE, candidate=""),
        tensor=KV_TENSOR,
        message=f"{detail}: the target's state was restored without the drafter's (from another saved "
        "prompt, or kept from an earlier request); save and restore both contexts' states together",
    )


def detect_not_conditioned_restored(run: Manifest) -> Finding | None:
    """Hypothesis: the program restored or kept a flow's prefix in the target's cache but not in the
    drafter's, so the drafter drafts with no features of that prefix. Evidence: the flow's
    `draft_cached` holds no row at cached positions."""
    found = _restored_rows(run, empty=True)
    if found is None:
        return None
    flow, rows = found
    detail = (
        f"the drafter's cache held no features at positions {span(rows)} of the {flow.n_cached} the "
        f"target held when flow {flow.flow} began"
    )
    return Finding.of(
        NotConditionedFields(detail=detail),
        tensor=KV_TENSOR,
        message=f"{detail}: the drafter drafts without them; restore (or re-inject) the drafter's state with the target's",
    )


KEPT_ROW_SOURCE = "another_request_row"  # wrong_source's `source`: a step drafter's row kept from an earlier request


def detect_wrong_source_kept_row(run: Manifest, row_token: int) -> Finding | None:
    """Hypothesis: a step drafter (EAGLE3: (token p+1, g p) at p; `row_token` 1) kept, from an
    earlier request, a cached row paired with a token this flow's prompt does not have there: the
    row at the last kept position pairs the earlier prompt's next token. Evidence: the flow's
    `draft_cached` (the token each cached drafter row was decoded with) differs from the flow's
    token at p + `row_token`."""
    for flow in run.flows:
        tokens = flow.prompt_tokens
        held = enumerate((flow.draft_cached or ())[: flow.n_cached])
        rows = [(p, d) for p, d in held if d >= 0 and p + row_token < len(tokens) and 0 <= tokens[p + row_token] != d]
        if rows and rows[0][0] < flow.n_cached - row_token:
            return _restored_step_rows_finding(flow, rows, row_token)
        if rows:
            return _kept_row_finding(flow, rows, row_token)
    return None


def _restored_step_rows_finding(flow: FlowInfo, rows: list[tuple[int, int]], row_token: int) -> Finding:
    """Rows before the last kept one pair other tokens: not upstream's bridge row, the drafter's
    cache holds another prompt's rows (a `/slots` file holds the target's state alone)."""
    p, d = rows[0]
    detail = (
        f"the drafter's rows at positions {span([r for r, _ in rows])} of the {flow.n_cached} the program "
        f"restored or kept for flow {flow.flow} were decoded with other tokens than this flow's (position "
        f"{p + row_token}: token {d}, where the prompt has {flow.prompt_tokens[p + row_token]})"
    )
    return Finding.of(
        WrongSourceFields(source=RESTORED_SOURCE, candidate=f"token {d} at position {p + row_token}"),
        tensor=KV_TENSOR,
        message=f"{detail}: the target's state was restored without the drafter's (llama-server's /slots files "
        "hold the target's state alone: llama_state_seq_save_file of the target's context), so the drafts attend "
        "to another prompt's rows; save and restore both contexts' states together",
    )


def _kept_row_finding(flow: FlowInfo, rows: list[tuple[int, int]], row_token: int) -> Finding:
    p, d = rows[0]
    at = p + row_token
    return Finding.of(
        WrongSourceFields(source=KEPT_ROW_SOURCE, candidate=f"token {d} at position {at}"),
        tensor=KV_TENSOR,
        message=(
            f"the drafter's row at position{'s' if len(rows) > 1 else ''} {span([r for r, _ in rows])} of the "
            f"{flow.n_cached} kept for flow {flow.flow} pairs token {d}, an earlier request's token at position {at}, "
            f"where this flow's prompt has {flow.prompt_tokens[at]}: upstream's EAGLE3 driver writes (token p+1, g p) "
            "at p and keeps that row when the next prompt reuses the cached prefix up to p (its bridge rewrites "
            "the row only where no cell holds it: common_speculative_impl_draft_eagle3::process), so the drafts "
            f"read another prompt's token; remove the drafter's rows from position {p} before the prefill"
        ),
    )
