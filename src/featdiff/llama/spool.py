"""Pack a shim spool (<prefix>.data + <prefix>.index) into a dump (format v1).

The index holds one JSON line per event: a `header` (models, build, prompt), an `eval`, a
`round`, or a `record` (written by the C shim after its data; featdiff.llama.spool_index reads the
lines). A line without a final newline is the tail of a process that died mid-write, and a record
whose bytes are not all in the data file cannot be read back: both are dropped and counted, every
other record is kept, so a killed capture still packs into a readable dump of its complete records
(`Packed` says what was dropped). `read_record_array` is the one reader of a record's bytes.

The spool sits beside the dump it becomes (`prefix_for`); a spool found there when a capture
starts is an earlier capture's that died before packing, and is moved aside, never overwritten.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from featdiff.core.errors import InputError
from featdiff.core.filters import FilterSet, RoleFilter
from featdiff.core.names import API_OP, ROLES, Role
from featdiff.core.outputs import check_output
from featdiff.core.phases import Phase
from featdiff.dump.manifest import Manifest
from featdiff.dump.records import Eval, Record, Round, record_key
from featdiff.dump.writer import DumpWriter
from featdiff.llama.spool_index import RecordEvent, n_dims, read_index_lines
from featdiff.llama.ubatch import split_ubatches

log = logging.getLogger(__name__)

HEADER = "header"  # the first line of an in-process spool (capture.py); the preload's lines are others
# why a pack dropped something, as its summary says it
DROP_DATA_SHORT = "data file ends early"  # a record whose bytes are not all in <prefix>.data
DROP_MISSIZED = "byte count does not match the shape"
DROP_TORN = "torn index line"  # the last line, cut off: the process died mid-write
DROP_UNREADABLE = "unreadable index line"
ASIDE_STAMP = "%Y%m%dT%H%M%SZ"  # UTC: `<output>.spool-20250101T120000Z.*`
RECOVERED_TAG = ".recovered-"  # the dump the set-aside message suggests: `<stem>.recovered-<stamp><suffix>`


def first_kind(index_path: Path) -> str | None:
    """The kind of the first readable line of a spool index (None: it holds none): `header` for
    an in-process spool, one of the preload's kinds for a `capture --exec` spool."""
    return read_index_lines(index_path).first_kind


@dataclass(frozen=True)
class SpoolEvents:
    """The complete lines of an in-process spool index, sorted by kind."""

    header: dict[str, Any]
    evals: tuple[Eval, ...]
    rounds: tuple[Round, ...]
    records: tuple[RecordEvent, ...]
    n_torn: int  # incomplete trailing lines dropped
    n_unreadable: int = 0  # complete lines dropped: no JSON event


def read_index(index_path: Path) -> SpoolEvents:
    """Parse the complete lines of an in-process spool index."""
    lines = read_index_lines(index_path)
    header: dict[str, Any] = {}
    evals, rounds = [], []
    for event in (dict(e) for e in lines.events):
        kind = event.pop("kind")
        if kind == HEADER:
            header = event
        elif kind == "eval":
            evals.append(Eval.from_json(event))
        elif kind == "round":
            rounds.append(Round.from_json(event))
    return SpoolEvents(header, tuple(evals), tuple(rounds), lines.records, lines.n_torn, lines.n_unreadable)


def dims_by_name(records: tuple[RecordEvent, ...], n_tokens: dict[int, int]) -> dict[str, int]:
    """Dimension count of each name in multi-token evals: a one-token eval's token dimension is 1
    and would otherwise vanish, turning (1, n_embd) into (n_embd,). API read-backs (their rows are
    output rows, not tokens) keep two dimensions on their own. A one-dimensional record of a
    multi-token eval that is not one value per token says nothing: it is that eval's one output row,
    its row dimension vanished too (a program's warm-up decode of two tokens, one an output)."""
    dims: dict[str, int] = {}
    for e in records:
        n = n_tokens.get(e.eval, 0)
        if n > 1 and e.op != API_OP and not (n_dims(e.ne) == 1 and e.ne[0] != n):
            dims[e.name] = max(dims.get(e.name, 1), n_dims(e.ne))
    return dims


def record_from_event(event: RecordEvent, phase: Phase, dims: int | None = None) -> Record:
    """A dump record from a shim `record` line; numpy shape = reversed ggml ne[:dims]
    (default: ggml's own dimension count)."""
    ne = event.ne[: dims or n_dims(event.ne)]
    return Record(
        key=record_key(event.eval, event.role, event.name, event.occurrence),
        role=event.role,
        phase=phase,
        eval=event.eval,
        name=event.name,
        occurrence=event.occurrence,
        op=event.op,
        ggml_type=event.ggml_type,
        ne=ne,
        srcs=event.srcs,
        dtype=event.dtype,
        shape=tuple(reversed(ne)),
        nb=event.nb,
        backend=event.backend,
    )


@dataclass(frozen=True)
class Written:
    """What `write_records` did: the (role, name) of each record it added, and the reason of
    each it dropped."""

    names: tuple[tuple[Role, str], ...]
    dropped: tuple[str, ...]


def write_records(writer: DumpWriter, records: tuple[RecordEvent, ...], evals: tuple[Eval, ...], data: Path) -> Written:
    """Add every record whose bytes are all in `data` to the dump being written; drop the others
    (a short one never hides the complete ones after it)."""
    phases = {e.eval: e.phase for e in evals}
    n_tokens = {e.eval: e.n_tokens for e in evals}
    dims = dims_by_name(records, n_tokens)
    kept, dropped = [], []
    with open(data, "rb") as f:
        for event in records:
            n = n_dims(event.ne)
            if event.op == API_OP:  # read back through the API: (output rows, values), one row or many
                n = max(n, 2)
            elif n_tokens.get(event.eval) == 1:
                n = min(max(n, dims.get(event.name, n + 1)), 4)  # keep the token dimension
            else:  # one output row of several tokens (a chained MTP step's h_nextn): keep its row dimension
                n = min(max(n, dims.get(event.name, n)), 4)
            record = record_from_event(event, phases.get(event.eval, Phase.WARMUP), n)
            array, why = read_record_array(f, event, record)
            if array is None:
                dropped.append(why)
                continue
            writer.add(record, array)
            kept.append((record.role, record.name))
    return Written(tuple(kept), tuple(dropped))


def read_record_array(f: BinaryIO, event: RecordEvent, record: Record) -> tuple[np.ndarray | None, str]:
    """The record's array (`record.shape`, `record.dtype`) from the open data file, or None and
    why it cannot be read (its byte count is not its shape's, or the file ends before its bytes
    do). Every reader of a spooled record's bytes reads them here."""
    if event.nbytes != int(np.prod(record.shape)) * np.dtype(record.dtype).itemsize:
        return None, DROP_MISSIZED
    f.seek(event.offset)
    buf = f.read(event.nbytes)
    if len(buf) != event.nbytes:
        return None, DROP_DATA_SHORT
    return np.frombuffer(buf, dtype=record.dtype).reshape(record.shape), ""


@dataclass(frozen=True)
class Packed:
    """What a pack wrote: the dump, how many records it kept, and what it dropped, per reason."""

    path: Path
    kept: int
    dropped: tuple[tuple[str, int], ...] = ()  # (reason, count), reasons that dropped something
    names: frozenset[tuple[Role, str]] = frozenset()  # (role, name) of the kept records

    @staticmethod
    def of(path: Path, written: Written, n_torn: int, n_unreadable: int) -> Packed:
        counts = Counter(written.dropped) + Counter({DROP_TORN: n_torn, DROP_UNREADABLE: n_unreadable})
        return Packed(path, len(written.names), tuple(sorted(counts.items())), frozenset(written.names))

    def summary(self) -> str:
        """One sentence: kept, and (if anything) dropped with the count of each reason."""
        kept = f"packed {self.kept} complete records into {self.path}"
        if not self.dropped:
            return kept
        counts = ", ".join(f"{n}: {reason}" for reason, n in self.dropped)
        return f"{kept}; warning: dropped {sum(n for _, n in self.dropped)} ({counts})"


def warn_dropped(packed: Packed) -> None:
    """A pack that dropped something says so (never silently)."""
    if packed.dropped:
        log.warning("%s", packed.summary())


SPOOL_SUFFIXES = (".index", ".data")
SPOOL_TAG = ".spool"


def prefix_for(output: Path) -> Path:
    """Where a capture spools while it writes `output`: beside it, `<output>.spool.*`."""
    return output.with_name(output.name + SPOOL_TAG)


def owner_output(prefix: Path) -> Path | None:
    """The output whose capture spools at `prefix` (the inverse of `prefix_for`); None for a
    prefix no capture spools at (one set aside, one named by hand)."""
    name = Path(prefix).name
    if not name.endswith(SPOOL_TAG) or name == SPOOL_TAG:
        return None
    return Path(prefix).with_name(name.removesuffix(SPOOL_TAG))


def spool_files(prefix: Path) -> tuple[Path, Path]:
    """The index and data files of the spool at `prefix`."""
    return Path(f"{prefix}.index"), Path(f"{prefix}.data")


def spool_paths(prefix: Path) -> tuple[Path, ...]:
    """Every file of the spool at `prefix`, whoever wrote it: `<prefix>.<anything>`."""
    start = prefix.name + "."
    parent = prefix.parent
    return tuple(sorted(p for p in parent.iterdir() if p.name.startswith(start))) if parent.is_dir() else ()


def remove_spool(prefix: Path, suffixes: tuple[str, ...] = SPOOL_SUFFIXES) -> None:
    for suffix in suffixes:
        Path(f"{prefix}{suffix}").unlink(missing_ok=True)


def set_aside(prefix: Path, output: Path) -> Path | None:
    """Move a spool found at `prefix` (an earlier capture to `output` died before packing it; its
    lock is free, so it is not running) to `<prefix>-<UTC time>.*`, every file of it, and say
    where and how to pack it. Returns the new prefix (None: there was no spool)."""
    found = spool_paths(prefix)
    if not found:
        return None
    stamp = datetime.now(UTC).strftime(ASIDE_STAMP)
    aside = _free_prefix(prefix.with_name(f"{prefix.name}-{stamp}"))
    for path in found:
        os.rename(path, aside.with_name(aside.name + path.name[len(prefix.name) :]))
    recovered = output.with_name(f"{output.stem}{RECOVERED_TAG}{stamp}{output.suffix}")
    log.warning(
        "found the spool of an earlier capture to %s that never finished (%s.*); moved it to %s.* "
        "instead of overwriting it: recover it with `featdiff pack %s -o %s`",
        output,
        prefix,
        aside,
        aside,
        recovered,
    )
    return aside


def _free_prefix(prefix: Path) -> Path:
    """`prefix`, or `<prefix>-2`, `<prefix>-3` ..., the first that no spool file uses."""
    n, found = 1, prefix
    while spool_paths(found):
        n += 1
        found = prefix.with_name(f"{prefix.name}-{n}")
    return found


def pack(prefix: Path, output: Path) -> Packed:
    """Write the dump of every complete record in the in-process spool at `prefix`."""
    index, data = require_spool(prefix)
    output = check_output(Path(output), (index, data), "-o")
    events = read_index(index)
    build = events.header.get("build", {})
    split = split_ubatches(events.evals, events.records, _header_n_ubatch(build, events.evals))
    writer = DumpWriter(output)
    written = write_records(writer, split.records, split.evals, data)
    manifest = Manifest(
        source="llama.cpp",
        models=events.header.get("models", {}),
        build=build,
        evals=split.evals,
        records=(),
        rounds=events.rounds,
        prompt_tokens=tuple(events.header.get("prompt_tokens", ())),
        flow_notes=split.notes,
    )
    return Packed.of(writer.close(manifest), written, events.n_torn, events.n_unreadable)


def _header_n_ubatch(build: dict[str, Any], evals: tuple[Eval, ...]) -> dict[int, int | None]:
    """Each eval's n_ubatch in an in-process capture: `build.n_ubatch`, both contexts' (llama.cpp's
    draft context inherits the target's); a capture made before it decoded one graph per eval."""
    size = build.get("n_ubatch") if isinstance(build, dict) else None
    return {ev.eval: size if isinstance(size, int) and size > 0 else None for ev in evals}


def require_spool(prefix: Path) -> tuple[Path, Path]:
    """The index and data files of the spool at `prefix`, checked to exist."""
    index, data = spool_files(prefix)
    if not index.is_file() or not data.is_file():
        raise InputError(
            f"{prefix}: no spool here ({index.name} and {data.name} expected); give the prefix a "
            "capture left, e.g. run.npz.spool for -o run.npz"
        )
    return index, data


# ---------------------------------------------------------------- filters that caught nothing


def unmatched_globs(filters: FilterSet, names: frozenset[tuple[Role, str]]) -> tuple[tuple[str, tuple[Role, ...]], ...]:
    """Each include glob of `filters` that matched no record name of any role it applies to,
    with those roles (a glob given without a role applies to both)."""
    roles_of: dict[str, list[Role]] = {}
    for role in ROLES:
        for glob in filters.role(role).include:
            roles_of.setdefault(glob, []).append(role)
    return tuple(
        (glob, tuple(roles))
        for glob, roles in roles_of.items()
        if not any(RoleFilter((glob,)).keeps(name) for role, name in names if role in roles)
    )


def warn_unmatched_filters(filters: FilterSet, packed: Packed) -> None:
    """One warning per `--filter` glob that caught no tensor in the whole capture: a misspelt
    name or a layer the model does not have. Only for the user's own globs (the caller's to say):
    the default wiring set names tensors some architectures lack."""
    for glob, roles in unmatched_globs(filters, packed.names):
        spec = glob if len(roles) == len(ROLES) else f"{roles[0]}:{glob}"
        log.warning(
            "--filter %r matched no tensor of the %s in this capture; check the name with "
            "`featdiff inspect` or the records list in docs/records.md",
            spec,
            " or the ".join(roles),
        )
