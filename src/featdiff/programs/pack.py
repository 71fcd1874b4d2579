"""Pack a `capture --exec` spool (the preload's and the shim's lines, featdiff.programs.run_log)
into a dump v1, at the end of a run or later (`featdiff pack` of a run that died).

Consumes the spool at a prefix and the manifest's build entry (`save_build` keeps the one known
at launch beside the spool); splits the decodes per graph and sequence (featdiff.programs.sequences),
reads the greedy tokens of each flow's verifies from the spooled logits (through
`spool.read_record_array`, the one reader of a record's bytes), infers phases and rounds
(featdiff.programs.phases) and produces the dump and a `spool.Packed`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.outputs import raise_if_no_room
from featdiff.core.phases import Phase
from featdiff.dump.manifest import Manifest
from featdiff.dump.model_info import model_info
from featdiff.dump.records import Eval, FlowInfo, MemoryOp, Round
from featdiff.dump.sampling import Sampler
from featdiff.dump.writer import DumpWriter
from featdiff.llama import ggml_dequant, spool
from featdiff.programs.memory import follow_memory
from featdiff.programs.phases import (
    argmax_notes,
    derive_rounds,
    flow_evals,
    flow_info,
    flow_notes,
    memory_ops,
    next_decodes,
    one_token_steps,
    whole_calls,
    with_encoder_rows,
)
from featdiff.programs.preload import PRELOAD_VAR
from featdiff.programs.run_log import ExecLog, read_exec_log
from featdiff.programs.sampler import flow_samplers
from featdiff.programs.sequences import split_decodes, split_of

log = logging.getLogger(__name__)

BUILD_SUFFIX = ".build.json"  # the manifest's build entry as known at launch: `featdiff pack` of a dead run reads it
# the preload's owner note, the server log, the launch's build entry
SPOOL_SUFFIXES = spool.SPOOL_SUFFIXES + (".owner", ".server.log", BUILD_SUFFIX)
UNKNOWN_VERSION = "unknown"  # the build's commit when the program does not say (featdiff.programs.exec)


def greedy_tokens(log: ExecLog, data: Path, evals: tuple[Eval, ...]) -> dict[int, tuple[int, ...]]:
    """Argmax of the captured target `result_output` rows of each verify (of a verify computed as
    several graphs, its parts' rows in order, under its first eval: whole_calls)."""
    merged, parts = whole_calls(evals)
    verifies = set(next_decodes(merged))
    n_tokens = {e.eval: e.n_tokens for e in evals}
    out: dict[int, tuple[int, ...]] = {}
    with open(data, "rb") as f:
        for event in log.records:
            whole = parts.get(event.eval, event.eval)
            if whole in verifies and event.name == names.RESULT_OUTPUT and event.occurrence == 0:
                n = n_tokens.get(event.eval, 0)
                record = spool.record_from_event(event, Phase.VERIFY)  # only its dtype and shape are read
                logits, _ = spool.read_record_array(f, event, record)  # (n_tokens, n_vocab); 1 token: (n_vocab,)
                if logits is not None and n and logits.size % n == 0:
                    out[whole] = out.get(whole, ()) + tuple(int(t) for t in logits.reshape(n, -1).argmax(axis=1))
    return out


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
    # (flow, note): where the next decode starts against the target's argmax (phases.argmax_notes),
    # kept for the flows whose target chose greedily (pack_exec: the samplers say which)
    argmax_notes: tuple[tuple[int, str], ...] = ()
    seqs_per_decode: int = 1  # the most sequences one decode call of the run held (build.seqs_per_decode)


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
    placed = with_encoder_rows(log_)
    seqs = split_decodes(placed, {c.index: split_of(c) for c in log_.contexts})
    log_ = seqs.log
    evals = flow_evals(log_)
    rounds: list[Round] = []
    flows: list[FlowInfo] = []
    starts = {s.flow: s for s in follow_memory(log_, evals)}
    notes_of: dict[int, list[str]] = {}  # flow -> the notes about it
    argmax_of: dict[int, list[str]] = {}  # flow -> its notes against the target's argmax
    for e, note in zip(seqs.noted_evals, seqs.notes):
        notes_of.setdefault(evals[e].flow, []).append(note)
    for k in sorted({e.flow for e in evals}):
        own = tuple(e for e in evals if e.flow == k)
        merged, _ = whole_calls(own)
        greedy = greedy_tokens(log_, data, own)
        found = derive_rounds(merged, greedy)
        rounds += [replace(r, flow=k) for r in found]
        notes_of.setdefault(k, []).extend(flow_notes(merged, found, one_token_steps(log_)))
        argmax_of[k] = argmax_notes(merged, found, greedy)
        flows.append(flow_info(k, own, starts.get(k)))
    # a flow whose sequence was changed in a way featdiff does not follow (`unfollowed`: a context
    # shift, a state never seen saved) is named by compare as information: its own notes are moot
    notes = [n for f in flows if not f.unfollowed for n in notes_of.get(f.flow, [])]
    by_argmax = tuple((f.flow, n) for f in flows if not f.unfollowed for n in argmax_of.get(f.flow, []))
    return ExecFlow(
        log_,
        evals,
        tuple(rounds),
        flows[0].prompt_tokens if flows else (),
        memory_ops(log_, evals),
        tuple(notes),
        tuple(flows) if len(flows) > 1 else (),
        seqs_per_decode=seqs_per_decode(placed),
        argmax_notes=by_argmax,
    )


def seqs_per_decode(log_: ExecLog) -> int:
    """The most sequences one decode call held, before the split (an EAGLE3 encoder call counted
    by the rows it encodes): above 1, the run computed rows of several sequences in one batch."""
    return max((len(set(ev.seq_ids)) for ev in log_.evals), default=1) or 1


def pack_exec(prefix: Path, output: Path, build: dict[str, Any], log_path: Path | None = None) -> spool.Packed:
    """Write the dump of the spool at `prefix`; `build` adds to the manifest's build entry, and
    the program's output at `log_path` (llama-server's) says how each request sampled."""
    flow = read_flow(prefix)
    writer = DumpWriter(Path(output))
    written = spool.write_records(writer, flow.log.records, flow.evals, spool.spool_files(prefix)[1])
    samplers = _samplers(flow, build, log_path)
    sampled = {s.flow for s in samplers if not s.is_greedy}  # its verify accepts what it drew, not the argmax
    manifest = Manifest(
        source="llama.cpp",
        models=_models(flow),
        evals=flow.evals,
        records=(),
        build={"kind": "exec", "library": flow.log.library, "commit": UNKNOWN_VERSION, **_batched(flow), **build},
        rounds=flow.rounds,
        prompt_tokens=flow.prompt_tokens,
        memory_ops=flow.memory_ops,
        flow_notes=(*flow.notes, *(n for k, n in flow.argmax_notes if k not in sampled)),
        flows=flow.flows,
        samplers=samplers,
    )
    return spool.Packed.of(writer.close(manifest), written, flow.log.n_torn, flow.log.n_unreadable)


def _samplers(flow: ExecFlow, build: dict[str, Any], log_path: Path | None) -> tuple[Sampler, ...]:
    """How each flow chose its tokens: from the program's flags, or llama-server's log of its requests."""
    command = [str(a) for a in build.get("command", ())]
    if not command or not flow.evals:
        return ()
    seq_of_flow: dict[int, int] = {f.flow: f.seq_id for f in flow.flows}
    for e in flow.evals:
        seq_of_flow.setdefault(e.flow, min(e.seq_ids or (0,)))
    if not any(k in build for k in ("server", "server_traffic", "server_error")):
        return flow_samplers(command, seq_of_flow, None)
    if log_path is None or not log_path.is_file():
        return ()  # a server's requests say how they sampled, in its log: without it, not known
    return flow_samplers(command, seq_of_flow, log_path.read_text(errors="replace"))


def _batched(flow: ExecFlow) -> dict[str, int]:
    """`build.seqs_per_decode`, written only where a decode held several sequences (dumps stay as they were)."""
    return {"seqs_per_decode": flow.seqs_per_decode} if flow.seqs_per_decode > 1 else {}


def save_build(prefix: Path, build: dict[str, Any], output: Path) -> None:
    """Keep the build entry known at launch beside the spool, for `featdiff pack` of a run that
    dies; out of room, it is removed and the capture to `output` refused (NoRoomError)."""
    path = Path(f"{prefix}{BUILD_SUFFIX}")
    try:
        path.write_text(json.dumps(build, sort_keys=True))
    except OSError as e:
        path.unlink(missing_ok=True)
        raise_if_no_room(e, output, path)
        raise


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
    used = {ev.ctx for ev, e in zip(flow.log.evals, flow.evals) if e.phase != Phase.WARMUP}
    out: dict[str, Any] = {}
    for c in flow.log.contexts:
        if c.index in used and c.role not in out and c.model_path:
            out[c.role] = model_info(Path(c.model_path), ggml=ggml_dequant.load).to_json()
    return out


def remove_spool(prefix: Path) -> None:
    spool.remove_spool(prefix, SPOOL_SUFFIXES)
