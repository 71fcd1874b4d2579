"""Dump format v1: one `.npz` (a zip of `.npy` members) plus a `manifest.json` member.

Producers (capture, reference) write through `DumpWriter`; consumers (compare, report) read
through `read_dump`, which validates format, version and keys once, at the boundary.
Arrays are stored in numpy order: reversed ggml `ne`.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from featdiff.errors import InputError
from featdiff.filters import KEEP_ALL, FilterSet
from featdiff.names import PHASES, ROLES, Role
from featdiff.outputs import partial_path

FORMAT = "featdiff-dump"
VERSION = 1
MANIFEST_MEMBER = "manifest.json"
SOURCES = ("llama.cpp", "reference")


@dataclass(frozen=True)
class Record:
    """One captured tensor: where it came from and how its array is stored."""

    key: str
    role: str
    phase: str
    eval: int
    name: str
    occurrence: int
    op: str
    ggml_type: str
    ne: tuple[int, ...]
    srcs: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    nb: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return dict(sorted(asdict(self).items()))

    @staticmethod
    def from_json(d: dict[str, Any]) -> Record:
        return Record(
            key=d["key"], role=d["role"], phase=d["phase"], eval=int(d["eval"]), name=d["name"],
            occurrence=int(d["occurrence"]), op=d["op"], ggml_type=d["ggml_type"],
            ne=tuple(d["ne"]), srcs=tuple(d["srcs"]), dtype=d["dtype"], shape=tuple(d["shape"]),
            nb=tuple(d.get("nb", ())),
        )


@dataclass(frozen=True)
class Eval:
    """One graph evaluation (a llama_decode of one ubatch), in execution order."""

    eval: int
    role: str
    phase: str
    n_tokens: int
    positions: tuple[int, ...]
    token_ids: tuple[int, ...]
    seq_ids: tuple[int, ...]
    round: int = 0
    rc: int = 0  # the decode's return code: non-zero when llama.cpp refused the batch (no records)

    def to_json(self) -> dict[str, Any]:
        return dict(sorted(asdict(self).items()))

    @staticmethod
    def from_json(d: dict[str, Any]) -> Eval:
        return Eval(
            eval=int(d["eval"]), role=d["role"], phase=d["phase"], n_tokens=int(d["n_tokens"]),
            positions=tuple(d["positions"]), token_ids=tuple(d.get("token_ids", ())),
            seq_ids=tuple(d.get("seq_ids", ())), round=int(d.get("round", 0)), rc=int(d.get("rc", 0)),
        )


@dataclass(frozen=True)
class Round:
    """One speculative round: the block drafted at `pos0` and how much of it the target took."""

    round: int
    pos0: int
    anchor: int
    drafts: tuple[int, ...]
    accepted: int
    target_tokens: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return dict(sorted(asdict(self).items()))

    @staticmethod
    def from_json(d: dict[str, Any]) -> Round:
        return Round(
            round=int(d["round"]), pos0=int(d["pos0"]), anchor=int(d["anchor"]),
            drafts=tuple(d["drafts"]), accepted=int(d["accepted"]),
            target_tokens=tuple(d.get("target_tokens", ())),
        )


@dataclass(frozen=True)
class MemoryOp:
    """A KV-cache edit the program made between evals (llama_memory_seq_rm): the removal of
    positions `p0 .. p1-1` (`p1` = -1: to the end) of `seq_id` in the `role` context, made after
    eval `after_eval` (-1: before the first eval). Facts the preload (or the driver) saw, so compare
    can follow which rows each context's cache holds."""

    role: str
    after_eval: int
    seq_id: int
    p0: int
    p1: int
    op: str = "seq_rm"

    def to_json(self) -> dict[str, Any]:
        return dict(sorted(asdict(self).items()))

    @staticmethod
    def from_json(d: dict[str, Any]) -> MemoryOp:
        return MemoryOp(role=d["role"], after_eval=int(d["after_eval"]), seq_id=int(d["seq_id"]),
                        p0=int(d["p0"]), p1=int(d["p1"]), op=d.get("op", "seq_rm"))


KV_TYPE_DEFAULT = "f16"  # llama.cpp's KV cache type unless told otherwise (common.h cache_type_k / _v)


@dataclass(frozen=True)
class CacheTypes:
    """The types one context's KV cache stores K and V in, as ggml names them (llama.cpp's
    `-ctk` / `-ctv`, `-ctkd` / `-ctvd` for the drafter)."""

    k: str = KV_TYPE_DEFAULT
    v: str = KV_TYPE_DEFAULT

    def to_json(self) -> dict[str, str]:
        return {"k": self.k, "v": self.v}

    @staticmethod
    def from_json(d: dict[str, Any]) -> CacheTypes:
        return CacheTypes(k=str(d.get("k", KV_TYPE_DEFAULT)).lower(), v=str(d.get("v", KV_TYPE_DEFAULT)).lower())


def _default_kv() -> dict[Role, CacheTypes]:
    return {role: CacheTypes() for role in ROLES}


@dataclass(frozen=True)
class Build:
    """What a manifest's `build` says about how the dump was made, as far as a consumer reads it
    (docs/dump.md), with the defaults that keys older dumps lack stand for. The manifest keeps
    the producer's whole `build` (command line, library, statistics) for people to read."""

    filters: FilterSet = KEEP_ALL  # what the capture kept; absent: every name
    kv_types: dict[Role, CacheTypes] = field(default_factory=_default_kv)  # per role
    dtype: str = "float32"  # the reference's compute dtype
    draft_max: int | None = None  # the capture's drafts per block (--draft-max)
    block_rows: int | None = None  # the reference's draft block rows
    p_min: float = 0.0
    llama: str = ""  # the llama.cpp version of a capture's build (`commit`)

    @property
    def kv_cache_types(self) -> tuple[str, ...]:
        """Every type the run's KV caches stored K or V in, sorted."""
        return tuple(sorted({t for c in self.kv_types.values() for t in (c.k, c.v)}))

    @staticmethod
    def from_json(d: dict[str, Any]) -> Build:
        """Read `build`: `kv_types` per role (a capture), else `kv_dtype` for every cache (the
        reference), else llama.cpp's default."""
        if "kv_types" in d:
            kv = {role: CacheTypes.from_json(d["kv_types"].get(role, {})) for role in ROLES}
        else:
            one = str(d.get("kv_dtype", KV_TYPE_DEFAULT)).lower()
            kv = {role: CacheTypes(one, one) for role in ROLES}
        return Build(filters=FilterSet.from_json(d.get("filters")), kv_types=kv,
                     dtype=str(d.get("dtype", "float32")),
                     draft_max=None if d.get("draft_max") is None else int(d["draft_max"]),
                     block_rows=None if d.get("block_rows") is None else int(d["block_rows"]),
                     p_min=float(d.get("p_min") or 0.0), llama=str(d.get("commit", "")))


def kv_types_json(kv: dict[Role, CacheTypes]) -> dict[str, dict[str, str]]:
    """A capture's `build.kv_types`: per role, the K and V cache types."""
    return {role: kv[role].to_json() for role in sorted(kv)}


@dataclass(frozen=True)
class Manifest:
    """Everything in a dump except the arrays."""

    source: str
    models: dict[str, Any]
    build: dict[str, Any]
    evals: tuple[Eval, ...]
    records: tuple[Record, ...]
    rounds: tuple[Round, ...] = ()
    prompt_tokens: tuple[int, ...] = ()
    memory_ops: tuple[MemoryOp, ...] = ()  # KV-cache edits between evals, in order (optional)
    # where the producer inferred the flow (phases, rounds) rather than knowing it, and the run broke
    # the convention it inferred from: one sentence each (optional; `capture --exec` writes them)
    flow_notes: tuple[str, ...] = ()

    @property
    def build_info(self) -> Build:
        """`build`, typed: what a consumer may read of it."""
        return Build.from_json(self.build)

    def to_json(self) -> dict[str, Any]:
        return {
            "build": self.build,
            "evals": [e.to_json() for e in self.evals],
            "flow_notes": list(self.flow_notes),
            "format": FORMAT,
            "memory_ops": [m.to_json() for m in self.memory_ops],
            "models": self.models,
            "prompt_tokens": list(self.prompt_tokens),
            "records": [r.to_json() for r in self.records],
            "rounds": [r.to_json() for r in self.rounds],
            "source": self.source,
            "version": VERSION,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> Manifest:
        return Manifest(
            source=d["source"], models=d.get("models", {}), build=d.get("build", {}),
            evals=tuple(Eval.from_json(e) for e in d.get("evals", [])),
            records=tuple(Record.from_json(r) for r in d["records"]),
            rounds=tuple(Round.from_json(r) for r in d.get("rounds", [])),
            prompt_tokens=tuple(d.get("prompt_tokens", ())),
            memory_ops=tuple(MemoryOp.from_json(m) for m in d.get("memory_ops", [])),
            flow_notes=tuple(d.get("flow_notes", ())),
        )


def record_key(eval_index: int, role: str, name: str, occurrence: int) -> str:
    """The `.npy` member name of a record: unique per (eval, role, name, occurrence)."""
    return f"e{eval_index:05d}.{role}.{name}.{occurrence}"


def stored_array(array: np.ndarray) -> np.ndarray:
    """The array as a dump stores it: float32 for floats, int32/int64 kept."""
    if array.dtype.kind == "f":
        return np.ascontiguousarray(array, dtype=np.float32)
    if array.dtype in (np.int32, np.int64):
        return np.ascontiguousarray(array)
    raise ValueError(f"dump arrays are float or int32/int64, got {array.dtype}")


@dataclass
class DumpWriter:
    """Writes a dump member by member; the manifest goes in last, on `close`.

    The file is written under a temporary name (featdiff.outputs.partial_path) and renamed at the
    end, so an existing dump at `path` is never left half-overwritten.
    """

    path: Path
    _zip: zipfile.ZipFile | None = field(default=None, init=False)
    _records: list[Record] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self._tmp = partial_path(self.path)
        self._zip = zipfile.ZipFile(self._tmp, "w", zipfile.ZIP_STORED, allowZip64=True)

    def add(self, record: Record, array: np.ndarray) -> None:
        """Store one record's array; its `dtype`/`shape` fields must match what is stored."""
        if record.shape != array.shape or record.dtype != str(array.dtype):
            raise ValueError(f"{record.key}: record says {record.dtype}{record.shape}, array is {array.dtype}{array.shape}")
        assert self._zip is not None
        with self._zip.open(record.key + ".npy", "w", force_zip64=True) as f:
            np.lib.format.write_array(f, array, allow_pickle=False)
        self._records.append(record)

    def close(self, manifest: Manifest) -> Path:
        """Write the manifest (its records are those added) and move the file into place."""
        assert self._zip is not None
        full = Manifest(**{**manifest.__dict__, "records": tuple(self._records)})
        self._zip.writestr(MANIFEST_MEMBER, json.dumps(full.to_json(), indent=1, sort_keys=True))
        self._zip.close()
        self._zip = None
        self._tmp.replace(self.path)
        return self.path


def record_from_array(key: str, role: str, phase: str, eval_index: int, name: str, occurrence: int,
                      array: np.ndarray, op: str = "NONE", ggml_type: str = "f32",
                      srcs: tuple[str, ...] = ()) -> tuple[Record, np.ndarray]:
    """A record for an array computed outside llama.cpp (the reference), ne = reversed shape."""
    stored = stored_array(array)
    record = Record(key=key, role=role, phase=phase, eval=eval_index, name=name,
                    occurrence=occurrence, op=op, ggml_type=ggml_type,
                    ne=tuple(reversed(stored.shape)), srcs=srcs, dtype=str(stored.dtype),
                    shape=tuple(stored.shape))
    return record, stored


class Dump:
    """A validated dump opened for lazy reading: the manifest now, arrays on demand."""

    def __init__(self, path: Path, manifest: Manifest, zf: zipfile.ZipFile):
        self.path = path
        self.manifest = manifest
        self._zip = zf
        self.by_key = {r.key: r for r in manifest.records}

    def array(self, record: Record | str) -> np.ndarray:
        key = record if isinstance(record, str) else record.key
        with self._zip.open(key + ".npy") as f:
            return np.lib.format.read_array(f, allow_pickle=False)

    def records(self) -> Iterator[Record]:
        return iter(self.manifest.records)

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> Dump:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_dump(path: str | Path) -> Dump:
    """Open and validate a dump; raise `InputError` naming the file for anything unusable."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such dump; run `featdiff capture` or `featdiff reference` to make one")
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise InputError(f"{path}: not a readable .npz ({e}); re-run the capture or reference that wrote it") from None
    names = zf.namelist()
    if MANIFEST_MEMBER not in names:
        raise InputError(f"{path}: no {MANIFEST_MEMBER} member, so not a featdiff dump; re-run capture or reference")
    try:
        raw = json.loads(zf.read(MANIFEST_MEMBER).decode("utf-8"))
    except (ValueError, zipfile.BadZipFile, OSError) as e:
        raise InputError(f"{path}: {MANIFEST_MEMBER} is unreadable ({e}); re-run capture or reference") from None
    manifest = _validated_manifest(path, raw, set(names))
    return Dump(path, manifest, zf)


def _validated_manifest(path: Path, raw: Any, members: set[str]) -> Manifest:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise InputError(f"{path}: format {raw.get('format') if isinstance(raw, dict) else raw!r}, expected {FORMAT!r}; this is not a featdiff dump")
    if raw.get("version") != VERSION:
        raise InputError(f"{path}: dump version {raw.get('version')}, this featdiff reads version {VERSION}; upgrade featdiff or re-run the producer")
    if raw.get("source") not in SOURCES:
        raise InputError(f"{path}: source {raw.get('source')!r}, expected one of {SOURCES}; re-run capture or reference")
    try:
        manifest = Manifest.from_json(raw)
        Build.from_json(manifest.build)  # once here: a malformed `build` is the file's fault, named here
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InputError(f"{path}: manifest field {e} missing or malformed; re-run capture or reference") from None
    keys = [r.key for r in manifest.records]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise InputError(f"{path}: record key {dup!r} appears twice; keys must be unique, re-run the producer")
    for r in manifest.records:
        if r.key + ".npy" not in members:
            raise InputError(f"{path}: record {r.key!r} has no {r.key}.npy member (truncated file?); re-run capture or reference")
        if r.role not in ROLES or r.phase not in PHASES:
            raise InputError(f"{path}: record {r.key!r} has role {r.role!r} / phase {r.phase!r}; expected {ROLES} / {PHASES}")
    return manifest
