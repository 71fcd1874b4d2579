"""Graphs and sequences of a program's decodes: each decode split into one per graph and
sequence before the flow of each sequence is inferred (docs/flow.md "Micro-batches", "Several
flows").

Consumes the decodes the preload noted, each context's micro-batch settings and the shim's
record events, which carry the index of their graph within the decode (`ubatch`); produces the
same log (programs/run_log.py `ExecLog`) with each decode replaced by one decode per (graph,
sequence), in execution order, holding its rows, and each record cut to them: a row record has
one row per token of its graph, an output record (logits) one per output row.

Which batch rows each graph computed follows llama.cpp's split (src/llama-batch.cpp): with one
KV stream (`kv_unified`, or one sequence) consecutive chunks of `n_ubatch` rows (`split_simple`);
with a stream per sequence, `split_equal(n_ubatch, sequential=true)`: each graph takes the unused
rows of consecutive sequence ids starting from the first unused row's, as many of each; an
encoder call (llama_encode) is one graph of all its rows. A decode
whose records do not fit that model (another split, a record with no row per token) is kept
whole and a note says why: its rows are then compared together, never guessed. Graphs that each
hold all of a batch's rows are one graph the shim cut where a node's address came round again
(a memory update's K-shift computed before it in the same call), and are taken as one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from featdiff.core import names
from featdiff.llama.spool_index import RecordEvent, n_dims
from featdiff.llama.ubatch import chunks
from featdiff.programs.run_log import ExecContext, ExecEval, ExecLog

Rows = tuple[int, ...]  # batch row indices, in the order a graph holds them


@dataclass(frozen=True)
class Split:
    """Micro-batch settings of a context: how llama.cpp splits its batches into graphs."""

    n_ubatch: int | None  # None: unknown (an older preload), the batch is one graph as far as known
    n_stream: int = 1  # KV streams: 1 when unified, else one per sequence (n_seq_max)
    n_rs_seq: int = 0  # recurrent-state snapshots kept per sequence for rollback (0: none, or not noted)


def split_of(context: ExecContext) -> Split:
    """How llama.cpp splits a context's batches into graphs: one KV stream when unified (or not
    noted: an older preload), else one per sequence."""
    streams = 1 if context.kv_unified in (True, None) else max(1, context.n_seq_max or 1)
    return Split(context.n_ubatch, streams, context.n_rs_seq or 0)


@dataclass(frozen=True)
class SplitLog:
    """The log with one graph and one sequence per decode, and the decodes kept whole."""

    log: ExecLog
    notes: tuple[str, ...] = ()
    noted_evals: tuple[int, ...] = ()  # the eval (of `log`) each note is about


def simple_graphs(n_tokens: int, n_ubatch: int) -> tuple[Rows, ...]:
    """split_simple: consecutive chunks of `n_ubatch` rows."""
    return tuple(tuple(range(start, end)) for start, end in chunks(n_tokens, n_ubatch))


def equal_graphs(
    seq_ids: tuple[int, ...], n_ubatch: int, sequential: bool = True, keep_tail: int = 0
) -> tuple[Rows, ...]:
    """split_equal(n_ubatch, sequential, n_keep_tail) for a batch whose rows each belong to one
    sequence: per graph, the sequences of the unused rows in batch order (with `sequential`, only
    consecutive ids from the first unused row's), the same number of unused rows of each while
    they last and fit, one sequence's rows after another's; with `keep_tail`, a sequence that
    would leave fewer than that many rows for a later graph waits for it (a recurrent memory
    keeps its rollback snapshots whole)."""
    used = [False] * len(seq_ids)
    rows_of: dict[int, list[int]] = {}
    for i, s in enumerate(seq_ids):
        rows_of.setdefault(s, []).append(i)
    out: list[Rows] = []
    while not all(used):
        seqs: list[int] = []
        for i, s in enumerate(seq_ids):  # in batch order, as llama.cpp scans it
            if used[i] or s in seqs or (sequential and seqs and s != seqs[-1] + 1):
                continue
            seqs.append(s)
            if len(seqs) > n_ubatch:
                break
        start = {s: sum(used[i] for i in rows_of[s]) for s in seqs}  # a sequence's rows are used in order
        took = dict.fromkeys(seqs, 0)
        while all(start[s] + took[s] < len(rows_of[s]) for s in seqs):
            for s in seqs:
                took[s] += 1
            if (took[seqs[0]] + 1) * len(seqs) > n_ubatch:
                break
        if keep_tail > 0:
            seqs, took = _kept_tails(seqs, took, start, rows_of, n_ubatch, keep_tail)
        graph = [i for s in seqs for i in rows_of[s][start[s] : start[s] + took[s]]]
        for i in graph:
            used[i] = True
        out.append(tuple(graph))
    return tuple(out)


def _kept_tails(
    seqs: list[int],
    took: dict[int, int],
    start: dict[int, int],
    rows_of: dict[int, list[int]],
    n_ubatch: int,
    tail: int,
) -> tuple[list[int], dict[int, int]]:
    """split_equal's n_keep_tail: the longest prefix of the graph's sequences that each either
    finish in it or leave at least `tail` rows; none: the first alone, run to its end if that
    fits, else cut back until `tail` rows are left."""

    def left(s: int) -> int:
        return len(rows_of[s]) - start[s] - took[s]

    n_keep = 0
    while n_keep < len(seqs) and not 0 < left(seqs[n_keep]) < tail:
        n_keep += 1
    if n_keep == 0:
        first = seqs[0]
        whole = took[first] + left(first)
        took = {**took, first: whole if whole <= n_ubatch else min(took[first], whole - tail)}
        n_keep = 1
    return seqs[:n_keep], took


def seq_graphs(seq_ids: tuple[int, ...], n_ubatch: int) -> tuple[Rows, ...]:
    """split_seq(n_ubatch) (a recurrent memory whose context outputs every row): per graph, up
    to `n_ubatch` unused rows of the first unused row's sequence, in batch order."""
    used = [False] * len(seq_ids)
    out: list[Rows] = []
    while not all(used):
        first = used.index(False)
        graph = [i for i in range(first, len(seq_ids)) if not used[i] and seq_ids[i] == seq_ids[first]][:n_ubatch]
        for i in graph:
            used[i] = True
        out.append(tuple(graph))
    return tuple(out)


def graph_rows(seq_ids: tuple[int, ...], split: Split) -> tuple[Rows, ...]:
    """The batch rows of each graph llama.cpp computes a decode of these rows as, by the
    context's settings: a memory keeping rollback snapshots (n_rs_seq: a recurrent or hybrid
    one) split_equal with their tails, sequential with a stream per sequence; else split_simple
    with one KV stream, split_equal(sequential) with one per sequence. featdiff's first guess:
    `_graphs` checks it against the records, and tries `other_splits` where they disagree."""
    n = len(seq_ids)
    if not split.n_ubatch or n == 0:
        return (tuple(range(n)),)
    if split.n_rs_seq:
        return equal_graphs(seq_ids, split.n_ubatch, split.n_stream > 1, split.n_rs_seq + 1)
    if split.n_stream == 1 or len(set(seq_ids)) == 1:
        return simple_graphs(n, split.n_ubatch)
    return equal_graphs(seq_ids, split.n_ubatch)


def other_splits(seq_ids: tuple[int, ...], split: Split) -> tuple[tuple[Rows, ...], ...]:
    """The other ways llama.cpp's memories split a batch into graphs (src/llama-batch.cpp, as
    each memory's init_batch calls it): split_simple; split_equal sequential or not, with or
    without the rollback tails of a recurrent or hybrid memory (n_rs_seq snapshots); split_seq."""
    n_ub = split.n_ubatch
    if not n_ub or not seq_ids:
        return ()
    tails = (0, split.n_rs_seq + 1) if split.n_rs_seq else (0,)
    equal = tuple(equal_graphs(seq_ids, n_ub, sequential, tail) for tail in tails for sequential in (False, True))
    return (simple_graphs(len(seq_ids), n_ub), *equal, seq_graphs(seq_ids, n_ub))


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


def _first_section(event: RecordEvent, start: int, n: int, n_rows: int) -> RecordEvent | None:
    """Rows [start, start + n) of the first section of an `inp_pos` holding several positions per
    token, section after section (M-RoPE: 4): the token positions compare reads of it; None for
    any other record."""
    if event.name != names.INP_POS or n_dims(event.ne) != 1 or not n_rows or event.ne[0] % n_rows:
        return None
    size = event.nbytes // event.ne[0]
    return replace(event, ubatch=0, ne=(n, *event.ne[1:]), offset=event.offset + start * size, nbytes=n * size)


def _record_part(event: RecordEvent, ev: ExecEval, graph: Rows, part: Rows) -> tuple[RecordEvent, ...] | None:
    """The rows of `part` (a run of `graph`'s rows) of a record of that graph, by token or by
    output row: one record, or none when the part holds no output row of an output record; None
    when the record has a row neither per token nor per output."""
    if len(part) == len(graph):  # the graph is one sequence's: all of the record is this part's
        return (replace(event, ubatch=0),)
    start = graph.index(part[0])
    cut = _cut(event, start, start + len(part), len(graph)) or _first_section(event, start, len(part), len(graph))
    if cut is not None:
        return (cut,)
    outputs = [i for i in graph if ev.outputs[i]]
    mine = [i for i in part if ev.outputs[i]]
    if not outputs and event.nbytes == 0:
        return (replace(event, ubatch=0),)  # an output record of a graph that outputs no row: empty for each part
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
    what = f"decode {ev.eval} ({len(ev.positions)} rows of sequences {sorted(set(ev.seq_ids))})"
    found = _graphs(ev, records, split)
    if isinstance(found, str):
        return _Plan((), f"{what} {found}")
    parts = []
    for u, graph in enumerate(found):
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


def _graphs(ev: ExecEval, records: list[RecordEvent], split: Split) -> tuple[Rows, ...] | str:
    """The rows of each graph of a decode: the context's split (graph_rows) where the records
    agree with it, else the one of `other_splits` they agree with; or why none can be told.
    llama_encode computes its batch as one graph."""
    n = len(ev.seq_ids)
    if ev.call != names.CALL_DECODE:
        return (tuple(range(n)),)
    guess = graph_rows(ev.seq_ids, split)
    seen = max((r.ubatch for r in records), default=0) + 1
    sizes = _graph_sizes(records)
    if _agrees(guess, seen, sizes):
        return guess
    fitting = list(dict.fromkeys(g for g in other_splits(ev.seq_ids, split) if _agrees(g, seen, sizes)))
    if len(fitting) == 1:
        return fitting[0]
    if len(set(ev.seq_ids)) == 1 and seen <= len(guess):
        return guess  # one sequence's rows, in batch order whatever the split: its graphs as guessed
    if _one_graph_cut(sizes, seen, n):
        return (tuple(range(n)),)
    shape = ", ".join(str(sizes.get(u, "?")) for u in range(seen))
    if not fitting:
        return f"was computed as {seen} graphs of {shape} rows, as none of llama.cpp's splits featdiff models"
    return (
        f"was computed as {seen} graphs of {shape} rows, as {len(fitting)} of llama.cpp's splits would, with other rows"
    )


def _one_graph_cut(sizes: dict[int, int], seen: int, n: int) -> bool:
    """Whether the records' graphs are one graph of all `n` rows that the shim cut in two or more:
    every graph they show holds all the batch's rows, which graphs that split a batch never do (they
    share its rows out). The shim starts a graph where a node's address comes round again, and a
    graph llama.cpp computed earlier in the same call leaves its addresses for the batch's graph to
    reuse: the K-shift of llama_context::memory_update, run before the batch after a seq_add (a
    context shift, --cache-reuse) whose context decoded nothing since."""
    return seen > 1 and len(sizes) == seen and all(rows == n for rows in sizes.values())


def _graph_sizes(records: list[RecordEvent]) -> dict[int, int]:
    """Per graph, the rows its records show: the most of any record of two or more dimensions
    (a node's leading numpy axis is one per token, or per output row: never more); a graph
    with only one-dimensional records (one row, or positions) or empty ones (no output row)
    shows none."""
    out: dict[int, int] = {}
    for r in records:
        rows = r.ne[n_dims(r.ne) - 1]
        if r.op != names.API_OP and n_dims(r.ne) >= 2 and rows > 0:
            out[r.ubatch] = max(out.get(r.ubatch, 0), rows)
    return out


def _agrees(graphs: tuple[Rows, ...], seen: int, sizes: dict[int, int]) -> bool:
    """Whether a split has as many graphs as the records show, each of the rows they show."""
    return len(graphs) >= seen and all(u < len(graphs) and len(graphs[u]) == n for u, n in sizes.items())


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
