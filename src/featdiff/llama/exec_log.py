"""What the preload noted of a program's run (native/featdiff_preload.c): its contexts, its
decodes, its memory edits and the shim's records, read from a spool index into typed records
once, for `capture --exec` (llama/exec.py) to infer the flow from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featdiff import names
from featdiff.llama import spool

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
    origin: int = -1  # the call this is one graph and sequence of (featdiff.llama.sequences); -1: itself

    @property
    def call_id(self) -> int:
        """The program's call this decode was (or was part of)."""
        return self.origin if self.origin >= 0 else self.eval

    @property
    def is_embd(self) -> bool:
        return bool(self.token_ids) and all(t == TOKEN_NULL for t in self.token_ids)


@dataclass(frozen=True)
class ExecLog:
    """The complete lines of a preload spool index, by kind, in the order they happened."""

    library: str  # the program's libllama, as the dynamic linker found it ("" if never loaded)
    contexts: tuple[ExecContext, ...]
    evals: tuple[ExecEval, ...]
    clears: tuple[tuple[int, int], ...]  # (ctx, last eval number before the memory clear)
    records: tuple[dict[str, Any], ...]  # the shim's record lines
    n_torn: int
    seq_rms: tuple[dict[str, Any], ...] = ()  # the preload's exec_seq_rm lines: removals from a cache
    n_unreadable: int = 0  # complete lines that are no JSON event


def read_exec_log(index: Path) -> ExecLog:
    """Parse a preload spool index; lines are JSON, written by native/featdiff_preload.c."""
    lines = spool.read_index_lines(index)
    events = lines.events
    models = {e["model"]: e["path"] for e in events if e["kind"] == "exec_model"}
    done = {e["eval"]: int(e["rc"]) for e in events if e["kind"] == "exec_done"}
    start = next((e for e in events if e["kind"] == "exec_start"), {})
    return ExecLog(
        library=start.get("library", ""),
        contexts=tuple(
            ExecContext(
                e["ctx"],
                names.ROLES[e["role"]],
                e["arch"],
                models.get(e["model"]),
                e["ok"],
                e.get("n_ubatch"),
                e.get("n_seq_max"),
                e.get("kv_unified"),
            )
            for e in events
            if e["kind"] == "exec_context"
        ),
        evals=tuple(_exec_eval(e, done.get(e["eval"])) for e in events if e["kind"] == "exec_eval"),
        clears=tuple((e["ctx"], e["after_eval"]) for e in events if e["kind"] == "exec_clear"),
        records=tuple(e for e in events if e["kind"] == spool.RECORD),
        n_torn=lines.n_torn,
        seq_rms=tuple(e for e in events if e["kind"] == "exec_seq_rm"),
        n_unreadable=lines.n_unreadable,
    )


def _exec_eval(e: dict[str, Any], rc: int | None) -> ExecEval:
    return ExecEval(
        e["eval"],
        e["ctx"],
        tuple(e["token_ids"]),
        tuple(e["positions"]),
        tuple(e["seq_ids"]),
        tuple(e["outputs"]),
        rc,
        str(e.get("call", names.CALL_DECODE)),
    )
