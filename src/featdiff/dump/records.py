"""Dump format v1 (docs/dump.md): the records a manifest lists, one per captured tensor (`Record`),
graph evaluation (`Eval`), speculative round (`Round`), flow (`FlowInfo`) and KV-cache edit (`MemoryOp`),
each beside its `to_json` / `from_json`. The manifest that holds them is in dump/manifest.py, the writer in
dump/writer.py, the reader in dump/reader.py. Arrays are stored in numpy order: reversed ggml `ne`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from featdiff.core.names import CALL_DECODE, CALL_ENCODE, Role
from featdiff.core.phases import Phase
from featdiff.dump.manifest_fields import (
    Fields,
    ManifestError,
    as_call,
    as_count,
    as_count_or_null,
    as_counts,
    as_int,
    as_ints,
    as_phase,
    as_role,
    as_str,
    as_str_or_null,
    as_strs,
)

FORMAT = "featdiff-dump"
VERSION = 1
MANIFEST_MEMBER = "manifest.json"
NPY_SUFFIX = ".npy"
SOURCES = ("llama.cpp", "reference")
DTYPES = ("float32", "int32", "int64")  # what a dump stores: stored_array; native/featdiff_shim.c host_array
MEMORY_OPS = ("seq_rm", "clear")  # llama_memory_seq_rm, llama_memory_clear (docs/dump.md `memory_ops`)
RERUN = "re-run capture or reference"  # the fix for a damaged or foreign dump

# a reading limit (docs/dump.md "Reading limits", the others in dump/reader.py), checked as a record is read
MAX_DIMS = 32  # numpy 1.x's NPY_MAXDIMS; a ggml tensor has at most 4


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
