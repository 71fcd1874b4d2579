"""What the preload noted of a program's run (native/featdiff_preload.c): its contexts, its
decodes, its memory edits and the shim's records, read from a spool index into typed records
once, for `capture --exec` to infer the phases and rounds from (featdiff.programs.phases).

Consumes a preload spool index (featdiff.llama.spool_index reads its lines); produces an `ExecLog`
of frozen records: nothing after it indexes a raw event. A line of a kind the preload writes that
lacks a field, or holds one of the wrong type, is an InputError naming the index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.llama import spool_index
from featdiff.llama.spool_index import RecordEvent, is_json_int

TOKEN_NULL = -1  # LLAMA_TOKEN_NULL: the batch entry is an embedding row


@dataclass(frozen=True)
class ExecContext:
    """A llama_context the program created (memory-fitting probes create throwaway ones)."""

    index: int
    role: names.Role
    arch: str
    model_path: str | None
    ok: bool
    n_ubatch: int | None = None  # rows llama.cpp computes in one graph (None: not noted)
    n_seq_max: int | None = None
    kv_unified: bool | None = None  # one KV stream for every sequence (None: not noted)
    n_rs_seq: int | None = None  # recurrent-state snapshots per sequence for rollback (None: not noted)


@dataclass(frozen=True)
class ExecEval:
    """One llama_process/llama_decode/llama_encode call as the program made it."""

    eval: int
    ctx: int
    token_ids: tuple[int, ...]  # TOKEN_NULL for an embedding row
    positions: tuple[int, ...]
    seq_ids: tuple[int, ...]
    outputs: tuple[int, ...]
    rc: int | None  # None: the program died during this decode
    call: str = names.CALL_DECODE  # "encode": llama_encode, or llama_process of LLAMA_PROCESS_TYPE_ENCODE
    origin: int = -1  # the call this is one graph and sequence of (featdiff.programs.sequences); -1: itself

    @property
    def call_id(self) -> int:
        """The program's call this decode was (or was part of)."""
        return self.origin if self.origin >= 0 else self.eval

    @property
    def is_embd(self) -> bool:
        return bool(self.token_ids) and all(t == TOKEN_NULL for t in self.token_ids)


@dataclass(frozen=True)
class ExecSeqRm:
    """A removal the program made from a context's cache (llama_memory_seq_rm), after an eval."""

    ctx: int
    after_eval: int  # the last eval before it (-1: before every eval)
    seq_id: int
    p0: int
    p1: int
    ok: bool = True  # what llama.cpp answered (False: it refused, nothing was removed)


MEMORY_OPS = ("seq_rm", "clear", "seq_cp", "seq_keep", "seq_add", "seq_div", "state_save", "state_restore")


@dataclass(frozen=True)
class ExecMemory:
    """A change the program made to what a context's sequences hold, in the order it was made:
    a removal (`seq_rm`), a `clear`, a copy, keep, shift or division of positions, a sequence's
    state saved or restored (the preload's exec_seq_rm, exec_clear and exec_memory lines)."""

    ctx: int
    after_eval: int  # the last eval before it (-1: before every eval)
    op: str  # one of MEMORY_OPS
    seq_id: int = -1  # the sequence (seq_cp: the source); -1: every sequence
    p0: int = -1
    p1: int = -1
    seq_dst: int = -1  # seq_cp's destination
    delta: int = 0  # seq_add's shift, seq_div's divisor
    flags: int = 0  # llama_state_seq_flags of a state op (1: a partial state, SWA or recurrent only)
    ok: bool = True  # what llama.cpp answered (a refused removal or restore changed nothing)
    state: str = ""  # a saved state's name: a hash of its bytes, or "file:<path>" for a state file


@dataclass(frozen=True)
class ExecLog:
    """The complete lines of a preload spool index, by kind, in the order they happened."""

    library: str  # the program's libllama, as the dynamic linker found it ("" if never loaded)
    contexts: tuple[ExecContext, ...]
    evals: tuple[ExecEval, ...]
    clears: tuple[tuple[int, int], ...]  # (ctx, last eval number before the memory clear)
    records: tuple[RecordEvent, ...]  # the shim's record lines
    n_torn: int
    seq_rms: tuple[ExecSeqRm, ...] = ()  # the preload's exec_seq_rm lines: removals from a cache
    n_unreadable: int = 0  # complete lines that are no JSON event
    memory: tuple[ExecMemory, ...] = ()  # every change to what a sequence holds, in order


_MISSING = object()


@dataclass(frozen=True)
class _Line:
    """One of the preload's lines, its fields read with their JSON type checked: a field that is
    missing or of another type is an InputError naming the spool index (the spool is damaged, or
    another featdiff wrote it), never a KeyError deep in the flow inference."""

    event: dict[str, Any]
    index: Path

    def _get(self, key: str, ok: Callable[[Any], bool], what: str, default: Any) -> Any:
        value = self.event.get(key, default)
        if value is _MISSING or not (ok(value) or (value is default and default is not _MISSING)):
            found = "missing" if key not in self.event else f"{self.event[key]!r}"
            raise InputError(
                f"{self.index}: an {self.event['kind']} line of the preload holds no {what} {key!r} ({found}); "
                "the spool is damaged or another featdiff version wrote it: run the capture again"
            )
        return value

    def integer(self, key: str, default: Any = _MISSING) -> Any:
        return self._get(key, is_json_int, "integer", default)

    def text(self, key: str, default: Any = _MISSING) -> Any:
        return self._get(key, lambda v: isinstance(v, str), "string", default)

    def flag(self, key: str, default: Any = _MISSING) -> Any:
        return self._get(key, lambda v: isinstance(v, bool), "true/false", default)

    def integers(self, key: str) -> tuple[int, ...]:
        return tuple(
            self._get(key, lambda v: isinstance(v, list) and all(map(is_json_int, v)), "integer list", _MISSING)
        )


def read_exec_log(index: Path) -> ExecLog:
    """Parse a preload spool index; lines are JSON, written by native/featdiff_preload.c. A line
    of a known kind without its fields is an InputError naming `index` (exit 2)."""
    lines = spool_index.read_index_lines(index)
    by_kind: dict[str, list[_Line]] = {}
    for e in lines.events:
        by_kind.setdefault(e["kind"], []).append(_Line(e, index))
    models = {e.integer("model"): e.text("path") for e in by_kind.get("exec_model", [])}
    done = {e.integer("eval"): e.integer("rc") for e in by_kind.get("exec_done", [])}
    start = by_kind.get("exec_start", [])
    return ExecLog(
        library=start[0].text("library", "") if start else "",
        contexts=tuple(_exec_context(e, models) for e in by_kind.get("exec_context", [])),
        evals=tuple(_exec_eval(e, done) for e in by_kind.get("exec_eval", [])),
        clears=tuple((e.integer("ctx"), e.integer("after_eval")) for e in by_kind.get("exec_clear", [])),
        records=lines.records,
        n_torn=lines.n_torn,
        seq_rms=tuple(
            ExecSeqRm(
                e.integer("ctx"),
                e.integer("after_eval"),
                e.integer("seq_id"),
                e.integer("p0"),
                e.integer("p1"),
                e.flag("ok", True),
            )
            for e in by_kind.get("exec_seq_rm", [])
        ),
        n_unreadable=lines.n_unreadable,
        memory=tuple(_exec_memory(_Line(e, index)) for e in lines.events if e["kind"] in _MEMORY_KINDS),
    )


_MEMORY_KINDS = ("exec_seq_rm", "exec_clear", "exec_memory")


def _exec_memory(e: _Line) -> ExecMemory:
    kind = e.event["kind"]
    if kind == "exec_clear":
        return ExecMemory(e.integer("ctx"), e.integer("after_eval"), "clear")
    op = "seq_rm" if kind == "exec_seq_rm" else e.text("op")
    if op not in MEMORY_OPS:
        raise InputError(
            f"{e.index}: an exec_memory line of the preload names op {op!r}, not one of {', '.join(MEMORY_OPS)}; "
            "the spool is damaged or another featdiff version wrote it: run the capture again"
        )
    file = e.text("file", "")
    return ExecMemory(
        e.integer("ctx"),
        e.integer("after_eval"),
        op,
        e.integer("seq_id"),
        e.integer("p0"),
        e.integer("p1"),
        e.integer("seq_dst", -1),
        e.integer("delta", 0),
        e.integer("flags", 0),
        e.flag("ok", True),
        f"file:{file}" if file else e.text("state", ""),
    )


def _exec_context(e: _Line, models: dict[int, str]) -> ExecContext:
    role = e.integer("role")
    if not 0 <= role < len(names.ROLES):
        raise InputError(
            f"{e.index}: an exec_context line of the preload names role {role}, not one of "
            f"0..{len(names.ROLES) - 1}; the spool is damaged or another featdiff version wrote it: run the capture again"
        )
    return ExecContext(
        e.integer("ctx"),
        names.ROLES[role],
        e.text("arch"),
        models.get(e.integer("model")),
        e.flag("ok"),
        e.integer("n_ubatch", None),
        e.integer("n_seq_max", None),
        e.flag("kv_unified", None),
        e.integer("n_rs_seq", None),
    )


def _exec_eval(e: _Line, done: dict[int, int]) -> ExecEval:
    eval_ = e.integer("eval")
    return ExecEval(
        eval_,
        e.integer("ctx"),
        e.integers("token_ids"),
        e.integers("positions"),
        e.integers("seq_ids"),
        e.integers("outputs"),
        done.get(eval_),
        e.text("call", names.CALL_DECODE),
    )
