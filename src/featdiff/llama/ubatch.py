"""Micro-batches: a decode that llama.cpp computed as several graphs, split into one eval per graph.

Consumes the evals a producer noted (one per decode call, in-process or through the preload), the
shim's record events (each carries `ubatch`, the index of its graph within the call: the shim
starts a new graph when a node comes round again, native/featdiff_shim.c) and each context's
`n_ubatch`; produces the dump's evals, one per graph (docs/dump.md: "one graph evaluation"), with
that graph's rows, tokens and positions, so compare pairs the rows of every graph with the
reference's at their positions, whatever the split.

llama.cpp splits a single-sequence batch into consecutive chunks of `n_ubatch` rows
(src/llama-batch.cpp `split_simple`, and `split_equal` with one sequence). A batch of several
sequences may be split otherwise; such an eval is kept whole and a flow note says why.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from featdiff.core.phases import phrase
from featdiff.dump.records import Eval, MemoryOp
from featdiff.llama.spool_index import RecordEvent


@dataclass(frozen=True)
class Split:
    """The evals once split per graph, the record events pointed at them, and what was kept whole."""

    evals: tuple[Eval, ...]
    records: tuple[RecordEvent, ...]
    memory_ops: tuple[MemoryOp, ...]
    renumbered: dict[int, int]  # old eval -> its last new eval (for anything that names evals)
    notes: tuple[str, ...] = ()


def chunks(n_tokens: int, n_ubatch: int) -> tuple[tuple[int, int], ...]:
    """The [start, end) rows of each graph of a batch of `n_tokens` split by `n_ubatch`."""
    return tuple((i, min(i + n_ubatch, n_tokens)) for i in range(0, n_tokens, n_ubatch))


def graphs_seen(records: tuple[RecordEvent, ...]) -> dict[int, int]:
    """Eval -> how many graphs its records came from (the highest `ubatch` + 1)."""
    seen: dict[int, int] = defaultdict(lambda: 1)
    for e in records:
        seen[e.eval] = max(seen[e.eval], e.ubatch + 1)
    return dict(seen)


def _why_whole(ev: Eval, n_ubatch: int | None, n_graphs: int) -> str | None:
    """Why an eval of several graphs cannot be split into its rows (None: it can)."""
    if n_ubatch is None or n_ubatch <= 0:
        return f"eval {ev.eval} ({phrase(ev.role, ev.phase)}) was computed as {n_graphs} graphs, but its context's n_ubatch is unknown"
    if len(set(ev.seq_ids)) > 1:
        return (
            f"eval {ev.eval} ({phrase(ev.role, ev.phase)}) holds {len(set(ev.seq_ids))} sequences and was computed as "
            f"{n_graphs} graphs: llama.cpp may split such a batch otherwise than in consecutive chunks"
        )
    if n_graphs > len(chunks(ev.n_tokens, n_ubatch)):
        return (
            f"eval {ev.eval} ({phrase(ev.role, ev.phase)}) was computed as {n_graphs} graphs, more than its "
            f"{ev.n_tokens} rows make in chunks of n_ubatch {n_ubatch}"
        )
    return None


def _sub_eval(ev: Eval, index: int, ubatch: int, start: int, end: int) -> Eval:
    return replace(
        ev,
        eval=index,
        n_tokens=end - start,
        positions=ev.positions[start:end],
        token_ids=ev.token_ids[start:end] if ev.token_ids else (),
        seq_ids=ev.seq_ids[start:end] if ev.seq_ids else (),
        ubatch=ubatch,
    )


def split_ubatches(
    evals: tuple[Eval, ...],
    records: tuple[RecordEvent, ...],
    n_ubatch: dict[int, int | None],
    memory_ops: tuple[MemoryOp, ...] = (),
) -> Split:
    """One eval per graph. `n_ubatch` maps each eval to its context's n_ubatch (None: unknown).
    Evals are renumbered in order; records and memory ops follow their eval."""
    seen = graphs_seen(records)
    out: list[Eval] = []
    new_id: dict[tuple[int, int], int] = {}  # (old eval, ubatch) -> new eval
    last: dict[int, int] = {}
    notes: list[str] = []
    for ev in evals:
        size = n_ubatch.get(ev.eval)
        parts = chunks(ev.n_tokens, size) if size and ev.n_tokens > size else ((0, ev.n_tokens),)
        n_graphs = max(seen.get(ev.eval, 1), len(parts))
        why = _why_whole(ev, size, n_graphs) if n_graphs > 1 else None
        if why is not None or len(parts) == 1:
            if why is not None:
                notes.append(why + "; its records are kept per graph and do not pair row by row")
            new_id[(ev.eval, 0)] = len(out)
            out.append(replace(ev, eval=len(out)))
        else:
            for u, (start, end) in enumerate(parts):
                new_id[(ev.eval, u)] = len(out)
                out.append(_sub_eval(ev, len(out), u, start, end))
        last[ev.eval] = len(out) - 1
    whole = {old for (old, u) in new_id if u == 0} - {old for (old, u) in new_id if u > 0}
    moved = _renumber_whole(tuple((e.eval, _move_record(e, new_id, last)) for e in records), whole, seen)
    ops = tuple(replace(op, after_eval=last.get(op.after_eval, op.after_eval)) for op in memory_ops)
    return Split(tuple(out), moved, ops, last, tuple(notes))


def _move_record(event: RecordEvent, new_id: dict[tuple[int, int], int], last: dict[int, int]) -> RecordEvent:
    """The record event pointed at its graph's eval (an eval kept whole keeps every graph's)."""
    old = event.eval
    target = new_id.get((old, event.ubatch))
    if target is None:  # kept whole: the later graphs' records stay in the one eval
        target = new_id.get((old, 0), last.get(old, old))
    return replace(event, eval=target)


def _renumber_whole(
    moved: tuple[tuple[int, RecordEvent], ...], whole: set[int], seen: dict[int, int]
) -> tuple[RecordEvent, ...]:
    """In an eval kept whole, occurrences count on across its graphs (the shim restarts them per
    graph), so every record key stays unique: the n-th record of a name gets occurrence n.
    `moved`: (the eval before the split, the record pointed at its new eval)."""
    split_whole = {old for old in whole if seen.get(old, 1) > 1}
    count: dict[tuple[int, str, str], int] = defaultdict(int)
    out = []
    for old, e in moved:
        if old in split_whole:
            key = (old, e.role, e.name)
            e = replace(e, occurrence=count[key])
            count[key] += 1
        out.append(e)
    return tuple(out)
