"""The drafter's KV cache, followed through the run's decodes and `memory_ops` (docs/dump.md):
which rows it holds when each draft block is decoded. Pure functions of a run `Manifest`; the
findings that follow from it (`stale`, `duplicate_rows`) are detectors/kvcache.py's.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from featdiff.core import names
from featdiff.core.phases import Phase
from featdiff.dump.manifest import Manifest
from featdiff.dump.records import Eval, MemoryOp

CLEAR_OP = "clear"  # a MemoryOp that empties the context (llama_memory_clear)


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
    pending = sorted((op for op in run.memory_ops if op.role == names.ROLE_DRAFT), key=lambda op: op.after_eval)
    held: dict[tuple[int, int], list[int]] = defaultdict(list)
    out = []
    for ev in run.evals:
        while pending and pending[0].after_eval < ev.eval:
            _apply(held, [pending.pop(0)])
        if ev.role == names.ROLE_DRAFT and ev.phase != Phase.WARMUP:
            if ev.phase == Phase.DRAFT and ev.positions:  # what the block met (also when it was refused)
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
