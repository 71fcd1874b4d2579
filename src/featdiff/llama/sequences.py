"""Graphs and sequences of a program's decodes: each decode split into one per graph and
sequence before the flow of each sequence is inferred (docs/flow.md "Micro-batches", "Several
flows").

Consumes the decodes the preload noted, each context's micro-batch settings and the shim's
record events, which carry the index of their graph within the decode (`ubatch`); produces the
same log (llama/exec_log.py `ExecLog`) with each decode replaced by one decode per (graph,
sequence), in execution order, holding its rows, and each record cut to them: a row record has
one row per token of its graph, an output record (logits) one per output row.

Which batch rows each graph computed follows llama.cpp's split (src/llama-batch.cpp): with one
KV stream (`kv_unified`, or one sequence) consecutive chunks of `n_ubatch` rows (`split_simple`);
with a stream per sequence, `split_equal(n_ubatch, sequential=true)`: each graph takes the unused
rows of consecutive sequence ids starting from the first unused row's, as many of each. A decode
whose records do not fit that model (another split, a record with no row per token) is kept
whole and a note says why: its rows are then compared together, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from featdiff import names
from featdiff.llama.exec_log import ExecContext, ExecEval, ExecLog
from featdiff.llama.spool_index import RecordEvent, n_dims
from featdiff.llama.ubatch import chunks

Rows = tuple[int, ...]  # batch row indices, in the order a graph holds them


@dataclass(frozen=True)
class Split:
    """Micro-batch settings of a context: how llama.cpp splits its batches into graphs."""

    n_ubatch: int | None  # None: unknown (an older preload), the batch is one graph as far as known
    n_stream: int = 1  # KV streams: 1 when unified, else one per sequence (n_seq_max)


def split_of(context: ExecContext) -> Split:
    """How llama.cpp splits a context's batches into graphs: one KV stream when unified (or not
    noted: an older preload), else one per sequence."""
    streams = 1 if context.kv_unified in (True, None) else max(1, context.n_seq_max or 1)
    return Split(context.n_ubatch, streams)


@dataclass(frozen=True)
class SplitLog:
    """The log with one graph and one sequence per decode, and the decodes kept whole."""

    log: ExecLog
    notes: tuple[str, ...] = ()
    noted_evals: tuple[int, ...] = ()  # the eval (of `log`) each note is about


def simple_graphs(n_tokens: int, n_ubatch: int) -> tuple[Rows, ...]:
    """split_simple: consecutive chunks of `n_ubatch` rows."""
    return tuple(tuple(range(start, end)) for start, end in chunks(n_tokens, n_ubatch))


def equal_graphs(seq_ids: tuple[int, ...], n_ubatch: int) -> tuple[Rows, ...]:
    """split_equal(n_ubatch, sequential=true) for a batch whose rows each belong to one sequence:
    per graph, the sequences with consecutive ids from the first unused row's, the same number
    of unused rows of each (in batch order), one sequence's rows after another's."""
    used = [False] * len(seq_ids)
    rows_of: dict[int, list[int]] = {}
    for i, s in enumerate(seq_ids):
        rows_of.setdefault(s, []).append(i)
    out: list[Rows] = []
    while not all(used):
        seqs: list[int] = []
        for i, s in enumerate(seq_ids):  # in batch order, as llama.cpp scans it
            if not used[i] and s not in seqs and (not seqs or s == seqs[-1] + 1):
                seqs.append(s)
                if len(seqs) > n_ubatch:
                    break
        free = [[i for i in rows_of[s] if not used[i]] for s in seqs]
        take = max(1, min(min(len(f) for f in free), n_ubatch // len(seqs)))
        graph = [i for f in free for i in f[:take]]
        for i in graph:
            used[i] = True
        out.append(tuple(graph))
    return tuple(out)


def graph_rows(seq_ids: tuple[int, ...], split: Split) -> tuple[Rows, ...]:
    """The batch rows of each graph llama.cpp computes a decode of these rows as."""
    n = len(seq_ids)
    if not split.n_ubatch or n == 0:
        return (tuple(range(n)),)
    if split.n_stream == 1 or len(set(seq_ids)) == 1:
        return simple_graphs(n, split.n_ubatch)
    return equal_graphs(seq_ids, split.n_ubatch)


def seq_runs(rows: Rows, seq_ids: tuple[int, ...]) -> tuple[Rows, ...] | None:
    """The rows of a graph in runs of one sequence; None when a sequence's rows are not one run."""
    runs: list[list[int]] = []
    for i in rows:
        if runs and seq_ids[runs[-1][0]] == seq_ids[i]:
            runs[-1].append(i)
        elif any(seq_ids[r[0]] == seq_ids[i] for r in runs):
            return None
        else:
            runs.append([i])
    return tuple(tuple(r) for r in runs)


def _cut(event: RecordEvent, start: int, end: int, n_rows: int) -> RecordEvent | None:
    """The record event cut to rows [start, end) of its `n_rows` (numpy's leading axis, ggml's
    last), or None when its leading axis is not those rows."""
    ne = list(event.ne)
    axis = n_dims(event.ne) - 1
    if n_rows == 1 and ne[axis] != 1 and axis + 1 < len(ne):  # one row: its axis is the 1 n_dims leaves out
        axis += 1
    if ne[axis] != n_rows or (n_rows == 1 and end - start != 1):
        return None
    if (start, end) == (0, n_rows):
        return replace(event, ubatch=0)
    row_bytes = event.nbytes // n_rows
    ne[axis] = end - start
    return replace(
        event,
        ubatch=0,
        ne=tuple(ne),
        offset=event.offset + start * row_bytes,
        nbytes=(end - start) * row_bytes,
    )


def _record_part(event: RecordEvent, ev: ExecEval, graph: Rows, part: Rows) -> tuple[RecordEvent, ...] | None:
    """The rows of `part` (a run of `graph`'s rows) of a record of that graph, by token or by
    output row: one record, or none when the part holds no output row of an output record; None
    when the record has a row neither per token nor per output."""
    if len(part) == len(graph):  # the graph is one sequence's: all of the record is this part's
        return (replace(event, ubatch=0),)
    start = graph.index(part[0])
    cut = _cut(event, start, start + len(part), len(graph))
    if cut is not None:
        return (cut,)
    outputs = [i for i in graph if ev.outputs[i]]
    mine = [i for i in part if ev.outputs[i]]
    if not outputs or len(outputs) == len(graph):
        return None
    if not mine:
        return ()  # this sequence has no output row in the record: nothing of it to keep
    first = outputs.index(mine[0])
    cut = _cut(event, first, first + len(mine), len(outputs))
    return None if cut is None else (cut,)


def _holds(event: RecordEvent, graph: int) -> bool:
    """Whether the record holds rows of this graph: a node those of its own, a row read back
    through the API after the call (`draft_logits`) those of every graph."""
    return event.op == names.API_OP or event.ubatch == graph


def _part_of(event: RecordEvent, ev: ExecEval, graph: Rows, part: Rows) -> tuple[RecordEvent, ...] | None:
    """The rows of `part` (a run of `graph`'s rows) of a record: a node's by its graph's rows
    (_record_part); an API read-back's by the call's output rows, in batch order, as the program
    reads them (llama_get_logits_ith)."""
    if event.op != names.API_OP:
        return _record_part(event, ev, graph, part)
    outputs = [i for i in range(len(ev.seq_ids)) if not ev.outputs or ev.outputs[i]]
    mine = [i for i in part if not ev.outputs or ev.outputs[i]]
    if not mine:
        return ()
    first = outputs.index(mine[0])
    cut = _cut(event, first, first + len(mine), len(outputs))
    return None if cut is None else (cut,)


@dataclass(frozen=True)
class _Plan:
    """How one decode splits: (graph index, graph rows, run rows) per part, or why it cannot."""

    parts: tuple[tuple[int, Rows, Rows], ...]
    why_whole: str | None = None


def _plan(ev: ExecEval, records: list[RecordEvent], split: Split) -> _Plan:
    graphs = graph_rows(ev.seq_ids, split)
    seen = max((r.ubatch for r in records), default=0) + 1
    what = f"decode {ev.eval} ({len(ev.positions)} rows of sequences {sorted(set(ev.seq_ids))})"
    if seen > len(graphs):
        return _Plan(
            (), f"{what} was computed as {seen} graphs, not as featdiff models llama.cpp's split ({len(graphs)})"
        )
    parts = []
    for u, graph in enumerate(graphs):
        runs = seq_runs(graph, ev.seq_ids)
        if runs is None:
            return _Plan((), f"{what} holds a sequence whose rows are not contiguous")
        parts += [(u, graph, run) for run in runs]
    if len(parts) == 1:
        return _Plan(tuple(parts))
    for r in records:
        if any(_part_of(r, ev, graph, run) is None for u, graph, run in parts if _holds(r, u)):
            return _Plan((), f"{what}: its record {r.name} has no row per token of its graph")
    return _Plan(tuple(parts))


def first_shared_decode(log: ExecLog) -> ExecEval | None:
    """The first decode llama.cpp took whose rows belong to more than one sequence (a server
    serving several slots in one batch), or None."""
    return next((ev for ev in log.evals if ev.rc == 0 and len(set(ev.seq_ids)) > 1), None)


def split_decodes(log: ExecLog, splits: dict[int, Split]) -> SplitLog:
    """One decode per graph and sequence (module docstring); `splits` per context index."""
    by_eval: dict[int, list[RecordEvent]] = {}
    for e in log.records:
        by_eval.setdefault(e.eval, []).append(e)
    evals: list[ExecEval] = []
    records: list[RecordEvent] = []
    last: dict[int, int] = {}
    notes: list[str] = []
    noted: list[int] = []
    for ev in log.evals:
        own = by_eval.get(ev.eval, [])
        plan = _plan(ev, own, splits.get(ev.ctx, Split(None)))
        if plan.why_whole is not None or len(plan.parts) <= 1:
            if plan.why_whole is not None:
                notes.append(
                    plan.why_whole + "; its rows are kept together, and pair with the reference only as a whole"
                )
                noted.append(len(evals))
            evals.append(replace(ev, eval=len(evals), origin=ev.call_id))
            records += _one_graph(own, len(evals) - 1)
        else:
            for u, graph, run in plan.parts:
                evals.append(_sub_decode(ev, len(evals), run))
                parts = (_part_of(r, ev, graph, run) or () for r in own if _holds(r, u))
                records += [replace(p, eval=len(evals) - 1) for part in parts for p in part]
        last[ev.eval] = len(evals) - 1
    moved = replace(
        log,
        evals=tuple(evals),
        records=tuple(records),
        clears=tuple((ctx, _moved(last, after)) for ctx, after in log.clears),
        seq_rms=tuple(replace(e, after_eval=_moved(last, e.after_eval)) for e in log.seq_rms),
        memory=tuple(replace(e, after_eval=_moved(last, e.after_eval)) for e in log.memory),
    )
    return SplitLog(moved, tuple(notes), tuple(noted))


def _one_graph(own: list[RecordEvent], eval_: int) -> list[RecordEvent]:
    """The records of a decode kept whole, as one eval's: a node of a later graph of the call
    counts on from the earlier graphs' nodes of its name (occurrence), so no two share a key."""
    count: dict[tuple[str, str, int], int] = {}  # (name, role, graph) -> its nodes of that name
    for r in own:
        k = (r.name, r.role, r.ubatch)
        count[k] = max(count.get(k, 0), r.occurrence + 1)
    return [replace(r, eval=eval_, occurrence=_in_earlier_graphs(count, r) + r.occurrence) for r in own]


def _in_earlier_graphs(count: dict[tuple[str, str, int], int], r: RecordEvent) -> int:
    return sum(n for (name, role, u), n in count.items() if (name, role) == (r.name, r.role) and u < r.ubatch)


def _moved(last: dict[int, int], after: int) -> int:
    """An edit made after decode `after` comes after its last part (-1: before every decode)."""
    return last.get(after, after) if after >= 0 else after


def _sub_decode(ev: ExecEval, new: int, rows: Rows) -> ExecEval:
    return replace(
        ev,
        eval=new,
        origin=ev.call_id,
        token_ids=tuple(ev.token_ids[i] for i in rows) if ev.token_ids else (),
        positions=tuple(ev.positions[i] for i in rows),
        seq_ids=tuple(ev.seq_ids[i] for i in rows),
        outputs=tuple(ev.outputs[i] for i in rows) if ev.outputs else (),
    )
