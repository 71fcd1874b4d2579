"""Dump format v1: one `.npz` (a zip of `.npy` members) plus a `manifest.json` member.

Producers (capture, reference) write through `DumpWriter`; consumers (compare, report) read
through `read_dump`, which checks the zip's directory, every manifest field and each member's size
against its record once, at the boundary, and `Dump.array`, which checks a member's `.npy` header
before it reads exactly the declared bytes (docs/dump.md, "Reading limits").
Arrays are stored in numpy order: reversed ggml `ne`.
"""

from __future__ import annotations

import json
import math
import tokenize
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import numpy as np

from featdiff.core.errors import InputError
from featdiff.core.filters import KEEP_ALL, FilterSet
from featdiff.core.names import CALL_DECODE, CALL_ENCODE, ROLES, Role
from featdiff.core.outputs import is_no_room, no_room_error, partial_path
from featdiff.core.phases import Phase
from featdiff.dump.manifest_fields import (
    Fields,
    ManifestError,
    ModelInfo,
    as_call,
    as_count,
    as_count_or_null,
    as_counts,
    as_filters,
    as_int,
    as_ints,
    as_models,
    as_number_or_null,
    as_object,
    as_objects,
    as_phase,
    as_role,
    as_str,
    as_str_or_null,
    as_strs,
    shown,
)
from featdiff.dump.sampling import Sampler

FORMAT = "featdiff-dump"
VERSION = 1
MANIFEST_MEMBER = "manifest.json"
NPY_SUFFIX = ".npy"
SOURCES = ("llama.cpp", "reference")
DTYPES = ("float32", "int32", "int64")  # what a dump stores: stored_array; native/featdiff_shim.c host_array
MEMORY_OPS = ("seq_rm", "clear")  # llama_memory_seq_rm, llama_memory_clear (docs/dump.md `memory_ops`)
RERUN = "re-run capture or reference"  # the fix for a damaged or foreign dump

# Reading limits (docs/dump.md "Reading limits"): what a hostile file may cost the reader.
MAX_MANIFEST_BYTES = 64 << 20  # ~170,000 records at ~400 bytes each; a 2,700-record capture writes 1 MB
MAX_INFLATION = 100  # a deflated member may inflate to 100x its compressed size (real arrays: < 10x) ...
INFLATION_FLOOR = 1 << 20  # ... or to 1 MiB, whichever is more (a small all-zero array deflates ~1000x)
NPY_MIN_HEADER = 10  # magic (6), version (2), header length (2 in .npy 1.0, 4 in 2.0): numpy.lib.format
NPY_MAX_HEADER_TEXT = 10_000  # numpy's own cap on a header's text (read_array_header_* max_header_size)
NPY_MAX_HEADER = 12 + NPY_MAX_HEADER_TEXT  # the longest preamble (.npy 2.0) and that text
MAX_DIMS = 32  # numpy 1.x's NPY_MAXDIMS; a ggml tensor has at most 4
READ_CHUNK = 1 << 20  # bytes an array read inflates at a time


# --- the records ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One captured tensor: where it came from and how its array is stored."""

    key: str
    role: Role
    phase: Phase
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
    # the ggml device whose memory held the data when a capture read it ("CPU", "Vulkan0"):
    # where a node was computed, or where a graph input was copied for its consumer (optional)
    backend: str | None = None

    @property
    def nbytes(self) -> int:
        """The bytes of the array's data, as the record declares it."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if self.backend is None:  # a reference record, or a capture before issue 31: the key is absent
            del d["backend"]
        return dict(sorted(d.items()))

    @staticmethod
    def from_json(d: Any, at: str = "record") -> Record:
        """A manifest record, every field checked; `shape` is `ne` reversed (numpy order), as both
        producers write it (llama/spool.py record_from_event, record_from_array)."""
        f = Fields.of(d, at)
        ne, shape = f.get("ne", as_counts), f.get("shape", as_counts)
        if shape != tuple(reversed(ne)):
            raise ManifestError(f"{at}.shape", f"ne reversed, {list(reversed(ne))}", list(shape))
        if len(shape) > MAX_DIMS:
            raise ManifestError(f"{at}.shape", f"at most {MAX_DIMS} dimensions", list(shape))
        return Record(
            key=f.get("key", as_str),
            role=f.get("role", as_role),
            phase=f.get("phase", as_phase),
            eval=f.get("eval", as_count),
            name=f.get("name", as_str),
            occurrence=f.get("occurrence", as_count),
            op=f.get("op", as_str),
            ggml_type=f.get("ggml_type", as_str),
            ne=ne,
            srcs=f.get("srcs", as_strs),
            dtype=f.get("dtype", as_str, DTYPES),
            shape=shape,
            nb=f.get("nb", as_counts, default=()),
            backend=f.get("backend", as_str_or_null, default=None),
        )


@dataclass(frozen=True)
class Eval:
    """One graph evaluation (a llama_decode of one ubatch), in execution order."""

    eval: int
    role: Role
    phase: Phase
    n_tokens: int
    positions: tuple[int, ...]
    token_ids: tuple[int, ...]
    seq_ids: tuple[int, ...]
    round: int = 0
    rc: int = 0  # the decode's return code: non-zero when llama.cpp refused the batch (no records)
    # "encode": the older generation's inject encoder step (llama_encode of the features): it
    # computes the rows the decode after it injects, and writes nothing to the KV cache
    call: str = CALL_DECODE
    # the index of this graph within its decode call, when llama.cpp computed the call as several
    # graphs (a batch larger than n_ubatch: one eval per graph, each with its rows); None: one graph
    ubatch: int | None = None
    # which flow of the run (one request of one sequence: docs/flow.md "Several flows") this eval
    # belongs to; a dump of one flow has 0 throughout and does not write it
    flow: int = 0

    @property
    def writes_cache(self) -> bool:
        return self.call != CALL_ENCODE

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if out["call"] == CALL_DECODE:
            del out["call"]  # written only where it says something: dumps stay as they were
        if out["ubatch"] is None:
            del out["ubatch"]
        if out["flow"] == 0:
            del out["flow"]
        return dict(sorted(out.items()))

    @staticmethod
    def from_json(d: Any, at: str = "eval") -> Eval:
        """An eval, every field checked: one position per token, and `token_ids` and `seq_ids`
        one per token or none (an embeddings batch has no token ids), as every producer writes."""
        f = Fields.of(d, at)
        ev = Eval(
            eval=f.get("eval", as_count),
            role=f.get("role", as_role),
            phase=f.get("phase", as_phase),
            n_tokens=f.get("n_tokens", as_count),
            positions=f.get("positions", as_ints),
            token_ids=f.get("token_ids", as_ints, default=()),
            seq_ids=f.get("seq_ids", as_ints, default=()),
            round=f.get("round", as_count, default=0),
            rc=f.get("rc", as_int, default=0),
            call=f.get("call", as_call, default=CALL_DECODE),
            ubatch=f.get("ubatch", as_count_or_null, default=None),
            flow=f.get("flow", as_count, default=0),
        )
        _check_per_token(ev, at)
        return ev


def _check_per_token(ev: Eval, at: str) -> None:
    """One position per token; `token_ids` and `seq_ids` one per token or none."""
    if len(ev.positions) != ev.n_tokens:
        raise ManifestError(f"{at}.positions", f"{ev.n_tokens} items (n_tokens)", list(ev.positions))
    for key, values in (("token_ids", ev.token_ids), ("seq_ids", ev.seq_ids)):
        if values and len(values) != ev.n_tokens:
            raise ManifestError(f"{at}.{key}", f"{ev.n_tokens} items (n_tokens) or none", list(values))


@dataclass(frozen=True)
class Round:
    """One speculative round: the block drafted at `pos0` and how much of it the target took."""

    round: int
    pos0: int
    anchor: int
    drafts: tuple[int, ...]
    accepted: int
    target_tokens: tuple[int, ...]
    flow: int = 0  # the flow the round belongs to (Eval.flow); not written when 0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if out["flow"] == 0:
            del out["flow"]
        return dict(sorted(out.items()))

    @staticmethod
    def from_json(d: Any, at: str = "round") -> Round:
        f = Fields.of(d, at)
        return Round(
            # `accepted` and `pos0` are any ints: capture --exec derives them from the positions of
            # the next decode (programs/exec.py), which a program that rewinds can put anywhere
            round=f.get("round", as_count),
            pos0=f.get("pos0", as_int),
            anchor=f.get("anchor", as_int),
            drafts=f.get("drafts", as_ints),
            accepted=f.get("accepted", as_int),
            target_tokens=f.get("target_tokens", as_ints, default=()),
            flow=f.get("flow", as_count, default=0),
        )


# what a flow's `prompt_tokens` and `draft_cached` hold at a cached position besides a token id
UNKNOWN_TOKEN = -1  # featdiff could not follow what the cache holds there (FlowInfo.unfollowed says why)
DRAFT_ROW = -2  # draft_cached: a row of a draft block (a token batch), not a target token's features
NO_ROW = -3  # draft_cached: the drafter's cache holds nothing there


@dataclass(frozen=True)
class FlowInfo:
    """One flow of a run of several (docs/flow.md "Several flows"): the request one sequence
    (llama.cpp seq id) served. `prompt_tokens` is the whole prompt as docs/flow.md counts it; the
    first `n_cached` of its positions were decoded before this flow began (a prompt cache the
    program reused), so its prefill starts there."""

    flow: int
    seq_id: int
    prompt_tokens: tuple[int, ...]
    n_cached: int = 0
    # the target token whose features the drafter's cache held at each of the n_cached positions
    # (-1: not known); None: not recorded (a dump before issue 30, or no drafter context)
    draft_cached: tuple[int, ...] | None = None
    # why some of the n_cached positions' tokens (-1 in prompt_tokens) are not known: a change to
    # the sequence's memory featdiff does not follow; "" when every one is known
    unfollowed: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["prompt_tokens"] = list(self.prompt_tokens)
        if self.draft_cached is None:
            del out["draft_cached"]
        else:
            out["draft_cached"] = list(self.draft_cached)
        if not self.unfollowed:
            del out["unfollowed"]
        return dict(sorted(out.items()))

    @staticmethod
    def from_json(d: Any, at: str = "flow") -> FlowInfo:
        f = Fields.of(d, at)
        return FlowInfo(
            flow=f.get("flow", as_count),
            seq_id=f.get("seq_id", as_int),
            prompt_tokens=f.get("prompt_tokens", as_ints),
            n_cached=f.get("n_cached", as_count, default=0),
            draft_cached=f.get("draft_cached", as_ints, default=None),
            unfollowed=f.get("unfollowed", as_str, default=""),
        )

    def why_unreplayable(self) -> str:
        """Why a reference cannot replay this flow, in one sentence ("" when it can): a prompt
        shorter than 2 tokens, or positions whose tokens the capture could not follow."""
        who = f"flow {self.flow} (sequence {self.seq_id})"
        if len(self.prompt_tokens) < 2:
            return f"{who} has no prompt of 2 tokens or more to replay"
        missing = [p for p, t in enumerate(self.prompt_tokens) if t < 0]
        if missing:
            because = self.unfollowed or "no decode the capture saw wrote them"
            return (
                f"{who} starts with {len(missing)} positions ({_spans(missing)}) whose tokens are not known: {because}"
            )
        return f"{who}: {self.unfollowed}" if self.unfollowed else ""


def _spans(positions: list[int]) -> str:
    """Sorted positions as runs: "0..81, 90"."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in runs)


@dataclass(frozen=True)
class MemoryOp:
    """A KV-cache edit the program made between evals (llama_memory_seq_rm): the removal of
    positions `p0 .. p1-1` (`p1` = -1: to the end) of `seq_id` in the `role` context, made after
    eval `after_eval` (-1: before the first eval). Facts the preload (or the driver) saw, so compare
    can follow which rows each context's cache holds."""

    role: Role
    after_eval: int
    seq_id: int
    p0: int
    p1: int
    op: str = MEMORY_OPS[0]

    def to_json(self) -> dict[str, Any]:
        return dict(sorted(asdict(self).items()))

    @staticmethod
    def from_json(d: Any, at: str = "memory_op") -> MemoryOp:
        f = Fields.of(d, at)
        return MemoryOp(
            role=f.get("role", as_role),
            after_eval=f.get("after_eval", as_int, -1),
            seq_id=f.get("seq_id", as_int),
            p0=f.get("p0", as_int),
            p1=f.get("p1", as_int),
            op=f.get("op", as_str, MEMORY_OPS, default=MEMORY_OPS[0]),
        )


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
    def from_json(d: Any, at: str = "kv_types") -> CacheTypes:
        f = Fields.of(d, at)
        return CacheTypes(
            k=f.get("k", as_str, default=KV_TYPE_DEFAULT).lower(), v=f.get("v", as_str, default=KV_TYPE_DEFAULT).lower()
        )


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
    seqs_per_decode: int = 1  # the most sequences one decode of the run held (several: batched rows)

    @property
    def kv_cache_types(self) -> tuple[str, ...]:
        """Every type the run's KV caches stored K or V in, sorted."""
        return tuple(sorted({t for c in self.kv_types.values() for t in (c.k, c.v)}))

    @staticmethod
    def from_json(d: Any, at: str = "build") -> Build:
        """Read `build`: `kv_types` per role (a capture), else `kv_dtype` for every cache (the
        reference), else llama.cpp's default."""
        f = Fields.of(d, at)
        if "kv_types" in f.d:
            per_role = Fields.of(f.d["kv_types"], f"{at}.kv_types")
            kv = {role: per_role.get(role, CacheTypes.from_json, default=CacheTypes()) for role in ROLES}
        else:
            one = f.get("kv_dtype", as_str, default=KV_TYPE_DEFAULT).lower()
            kv = {role: CacheTypes(one, one) for role in ROLES}
        return Build(
            filters=FilterSet.from_json(f.get("filters", as_filters, default=None)),
            kv_types=kv,
            dtype=f.get("dtype", as_str, default="float32"),
            draft_max=f.get("draft_max", as_count_or_null, default=None),
            block_rows=f.get("block_rows", as_count_or_null, default=None),
            p_min=f.get("p_min", as_number_or_null, default=None) or 0.0,
            llama=f.get("commit", as_str, default=""),
            seqs_per_decode=f.get("seqs_per_decode", as_count_or_null, default=None) or 1,
        )


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
    # the flows of a run of several requests or sequences (optional: a dump without it is one flow)
    flows: tuple[FlowInfo, ...] = ()
    # how each flow's tokens were chosen (optional, per flow: a flow without one chose greedily)
    samplers: tuple[Sampler, ...] = ()

    def sampler(self, flow: int) -> Sampler | None:
        """The sampler of `flow`, None when it chose greedily (a dump without the record included)."""
        found = next((s for s in self.samplers if s.flow == flow), None)
        return None if found is None or found.is_greedy else found

    def flow_ids(self) -> tuple[int, ...]:
        """The flows the evals belong to, in order (a dump of one flow: (0,))."""
        return tuple(sorted({e.flow for e in self.evals})) or (0,)

    def flow_info(self, flow: int) -> FlowInfo:
        """`flows[flow]`, or what a dump of one flow says of it."""
        found = next((f for f in self.flows if f.flow == flow), None)
        if found is not None:
            return found
        seqs = {s for e in self.evals if e.flow == flow for s in e.seq_ids}
        return FlowInfo(flow, min(seqs) if seqs else 0, self.prompt_tokens if flow == 0 else ())

    def model(self, role: Role) -> ModelInfo | None:
        """`models[role]`, typed (featdiff.dump.manifest_fields.ModelInfo); None when the dump has no such entry."""
        entry = self.models.get(role)
        return ModelInfo.from_json(entry) if isinstance(entry, dict) else None

    @property
    def build_info(self) -> Build:
        """`build`, typed: what a consumer may read of it."""
        return Build.from_json(self.build)

    def to_json(self) -> dict[str, Any]:
        return {
            "build": self.build,
            "evals": [e.to_json() for e in self.evals],
            "flow_notes": list(self.flow_notes),
            **({"flows": [f.to_json() for f in self.flows]} if self.flows else {}),
            "format": FORMAT,
            "memory_ops": [m.to_json() for m in self.memory_ops],
            "models": self.models,
            "prompt_tokens": list(self.prompt_tokens),
            "records": [r.to_json() for r in self.records],
            "rounds": [r.to_json() for r in self.rounds],
            **({"samplers": [s.to_json() for s in self.samplers]} if self.samplers else {}),
            "source": self.source,
            "version": VERSION,
        }

    @staticmethod
    def from_json(d: Any, at: str = "") -> Manifest:
        """The whole manifest, every field checked (ManifestError names the first bad one); `build`
        is checked as `Build` reads it, `models` as ModelInfo types its fields."""
        f = Fields.of(d, at)
        build = f.get("build", as_object, default={})
        Build.from_json(build, f"{at}.build" if at else "build")
        return Manifest(
            source=f.get("source", as_str, SOURCES),
            models=f.get("models", as_models, default={}),
            build=build,
            evals=f.get("evals", as_objects, Eval.from_json, default=()),
            records=f.get("records", as_objects, Record.from_json),
            rounds=f.get("rounds", as_objects, Round.from_json, default=()),
            prompt_tokens=f.get("prompt_tokens", as_ints, default=()),
            memory_ops=f.get("memory_ops", as_objects, MemoryOp.from_json, default=()),
            flow_notes=f.get("flow_notes", as_strs, default=()),
            flows=f.get("flows", as_objects, FlowInfo.from_json, default=()),
            samplers=f.get("samplers", as_objects, Sampler.from_json, default=()),
        )


def flow_view(m: Manifest, flow: int, notes_with: int | None = None) -> Manifest:
    """The manifest of one flow of a run of several: its evals, records, rounds and prompt, and the
    KV-cache edits of its sequence (eval numbers stay the dump's). The flow notes go with flow
    `notes_with` (default: the first flow), so that exactly one view of the run holds them."""
    info = m.flow_info(flow)
    evals = tuple(e for e in m.evals if e.flow == flow)
    ids = {e.eval for e in evals}
    return replace(
        m,
        evals=evals,
        records=tuple(r for r in m.records if r.eval in ids),
        rounds=tuple(r for r in m.rounds if r.flow == flow),
        prompt_tokens=info.prompt_tokens,
        memory_ops=tuple(op for op in m.memory_ops if op.seq_id in (-1, info.seq_id)),
        flow_notes=m.flow_notes if flow == (m.flow_ids()[0] if notes_with is None else notes_with) else (),
        flows=(info,) if m.flows else (),
        samplers=tuple(s for s in m.samplers if s.flow == flow),
    )


def record_key(eval_index: int, role: str, name: str, occurrence: int) -> str:
    """The `.npy` member name of a record: unique per (eval, role, name, occurrence)."""
    return f"e{eval_index:05d}.{role}.{name}.{occurrence}"


def stored_array(array: np.ndarray) -> np.ndarray:
    """The array as a dump stores it: float32 for floats, int32/int64 kept (DTYPES)."""
    if array.dtype.kind == "f":
        return np.ascontiguousarray(array, dtype=np.float32)
    if str(array.dtype) in DTYPES:
        return np.ascontiguousarray(array)
    raise ValueError(f"dump arrays are float or int32/int64, got {array.dtype}")


# --- writing ----------------------------------------------------------------------------------


@dataclass
class DumpWriter:
    """Writes a dump member by member; the manifest goes in last, on `close`.

    The file is written under a temporary name (featdiff.core.outputs.partial_path) and renamed at the
    end, so an existing dump at `path` is never left half-overwritten. A write that fails removes
    the temporary file; one that runs out of room (disk, quota, `ulimit -f`) is an InputError
    naming `path` (featdiff.core.outputs.no_room_error).
    """

    path: Path
    _zip: zipfile.ZipFile | None = field(default=None, init=False)
    _records: list[Record] = field(default_factory=list, init=False)
    _keys: set[str] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self._tmp = partial_path(self.path)
        try:
            self._zip = zipfile.ZipFile(self._tmp, "w", zipfile.ZIP_STORED, allowZip64=True)
        except OSError as e:
            raise self._failed(e) from None

    def add(self, record: Record, array: np.ndarray) -> None:
        """Store one record's array; its `dtype`/`shape` fields must match what is stored."""
        if record.shape != array.shape or record.dtype != str(array.dtype):
            raise ValueError(
                f"{record.key}: record says {record.dtype}{record.shape}, array is {array.dtype}{array.shape}"
            )
        assert self._zip is not None
        if record.key in self._keys:  # a bug of the producer's: never a zip the reader refuses
            self._failed(OSError())
            raise ValueError(f"{self.path}: record {record.key} written twice; nothing was written (a featdiff bug)")
        self._keys.add(record.key)
        try:
            with self._zip.open(record.key + NPY_SUFFIX, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, array, allow_pickle=False)
        except OSError as e:
            raise self._failed(e) from None
        self._records.append(record)

    def close(self, manifest: Manifest) -> Path:
        """Write the manifest (its records are those added) and move the file into place."""
        assert self._zip is not None
        full = Manifest(**{**manifest.__dict__, "records": tuple(self._records)})
        try:
            self._zip.writestr(MANIFEST_MEMBER, json.dumps(full.to_json(), indent=1, sort_keys=True))
            self._zip.close()
        except OSError as e:
            raise self._failed(e) from None
        self._zip = None
        self._tmp.replace(self.path)
        return self.path

    def _failed(self, e: OSError) -> BaseException:
        """Remove the temporary file after a failed write; what to raise for `e`: an InputError
        naming the dump when it ran out of room, else `e` itself (a bug or a broken disk)."""
        zf, self._zip = self._zip, None
        if zf is not None:
            try:
                zf.close()  # releases the file even when its central directory cannot be written
            except (OSError, ValueError):  # that write failing too changes nothing: the file goes
                pass
        self._tmp.unlink(missing_ok=True)
        return no_room_error(self.path, e) if is_no_room(e) else e


def record_from_array(
    key: str,
    role: Role,
    phase: Phase,
    eval_index: int,
    name: str,
    occurrence: int,
    array: np.ndarray,
    op: str = "NONE",
    ggml_type: str = "f32",
    srcs: tuple[str, ...] = (),
) -> tuple[Record, np.ndarray]:
    """A record for an array computed outside llama.cpp (the reference), ne = reversed shape."""
    stored = stored_array(array)
    record = Record(
        key=key,
        role=role,
        phase=phase,
        eval=eval_index,
        name=name,
        occurrence=occurrence,
        op=op,
        ggml_type=ggml_type,
        ne=tuple(reversed(stored.shape)),
        srcs=srcs,
        dtype=str(stored.dtype),
        shape=tuple(stored.shape),
    )
    return record, stored


# --- reading ----------------------------------------------------------------------------------

# What reading a damaged member raises: a bad local header or CRC, bad deflate data, a short
# member, an I/O error, a malformed .npy header (numpy raises ValueError), a zip feature zipfile
# does not implement (a version or flag a damaged entry claims).
_DAMAGE = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError)
ZIP_UNSUPPORTED_FLAGS = 0x1 | 0x20 | 0x40  # encrypted, compressed patched data, strong encryption (APPNOTE 4.4.4)


def _one_line(e: BaseException) -> str:
    """An exception's message, first line only (numpy's header errors run to three)."""
    lines = str(e).splitlines()
    return lines[0] if lines else type(e).__name__


class Dump:
    """A validated dump opened for lazy reading: the manifest now, arrays on demand."""

    def __init__(self, path: Path, manifest: Manifest, zf: zipfile.ZipFile):
        self.path = path
        self.manifest = manifest
        self._zip = zf
        self.by_key = {r.key: r for r in manifest.records}

    def array(self, record: Record | str) -> np.ndarray:
        """The record's array: its `.npy` header checked against the record, then exactly the
        declared bytes read, never more; InputError naming the file and record when the member
        disagrees with its record or is damaged."""
        record = self.by_key[record] if isinstance(record, str) else record
        try:
            info = self._zip.getinfo(record.key + NPY_SUFFIX)
            with self._zip.open(info) as f:
                return read_member_array(f, record, info.file_size)
        except _DAMAGE as e:
            raise InputError(f"{self.path}: record {record.key!r}: {_one_line(e)}; {RERUN}") from None

    def records(self) -> Iterator[Record]:
        return iter(self.manifest.records)

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> Dump:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_npy_header(f: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """A `.npy` stream's (shape, fortran_order, dtype), read up to the data; ValueError when the
    magic, version or header is malformed or the header is longer than numpy's cap."""
    major, minor = np.lib.format.read_magic(f)
    if (major, minor) not in ((1, 0), (2, 0)):
        raise ValueError(f".npy version {major}.{minor}, expected 1.0 or 2.0")
    read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    try:
        return read_header(f, max_header_size=NPY_MAX_HEADER_TEXT)
    except tokenize.TokenError as e:  # numpy's fallback parser of Python 2 headers tokenizes the text
        raise ValueError(f"the .npy header is not a Python literal ({e.args[0]})") from None


def read_member_array(f: IO[bytes], record: Record, size: int) -> np.ndarray:
    """The array of a `.npy` stream of `size` bytes holding `record`: the header must say the
    record's dtype and shape in C order and leave exactly the declared bytes, which are read in
    READ_CHUNK pieces into one array of that size; ValueError when anything disagrees."""
    shape, fortran_order, dtype = read_npy_header(f)
    if dtype != np.dtype(record.dtype) or shape != record.shape or fortran_order:
        order = "Fortran" if fortran_order else "C"
        raise ValueError(
            f"the .npy header says {dtype.str} {shape} in {order} order, the record "
            f"{record.dtype} {record.shape} in C order"
        )
    if f.tell() + record.nbytes != size:
        raise ValueError(
            f"the member holds {size} bytes, a {f.tell()}-byte header and {record.nbytes} data bytes expected"
        )
    out = np.empty(record.shape, dtype=dtype)
    data = out.reshape(-1).view(np.uint8)  # (nbytes,): the array's own memory
    done = 0
    while done < record.nbytes:
        chunk = f.read(min(READ_CHUNK, record.nbytes - done))
        if not chunk:
            raise ValueError(f"the member ends after {done} of {record.nbytes} data bytes")
        data[done : done + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
        done += len(chunk)
    if f.read(1):  # also where zipfile checks the CRC, at the member's end
        raise ValueError(f"the member holds more than its {record.nbytes} data bytes")
    return out


def read_dump(path: str | Path) -> Dump:
    """Open and validate a dump; raise `InputError` naming the file for anything unusable.

    Reads the zip's central directory and the manifest member, and no array data: every member
    is checked for its bounds and compression (`_check_member`), every manifest field for its
    type (`Manifest.from_json`), every record's member for the size its declared array needs."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such dump; run `featdiff capture` or `featdiff reference` to make one")
    try:
        zf = zipfile.ZipFile(path)
    except _DAMAGE as e:
        raise InputError(
            f"{path}: not a readable .npz ({_one_line(e)}); re-run the capture or reference that wrote it"
        ) from None
    try:
        manifest = _manifest_of(path, zf)
    except InputError:
        zf.close()
        raise
    return Dump(path, manifest, zf)


def _manifest_of(path: Path, zf: zipfile.ZipFile) -> Manifest:
    """The checked manifest of an open dump, its members checked against it."""
    infos = zf.infolist()
    names = [i.filename for i in infos]
    dup = _first_duplicate(names)
    if dup is not None:
        raise InputError(f"{path}: member {dup!r} appears twice in the zip; {RERUN}")
    size = path.stat().st_size
    for info in infos:
        _check_member(path, info, size)
    members = dict(zip(names, infos))
    raw = _manifest_json(path, zf, members.get(MANIFEST_MEMBER))
    return _validated_manifest(path, raw, members)


def _check_member(path: Path, info: zipfile.ZipInfo, size: int) -> None:
    """Refuse a member the reader cannot read safely, from its directory entry alone: encrypted,
    compressed other than by deflate, reaching past the file's end, or inflating past
    MAX_INFLATION times its compressed size (and INFLATION_FLOOR): a zip bomb."""
    where = f"{path}: member {info.filename!r}"
    if info.flag_bits & ZIP_UNSUPPORTED_FLAGS:
        raise InputError(
            f"{where} is encrypted or patched (flags {info.flag_bits:#x}); a dump's members are plain. {RERUN}"
        )
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise InputError(
            f"{where} uses zip method {info.compress_type}; a dump's members are stored or deflated. {RERUN}"
        )
    if (
        not 0 <= info.header_offset <= info.header_offset + 30 + info.compress_size <= size
    ):  # 30: a local header's fixed part
        raise InputError(f"{where} reaches past the end of the {size}-byte file (truncated?); {RERUN}")
    if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
        raise InputError(f"{where} is stored in {info.compress_size} bytes but says it holds {info.file_size}; {RERUN}")
    if info.file_size > max(MAX_INFLATION * info.compress_size, INFLATION_FLOOR):
        raise InputError(
            f"{where} inflates {info.compress_size} bytes to {info.file_size}, more than "
            f"{MAX_INFLATION}x: refused as a zip bomb; {RERUN}"
        )


def _manifest_json(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo | None) -> Any:
    """The manifest member parsed, its size checked against MAX_MANIFEST_BYTES before it is read;
    a key twice in one object and NaN / Infinity are refused as not JSON's."""
    if info is None:
        raise InputError(f"{path}: no {MANIFEST_MEMBER} member, so not a featdiff dump; {RERUN}")
    if info.file_size > MAX_MANIFEST_BYTES:
        raise InputError(
            f"{path}: {MANIFEST_MEMBER} is {info.file_size} bytes, more than the "
            f"{MAX_MANIFEST_BYTES} a manifest may take; {RERUN}"
        )
    try:
        with zf.open(info) as f:
            text = f.read(MAX_MANIFEST_BYTES + 1).decode("utf-8")
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (*_DAMAGE, RecursionError) as e:
        raise InputError(f"{path}: {MANIFEST_MEMBER} is unreadable ({_one_line(e)}); {RERUN}") from None


def _first_duplicate(items: list[str]) -> str | None:
    """The first item that appeared before, None when all are distinct."""
    seen: set[str] = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    dup = _first_duplicate([k for k, _ in pairs])
    if dup is not None:
        raise ValueError(f"key {dup!r} appears twice in one object")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _validated_manifest(path: Path, raw: Any, members: dict[str, zipfile.ZipInfo]) -> Manifest:
    """The typed manifest; each record's member present and as large as its declared array
    needs (a header of NPY_MIN_HEADER .. NPY_MAX_HEADER bytes plus the data)."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = shown(raw.get("format")) if isinstance(raw, dict) else shown(raw)
        raise InputError(f"{path}: format {got}, expected {json.dumps(FORMAT)}; this is not a featdiff dump")
    if type(raw.get("version")) is not int or raw["version"] != VERSION:
        raise InputError(
            f"{path}: dump version {shown(raw.get('version'))}, this featdiff reads version "
            f"{VERSION}; upgrade featdiff or re-run the producer"
        )
    try:
        manifest = Manifest.from_json(raw)
    except ManifestError as e:
        raise InputError(f"{path}: {e}; {RERUN}") from None
    dup = _first_duplicate([r.key for r in manifest.records])
    if dup is not None:
        raise InputError(f"{path}: record key {dup!r} appears twice; keys must be unique, re-run the producer")
    for r in manifest.records:
        _check_record_member(path, r, members.get(r.key + NPY_SUFFIX))
    return manifest


def _check_record_member(path: Path, record: Record, info: zipfile.ZipInfo | None) -> None:
    if info is None:
        raise InputError(
            f"{path}: record {record.key!r} has no member {record.key + NPY_SUFFIX!r} (truncated file?); {RERUN}"
        )
    if not NPY_MIN_HEADER <= info.file_size - record.nbytes <= NPY_MAX_HEADER:
        raise InputError(
            f"{path}: record {record.key!r} declares {record.dtype} {record.shape} ({record.nbytes} "
            f"bytes) but its member holds {info.file_size}; {RERUN}"
        )
