"""Dump format v1 (docs/dump.md): the manifest, everything in a dump except the arrays (`Manifest`),
and what a consumer reads of its `build` (`Build`, `CacheTypes` per role); `flow_view` cuts one flow
out of a run of several.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from featdiff.core.filters import KEEP_ALL, FilterSet
from featdiff.core.names import ROLES, Role
from featdiff.dump.manifest_fields import (
    Fields,
    ModelInfo,
    as_count_or_null,
    as_filters,
    as_ints,
    as_models,
    as_number_or_null,
    as_object,
    as_objects,
    as_str,
    as_strs,
)
from featdiff.dump.records import FORMAT, SOURCES, VERSION, Eval, FlowInfo, MemoryOp, Record, Round
from featdiff.dump.sampling import Sampler

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
