"""The lines of a spool index (<prefix>.index), read once: either kind of spool, in-process
(featdiff.llama.spool) or the preload's (featdiff.programs.run_log).

Consumes the index's bytes; produces its complete lines as JSON events by `kind`, and the shim's
`record` lines (native/featdiff_shim.c: one tensor's bytes in <prefix>.data) checked into typed
`RecordEvent`s. A line without a final newline is the tail of a process that died mid-write
(torn); a complete line that is no JSON event, or a record line missing a field or holding one of
the wrong type, is unreadable: both are dropped and counted, never raised, so a killed capture
still packs its complete records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featdiff.core.names import ROLES, Role

RECORD = "record"
RECORD_FIELDS = (
    "eval",
    "role",
    "name",
    "occurrence",
    "op",
    "ggml_type",
    "ne",
    "nb",
    "srcs",
    "dtype",
    "offset",
    "nbytes",
)  # what a shim `record` line holds (featdiff_shim.c)


@dataclass(frozen=True)
class RecordEvent:
    """A shim `record` line: which tensor of which eval, how ggml laid it out, and where its bytes
    are in <prefix>.data (`offset`, `nbytes`)."""

    eval: int
    role: Role
    name: str
    occurrence: int  # the how-many-th tensor of this name in the eval (and graph)
    op: str
    ggml_type: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the fastest-moving dimension
    nb: tuple[int, ...]
    srcs: tuple[str, ...]
    dtype: str  # numpy dtype of the stored bytes
    offset: int
    nbytes: int
    ubatch: int = 0  # the graph within the eval (absent in spools written before it: 0)
    backend: str | None = None  # the ggml device whose memory held the data (absent before issue 31)


def is_json_int(x: Any) -> bool:
    """A JSON integer as json.loads gives it (true/false are no integers here)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _ints(x: Any) -> bool:
    return isinstance(x, list) and all(is_json_int(v) for v in x)


def record_event(event: dict[str, Any]) -> RecordEvent | None:
    """A `record` line as a RecordEvent, or None when a field is missing or of the wrong type."""
    if not all(k in event for k in RECORD_FIELDS):
        return None
    ints = (event["eval"], event["role"], event["occurrence"], event["offset"], event["nbytes"])
    strs = (event["name"], event["op"], event["ggml_type"], event["dtype"])
    ubatch = event.get("ubatch", 0)
    backend = event.get("backend")
    if not (
        all(is_json_int(v) for v in ints)
        and is_json_int(ubatch)
        and all(isinstance(v, str) for v in strs)
        and _ints(event["ne"])
        and event["ne"]
        and _ints(event["nb"])
        and isinstance(event["srcs"], list)
        and all(isinstance(s, str) for s in event["srcs"])
        and 0 <= event["role"] < len(ROLES)
        and (backend is None or isinstance(backend, str))
    ):
        return None
    return RecordEvent(
        eval=event["eval"],
        role=ROLES[event["role"]],
        name=event["name"],
        occurrence=event["occurrence"],
        op=event["op"],
        ggml_type=event["ggml_type"],
        ne=tuple(event["ne"]),
        nb=tuple(event["nb"]),
        srcs=tuple(event["srcs"]),
        dtype=event["dtype"],
        offset=event["offset"],
        nbytes=event["nbytes"],
        ubatch=ubatch,
        backend=backend,
    )


def n_dims(ne: tuple[int, ...]) -> int:
    """ggml's dimension count: trailing 1s of ne dropped (an empty dimension, ne = 0, is kept)."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n


@dataclass(frozen=True)
class IndexLines:
    """The complete, readable lines of a spool index, and how many were not."""

    events: tuple[dict[str, Any], ...]  # every line but the records, in order, each with its `kind`
    records: tuple[RecordEvent, ...]  # the shim's record lines, in order
    n_torn: int  # an incomplete last line
    n_unreadable: int  # complete lines that are no JSON event (or a record without its fields)
    first_kind: str | None = None  # the kind of the first readable line (None: there is none)


def read_index_lines(index_path: Path) -> IndexLines:
    """Parse the complete lines of a spool index (either kind: in-process or the preload's)."""
    complete, _, torn = index_path.read_bytes().rpartition(b"\n")
    events: list[dict[str, Any]] = []
    records: list[RecordEvent] = []
    bad = 0
    first: str | None = None
    for line in complete.split(b"\n") if complete else []:
        event = _event(line)
        record = record_event(event) if event is not None and event["kind"] == RECORD else None
        if event is None or (event["kind"] == RECORD and record is None):
            bad += 1
            continue
        first = first or event["kind"]
        if record is not None:
            records.append(record)
        else:
            events.append(event)
    return IndexLines(tuple(events), tuple(records), int(bool(torn)), bad, first)


def _event(line: bytes) -> dict[str, Any] | None:
    """One index line as an event, or None when it is not one."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict) or not isinstance(event.get("kind"), str):
        return None
    return event
