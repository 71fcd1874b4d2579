"""The drafter's KV cache, followed through the run's decodes and `memory_ops` (docs/dump.md):
which rows it holds when each draft block is decoded, and the findings that follow from it,
`stale` (rows the flow removes, still held) and `duplicate_rows` (a position held twice).
Pure functions of a run `Manifest`. Without `memory_ops` (older dumps, the in-process capture)
only what the evals show is checked: an inject batch, or two of one round, carrying a position twice.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from featdiff import names
from featdiff.compare.result import Finding
from featdiff.dump import Eval, Manifest, MemoryOp

CLEAR_OP = "clear"  # a MemoryOp that empties the context (llama_memory_clear)
KV_TENSOR = f"{names.KCUR_INJECTED}-*"  # what the draft KV cache holds: the injected K/V rows


@dataclass(frozen=True)
class CacheState:
    """What the draft KV cache holds when a draft block is decoded: (seq, position) -> the evals
    that wrote a row there, one entry per row held."""

    block: Eval
    n_past: int
    held: dict[tuple[int, int], tuple[int, ...]]


def draft_cache_states(run: Manifest) -> tuple[CacheState, ...]:
    """Follow the draft context's cache through its decodes and `memory_ops`; () without ops."""
    if not run.memory_ops:
        return ()
    # in eval order; an edit made after an eval this manifest does not hold (another flow's, in a
    # flow view: dump.flow_view) applies before the next eval it holds
    pending = sorted((op for op in run.memory_ops if op.role == "draft"), key=lambda op: op.after_eval)
    held: dict[tuple[int, int], list[int]] = defaultdict(list)
    out = []
    for ev in run.evals:
        while pending and pending[0].after_eval < ev.eval:
            _apply(held, [pending.pop(0)])
        if ev.role == "draft" and ev.phase != names.PHASE_WARMUP:
            if ev.phase == "draft" and ev.positions:  # what the block met (also when it was refused)
                out.append(CacheState(ev, ev.positions[0], {k: tuple(v) for k, v in held.items() if v}))
            for pos, seq in zip(ev.positions, ev.seq_ids or (0,) * len(ev.positions)):
                if not ev.rc and ev.writes_cache:  # a refused batch, an encoder step write nothing
                    held[(seq, pos)].append(ev.eval)
    return tuple(out)


def _apply(held: dict[tuple[int, int], list[int]], ops: list[MemoryOp]) -> None:
    """llama_memory_seq_rm(seq_id, p0, p1): drop the rows of [p0, p1) (seq_id < 0: every
    sequence; p0 < 0: from 0; p1 < 0: to the end); a clear drops everything."""
    for op in ops:
        hi = float("inf") if op.p1 < 0 else op.p1
        for seq, pos in list(held):
            if op.op == CLEAR_OP or ((op.seq_id < 0 or seq == op.seq_id) and max(op.p0, 0) <= pos < hi):
                del held[(seq, pos)]


def _block_seqs(state: CacheState) -> set[int]:
    return set(state.block.seq_ids) or {0}


def detect_stale(run: Manifest) -> Finding | None:
    """Hypothesis: rows the flow removes stayed in the drafter's KV cache (the rejected rows of a
    verify, an earlier draft block), so the drafter attends to them. Evidence: following the
    run's `memory_ops`, the cache holds a position >= n_past when a draft block starts at n_past."""
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
            return Finding(
                kind="stale",
                tensor=KV_TENSOR,
                severity="error",
                message=f"{detail}; the flow removes every row at or beyond n_past after the accept "
                f"and after each draft block (llama_memory_seq_rm(seq, n_past, -1))",
                fields={
                    "rows": rows,
                    "detail": detail,
                    "source_eval": source,
                    "round": state.block.round,
                    "eval": state.block.eval,
                },
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
        if ev.role != "draft" or ev.phase != "inject":
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
        if ev.role == "draft" and ev.phase == "inject" and ev.writes_cache:
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
    return Finding(
        kind="duplicate_rows",
        tensor=KV_TENSOR,
        severity="error",
        message=f"{what}; inject each target row once (remove rows with llama_memory_seq_rm before "
        f"injecting the same positions again)",
        fields={"rows": rows, "source_evals": sources, "round": rnd, "eval": eval_index},
    )


def span(positions) -> str:
    p = list(positions)
    if len(p) > 1 and p == list(range(p[0], p[0] + len(p))):
        return f"{p[0]}..{p[-1]}"
    return ", ".join(map(str, p[:8])) + (" ..." if len(p) > 8 else "")
