"""What each sequence of each context holds, followed through a program's decodes and every
change it made to its memory (docs/flow.md "What a sequence holds"): removals and clears, copies
and keeps, position shifts, and states saved and restored (llama-server's RAM prompt cache, its
`/slots` files, context checkpoints).

Consumes an `ExecLog` (decodes one per graph and sequence: featdiff.programs.sequences) and its
evals with their phase and flow (featdiff.programs.phases.flow_evals); produces, for each
flow, the tokens its target sequence held before the flow's first prefill position (the prefix a
prompt cache gave it) and which target tokens' features the drafter's cache held at those
positions, and one sentence for each change featdiff cannot follow. Pure: it reads no file.

A position's token is known from the decode that wrote it. A saved state is named by a hash of
its bytes (or by its file), so a restore brings back the history that was saved under that name,
whatever the program believes it restored. A shift (`seq_add`, `seq_div`: llama.cpp's context
shift, `--cache-reuse`) moves rows whose keys and values were computed in another context than
a replay from position 0 would compute: those positions are not modelled (UNKNOWN_TOKEN).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from featdiff.core import names
from featdiff.core.phases import Phase
from featdiff.dump.records import DRAFT_ROW, NO_ROW, UNKNOWN_TOKEN, Eval
from featdiff.kinds import registry as kinds
from featdiff.programs.run_log import ExecLog, ExecMemory

PARTIAL_STATE = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: a recurrent or SWA checkpoint, not the positions held

Held = dict[int, int]  # position -> token (target), or the target token whose features the row holds (drafter)


@dataclass(frozen=True)
class FlowStart:
    """What a flow's sequence held when its first prefill ran: position p < n_cached holds
    `target[p]` on the target and the features of `draft[p]` in the drafter (None: no drafter
    context)."""

    flow: int
    seq_id: int
    n_cached: int
    target: tuple[int, ...]
    draft: tuple[int, ...] | None
    unfollowed: str = ""  # why some of those positions are UNKNOWN_TOKEN ("" when every one is known)


@dataclass
class _Memory:
    """The contexts' sequences as the walk has followed them so far."""

    held: dict[tuple[int, int], Held] = field(default_factory=dict)  # (ctx, seq) -> what it holds
    saved: dict[str, Held] = field(default_factory=dict)  # a saved state's name -> what it held
    why: dict[tuple[int, int], str] = field(default_factory=dict)  # (ctx, seq) -> why some rows are UNKNOWN_TOKEN

    def seq(self, ctx: int, seq: int) -> Held:
        return self.held.setdefault((ctx, seq), {})

    def seqs(self, ctx: int, seq: int) -> list[tuple[int, int]]:
        """The (ctx, seq) keys an op on `seq` touches (seq < 0: every sequence of the context)."""
        return [k for k in self.held if k[0] == ctx and (seq < 0 or k[1] == seq)]


def follow_memory(log: ExecLog, evals: tuple[Eval, ...]) -> tuple[FlowStart, ...]:
    """Walk the decodes and memory changes in the order the program made them; for each flow,
    what its sequence held at its first prefill (module docstring). `evals` are `log.evals`
    with their phases, one for one."""
    roles = {c.index: c.role for c in log.contexts}
    mem = _Memory()
    pending = list(log.memory)
    starts: dict[int, FlowStart] = {}
    n_cached = _n_cached(evals)
    draft_ctx = next((c.index for c in log.contexts if c.role == names.ROLE_DRAFT and c.ok), None)
    steps = {c.index for c in log.contexts if c.role == names.ROLE_DRAFT and not kinds.of_arch(c.arch).block_flow}
    target_ctx: int | None = None
    active: dict[int, int] = {}  # sequence -> the flow it serves now
    broken: dict[int, str] = {}  # flow -> the change made to its sequence while it ran
    failed: dict[int, list[tuple[str, int, int]]] = {}  # broken flow -> (role, first position, rc) of a failed decode
    last = {e.flow: ev.eval for ev, e in zip(log.evals, evals) if e.phase != Phase.WARMUP}  # flow -> its last eval
    for ev, e in zip(log.evals, evals):
        while pending and pending[0].after_eval < ev.eval:
            op = pending.pop(0)
            _apply(mem, op)
            _note_midflow(op, active, starts, broken, last)
        role = roles.get(ev.ctx, names.ROLE_TARGET)
        if role == names.ROLE_TARGET and e.phase != Phase.WARMUP:
            target_ctx = ev.ctx
            if e.phase == Phase.PREFILL and e.flow not in starts:
                starts[e.flow] = _start(mem, e, ev.ctx, draft_ctx, n_cached.get(e.flow, 0))
        if e.phase != Phase.WARMUP:
            active.update({s: e.flow for s in e.seq_ids})
        if e.flow in broken and ev.rc not in (0, None):
            failed.setdefault(e.flow, []).append((role, ev.positions[0] if ev.positions else -1, ev.rc))
        if (ev.rc == 0 or ev.rc is None) and ev.call != names.CALL_ENCODE:  # an encoder call writes no cache
            _write(mem, ev.ctx, role, ev.positions, ev.seq_ids, ev.token_ids, target_ctx, ev.ctx in steps)
    return tuple(_broken(starts[k], broken.get(k, "") + _failed_after(failed.get(k, []))) for k in sorted(starts))


def _failed_after(failed: list[tuple[str, int, int]]) -> str:
    """The decodes of a shifted flow that failed after the shift, for the sentence that names it
    (upstream's EAGLE3 driver keeps the position it last drafted from unshifted, and its next
    draft decode meets positions the shift left non-consecutive: llama-server fails the request)."""
    if not failed:
        return ""
    role, pos, rc = failed[0]
    return (
        f"; after it {len(failed)} decode{'s' if len(failed) > 1 else ''} of the flow failed, the first of the "
        f"{role} context at position {pos} (return code {rc}), so the program did not complete the flow either"
    )


def _note_midflow(
    op: ExecMemory, active: dict[int, int], starts: dict[int, FlowStart], broken: dict[int, str], last: dict[int, int]
) -> None:
    """A shift of a sequence whose flow has started and decodes again after it (llama-server's
    context shift): the rest of that flow decodes on rows a replay from position 0 does not
    compute. A shift after a flow's last decode (`--cache-reuse` moving a finished request's rows
    for the next prompt) leaves that flow as it ran; the next flow's cached rows say it."""
    if op.op not in ("seq_add", "seq_div") or not op.ok:
        return
    for seq, flow in active.items():
        ran_on = last.get(flow, -1) > op.after_eval
        if (op.seq_id < 0 or seq == op.seq_id) and flow in starts and flow not in broken and ran_on:
            broken[flow] = (
                f"the program moved positions of sequence {seq} from {max(op.p0, 0)} on {_moved_how(op)} while the flow ran "
                f"(after eval {op.after_eval}; {op.op}: a context shift), and a replay does not compute the rows it moved"
            )


def _moved_how(op: ExecMemory) -> str:
    """How a seq_add / seq_div moved the positions, for the sentence that names it."""
    return f"by {op.delta:+d}" if op.op == "seq_add" else f"divided by {op.delta}"


def _broken(start: FlowStart, why: str) -> FlowStart:
    return start if start.unfollowed or not why else replace(start, unfollowed=why)


def _n_cached(evals: tuple[Eval, ...]) -> dict[int, int]:
    """Each flow's first prefill position: the positions before it came from its cache."""
    out: dict[int, int] = {}
    for e in evals:
        if e.phase == Phase.PREFILL and e.positions:
            out[e.flow] = min(out.get(e.flow, e.positions[0]), min(e.positions))
    return out


def _start(mem: _Memory, e: Eval, ctx: int, draft_ctx: int | None, n_cached: int) -> FlowStart:
    seq = e.seq_ids[0] if e.seq_ids else 0
    t = tuple(mem.seq(ctx, seq).get(p, UNKNOWN_TOKEN) for p in range(n_cached))
    why = ""
    if UNKNOWN_TOKEN in t:
        why = mem.why.get((ctx, seq)) or (
            "no decode the capture saw wrote them (the program's cache held them before featdiff attached)"
        )
    if draft_ctx is None:
        return FlowStart(e.flow, seq, n_cached, t, None, why)
    d = _drafter_rows(mem, draft_ctx, seq, n_cached)
    if not why and UNKNOWN_TOKEN in d:
        why = "the drafter's cache: " + mem.why[(draft_ctx, seq)]
    return FlowStart(e.flow, seq, n_cached, t, d, why)


def _drafter_rows(mem: _Memory, draft_ctx: int, seq: int, n: int) -> tuple[int, ...]:
    """The target token whose features each of the drafter's first `n` positions holds: a position
    nothing wrote holds nothing (NO_ROW), unless a change featdiff cannot follow touched the
    sequence (UNKNOWN_TOKEN)."""
    absent = UNKNOWN_TOKEN if (draft_ctx, seq) in mem.why else NO_ROW
    held = mem.seq(draft_ctx, seq)
    return tuple(held.get(p, absent) for p in range(n))


def _write(
    mem: _Memory,
    ctx: int,
    role: names.Role,
    positions: tuple[int, ...],
    seq_ids: tuple[int, ...],
    token_ids: tuple[int, ...],
    target_ctx: int | None,
    is_step: bool = False,
) -> None:
    """A decode's rows into its context: a target row holds its token; a block drafter's embd row
    (inject) the features of the target token at its position, its token row a draft block; a step
    drafter's row (EAGLE3, MTP: a token with a hidden state) the token it was decoded with."""
    for i, (pos, seq) in enumerate(zip(positions, seq_ids or (0,) * len(positions))):
        token = token_ids[i] if i < len(token_ids) else UNKNOWN_TOKEN
        if role == names.ROLE_DRAFT and not is_step:
            is_embd = token < 0
            target = mem.seq(target_ctx, seq) if target_ctx is not None else {}
            token = target.get(pos, UNKNOWN_TOKEN) if is_embd else DRAFT_ROW
        mem.seq(ctx, seq)[pos] = token


def _apply(mem: _Memory, op: ExecMemory) -> None:
    """One change to a context's memory, as llama.cpp makes it (llama.h: p0 < 0 from 0, p1 < 0 to the end)."""
    if not op.ok:
        if op.op == "state_restore":  # llama.cpp empties the sequence when a restore fails
            mem.held[(op.ctx, op.seq_id)] = {}
        return
    hi = float("inf") if op.p1 < 0 else op.p1
    lo = max(op.p0, 0)
    if op.op == "clear" or (op.op == "seq_rm" and lo == 0 and op.p1 < 0):  # nothing left to explain
        for k in mem.seqs(op.ctx, -1 if op.op == "clear" else op.seq_id):
            mem.held[k] = {}
            mem.why.pop(k, None)
    elif op.op == "seq_rm":
        for k in mem.seqs(op.ctx, op.seq_id):
            mem.held[k] = {p: t for p, t in mem.held[k].items() if not lo <= p < hi}
    elif op.op == "seq_cp":
        src = mem.seq(op.ctx, op.seq_id)
        mem.seq(op.ctx, op.seq_dst).update({p: t for p, t in src.items() if lo <= p < hi})
    elif op.op == "seq_keep":
        for k in mem.seqs(op.ctx, -1):
            if k[1] != op.seq_id:
                mem.held[k] = {}
    elif op.op in ("seq_add", "seq_div"):
        _shift(mem, op, lo, hi)
    elif op.op == "state_save" and not op.flags & PARTIAL_STATE:
        mem.saved[op.state] = dict(mem.seq(op.ctx, op.seq_id))
    elif op.op == "state_restore" and not op.flags & PARTIAL_STATE:
        _restore(mem, op)


def _shift(mem: _Memory, op: ExecMemory, lo: int, hi: float) -> None:
    """seq_add / seq_div: the rows move, but their keys and values were computed in another
    context than a replay would give them: their positions become UNKNOWN_TOKEN."""
    for k in mem.seqs(op.ctx, op.seq_id):
        moved = [p for p in mem.held[k] if lo <= p < hi]
        for p in moved:
            new = p + op.delta if op.op == "seq_add" else p // max(op.delta, 1)
            mem.held[k].pop(p)
            mem.held[k][new] = UNKNOWN_TOKEN
        if moved:
            mem.why[k] = (
                f"the program moved {len(moved)} positions of sequence {k[1]} from {min(moved)} on {_moved_how(op)} "
                f"({op.op}: a context shift or --cache-reuse), and a replay from position 0 does not compute "
                "the rows it moved"
            )


def _restore(mem: _Memory, op: ExecMemory) -> None:
    key = (op.ctx, op.seq_id)
    mem.held[key] = dict(mem.saved.get(op.state, {}))
    if op.state not in mem.saved:
        what = f"the state file {op.state[5:]}" if op.state.startswith("file:") else "a state"
        mem.why[key] = (
            f"the program restored sequence {op.seq_id} from {what} the capture never saw saved, so which "
            "tokens it holds is not known"
        )
