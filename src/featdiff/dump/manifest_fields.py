"""The manifest's schema beside the dump: `ModelInfo`, what a `models` entry says about a model
(capture and the reference write it, compare reads it back), and typed reading of a JSON manifest,
field by field: each reader checks one value's type and range and raises `ManifestError` naming
the value's path (`records[3].shape[1]`), which `featdiff.dump` turns into an InputError naming the
file. No value is trusted, none is coerced.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, cast, get_type_hints

from featdiff.core import names
from featdiff.core.names import CALLS, ROLES, Role
from featdiff.core.phases import PHASES, Phase

INT64 = 1 << 63  # every int of a manifest is a llama.cpp int32/int64 (or a count): |x| < 2**63
SHOWN_CHARS = 40  # how much of a bad value a message quotes
REQUIRED = object()  # `Fields.get`'s default: the field has none

# what a `models` entry without the fields a producer always writes reads as: unknown
UNKNOWN_MODEL: dict[str, Any] = {"path": "", "sha256": "", "architecture": "", "n_layer": 0, "n_embd": 0, "n_vocab": 0}


@dataclass(frozen=True)
class ModelInfo:
    """The metadata of one model that matters for wiring (read from a GGUF by
    featdiff.core.gguf_reader.model_info)."""

    path: str
    sha256: str
    architecture: str
    n_layer: int
    n_embd: int
    n_vocab: int
    weight_types: tuple[str, ...]  # distinct ggml types of the 2-D weights
    target_layers: tuple[int, ...] = ()  # drafter: input-of-layer ids (GGUF convention)
    block_size: int = 0
    mask_token_id: int = -1
    log_snr: dict[str, Any] | None = None  # {"enabled", "min", "max"} for a drafter
    has_own_embeddings: bool = False
    has_log_snr_tensors: bool = False
    rope_freq_base: float = names.ROPE_FREQ_BASE_DEFAULT
    dspark: dict[str, Any] | None = None  # a DSpark drafter's heads (`dspark_info`); None without markov_w1
    # a reference's GGUF: who dequantized its weights, GGUF_PY or the libggml-base file; None: not
    # said (a capture, whose build's ggml reads them; a HF checkpoint, never quantized)
    dequantized_by: str | None = None
    # a drafter's keys and tensors llama.cpp computes and the reference does not model
    # (featdiff.kinds.dflash.modelled); optional (docs/dump.md): written only when there is one
    unmodelled: tuple[str, ...] = ()
    # an EAGLE3 reference's HF checkpoint: {"trainer", "layer_ids", "layer_ids_mean", "told_by"}
    # (docs/dump.md); optional, written only when set
    checkpoint: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["weight_types"] = list(self.weight_types)
        d["target_layers"] = list(self.target_layers)
        if self.dequantized_by is None:  # optional (docs/dump.md): written only where it says something
            del d["dequantized_by"]
        if self.unmodelled:
            d["unmodelled"] = list(self.unmodelled)
        else:
            del d["unmodelled"]
        if self.checkpoint is None:
            del d["checkpoint"]
        return dict(sorted(d.items()))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelInfo:
        """A manifest's `models` entry (its field types checked by featdiff.dump on reading); a
        field an older or hand-made dump lacks reads as unknown: "", 0, (), or its default."""
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        return cls(
            **{
                **UNKNOWN_MODEL,
                **d,
                "weight_types": tuple(d.get("weight_types", ())),
                "target_layers": tuple(d.get("target_layers", ())),
                "unmodelled": tuple(d.get("unmodelled", ())),
            }
        )


def dspark_info(
    rank: int, has_confidence_head: bool, sample_from_anchor: bool, causal: bool, n_vocab_draft: int
) -> dict[str, Any]:
    """ModelInfo's `dspark` entry (docs/dump.md): what the Markov and confidence heads are."""
    return {
        "markov": True,
        "rank": rank,
        "confidence_head": has_confidence_head,
        "sample_from_anchor": sample_from_anchor,
        "causal": causal,
        "n_vocab_draft": n_vocab_draft,
    }


class ManifestError(ValueError):
    """A malformed manifest field: its path (`records[3].shape[1]`), what was expected, what was found.
    `read_dump` turns it into an `InputError` naming the file."""

    def __init__(self, where: str, expected: str, got: Any) -> None:
        super().__init__(f"manifest{' ' + where if where else ''}: expected {expected}, got {shown(got)}")


def shown(value: Any) -> str:
    """A value as the message quotes it: one line of JSON, ASCII, cut after SHOWN_CHARS."""
    if value is REQUIRED:
        return "nothing (the field is missing)"
    try:
        text = json.dumps(preview(value), ensure_ascii=True)
    except (TypeError, ValueError):  # not JSON's (a message about our own records), or an int too long to print
        text = type(value).__name__
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def preview(value: Any, depth: int = 8) -> Any:
    """As much of `value` as a message shows, so that quoting a huge or deep value costs nothing:
    16 items of a list or object (their JSON is longer than SHOWN_CHARS, so it is cut), strings
    cut, "..." below `depth` levels."""
    if depth == 0:
        return "..."
    if isinstance(value, str):
        return value[: SHOWN_CHARS + 1]
    if isinstance(value, list):
        return [preview(v, depth - 1) for v in value[:16]]
    if isinstance(value, dict):
        return {str(k)[: SHOWN_CHARS + 1]: preview(v, depth - 1) for k, v in itertools.islice(value.items(), 16)}
    return value


def _int_kind(lo: int) -> str:
    return "a non-negative int" if lo == 0 else "an int" if lo == -INT64 else f"an int >= {lo}"


def as_int(value: Any, where: str, lo: int = -INT64) -> int:
    """An int in [lo, 2**63); a bool or a float is not an int."""
    if type(value) is not int or not lo <= value < INT64:
        raise ManifestError(where, _int_kind(lo), value)
    return value


def as_count(value: Any, where: str) -> int:
    return as_int(value, where, 0)


def as_str(value: Any, where: str, choices: tuple[str, ...] | None = None) -> str:
    """A string, one of `choices` when given."""
    if not isinstance(value, str) or (choices is not None and value not in choices):
        raise ManifestError(where, "a string" if choices is None else f"one of {', '.join(choices)}", value)
    return value


def as_role(value: Any, where: str) -> Role:
    """A record role (names.ROLES), typed."""
    return cast(Role, as_str(value, where, ROLES))


def as_phase(value: Any, where: str) -> Phase:
    """An eval phase (featdiff.core.phases.PHASES), typed."""
    return Phase(as_str(value, where, PHASES))


def as_call(value: Any, where: str) -> str:
    """How an eval ran (names.CALLS): a decode, or the older generation's inject encoder step."""
    return as_str(value, where, CALLS)


def as_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ManifestError(where, "true or false", value)
    return value


def as_number(value: Any, where: str) -> float:
    """A finite float, or an int in (-2**63, 2**63) (not a bool)."""
    ok = -INT64 < value < INT64 if type(value) is int else type(value) is float and math.isfinite(value)
    if not ok:
        raise ManifestError(where, "a number", value)
    return float(value)


def as_number_or_null(value: Any, where: str) -> float | None:
    return None if value is None else as_number(value, where)


def as_str_or_null(value: Any, where: str) -> str | None:
    return None if value is None else as_str(value, where)


def as_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ManifestError(where, "a list", value)
    return value


def as_ints(value: Any, where: str, lo: int = -INT64) -> tuple[int, ...]:
    """A list of ints in [lo, 2**63): checked in one pass, the bad one named when there is one."""
    items = as_list(value, where)
    if all(type(x) is int and lo <= x < INT64 for x in items):
        return tuple(items)
    return tuple(as_int(x, f"{where}[{i}]", lo) for i, x in enumerate(items))


def as_counts(value: Any, where: str) -> tuple[int, ...]:
    return as_ints(value, where, 0)


def as_strs(value: Any, where: str) -> tuple[str, ...]:
    return tuple(as_str(x, f"{where}[{i}]") for i, x in enumerate(as_list(value, where)))


def as_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ManifestError(where, "an object", value)
    return value


def as_object_or_null(value: Any, where: str) -> dict[str, Any] | None:
    return None if value is None else as_object(value, where)


def as_count_or_null(value: Any, where: str) -> int | None:
    return None if value is None else as_count(value, where)


def as_objects(value: Any, where: str, read: Callable[[Any, str], Any]) -> tuple[Any, ...]:
    """A list of objects, each read by `read(item, 'where[i]')`."""
    return tuple(read(item, f"{where}[{i}]") for i, item in enumerate(as_list(value, where)))


@dataclass(frozen=True)
class Fields:
    """One JSON object of the manifest and its path there, read field by field with types checked."""

    d: dict[str, Any]
    at: str

    @staticmethod
    def of(value: Any, at: str) -> Fields:
        return Fields(as_object(value, at), at)

    def get(self, key: str, read: Callable[..., Any], *args: Any, default: Any = REQUIRED) -> Any:
        """Field `key` read by `read` (which names `at.key` when it fails); `default` when absent.
        A required field that is absent reaches `read` as `REQUIRED`, which no check accepts."""
        if key not in self.d and default is not REQUIRED:
            return default
        return read(self.d.get(key, REQUIRED), f"{self.at}.{key}" if self.at else key, *args)


# What each `models` entry field must be, by ModelInfo's own field types (above: the one home of
# those names); a field of a type not listed here is passed through unchecked.
_READ_BY_TYPE: dict[Any, Callable[[Any, str], Any]] = {
    str: as_str,
    int: as_int,
    float: as_number,
    bool: as_bool,
    tuple[int, ...]: as_ints,
    tuple[str, ...]: as_strs,
    dict[str, Any] | None: as_object_or_null,
    str | None: as_str_or_null,
}
MODEL_FIELDS = {name: _READ_BY_TYPE[t] for name, t in get_type_hints(ModelInfo).items() if t in _READ_BY_TYPE}


def as_models(value: Any, where: str) -> dict[str, Any]:
    """`models`: per role an object whose ModelInfo fields have ModelInfo's types (others are kept)."""
    for role, info in as_object(value, where).items():
        entry = Fields.of(info, f"{where}.{role}" if role.isidentifier() else f"{where}[{json.dumps(role)}]")
        for key, read in MODEL_FIELDS.items():
            if key in entry.d:
                entry.get(key, read)
    return value


def as_filters(value: Any, where: str) -> Any:
    """`build.filters`: null, one list of globs, or per role a list (filters.FilterSet.from_json)."""
    if isinstance(value, list):
        as_strs(value, where)
    elif isinstance(value, dict):
        for role in ROLES:
            if role in value:
                as_strs(value[role], f"{where}.{role}")
    elif value is not None:
        raise ManifestError(where, "null, a list of globs or per role a list of them", value)
    return value
