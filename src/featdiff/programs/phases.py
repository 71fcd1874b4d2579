"""The phases and rounds of a program's decodes (`capture --exec`), inferred from what the
preload noted (docs/flow.md).

Consumes an `ExecLog` (featdiff.programs.run_log), its decodes already one per graph and sequence
(featdiff.programs.sequences), and for the last verify of a flow the target's greedy tokens;
produces the dump's evals with their phase, round and flow, the rounds (drafts, accepted), the
prompt, the memory operations, and flow notes where the run broke a convention the inference
rests on. Pure: it reads no file (featdiff.programs.pack reads the spool and packs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from featdiff.core import names
from featdiff.core.blocks import accepted_length
from featdiff.core.phases import TARGET_PHASES, Phase, phrase
from featdiff.dump.records import Eval, FlowInfo, MemoryOp, Round
from featdiff.kinds import registry as kinds
from featdiff.programs.memory import PARTIAL_STATE, FlowStart
from featdiff.programs.run_log import ExecEval, ExecLog

POS_UNSET = -1  # the preload's position of an entry the program left unplaced (a NULL pos array)


def _encoded_positions(evals: tuple[ExecEval, ...]) -> dict[int, tuple[int, ...]]:
    """The positions of the older generation's DFlash encoder evals: llama_encode gets no
    positions (every one unset), and its rows are the ones the context's next embd decode of as
    many rows places; that decode's positions are theirs."""
    out = {}
    for i, ev in enumerate(evals):
        if ev.call != names.CALL_ENCODE or not ev.is_embd or any(p != POS_UNSET for p in ev.positions):
            continue
        after = next((evals[j] for j in range(i + 1, len(evals)) if evals[j].ctx == ev.ctx), None)
        if after is not None and after.is_embd and len(after.positions) == len(ev.positions):
            out[ev.eval] = after.positions
    return out


def warmup_evals(log: ExecLog) -> frozenset[int]:
    """Evals outside the real flow: those whose context memory was cleared before its next eval
    (common_init_from_params' warm-up, common_context_can_seq_rm's probe decode), and failed ones
    before the flow's first real decode (probes). A decode that fails later is part of the flow:
    llama.cpp refused the batch the driver built (a draft block at positions the cache does not
    continue), and it keeps its phase with its `rc`."""
    out: set[int] = set()
    for ctx, last in log.clears:
        cleared = [ev.eval for ev in log.evals if ev.ctx == ctx and ev.eval <= last]
        out.update(cleared)
    for ev in log.evals:
        if ev.rc not in (0, None):
            out.add(ev.eval)
        elif ev.eval not in out:
            break  # the flow has started
    return frozenset(out)


@dataclass(frozen=True)
class _Walk:
    """Where one sequence's flow stands after an eval: the round, whether a draft awaits its
    verify, and which of the sequence's requests it serves."""

    round: int = 0
    drafted: bool = False  # a draft eval since the last target decode
    speculating: bool = False  # this sequence has drafted before (a new one starts at position 0)
    request: int = 0  # requests this sequence served before this one
    last_pos0: int = -1  # the first position of the sequence's last target decode
    restored: bool = False  # the program restored the sequence's state since its last target decode


def flow_evals(log: ExecLog) -> tuple[Eval, ...]:
    """Each eval with its phase (docs/flow.md) and round.

    Drafter: an embd batch is `inject` (on the older generation two evals: the encoder's, which
    takes the positions of the decode after it, and that decode), a token batch is `draft` and
    opens a round. Target: a
    token batch after a draft is its `verify`; once a sequence has drafted, a target decode
    without a new draft is a `verify` of no drafts in a round of its own (llama-server does this
    when the length budget leaves no room to draft); before that it is `prefill`. Warm-up and
    probe decodes are kept, as phase `warmup`. An EAGLE3 encoder call holds the positions and
    sequences `with_encoder_rows` placed before the decodes were split.
    """
    roles: dict[int, names.Role] = {c.index: c.role for c in log.contexts}
    warm = warmup_evals(log)
    steps = one_token_steps(log)
    encoded = _encoded_positions(log.evals)
    walks: dict[int, _Walk] = {}  # per sequence (a decode of several, kept whole: -1)
    last_part: dict[int, tuple[int, str, int]] = {}  # per sequence: (call, role, seq) of its last decode
    calls: list[tuple[int, int]] = []  # (call, sequence) of each eval
    flow_of: dict[tuple[int, int], int] = {}  # (sequence, request) -> flow, in order of appearance
    restores = _target_restores(log)
    out: list[Eval] = []
    for ev in log.evals:
        ev = replace(ev, positions=encoded.get(ev.eval, ev.positions))
        role: names.Role = roles.get(ev.ctx, names.ROLE_TARGET)
        seq = ev.seq_ids[0] if len(set(ev.seq_ids)) == 1 else -1
        while restores and restores[0][0] < ev.eval:  # a restored state: the sequence's next request
            _, restored = restores.pop(0)
            if restored in walks and walks[restored].speculating:
                walks[restored] = replace(walks[restored], restored=True)
        walk = walks.get(seq, _Walk())
        if ev.eval in warm:
            phase = Phase.WARMUP
        elif out and (ev.call_id, role, seq) == last_part.get(seq):  # another graph of the same call
            phase = _phase_of(out, seq)
        else:
            phase, walk = _step(walk, role, ev, steps)
        walks[seq] = walk
        last_part[seq] = (ev.call_id, role, seq)
        flow = 0 if phase == Phase.WARMUP else flow_of.setdefault((seq, walk.request), len(flow_of))
        out.append(
            Eval(
                eval=ev.eval,
                role=role,
                phase=phase,
                n_tokens=len(ev.positions),
                positions=ev.positions,
                token_ids=() if ev.is_embd else ev.token_ids,
                seq_ids=ev.seq_ids,
                round=0 if phase == Phase.WARMUP else walk.round,
                rc=0 if phase == Phase.WARMUP else int(ev.rc or 0),
                call=names.CALL_ENCODE if ev.call == names.CALL_ENCODE else names.CALL_DECODE,
                flow=flow,
            )
        )
        calls.append((ev.call_id, seq))
    return _numbered_parts(out, calls)


def _target_restores(log: ExecLog) -> list[tuple[int, int]]:
    """(after eval, sequence) of each state the program restored into a target sequence (a prompt
    cache hit: llama-server's RAM cache, a `/slots` file), in order; partial states (checkpoints
    of a recurrent or SWA memory) roll a request back and start none."""
    targets = {c.index for c in log.contexts if c.role == names.ROLE_TARGET}
    return [
        (m.after_eval, m.seq_id)
        for m in log.memory
        if m.op == "state_restore" and m.ok and m.ctx in targets and not m.flags & PARTIAL_STATE
    ]


def _numbered_parts(evals: list[Eval], calls: list[tuple[int, int]]) -> tuple[Eval, ...]:
    """The decodes a call of one sequence was computed as (one per graph) numbered 0, 1, ... in
    `ubatch`; a call computed as one graph keeps None."""
    count: dict[tuple[int, int], int] = {}
    for c in calls:
        count[c] = count.get(c, 0) + 1
    seen: dict[tuple[int, int], int] = {}
    out = []
    for e, c in zip(evals, calls):
        if count[c] > 1:
            e = replace(e, ubatch=seen.get(c, 0))
            seen[c] = seen.get(c, 0) + 1
        out.append(e)
    return tuple(out)


def _phase_of(out: list[Eval], seq: int) -> Phase:
    """The phase the sequence's last decode had (a later graph of the same call shares it)."""
    return next(e.phase for e in reversed(out) if (e.seq_ids[0] if len(set(e.seq_ids)) == 1 else -1) == seq)


def one_token_steps(log: ExecLog) -> bool:
    """Whether the run's drafter drafts one token a decode (EAGLE3, featdiff.kinds): its round's
    draft is several decodes, and its inject an encoder call then a decode of token rows."""
    return any(c.role == names.ROLE_DRAFT and not kinds.of_arch(c.arch).block_flow for c in log.contexts if c.ok)


def with_encoder_rows(log: ExecLog) -> ExecLog:
    """The log with each EAGLE3 encoder call given the positions and sequences of the target rows
    it encodes (_features_rows), so that an encoder call of several sequences' rows (a server
    serving slots together) splits per sequence as the decodes do (featdiff.programs.sequences)."""
    if not one_token_steps(log):
        return log
    roles: dict[int, names.Role] = {c.index: c.role for c in log.contexts}
    rows = _features_rows(log.evals, roles, warmup_evals(log))
    if not rows:
        return log
    placed = (
        replace(ev, positions=rows[ev.eval][0], seq_ids=rows[ev.eval][1]) if ev.eval in rows else ev for ev in log.evals
    )
    return replace(log, evals=tuple(placed))


def _features_rows(
    evals: tuple[ExecEval, ...], roles: dict[int, names.Role], warm: frozenset[int]
) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """The positions and sequences of EAGLE3's encoder evals: the rows of the target call before
    them whose features they encode, in order (the encoder runs in chunks of the drafter's
    n_ubatch, every row in sequence 0 at placeholder positions upstream makes up: it reads none)."""
    out: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    rows: list[tuple[int, int]] = []  # (position, sequence) of the last target call's rows
    last_call = -1
    for ev in evals:
        if ev.eval in warm:
            continue
        if roles.get(ev.ctx) == names.ROLE_TARGET:
            rows = (rows if ev.call_id == last_call else []) + list(zip(ev.positions, ev.seq_ids))
            last_call = ev.call_id
        elif ev.call == names.CALL_ENCODE and ev.is_embd:
            took, rows = rows[: len(ev.positions)], rows[len(ev.positions) :]
            if len(took) == len(ev.positions):
                out[ev.eval] = (tuple(p for p, _ in took), tuple(q for _, q in took))
    return out


def _step(walk: _Walk, role: names.Role, ev: ExecEval, steps: bool = False) -> tuple[Phase, _Walk]:
    """The phase of one real eval of a sequence, and the walk after it. Once a sequence has
    drafted, a target decode with no draft before it starts the sequence's next request when it
    is no verify of no drafts (one token, the anchor, past the last decode's first position): a
    new prompt from position 0, or from a prefix the program kept cached (docs/flow.md). With
    one-token `steps` (EAGLE3) a drafter decode of token rows is its inject when it outputs
    nothing (the decoder batch after the encoder), else a draft step, and the first step after a
    target decode opens the round."""
    if role == names.ROLE_DRAFT:
        if ev.is_embd or (steps and not any(ev.outputs)):
            return Phase.INJECT, walk
        opens = not (steps and walk.drafted)
        return Phase.DRAFT, replace(walk, round=walk.round + opens, drafted=True, speculating=True)
    pos0 = ev.positions[0] if ev.positions else walk.last_pos0 + 1
    if walk.restored:  # a prompt cache restored it: a new request, whatever it decodes
        return Phase.PREFILL, _Walk(request=walk.request + 1, last_pos0=pos0)
    if walk.drafted:
        return Phase.VERIFY, replace(walk, drafted=False, last_pos0=pos0)
    if walk.speculating and len(ev.positions) == 1 and pos0 > walk.last_pos0:
        return Phase.VERIFY, replace(walk, round=walk.round + 1, last_pos0=pos0)
    if walk.speculating:  # a new request of this sequence: its rounds count afresh
        return Phase.PREFILL, _Walk(request=walk.request + 1, last_pos0=pos0)
    return Phase.PREFILL, replace(walk, last_pos0=pos0)


def prompt_from_evals(evals: tuple[Eval, ...]) -> tuple[int, ...]:
    """The prompt as docs/flow.md counts it: the target tokens decoded before the first draft,
    plus that draft's anchor (the token the program sampled, or kept back, to start from)."""
    first_draft = next((e for e in evals if e.phase == Phase.DRAFT), None)
    stop = first_draft.eval if first_draft else len(evals)
    by_pos = {
        p: t for e in evals if e.phase == Phase.PREFILL and e.eval < stop for p, t in zip(e.positions, e.token_ids)
    }
    anchor = first_draft.token_ids[:1] if first_draft else ()
    return tuple(by_pos[p] for p in sorted(by_pos)) + tuple(anchor)


def next_decodes(evals: tuple[Eval, ...]) -> dict[int, Eval | None]:
    """For each verify, the target decode that continues its sequence (None: nothing did).

    A continuation starts inside the verified block: at pos0 + accepted + 1 (llama.cpp keeps the
    accepted drafts and the target's next token becomes the anchor).
    """
    targets = [e for e in evals if e.role == names.ROLE_TARGET and e.phase in TARGET_PHASES and e.positions]
    out: dict[int, Eval | None] = {}
    for i, v in enumerate(targets):
        if v.phase != Phase.VERIFY:
            continue
        nxt = targets[i + 1] if i + 1 < len(targets) else None
        continues = nxt is not None and v.positions[0] < nxt.positions[0] <= v.positions[0] + v.n_tokens
        out[v.eval] = nxt if continues else None
    return out


def derive_rounds(evals: tuple[Eval, ...], greedy: dict[int, tuple[int, ...]]) -> tuple[Round, ...]:
    """Each verify as a Round: the drafts it verified and how many the program kept.

    `accepted` comes from where the next target decode starts (n_past += accepted + 1) and its
    first token (the target's token after the accepted drafts). A verify nothing continued (the
    last one) is decided by `greedy` (verify eval -> argmax of its captured result_output rows),
    and left out without it.
    """
    by_eval = {e.eval: e for e in evals}
    out = []
    for v_eval, nxt in next_decodes(evals).items():
        v = by_eval[v_eval]
        drafts = v.token_ids[1:]
        if nxt is not None:
            accepted = nxt.positions[0] - v.positions[0] - 1
            target_tokens = drafts[:accepted] + nxt.token_ids[:1]
        elif v.eval in greedy:
            accepted = accepted_length(drafts, greedy[v.eval])
            target_tokens = greedy[v.eval][: accepted + 1]
        else:
            continue
        out.append(
            Round(
                round=v.round,
                pos0=v.positions[0],
                anchor=v.token_ids[0],
                drafts=drafts,
                accepted=accepted,
                target_tokens=tuple(target_tokens),
            )
        )
    return tuple(out)


def whole_calls(evals: tuple[Eval, ...]) -> tuple[tuple[Eval, ...], dict[int, int]]:
    """One flow's evals with the graphs of one call merged back (a verify computed as several
    graphs is one verify of its round), and which eval each merged one was part of."""
    out: list[Eval] = []
    parts: dict[int, int] = {}
    for e in evals:
        prev = out[-1] if out else None
        if (
            prev is not None
            and (e.ubatch or 0) > 0
            and (prev.role, prev.phase, prev.round) == (e.role, e.phase, e.round)
        ):
            out[-1] = replace(
                prev,
                n_tokens=prev.n_tokens + e.n_tokens,
                positions=prev.positions + e.positions,
                token_ids=prev.token_ids + e.token_ids,
                seq_ids=prev.seq_ids + e.seq_ids,
            )
            parts[e.eval] = parts.get(prev.eval, prev.eval)
        else:
            out.append(e)
    return tuple(out), parts


def memory_ops(log: ExecLog, evals: tuple[Eval, ...]) -> tuple[MemoryOp, ...]:
    """The removals the program made from the caches of its flow's contexts, in order: a
    memory clear is a removal of everything (seq -1, p0 -1, p1 -1). Ops on contexts that ran only
    warm-up decodes, and ops before the first real eval (warm-up, probes), are left out."""
    roles: dict[int, names.Role] = {c.index: c.role for c in log.contexts}
    real = [e.eval for e in evals if e.phase != Phase.WARMUP]
    real_set = set(real)
    used = {ev.ctx for ev in log.evals if ev.eval in real_set}
    first = real[0] if real else 0
    ops = [
        (e.after_eval, MemoryOp(roles.get(e.ctx, names.ROLE_TARGET), e.after_eval, e.seq_id, e.p0, e.p1))
        for e in log.seq_rms
        if e.ctx in used and e.ok
    ]
    ops += [
        (after, MemoryOp(roles.get(ctx, names.ROLE_TARGET), after, -1, -1, -1, "clear"))
        for ctx, after in log.clears
        if ctx in used
    ]
    return tuple(op for after, op in sorted(ops, key=lambda x: x[0]) if after >= first)


def flow_notes(evals: tuple[Eval, ...], rounds: tuple[Round, ...], steps: bool = False) -> tuple[str, ...]:
    """Where the phases and rounds above rest on a convention the run broke: one sentence each.

    docs/flow.md: a round's verify starts where its draft block starts, and the next target
    decode starts inside the verified block. With one-token `steps` (EAGLE3) a round's first draft
    decode is its seed, at pos0 - 1: no block to place. Where the next decode starts against the
    target's argmax is argmax_notes', for a flow whose target chose greedily."""
    real = tuple(e for e in evals if e.phase != Phase.WARMUP)
    n_drafts = sum(e.phase == Phase.DRAFT for e in real)
    unrounded = (
        [
            f"the drafter decoded {n_drafts} draft blocks but no round could be inferred: no target "
            "verify followed them where the flow expects it"
        ]
        if n_drafts and not rounds
        else []
    )
    return (
        *unrounded,
        *_refused_notes(real),
        *(_misplaced_block_notes(real) if not steps else ()),  # EAGLE3's seed sits before its verify
        *_continuation_notes(evals, real),
    )


def _refused_notes(real: tuple[Eval, ...]) -> list[str]:
    """A decode llama.cpp refused, in the flow."""
    out = []
    for e in (e for e in real if e.rc):
        span = f"positions {e.positions[0]}..{e.positions[-1]}" if e.positions else "no rows"
        out.append(
            f"eval {e.eval} ({phrase(e.role, e.phase)}, round {e.round}, {span}) failed with rc {e.rc}: "
            "llama.cpp refused the batch the program built (see the program's log)"
        )
    return out


def _misplaced_block_notes(real: tuple[Eval, ...]) -> list[str]:
    """A draft block whose verify starts elsewhere: the round was paired on a broken convention."""
    drafts = {e.round: e for e in real if e.phase == Phase.DRAFT and not e.rc}
    out = []
    for v in (e for e in real if e.phase == Phase.VERIFY and e.round in drafts and e.positions):
        d = drafts[v.round]
        if d.positions and d.positions[0] != v.positions[0]:
            out.append(
                f"the draft block of round {v.round} starts at position {d.positions[0]}, its verify at "
                f"{v.positions[0]}: the rounds were inferred from a run whose draft block is misplaced"
            )
    return out


def argmax_notes(evals: tuple[Eval, ...], rounds: tuple[Round, ...], greedy: dict[int, tuple[int, ...]]) -> list[str]:
    """A next target decode that does not start at pos0 + accepted + 1 of the verify before it,
    `accepted` being what the target's greedy tokens (`greedy`: verify eval -> argmax rows) took
    of the drafts. Only for a flow whose target chose greedily: a sampled verify accepts what its
    sampler drew, which need not be the argmax (programs/pack.py keeps these notes only then)."""
    by_round = {r.round: r for r in rounds}
    by_eval = {e.eval: e for e in evals}
    out = []
    for v, nxt in next_decodes(evals).items():
        ev, rnd = by_eval[v], by_round.get(by_eval[v].round)
        if nxt is not None and rnd is not None and greedy.get(v):
            took = accepted_length(rnd.drafts, greedy[v])
            if took != rnd.accepted:
                out.append(
                    f"after the verify of round {ev.round} the target accepted {took} of {len(rnd.drafts)} "
                    f"drafts (argmax of its logits), but the next target decode starts at position "
                    f"{nxt.positions[0]} = {rnd.pos0} + {rnd.accepted} + 1: the run's n_past drifted by "
                    f"{rnd.accepted - took}; the rounds' accepted counts follow the positions"
                )
    return out


def _continuation_notes(evals: tuple[Eval, ...], real: tuple[Eval, ...]) -> list[str]:
    """A target decode after a verify that starts outside the verified block (not a new prompt)."""
    by_eval = {e.eval: e for e in evals}
    targets = [e for e in real if e.role == names.ROLE_TARGET and e.positions]
    out = []
    for v, nxt in next_decodes(evals).items():
        ev = by_eval[v]
        later = next((e for e in targets if e.eval > v), None)
        if nxt is None and later is not None and later.phase == Phase.VERIFY:  # a prefill starts a new prompt
            out.append(
                f"the target decode after the verify of round {ev.round} (eval {later.eval}) starts at "
                f"position {later.positions[0]}, outside the verified block {ev.positions[0]}.."
                f"{ev.positions[-1]}: the run's n_past does not follow the accepted drafts"
            )
    return out


def flow_info(flow: int, evals: tuple[Eval, ...], start: FlowStart | None) -> FlowInfo:
    """One flow's sequence and prompt: the tokens its sequence held before the flow's first
    prefill position (`start`: a prompt cache the program reused or restored,
    featdiff.programs.memory), then prompt_from_evals'."""
    real = [e for e in evals if e.phase != Phase.WARMUP]
    seq = real[0].seq_ids[0] if real and real[0].seq_ids else 0
    prompt = prompt_from_evals(evals)
    if start is None:
        return FlowInfo(flow, seq, prompt)
    if not start.n_cached:
        return FlowInfo(flow, seq, prompt, unfollowed=start.unfollowed)
    return FlowInfo(flow, seq, start.target + prompt, start.n_cached, start.draft, start.unfollowed)
