"""Pack a shim spool (<prefix>.data + <prefix>.index) into a dump (format v1).

The index holds one JSON line per event: a `header` (models, build, prompt), an `eval`, a
`round`, or a `record` (written by the C shim after its data). Lines without a final newline
are the tail of a process that died mid-write; they and anything after them are ignored, so a
killed capture still packs into a readable dump of its complete records.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from featdiff.dump import DumpWriter, Eval, Manifest, Record, Round, record_key
from featdiff.errors import InputError
from featdiff.names import PHASE_WARMUP, ROLES
from featdiff.outputs import check_output

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpoolEvents:
    """The complete lines of a spool index, sorted by kind."""

    header: dict[str, Any]
    evals: tuple[Eval, ...]
    rounds: tuple[Round, ...]
    records: tuple[dict[str, Any], ...]
    n_torn: int  # incomplete trailing lines dropped


def read_index(index_path: Path) -> SpoolEvents:
    """Parse the complete lines of a spool index."""
    raw = index_path.read_bytes()
    complete, _, torn = raw.rpartition(b"\n")
    header: dict[str, Any] = {}
    evals, rounds, records = [], [], []
    for line in complete.split(b"\n") if complete else []:
        event = json.loads(line)
        kind = event.pop("kind")
        if kind == "header":
            header = event
        elif kind == "eval":
            evals.append(Eval.from_json(event))
        elif kind == "round":
            rounds.append(Round.from_json(event))
        elif kind == "record":
            records.append(event)
    return SpoolEvents(header, tuple(evals), tuple(rounds), tuple(records), int(bool(torn)))


def _n_dims(ne: list[int]) -> int:
    """ggml's dimension count: trailing 1s of ne dropped (an empty dimension, ne = 0, is kept)."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n


def dims_by_name(records: tuple[dict[str, Any], ...], n_tokens: dict[int, int]) -> dict[str, int]:
    """Dimension count of each name in multi-token evals: a one-token eval's token dimension is 1
    and would otherwise vanish, turning (1, n_embd) into (n_embd,)."""
    dims: dict[str, int] = {}
    for e in records:
        if n_tokens.get(int(e["eval"]), 0) > 1:
            dims[e["name"]] = max(dims.get(e["name"], 1), _n_dims(e["ne"]))
    return dims


def record_from_event(event: dict[str, Any], phase: str, n_dims: int | None = None) -> Record:
    """A dump record from a shim `record` line; numpy shape = reversed ggml ne[:n_dims]
    (default: ggml's own dimension count)."""
    ne = tuple(int(x) for x in event["ne"][:n_dims or _n_dims(event["ne"])])
    role = ROLES[int(event["role"])]
    return Record(
        key=record_key(int(event["eval"]), role, event["name"], int(event["occurrence"])),
        role=role, phase=phase, eval=int(event["eval"]), name=event["name"],
        occurrence=int(event["occurrence"]), op=event["op"], ggml_type=event["ggml_type"],
        ne=ne, srcs=tuple(event["srcs"]), dtype=event["dtype"], shape=tuple(reversed(ne)),
        nb=tuple(int(x) for x in event["nb"]),
    )


def write_records(writer: DumpWriter, records: tuple[dict[str, Any], ...], evals: tuple[Eval, ...],
                  data: Path) -> None:
    """Add every record whose data is complete in `data` to the dump being written."""
    phases = {e.eval: e.phase for e in evals}
    n_tokens = {e.eval: e.n_tokens for e in evals}
    dims = dims_by_name(records, n_tokens)
    with open(data, "rb") as f:
        for event in records:
            n = _n_dims(event["ne"])
            if n_tokens.get(int(event["eval"])) == 1:
                n = min(max(n, dims.get(event["name"], n + 1)), 4)  # keep the token dimension
            record = record_from_event(event, phases.get(int(event["eval"]), PHASE_WARMUP), n)
            f.seek(int(event["offset"]))
            buf = f.read(int(event["nbytes"]))
            if len(buf) != int(event["nbytes"]):
                break  # the data file ends early: this record and later ones are incomplete
            writer.add(record, np.frombuffer(buf, dtype=record.dtype).reshape(record.shape))


SPOOL_SUFFIXES = (".index", ".data")


def prefix_for(output: Path) -> Path:
    """Where a capture spools while it writes `output`: beside it, `<output>.spool.*`."""
    return output.with_name(output.name + ".spool")


def spool_files(prefix: Path) -> tuple[Path, Path]:
    """The index and data files of the spool at `prefix`."""
    return Path(f"{prefix}.index"), Path(f"{prefix}.data")


def remove_spool(prefix: Path, suffixes: tuple[str, ...] = SPOOL_SUFFIXES) -> None:
    for suffix in suffixes:
        Path(f"{prefix}{suffix}").unlink(missing_ok=True)


def pack(prefix: Path, output: Path) -> Path:
    """Write the dump of everything complete in the spool at `prefix`; return its path."""
    index, data = spool_files(prefix)
    if not index.is_file() or not data.is_file():
        raise InputError(f"{prefix}: no spool (.index/.data) here; was the capture started?")
    output = check_output(Path(output), (index, data), "-o")
    events = read_index(index)
    if events.n_torn:
        log.warning("%s: dropped an incomplete last line (the capture was interrupted)", index)
    writer = DumpWriter(output)
    write_records(writer, events.records, events.evals, data)
    manifest = Manifest(source="llama.cpp", models=events.header.get("models", {}),
                        build=events.header.get("build", {}), evals=events.evals, records=(),
                        rounds=events.rounds, prompt_tokens=tuple(events.header.get("prompt_tokens", ())))
    return writer.close(manifest)
