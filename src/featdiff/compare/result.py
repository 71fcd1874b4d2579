"""The records compare produces: pair metrics, alignments, findings and the whole comparison.

These are the contract between compare/ (which fills them) and report/ and the CLI (which
render them). JSON keys are the contract's names (DESIGN.md, findings vocabulary).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Severity = Literal["error", "info"]
Kind = Literal[
    "layer_offset", "slot_permutation", "layout_transpose", "row_shift", "position_offset",
    "missing_term", "extra_term", "scale", "wrong_source", "not_conditioned", "zeros",
    "nonfinite", "stale", "missing_tensor", "unexpected_tensor", "divergence", "numeric_noise",
]
KINDS: tuple[str, ...] = Kind.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Finding:
    """One diagnosis. `fields` holds the kind-specific fields, keyed exactly as in DESIGN.md."""

    kind: str
    tensor: str
    severity: Severity
    message: str
    fields: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dict(sorted({**self.fields, "kind": self.kind, "tensor": self.tensor,
                            "severity": self.severity, "message": self.message}.items()))

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Finding":
        core = {"kind", "tensor", "severity", "message"}
        return Finding(kind=d["kind"], tensor=d["tensor"], severity=d["severity"],
                       message=d["message"], fields={k: v for k, v in d.items() if k not in core})


@dataclass(frozen=True)
class Alignment:
    """How a run record was matched to a ref record: the plan, shown in the report."""

    ref_key: str
    run_key: str
    name_map: str = ""          # "" or "<run name> -> <ref name>" when a name map applied
    layout: str = "same"        # e.g. "same", "(T, n_head, head_dim) -> (T, n_embd)"
    rows: tuple[int, ...] = ()  # ref row index for each run row (by positions); () = identity
    positions: tuple[int, ...] = ()  # the positions of the compared rows
    run_rows: tuple[int, ...] = ()   # run row index of each compared row; () = identity
    comparable: bool = True          # False: the shapes could not be reconciled (see `layout`)
    note: str = ""                   # e.g. rows left out because the two histories differ

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
    tolerance: float   # on nmse
    within: bool
    row_rel_err: tuple[float, ...] = ()  # per compared row: ||run-ref|| / ||ref||
    positions: tuple[int, ...] = ()      # the position of each compared row
    round: int = 0
    run_name: str = ""                   # the run's own name when a name map renamed it
    row_tolerance: float = 0.0           # on each row's relative error
    inherited: bool = False              # beyond tolerance, but so is an input it depends on

    def to_json(self) -> dict[str, Any]:
        return dict(sorted(asdict(self).items()))


@dataclass(frozen=True)
class Comparison:
    """Everything compare found: findings first, then per-pair metrics and alignments."""

    ref_path: str
    run_path: str
    findings: tuple[Finding, ...]
    pairs: tuple[PairMetrics, ...]
    alignments: tuple[Alignment, ...]
    first_divergence: int | None = None  # index into `pairs`
    skipped: tuple[str, ...] = ()        # pairs not compared, one line each (no common rows, ...)
    types: dict[str, Any] = field(default_factory=dict)  # the types the tolerance model used

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "findings": [f.to_json() for f in self.findings],
                "records": [p.to_json() for p in self.pairs]}
