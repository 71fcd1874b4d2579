"""The records compare produces: pair metrics, alignments, findings and the whole comparison.

These are the contract between compare/ (which fills them) and report/ and the CLI (which
render them). JSON keys are the contract's names (docs/findings.md, docs/findings.schema.json).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import numpy as np

from featdiff.core.names import Role
from featdiff.core.phases import phrase
from featdiff.core.words import plural
from featdiff.diff.rowshift import RowShift
from featdiff.diff.sketch import LayerMatch
from featdiff.dump.manifest import Manifest

# The findings JSON's schema version (docs/findings.schema.json): keys are only ever added; it
# changes only if a key's meaning does.
SCHEMA_VERSION = 1
Severity = Literal["error", "info"]
Kind = Literal[
    "layer_offset",
    "slot_permutation",
    "layout_transpose",
    "row_shift",
    "position_offset",
    "missing_term",
    "extra_term",
    "scale",
    "wrong_source",
    "not_conditioned",
    "zeros",
    "nonfinite",
    "stale",
    "missing_tensor",
    "unexpected_tensor",
    "divergence",
    "numeric_noise",
    "unpaired",
    "block_token",
    "duplicate_rows",
    "flow_note",
    "near_tie",
    "misplaced_rows",
    "unmodelled",
    "expert_choice",
    "chain_choice",
]
KINDS: tuple[str, ...] = Kind.__args__  # type: ignore[attr-defined]
SkipSide = Literal["both", "ref", "run"]  # where the records of a skip are
# Why a record set (or some of its rows) was not compared (docs/findings.md, `coverage`).
SkipReason = Literal[
    "token_history",  # rows computed from another token history than the reference's rows there
    "position",  # rows at positions the other side has no row at, in that eval group
    "missing_eval",  # an eval group (role, phase, round) one side lacks
    "failed_eval",  # the run's decodes of that eval group failed: llama.cpp refused the batch (Eval.rc)
    "no_rows",  # the run output rows where the reference output none (llama-server's prefill)
    "no_draft",  # a run round without a draft (llama-server's last verify): the reference drafts every round
    "fewer_drafts",  # the run verified fewer drafts than the reference (llama.cpp's length budget)
    "warmup",  # warm-up and probe decodes outside the flow
    "empty",  # no element on either side
]
SKIP_REASONS: tuple[str, ...] = SkipReason.__args__  # type: ignore[attr-defined]
# The skip of an eval group of phase `warmup` (featdiff.core.phases.Phase.WARMUP): the findings word
# happens to be the phase's value, spelled here as the skip reason it is.
WARMUP_SKIP: SkipReason = "warmup"
# How each skip reason is judged (docs/findings.md, `unpaired` reasons), every reason in one class:
# rows another error finding can explain (the run decoded other tokens, or placed or refused its
# batches): an error `unpaired`, info when one does
EXPLAINABLE_SKIPS: tuple[SkipReason, ...] = ("token_history", "position", "failed_eval")
ERROR_SKIPS: tuple[SkipReason, ...] = ("missing_eval",)  # always an error `unpaired`
# the protocol explains these, never an error: llama.cpp's own (an info `unpaired` among the
# findings), and those counted in `coverage` only
INFO_SKIPS: tuple[SkipReason, ...] = ("no_rows", "no_draft", "fewer_drafts")
QUIET_SKIPS: tuple[SkipReason, ...] = (WARMUP_SKIP, "empty")
EXPECTED_SKIPS: tuple[SkipReason, ...] = INFO_SKIPS + QUIET_SKIPS


class KindFields(Protocol):
    """The kind-specific fields of one finding kind (diff/fields.py: one record per kind)."""

    KIND: ClassVar[Kind]

    def to_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Finding:
    """One diagnosis. `fields` holds the kind-specific fields, keyed exactly as in docs/findings.md:
    the JSON of the kind's record (diff/fields.py), made by `Finding.of`."""

    kind: Kind
    tensor: str
    severity: Severity
    message: str
    fields: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(fields: KindFields, tensor: str, message: str, severity: Severity = "error") -> Finding:
        """The finding of `fields`' kind: how every producer makes one, so a kind has one shape."""
        return Finding(kind=fields.KIND, tensor=tensor, severity=severity, message=message, fields=fields.to_json())

    def to_json(self) -> dict[str, Any]:
        return dict(
            sorted(
                {
                    **self.fields,
                    "kind": self.kind,
                    "tensor": self.tensor,
                    "severity": self.severity,
                    "message": self.message,
                }.items()
            )
        )

    @staticmethod
    def from_json(d: dict[str, Any]) -> Finding:
        core = {"kind", "tensor", "severity", "message"}
        return Finding(
            kind=d["kind"],
            tensor=d["tensor"],
            severity=d["severity"],
            message=d["message"],
            fields={k: v for k, v in d.items() if k not in core},
        )


@dataclass(frozen=True)
class Alignment:
    """How a run record was matched to a ref record: the plan, shown in the report."""

    ref_key: str
    run_key: str
    name_map: str = ""  # "" or "<run name> -> <ref name>" when a name map applied
    layout: str = "same"  # e.g. "same", "(T, n_head, head_dim) -> (T, n_embd)"
    rows: tuple[int, ...] = ()  # ref row index for each run row (by positions); () = identity
    positions: tuple[int, ...] = ()  # the positions of the compared rows
    run_rows: tuple[int, ...] = ()  # run row index of each compared row; () = identity
    comparable: bool = True  # False: the shapes could not be reconciled (see `layout`)
    note: str = ""  # e.g. rows left out because the two histories differ
    history_rows: tuple[int, ...] = ()  # positions of run rows left out: another token history
    unmatched_rows: tuple[int, ...] = ()  # positions (either side) with no row there on the other

    def to_json(self) -> dict[str, Any]:
        return dict(sorted(asdict(self).items()))


@dataclass(frozen=True)
class PairMetrics:
    """How far one run record is from its ref record, and the tolerance that applies."""

    role: str
    phase: str
    eval: int
    name: str
    occurrence: int
    max_abs: float
    nmse: float
    cos_min: float
    cos_median: float
    rel_p50: float
    rel_p99: float
    tolerance: float  # on nmse
    within: bool
    row_rel_err: tuple[float, ...] = ()  # per compared row: ||run-ref|| / ||ref||
    positions: tuple[int, ...] = ()  # the position of each compared row
    round: int = 0
    run_name: str = ""  # the run's own name when a name map renamed it
    row_tolerance: float = 0.0  # on each row's relative error
    inherited: bool = False  # beyond tolerance, but so is an input it depends on
    tolerance_sources: tuple[str, ...] = ()  # what the tolerance allows for: "f32", "f16 KV cache", ...

    def to_json(self) -> dict[str, Any]:
        return dict(sorted(asdict(self).items()))

    def row_positions(self) -> tuple[int, ...]:
        """The position of each row of `row_rel_err`; row indices when compare recorded none that fit."""
        if len(self.positions) == len(self.row_rel_err):
            return tuple(self.positions)
        return tuple(range(len(self.row_rel_err)))

    def first_bad_position(self) -> int | None:
        """The position of the first row over the row tolerance, else of the worst row; None
        without rows."""
        if not self.row_rel_err:
            return None
        err = np.nan_to_num(np.asarray(self.row_rel_err, dtype=np.float64), nan=np.inf)
        # the row tolerance, else the nmse one: nmse is a squared relative error
        bad = np.flatnonzero(err > (self.row_tolerance or math.sqrt(self.tolerance)))
        row = int(bad[0]) if bad.size else int(np.argmax(err))
        return self.row_positions()[row]


@dataclass(frozen=True)
class Skip:
    """One record set (role, phase, round, name, occurrence) not compared, or compared without
    some of its rows: why, on which side the records are, and which positions were left out."""

    role: Role
    phase: str
    round: int
    name: str  # the reference's name (the run's, mapped, when only the run has it)
    occurrence: int
    reason: SkipReason
    side: SkipSide  # "both": the pair exists, some or all rows were left out
    whole: bool  # no row (no element) of the record set was compared
    records: int  # records (one per eval) the set stacks
    rows: tuple[int, ...] = ()  # positions of the rows left out (either side); () = not row-wise
    evals: tuple[int, ...] = ()  # the evals holding them (the run's, or the ref's when only it has them)

    @property
    def is_expected(self) -> bool:
        return self.reason in EXPECTED_SKIPS

    def line(self) -> str:
        """One line for people: what was left out and why."""
        where = f"{self.name} ({phrase(self.role, self.phase)}, round {self.round}, occurrence {self.occurrence})"
        what = "not compared" if self.whole else f"{plural(len(self.rows), 'row')} left out"
        return f"{where}: {what}: {SKIP_SENTENCES[self.reason].format(side=SIDE_NAMES[self.side])}"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["expected"] = self.is_expected
        return dict(sorted(d.items()))

    @staticmethod
    def from_json(d: dict[str, Any]) -> Skip:
        return Skip(
            role=d["role"],
            phase=d["phase"],
            round=int(d["round"]),
            name=d["name"],
            occurrence=int(d["occurrence"]),
            reason=d["reason"],
            side=d["side"],
            whole=bool(d["whole"]),
            records=int(d["records"]),
            rows=tuple(d["rows"]),
            evals=tuple(d["evals"]),
        )


SIDE_NAMES = {"both": "both sides", "ref": "only the reference", "run": "only the run"}
SKIP_SENTENCES = {
    "token_history": "the rows there were computed from another token history than the reference's",
    "position": "no row at the same position on the other side",
    "missing_eval": "{side} has this eval group",
    "failed_eval": "the run's decode of this eval group failed",
    "no_rows": "the reference output no rows there",
    "no_draft": "the run decoded without drafting; the reference drafts every round",
    "fewer_drafts": "the run verified fewer drafts than the reference (the length budget left no room)",
    WARMUP_SKIP: "a warm-up or probe decode, outside the flow",
    "empty": "empty on both sides",
}


@dataclass(frozen=True)
class Coverage:
    """What compare compared and what it did not: the base an OK verdict rests on."""

    pairs: int = 0  # record sets compared (at least one row, or a whole non-row record)
    rows: int = 0  # rows compared, over all of them
    skips: tuple[Skip, ...] = ()
    ref_only: int = 0  # ref record sets whose name the run never has in that eval group
    run_only: int = 0  # run record sets whose name the reference never has in that eval group

    @property
    def unexpected(self) -> tuple[Skip, ...]:
        """Skips the flow does not explain: each is counted in an `unpaired` (or other) finding."""
        return tuple(s for s in self.skips if not s.is_expected)

    @property
    def expected(self) -> tuple[Skip, ...]:
        """Skips the flow explains: warm-up decodes, llama.cpp's prefill row, shorter last verifies."""
        return tuple(s for s in self.skips if s.is_expected)

    @property
    def pairs_skipped(self) -> int:
        """Record sets of which nothing was compared, for a reason the flow does not explain."""
        return sum(1 for s in self.unexpected if s.whole)

    @property
    def rows_skipped(self) -> int:
        """Rows left out (whole record sets and partial ones) for a reason the flow does not explain."""
        return sum(len(s.rows) for s in self.unexpected)

    def skipped_phrase(self) -> str:
        """`0 skipped`, or the record sets and rows left out; then what the flow explains."""
        n, rows = self.pairs_skipped, self.rows_skipped
        head = (
            "0 skipped"
            if not self.unexpected
            else f"{plural(n, 'record set')} skipped" + (f", {plural(rows, 'row')} left out" if rows else "")
        )
        if not self.expected:
            return head
        n_exp = sum(1 for s in self.expected if s.whole)
        rows_exp = sum(len(s.rows) for s in self.expected)
        reasons = ", ".join(dict.fromkeys(s.reason for s in self.expected))
        return (
            f"{head} ({plural(n_exp, 'record set')}"
            + (f", {plural(rows_exp, 'row')}" if rows_exp else "")
            + f" left out as expected: {reasons})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "pairs": self.pairs,
            "rows": self.rows,
            "pairs_skipped": self.pairs_skipped,
            "rows_skipped": self.rows_skipped,
            "skips_expected": len(self.expected),
            "ref_only": self.ref_only,
            "run_only": self.run_only,
            "skipped": [s.to_json() for s in self.skips],
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> Coverage:
        return Coverage(
            pairs=int(d["pairs"]),
            rows=int(d["rows"]),
            skips=tuple(Skip.from_json(s) for s in d["skipped"]),
            ref_only=int(d["ref_only"]),
            run_only=int(d["run_only"]),
        )


@dataclass(frozen=True)
class Comparison:
    """Everything compare found: findings first, then per-pair metrics and alignments."""

    ref_path: str
    run_path: str
    findings: tuple[Finding, ...]
    pairs: tuple[PairMetrics, ...]
    alignments: tuple[Alignment, ...]
    first_divergence: int | None = None  # index into `pairs`
    skipped: tuple[str, ...] = ()  # pairs not compared, one line each (no common rows, ...)
    types: dict[str, Any] = field(default_factory=dict)  # the types the tolerance model used
    coverage: Coverage = Coverage()
    map_path: str | None = None  # the name map (--map) compare applied, if any
    versions: dict[str, str | None] = field(default_factory=dict)  # featdiff's, and the run's llama.cpp
    layer_match: LayerMatch | None = None  # the first injected features x the target's layer inputs
    row_shift: RowShift | None = None  # run rows x ref rows of the first divergent record
    # (ref, run) manifests as compare read them: the report states the dumps' facts from these instead
    # of reading the dumps again; not part of the findings JSON
    manifests: tuple[Manifest, Manifest] | None = field(default=None, compare=False, repr=False)

    @property
    def inputs(self) -> tuple[Path, ...]:
        """The files this comparison was made of, which none of its outputs may overwrite."""
        return tuple(Path(p) for p in (self.ref_path, self.run_path, self.map_path) if p is not None)

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        """The findings JSON (docs/findings.md; its schema: docs/findings.schema.json)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "versions": self.versions,
            "ok": self.ok,
            "findings": [f.to_json() for f in self.findings],
            "records": [p.to_json() for p in self.pairs],
            "coverage": self.coverage.to_json(),
            "first_divergence": self._first_divergence_json(),
            "types": self.types,
            "layer_match": None if self.layer_match is None else self.layer_match.to_json(),
            "row_shift": None if self.row_shift is None else self.row_shift.to_json(),
        }

    def _first_divergence_json(self) -> dict[str, Any] | None:
        """Which record first diverges (`record`: its index in `records`), or None."""
        if self.first_divergence is None:
            return None
        p = self.pairs[self.first_divergence]
        return {
            "record": self.first_divergence,
            "role": p.role,
            "phase": p.phase,
            "round": p.round,
            "eval": p.eval,
            "name": p.name,
            "run_name": p.run_name or p.name,
            "occurrence": p.occurrence,
            "nmse": p.nmse,
            "tolerance": p.tolerance,
        }
