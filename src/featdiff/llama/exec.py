"""Capture around an unmodified llama.cpp program (`featdiff capture --exec -- <command>`).

Consumes a command line; runs it with the preload library (native/featdiff_preload.c, loaded by
LD_PRELOAD / DYLD_INSERT_LIBRARIES), which chains the shim's callback into every context and
notes each decode; produces a dump v1 whose phases and rounds are derived from those notes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from featdiff import names
from featdiff.blocks import accepted_length
from featdiff.dump import DumpWriter, Eval, FlowInfo, Manifest, MemoryOp, Round
from featdiff.errors import InputError, Interrupted
from featdiff.filters import capture_filters
from featdiff.gguf_meta import model_info
from featdiff.llama import server, spool
from featdiff.llama.exec_log import ExecEval, ExecLog, read_exec_log
from featdiff.llama.options import options_of_command
from featdiff.llama.preload import PRELOAD_VAR, Preload, build_of_program, preload
from featdiff.llama.sequences import split_decodes, split_of
from featdiff.outputs import check_output, existing_file, failed_output, output_lock

log = logging.getLogger(__name__)

BUILD_SUFFIX = ".build.json"  # the manifest's build entry as known at launch: `featdiff pack` of a dead run reads it
# the preload's owner note, the server log, the launch's build entry
SPOOL_SUFFIXES = spool.SPOOL_SUFFIXES + (".owner", ".server.log", BUILD_SUFFIX)
POS_UNSET = -1  # the preload's position of an entry the program left unplaced (a NULL pos array)
WARMUP = names.PHASE_WARMUP
# Upstream programs print their llama.cpp version for --version and exit (common/arg.cpp).
UPSTREAM_PREFIX = "llama-"
VERSION_FLAG = "--version"
VERSION_TIMEOUT_S = 10
UNKNOWN_VERSION = "unknown"


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


# ---------------------------------------------------------------- phases and rounds


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


def flow_evals(log: ExecLog) -> tuple[Eval, ...]:
    """Each eval with its phase (docs/flow.md) and round.

    Drafter: an embd batch is `inject` (on the older generation two evals: the encoder's, which
    takes the positions of the decode after it, and that decode), a token batch is `draft` and
    opens a round. Target: a
    token batch after a draft is its `verify`; once a sequence has drafted, a target decode
    without a new draft is a `verify` of no drafts in a round of its own (llama-server does this
    when the length budget leaves no room to draft); before that it is `prefill`. Warm-up and
    probe decodes are kept, as phase `warmup`.
    """
    roles: dict[int, names.Role] = {c.index: c.role for c in log.contexts}
    warm = warmup_evals(log)
    encoded = _encoded_positions(log.evals)
    walks: dict[int, _Walk] = {}  # per sequence (a decode of several, kept whole: -1)
    last_part: dict[int, tuple[int, str, int]] = {}  # per sequence: (call, role, seq) of its last decode
    calls: list[tuple[int, int]] = []  # (call, sequence) of each eval
    flow_of: dict[tuple[int, int], int] = {}  # (sequence, request) -> flow, in order of appearance
    out: list[Eval] = []
    for ev in log.evals:
        ev = replace(ev, positions=encoded.get(ev.eval, ev.positions))
        role: names.Role = roles.get(ev.ctx, "target")
        seq = ev.seq_ids[0] if len(set(ev.seq_ids)) == 1 else -1
        walk = walks.get(seq, _Walk())
        if ev.eval in warm:
            phase = WARMUP
        elif out and (ev.call_id, role, seq) == last_part.get(seq):  # another graph of the same call
            phase = _phase_of(out, seq)
        else:
            phase, walk = _step(walk, role, ev)
        walks[seq] = walk
        last_part[seq] = (ev.call_id, role, seq)
        flow = 0 if phase == WARMUP else flow_of.setdefault((seq, walk.request), len(flow_of))
        out.append(
            Eval(
                eval=ev.eval,
                role=role,
                phase=phase,
                n_tokens=len(ev.positions),
                positions=ev.positions,
                token_ids=() if ev.is_embd else ev.token_ids,
                seq_ids=ev.seq_ids,
                round=0 if phase == WARMUP else walk.round,
                rc=0 if phase == WARMUP else int(ev.rc or 0),
                call=names.CALL_ENCODE if ev.call == names.CALL_ENCODE else names.CALL_DECODE,
                flow=flow,
            )
        )
        calls.append((ev.call_id, seq))
    return _numbered_parts(out, calls)


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


def _phase_of(out: list[Eval], seq: int) -> names.Phase:
    """The phase the sequence's last decode had (a later graph of the same call shares it)."""
    return next(e.phase for e in reversed(out) if (e.seq_ids[0] if len(set(e.seq_ids)) == 1 else -1) == seq)


def _step(walk: _Walk, role: names.Role, ev: ExecEval) -> tuple[names.Phase, _Walk]:
    """The phase of one real eval of a sequence, and the walk after it. Once a sequence has
    drafted, a target decode with no draft before it starts the sequence's next request when it
    is no verify of no drafts (one token, the anchor, past the last decode's first position): a
    new prompt from position 0, or from a prefix the program kept cached (docs/flow.md)."""
    if role == "draft":
        if ev.is_embd:
            return "inject", walk
        return "draft", replace(walk, round=walk.round + 1, drafted=True, speculating=True)
    pos0 = ev.positions[0] if ev.positions else walk.last_pos0 + 1
    if walk.drafted:
        return "verify", replace(walk, drafted=False, last_pos0=pos0)
    if walk.speculating and len(ev.positions) == 1 and pos0 > walk.last_pos0:
        return "verify", replace(walk, round=walk.round + 1, last_pos0=pos0)
    if walk.speculating:  # a new request of this sequence: its rounds count afresh
        return "prefill", _Walk(request=walk.request + 1, last_pos0=pos0)
    return "prefill", replace(walk, last_pos0=pos0)


def prompt_from_evals(evals: tuple[Eval, ...]) -> tuple[int, ...]:
    """The prompt as docs/flow.md counts it: the target tokens decoded before the first draft,
    plus that draft's anchor (the token the program sampled, or kept back, to start from)."""
    first_draft = next((e for e in evals if e.phase == "draft"), None)
    stop = first_draft.eval if first_draft else len(evals)
    by_pos = {p: t for e in evals if e.phase == "prefill" and e.eval < stop for p, t in zip(e.positions, e.token_ids)}
    anchor = first_draft.token_ids[:1] if first_draft else ()
    return tuple(by_pos[p] for p in sorted(by_pos)) + tuple(anchor)


def next_decodes(evals: tuple[Eval, ...]) -> dict[int, Eval | None]:
    """For each verify, the target decode that continues its sequence (None: nothing did).

    A continuation starts inside the verified block: at pos0 + accepted + 1 (llama.cpp keeps the
    accepted drafts and the target's next token becomes the anchor).
    """
    targets = [e for e in evals if e.role == "target" and e.phase in ("prefill", "verify") and e.positions]
    out: dict[int, Eval | None] = {}
    for i, v in enumerate(targets):
        if v.phase != "verify":
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


def greedy_tokens(log: ExecLog, data: Path, evals: tuple[Eval, ...]) -> dict[int, tuple[int, ...]]:
    """Argmax of the captured target `result_output` rows of each verify (of a verify computed as
    several graphs, its parts' rows in order, under its first eval: whole_calls)."""
    merged, parts = whole_calls(evals)
    verifies = set(next_decodes(merged))
    n_tokens = {e.eval: e.n_tokens for e in evals}
    out: dict[int, tuple[int, ...]] = {}
    for event in log.records:
        whole = parts.get(int(event["eval"]), int(event["eval"]))
        if whole in verifies and event["name"] == names.RESULT_OUTPUT and event["occurrence"] == 0:
            n = n_tokens.get(int(event["eval"]), 0)
            logits = _record_array(event, data)  # (n_tokens, n_vocab); a 1-token eval is stored (n_vocab,)
            if n and logits.size % n == 0:
                out[whole] = out.get(whole, ()) + tuple(int(t) for t in logits.reshape(n, -1).argmax(axis=1))
    return out


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


def _record_array(event: dict[str, Any], data: Path) -> np.ndarray:
    record = spool.record_from_event(event, "verify")
    with open(data, "rb") as f:
        f.seek(int(event["offset"]))
        return np.frombuffer(f.read(int(event["nbytes"])), dtype=record.dtype).reshape(record.shape)


def memory_ops(log: ExecLog, evals: tuple[Eval, ...]) -> tuple[MemoryOp, ...]:
    """The removals the program made from the caches of its flow's contexts, in order: a
    memory clear is a removal of everything (seq -1, p0 -1, p1 -1). Ops on contexts that ran only
    warm-up decodes, and ops before the first real eval (warm-up, probes), are left out."""
    roles: dict[int, names.Role] = {c.index: c.role for c in log.contexts}
    real = [e.eval for e in evals if e.phase != WARMUP]
    real_set = set(real)
    used = {ev.ctx for ev in log.evals if ev.eval in real_set}
    first = real[0] if real else 0
    ops = [
        (e["after_eval"], MemoryOp(roles.get(e["ctx"], "target"), e["after_eval"], e["seq_id"], e["p0"], e["p1"]))
        for e in log.seq_rms
        if e["ctx"] in used and e.get("ok", True)
    ]
    ops += [
        (after, MemoryOp(roles.get(ctx, "target"), after, -1, -1, -1, "clear"))
        for ctx, after in log.clears
        if ctx in used
    ]
    return tuple(op for after, op in sorted(ops, key=lambda x: x[0]) if after >= first)


def flow_notes(
    evals: tuple[Eval, ...], rounds: tuple[Round, ...], greedy: dict[int, tuple[int, ...]]
) -> tuple[str, ...]:
    """Where the phases and rounds above rest on a convention the run broke: one sentence each.

    docs/flow.md: a round's verify starts where its draft block starts, and the next target
    decode starts inside the verified block at pos0 + accepted + 1, where `accepted` is what the
    target's greedy tokens (`greedy`: verify eval -> argmax rows) took of the drafts."""
    real = tuple(e for e in evals if e.phase != WARMUP)
    n_drafts = sum(e.phase == "draft" for e in real)
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
        *_misplaced_block_notes(real),
        *_continuation_notes(evals, real, rounds, greedy),
    )


def _refused_notes(real: tuple[Eval, ...]) -> list[str]:
    """A decode llama.cpp refused, in the flow."""
    out = []
    for e in (e for e in real if e.rc):
        span = f"positions {e.positions[0]}..{e.positions[-1]}" if e.positions else "no rows"
        out.append(
            f"eval {e.eval} ({e.role} {e.phase}, round {e.round}, {span}) failed with rc {e.rc}: "
            "llama.cpp refused the batch the program built (see the program's log)"
        )
    return out


def _misplaced_block_notes(real: tuple[Eval, ...]) -> list[str]:
    """A draft block whose verify starts elsewhere: the round was paired on a broken convention."""
    drafts = {e.round: e for e in real if e.phase == "draft" and not e.rc}
    out = []
    for v in (e for e in real if e.phase == "verify" and e.round in drafts and e.positions):
        d = drafts[v.round]
        if d.positions and d.positions[0] != v.positions[0]:
            out.append(
                f"the draft block of round {v.round} starts at position {d.positions[0]}, its verify at "
                f"{v.positions[0]}: the rounds were inferred from a run whose draft block is misplaced"
            )
    return out


def _continuation_notes(
    evals: tuple[Eval, ...], real: tuple[Eval, ...], rounds: tuple[Round, ...], greedy: dict[int, tuple[int, ...]]
) -> list[str]:
    """A next target decode that does not start at pos0 + accepted + 1 of the verify before it."""
    by_round = {r.round: r for r in rounds}
    by_eval = {e.eval: e for e in evals}
    targets = [e for e in real if e.role == "target" and e.positions]
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
        later = next((e for e in targets if e.eval > v), None)
        if nxt is None and later is not None and later.phase == "verify":  # a prefill starts a new prompt
            out.append(
                f"the target decode after the verify of round {ev.round} (eval {later.eval}) starts at "
                f"position {later.positions[0]}, outside the verified block {ev.positions[0]}.."
                f"{ev.positions[-1]}: the run's n_past does not follow the accepted drafts"
            )
    return out


# ---------------------------------------------------------------- packing


@dataclass(frozen=True)
class ExecFlow:
    """Everything a dump says about the program's run, short of the arrays."""

    log: ExecLog
    evals: tuple[Eval, ...]
    rounds: tuple[Round, ...]
    prompt_tokens: tuple[int, ...]
    memory_ops: tuple[MemoryOp, ...] = ()
    notes: tuple[str, ...] = ()
    flows: tuple[FlowInfo, ...] = ()  # a run of several flows (requests, sequences); () for one


def read_flow(prefix: Path) -> ExecFlow:
    """The spool at `prefix` as a flow: phases, rounds, prompt tokens."""
    index, data = spool.spool_files(prefix)
    if not index.is_file() or not data.is_file():
        raise InputError(
            f"{index}: the program never loaded the preload library; is it dynamically linked "
            f"against libllama (BUILD_SHARED_LIBS=ON), and not setuid? ({PRELOAD_VAR} is ignored otherwise)"
        )
    log_ = read_exec_log(index)
    if not log_.library:
        raise InputError(
            f"{index}: the preload library loaded but saw no llama.cpp call; is the program built "
            "with shared libllama (BUILD_SHARED_LIBS=ON)?"
        )
    seqs = split_decodes(log_, {c.index: split_of(c) for c in log_.contexts})
    log_ = seqs.log
    evals = flow_evals(log_)
    rounds: list[Round] = []
    notes: list[str] = list(seqs.notes)
    flows: list[FlowInfo] = []
    history: dict[int, dict[int, int]] = {}  # sequence -> position -> the token last decoded there
    for k in sorted({e.flow for e in evals}):
        own = tuple(e for e in evals if e.flow == k)
        merged, _ = whole_calls(own)
        greedy = greedy_tokens(log_, data, own)
        found = derive_rounds(merged, greedy)
        rounds += [replace(r, flow=k) for r in found]
        notes += flow_notes(merged, found, greedy)
        flows.append(flow_info(k, own, history))
    return ExecFlow(
        log_,
        evals,
        tuple(rounds),
        flows[0].prompt_tokens if flows else (),
        memory_ops(log_, evals),
        tuple(notes),
        tuple(flows) if len(flows) > 1 else (),
    )


def flow_info(flow: int, evals: tuple[Eval, ...], history: dict[int, dict[int, int]]) -> FlowInfo:
    """One flow's sequence and prompt: the tokens its sequence already held before the flow's
    first prefill position (a prompt cache the program reused), then prompt_from_evals'. Records
    the flow's target tokens into `history` for the flows after it."""
    real = [e for e in evals if e.phase != WARMUP]
    seq = real[0].seq_ids[0] if real and real[0].seq_ids else 0
    held = history.setdefault(seq, {})
    prefill = [p for e in real if e.phase == "prefill" for p in e.positions]
    n_cached = min(prefill) if prefill else 0
    cached = tuple(held.get(p, -1) for p in range(n_cached))
    for e in real:
        if e.role == "target" and e.token_ids:
            held.update(zip(e.positions, e.token_ids))
    return FlowInfo(flow, seq, cached + prompt_from_evals(evals), n_cached)


def pack_exec(prefix: Path, output: Path, build: dict[str, Any]) -> spool.Packed:
    """Write the dump of the spool at `prefix`; `build` adds to the manifest's build entry."""
    flow = read_flow(prefix)
    writer = DumpWriter(Path(output))
    written = spool.write_records(writer, flow.log.records, flow.evals, spool.spool_files(prefix)[1])
    manifest = Manifest(
        source="llama.cpp",
        models=_models(flow),
        evals=flow.evals,
        records=(),
        build={"kind": "exec", "library": flow.log.library, "commit": UNKNOWN_VERSION, **build},
        rounds=flow.rounds,
        prompt_tokens=flow.prompt_tokens,
        memory_ops=flow.memory_ops,
        flow_notes=flow.notes,
        flows=flow.flows,
    )
    return spool.Packed.of(writer.close(manifest), written, flow.log.n_torn, flow.log.n_unreadable)


def save_build(prefix: Path, build: dict[str, Any]) -> None:
    """Keep the build entry known at launch beside the spool, for `featdiff pack` of a run that dies."""
    Path(f"{prefix}{BUILD_SUFFIX}").write_text(json.dumps(build, sort_keys=True))


def saved_build(prefix: Path) -> dict[str, Any]:
    """The build entry `save_build` kept for the spool at `prefix` ({} when there is none, or it is cut off)."""
    path = Path(f"{prefix}{BUILD_SUFFIX}")
    try:
        found = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        log.warning("%s: not readable JSON; packing without the command line and filters it held", path)
        return {}
    return found if isinstance(found, dict) else {}


def _models(flow: ExecFlow) -> dict[str, Any]:
    """The model of the context each role ran its real (non-warm-up) evals on."""
    used = {ev.ctx for ev, e in zip(flow.log.evals, flow.evals) if e.phase != WARMUP}
    out: dict[str, Any] = {}
    for c in flow.log.contexts:
        if c.index in used and c.role not in out and c.model_path:
            out[c.role] = model_info(Path(c.model_path)).to_json()
    return out


def remove_spool(prefix: Path) -> None:
    spool.remove_spool(prefix, SPOOL_SUFFIXES)


# ---------------------------------------------------------------- running a program


def program_path(command: list[str]) -> Path:
    """The program of `command`, checked to exist."""
    if not command:
        raise InputError(
            "capture --exec needs a command after `--`, e.g. -- llama-speculative-simple -m T.gguf -md D.gguf ..."
        )
    found = shutil.which(command[0])
    if found is None:
        raise InputError(f"{command[0]}: no such program (not a file, not on PATH); give its path after `--`")
    return Path(found)


def command_files(command: list[str]) -> tuple[Path, ...]:
    """The existing files a command line names, as `-m T.gguf` or `--model=T.gguf`: its inputs."""
    named = [a for arg in command for a in (arg, arg.partition("=")[2]) if a]
    return tuple(f for f in map(existing_file, named) if f is not None)


def run_program(command: list[str], pre: Preload, timeout_s: float | None) -> int:
    """Run `command` with the preload, its stdin/stdout/stderr the caller's own; return its exit
    code. Stopped (server.stop_process) if featdiff is interrupted or it overruns `timeout_s`."""
    proc = subprocess.Popen(command, env=pre.environ())
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise InputError(f"{command[0]}: still running after {timeout_s:.0f} s; stopped it") from None
    finally:
        server.stop_process(proc)


def program_version(program: Path) -> str:
    """The llama.cpp version an upstream program (`llama-*`, common/arg.cpp) reports for
    `--version` ("version: 0.5.0-dev (build 0, commit unknown)"), else "unknown"."""
    if not program.name.startswith(UPSTREAM_PREFIX):
        return UNKNOWN_VERSION
    try:
        done = subprocess.run(
            [str(program), VERSION_FLAG],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=VERSION_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN_VERSION
    found = re.search(r"^version: (.+)$", done.stdout + done.stderr, re.MULTILINE)
    return found.group(1).strip() if found else UNKNOWN_VERSION


def capture_exec(
    command: list[str],
    output: Path,
    filters: list[str] | None = None,
    llama_dir: Path | None = None,
    *,
    prompt: str | None = None,
    tokens: str | None = None,
    timeout_s: float | None = None,
    n_requests: int | None = None,
) -> Path:
    """Run `command` under the preload and write its dump; llama-server is started, asked one
    greedy completion (`prompt`/`tokens`) and stopped, or without them records the user's own
    requests until featdiff is stopped or `n_requests` have completed (featdiff.llama.server). A
    program that fails or is interrupted leaves its dump at `failed_output(output)`, never over a
    dump at -o."""
    program = program_path(command)
    server.check_traffic(command, n_requests, prompt is not None or tokens is not None, os.environ)
    output = check_output(Path(output), (program, *command_files(command)), "-o")
    kept = capture_filters(filters)
    with output_lock(output):
        prefix = spool.prefix_for(output)
        spool.set_aside(prefix, output)
        build: dict[str, Any] = {
            "command": list(command),
            "program": str(program),
            "filters": kept.to_json(),
            **options_of_command(command, os.environ).build_json(),
            "commit": program_version(program),
        }
        pre = preload(prefix, kept, build_of_program(program, llama_dir))
        save_build(prefix, build)
        try:
            build |= _launch(command, pre, prefix, prompt, tokens, timeout_s, n_requests)
        except KeyboardInterrupt as stop:
            raise _pack_interrupted(stop, prefix, output, build) from None
        packed = _pack_run(command, prefix, output, build)
    if filters:
        spool.warn_unmatched_filters(kept, packed)
    rc = int(build.get("exit_code", 0))
    if rc != 0:
        failed = build.get("server_error") or f"{command[0]}: exited with code {rc} under capture"
        raise InputError(
            f"{failed}; {packed.path} holds what it decoded before that (compare it against the "
            "reference to see why); run the command without featdiff to see whether it fails alone"
        )
    return packed.path


def _pack_run(command: list[str], prefix: Path, output: Path, build: dict[str, Any]) -> spool.Packed:
    """Pack the spool of a run that ended (to -o, or beside it if the program failed) and remove it."""
    rc = int(build.get("exit_code", 0))
    try:
        packed = pack_exec(prefix, failed_output(output) if rc != 0 else output, build)
    except InputError:
        remove_spool(prefix)  # the program never reached llama.cpp: the spool holds nothing
        if rc != 0:  # it failed before any llama.cpp call: its own exit is the news
            raise InputError(
                f"{command[0]}: exited with code {rc} before decoding anything; run it without featdiff to see why"
            ) from None
        raise
    remove_spool(prefix)
    spool.warn_dropped(packed)
    return packed


def _pack_interrupted(stop: KeyboardInterrupt, prefix: Path, output: Path, build: dict[str, Any]) -> Interrupted:
    """featdiff was interrupted while the program ran (it has been stopped): pack what it decoded
    beside a dump at -o (or to -o if there is none) and say where."""
    try:
        packed = pack_exec(prefix, failed_output(output), build)
    except InputError:
        remove_spool(prefix)
        return Interrupted.of(stop, "the program was stopped before it decoded anything; no dump written")
    remove_spool(prefix)
    return Interrupted.of(stop, f"stopped the program; {packed.summary()}")


def _launch(
    command: list[str],
    pre: Preload,
    prefix: Path,
    prompt: str | None,
    tokens: str | None,
    timeout_s: float | None,
    n_requests: int | None = None,
) -> dict[str, Any]:
    """Run the program (or serve one request, or the user's traffic); return what the manifest's
    build records of it."""
    if server.is_server(command) and prompt is None and tokens is None:
        traffic = server.record_traffic(command, pre, prefix, n_requests)
        return {"server_traffic": traffic.to_json(), "exit_code": traffic.exit_code}
    if server.is_server(command):
        request = server.request_from(prompt, tokens)
        try:
            result = server.serve_one(command, pre, request, prefix)
        except server.RequestFailed as e:  # it decoded, then failed: the dump still tells what it did
            return {"server_error": str(e), "exit_code": 1}
        return {"server": result.to_json()}
    return {"exit_code": run_program(command, pre, timeout_s)}
