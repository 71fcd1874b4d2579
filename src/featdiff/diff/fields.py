"""The kind-specific fields of every finding kind (docs/findings.md, Kinds): one frozen record per
kind, which every producer of that kind fills, so a kind has one shape whoever reports it.

A record's `to_json()` is the finding's `fields` mapping (`Finding.of`): its members keyed by name,
tuples as lists, an `ABSENT` member left out. `ABSENT` is a field only some producers of a kind
have (a `position_offset` of a batch adds `role`, `phase`, `round`, `eval` to the `offset` of a
RoPE'd record); `None` is a value (`null` in JSON: a token one side lacks). diff/schema.py
makes the findings schema's finding properties from these records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, ClassVar, Literal, Self

from featdiff.core.names import Role
from featdiff.core.phases import Phase
from featdiff.diff.result import Finding, Kind, SkipReason, SkipSide


class Absent(Enum):
    """A member the producer of a kind does not have: left out of the JSON (never `null`)."""

    ABSENT = "absent"


ABSENT = Absent.ABSENT
Metric = Literal["nmse", "shape", "margin"]  # what a divergence's (or numeric noise's) `value` measures
# nmse: a number (null when NaN); shape: the run's shape; margin: the reference's logit margin
MetricValue = float | None | tuple[int, ...]
UnpairedReason = SkipReason | Literal["prompt"]  # a skip's reason, or `prompt`: the prompts differ


@dataclass(frozen=True)
class Fields:
    """The fields of one finding kind (`KIND`); subclasses add the members."""

    KIND: ClassVar[Kind]

    def to_json(self) -> dict[str, Any]:
        """The finding's `fields`: members by name, ABSENT ones left out, tuples as lists."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not ABSENT}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Self:
        """The record of a finding's `fields`; keys it does not hold (`flow`, `seq_id`, a newer
        version's) are ignored, members the mapping lacks are ABSENT."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: _tupled(v) for k, v in d.items() if k in known})


def _jsonable(v: Any) -> Any:
    return [_jsonable(x) for x in v] if isinstance(v, tuple) else v


def _tupled(v: Any) -> Any:
    return tuple(_tupled(x) for x in v) if isinstance(v, list) else v


# --- feature slots, terms, sources ---------------------------------------------------------------


@dataclass(frozen=True)
class LayerOffsetFields(Fields):
    KIND: ClassVar[Kind] = "layer_offset"
    slot: int
    expected_layer: int
    observed_layer: int
    delta: int
    observed_layers: tuple[int, ...]  # every slot's
    expected_layers: tuple[int, ...]


@dataclass(frozen=True)
class SlotPermutationFields(Fields):
    KIND: ClassVar[Kind] = "slot_permutation"
    permutation: tuple[int, ...]  # the observed slot order


@dataclass(frozen=True)
class MissingTermFields(Fields):
    KIND: ClassVar[Kind] = "missing_term"
    term: str  # the reference record name
    expected_in: str | Absent = ABSENT  # the sum the run's graph lacks, when it lacks one


@dataclass(frozen=True)
class ExtraTermFields(Fields):
    KIND: ClassVar[Kind] = "extra_term"
    term: str


@dataclass(frozen=True)
class WrongSourceFields(Fields):
    KIND: ClassVar[Kind] = "wrong_source"
    source: str
    candidate: str  # the reference record matched
    # another_output_row, where each named row read its own top-k values with another row's token
    # ids: per named row, the position whose ids it carries
    ids_from: tuple[int, ...] | Absent = ABSENT


@dataclass(frozen=True)
class NotConditionedFields(Fields):
    KIND: ClassVar[Kind] = "not_conditioned"
    detail: str


# --- values, rows, layouts -----------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutTransposeFields(Fields):
    KIND: ClassVar[Kind] = "layout_transpose"
    detail: str


@dataclass(frozen=True)
class RowShiftFields(Fields):
    KIND: ClassVar[Kind] = "row_shift"
    shift: int  # run row at position p = ref row at p + shift


@dataclass(frozen=True)
class MisplacedRowsFields(Fields):
    KIND: ClassVar[Kind] = "misplaced_rows"
    rows: tuple[int, ...]  # the run positions
    sources: tuple[int, ...]  # the reference position each holds


@dataclass(frozen=True)
class PositionOffsetFields(Fields):
    """`offset` of a RoPE'd record or `inp_pos`; a batch's adds where it is (role .. eval)."""

    KIND: ClassVar[Kind] = "position_offset"
    offset: int
    role: Role | Absent = ABSENT
    phase: Phase | Absent = ABSENT
    round: int | Absent = ABSENT
    eval: int | Absent = ABSENT


@dataclass(frozen=True)
class ScaleFields(Fields):
    """One factor; per channel also the factors (one head's when they repeat) and `detail`."""

    KIND: ClassVar[Kind] = "scale"
    factor: float
    factors: tuple[float, ...] | Absent = ABSENT
    detail: str | Absent = ABSENT


@dataclass(frozen=True)
class ZerosFields(Fields):
    KIND: ClassVar[Kind] = "zeros"
    rows: tuple[int, ...]


@dataclass(frozen=True)
class NonfiniteFields(Fields):
    KIND: ClassVar[Kind] = "nonfinite"
    rows: tuple[int, ...]


@dataclass(frozen=True)
class StaleFields(Fields):
    """Rows repeating an earlier eval (`source_eval`); the draft KV cache's add `detail` and the
    draft block (`round`, `eval`) that met them."""

    KIND: ClassVar[Kind] = "stale"
    rows: tuple[int, ...]
    source_eval: int | None
    detail: str | Absent = ABSENT
    round: int | Absent = ABSENT
    eval: int | Absent = ABSENT


@dataclass(frozen=True)
class DuplicateRowsFields(Fields):
    KIND: ClassVar[Kind] = "duplicate_rows"
    rows: tuple[int, ...]
    source_evals: tuple[int, ...]
    round: int
    eval: int


# --- records one side lacks ----------------------------------------------------------------------


@dataclass(frozen=True)
class MissingTensorFields(Fields):
    KIND: ClassVar[Kind] = "missing_tensor"


@dataclass(frozen=True)
class UnexpectedTensorFields(Fields):
    """No field; the info form lists the one-sided `names` outside the wiring set."""

    KIND: ClassVar[Kind] = "unexpected_tensor"
    names: tuple[str, ...] | Absent = ABSENT


@dataclass(frozen=True)
class UnpairedFields(Fields):
    """Record sets left out for one reason; `prompt` (the prompts differ) has no side, role or
    phase, and adds the first differing token (`row`, `expected`, `observed`)."""

    KIND: ClassVar[Kind] = "unpaired"
    reason: UnpairedReason
    records: int
    rows: tuple[int, ...]
    evals: tuple[int, ...]
    round: int
    side: SkipSide | Absent = ABSENT
    role: Role | Absent = ABSENT
    phase: Phase | Absent = ABSENT
    row: int | Absent = ABSENT
    expected: int | None | Absent = ABSENT
    observed: int | None | Absent = ABSENT


@dataclass(frozen=True)
class UnmodelledFields(Fields):
    KIND: ClassVar[Kind] = "unmodelled"
    names: tuple[str, ...]  # the features
    role: Role
    first_use: tuple[str, ...]
    not_judged: tuple[str, ...]
    diverged: tuple[str, ...]


# --- token ids, positions, the flow --------------------------------------------------------------


@dataclass(frozen=True)
class BlockTokenFields(Fields):
    KIND: ClassVar[Kind] = "block_token"
    row: int
    expected: int | None  # token ids; None for a row one side lacks
    observed: int | None
    round: int
    eval: int


@dataclass(frozen=True)
class FlowNoteFields(Fields):
    KIND: ClassVar[Kind] = "flow_note"
    notes: tuple[str, ...]  # the producer's sentences


@dataclass(frozen=True)
class NearTieFields(Fields):
    KIND: ClassVar[Kind] = "near_tie"
    phase: Phase
    round: int
    row: int
    position: int
    eval: int
    expected: int | None  # the reference's token (never None here; `expected` of block_token may be)
    observed: int | None  # the run's
    margin: float | None
    bound: float


@dataclass(frozen=True)
class ExpertChoiceFields(Fields):
    KIND: ClassVar[Kind] = "expert_choice"
    layer: int | str
    rows: tuple[int, ...]
    margins: tuple[float, ...]
    bounds: tuple[float, ...]


@dataclass(frozen=True)
class ChainChoiceFields(Fields):
    """DSpark's in-graph Markov chain took another token than the reference's at a near-tie."""

    KIND: ClassVar[Kind] = "chain_choice"
    position: int  # the row whose argmax the chain took
    expected: int | None  # the reference's argmax there (never None here: one type per key)
    observed: int | None  # the run's
    margin: float | None
    bound: float
    rows: tuple[int, ...]  # the positions after it whose bias follows the other token: not judged


# --- no specific cause ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DivergenceFields(Fields):
    """The metric against its tolerance; a parting by margin adds where the tokens part (`phase` ..
    `observed`); the RoPE form adds `detail` `rope` and the frequency `pairs` that differ."""

    KIND: ClassVar[Kind] = "divergence"
    metric: Metric
    value: MetricValue
    tolerance: MetricValue
    detail: str | Absent = ABSENT
    pairs: tuple[int, ...] | Absent = ABSENT
    phase: Phase | Absent = ABSENT
    round: int | Absent = ABSENT
    row: int | Absent = ABSENT
    position: int | Absent = ABSENT
    eval: int | Absent = ABSENT
    expected: int | None | Absent = ABSENT
    observed: int | None | Absent = ABSENT


@dataclass(frozen=True)
class NumericNoiseFields(Fields):
    KIND: ClassVar[Kind] = "numeric_noise"
    metric: Metric
    value: MetricValue
    tolerance: MetricValue


@dataclass(frozen=True)
class FlowFields:
    """Added to every finding of a run of several flows: which flow (docs/flow.md) it is about."""

    flow: int
    seq_id: int

    def to_json(self) -> dict[str, Any]:
        return {"flow": self.flow, "seq_id": self.seq_id}


# Where a fault lives (docs/findings.md, `where`): the GGUF, the graph llama.cpp built, the code
# that fed it, or not decided by the evidence at hand
Where = Literal["export", "graph", "driver", "unknown"]


@dataclass(frozen=True)
class WhereFields:
    """Added to every error finding: where the fault lives and the evidence that places it there
    (diff/attribution.py decides them)."""

    where: Where
    where_reason: str

    def to_json(self) -> dict[str, Any]:
        return {"where": self.where, "where_reason": self.where_reason}


RECORDS: tuple[type[Fields], ...] = (
    LayerOffsetFields,
    SlotPermutationFields,
    LayoutTransposeFields,
    RowShiftFields,
    PositionOffsetFields,
    MissingTermFields,
    ExtraTermFields,
    ScaleFields,
    WrongSourceFields,
    NotConditionedFields,
    ZerosFields,
    NonfiniteFields,
    StaleFields,
    MissingTensorFields,
    UnexpectedTensorFields,
    DivergenceFields,
    NumericNoiseFields,
    UnpairedFields,
    BlockTokenFields,
    DuplicateRowsFields,
    FlowNoteFields,
    NearTieFields,
    MisplacedRowsFields,
    UnmodelledFields,
    ExpertChoiceFields,
    ChainChoiceFields,
)
RECORD_OF: dict[str, type[Fields]] = {r.KIND: r for r in RECORDS}  # kind -> its record


def fields_of(f: Finding) -> Fields:
    """A finding's fields as its kind's record."""
    return RECORD_OF[f.kind].from_json(f.fields)
