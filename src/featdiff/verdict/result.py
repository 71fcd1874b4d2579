"""`featdiff check`: one verdict a CI job (or a pytest test) acts on.

Consumes a GGUF pair, the reference's models and a llama.cpp build (in-process) or a program to
run around (`--exec`: llama-server or llama-speculative-simple); runs the stages in order: a short
capture, the reference on the run's prompt tokens and block length, following the run's tokens
from wherever its own choice parts from them (`reference --run`: a parting at a near-tie is
information, the rounds after it are still compared), compare, and the greedy accept probe of run
and reference (featdiff.verdict.probe). Produces a `CheckResult`: the comparison, the
probe, the accept judgement, the verdict and its reasons; writes the JSON, the HTML report and
the Markdown summary (for a CI job's page) on request. This module holds the result's records and
the judgement; `check` plans (verdict/plan.py, `plan_check`: every input and output checked before
a model runs), then executes (verdict/run.py, `run_check`); verdict/render.py writes what people read.

The accept margin. The probe is teacher-forced: in each drafted block i the reference drafts
after the run's own tokens, so the two sides pair block by block and d_i = run accepted - ref
accepted (tokens) is the run's loss in that block; the mean accepted lengths differ by
mean(d). The run matches the reference when |mean(d)| <= Z * s_d / sqrt(n), the two-sided normal
bound on a mean of n paired differences with sample standard deviation s_d (n - 1 denominator)
and Z = MARGIN_Z (99%). Right wiring gives d_i = 0 in every block, up to numerical near-ties of
the two argmaxes (f16 KV cache) that flip a block now and then; a single flipped block never
exceeds the bound (|mean(d)| = |d_j| / n while Z * s_d / sqrt(n) >= Z * |d_j| / n). A constant
loss (s_d = 0) exceeds it whatever its size. Fewer than MIN_BLOCKS blocks give no bound: a fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from featdiff.core.words import plural
from featdiff.diff.result import Comparison, Finding
from featdiff.verdict.probe import AcceptStats, Probe

MARGIN_Z = 2.576  # two-sided 99% normal quantile: a CI gate should rarely fail a right wiring by chance


MIN_BLOCKS = 2  # a sample standard deviation needs two blocks


Mode = Literal["in-process", "llama-server", "program", "capture"]


Verdict = Literal["pass", "fail"]


@dataclass(frozen=True)
class AcceptCheck:
    """The run's accept against the reference's over the probe's paired blocks."""

    run: AcceptStats
    ref: AcceptStats
    blocks: int  # drafted blocks paired (the run's rounds with drafts)
    gap: float  # run mean accepted length - ref mean accepted length (tokens per block)
    margin: float  # the allowed |gap| (module docstring); nan with fewer than MIN_BLOCKS blocks
    min_accept: float | None  # the least accept rate asked of the run (--min-accept)

    @property
    def matches(self) -> bool:
        return self.blocks >= MIN_BLOCKS and abs(self.gap) <= self.margin

    @property
    def above_min(self) -> bool:
        return self.min_accept is None or self.run.rate >= self.min_accept

    def to_json(self) -> dict[str, Any]:
        return {
            "run": _stats_json(self.run),
            "ref": _stats_json(self.ref),
            "blocks": self.blocks,
            "gap": self.gap,
            "margin": self.margin,
            "z": MARGIN_Z,
            "matches": self.matches,
            "min_accept": self.min_accept,
            "above_min": self.above_min,
        }


@dataclass(frozen=True)
class CheckResult:
    """One check: what compare found, what the probe measured, and the verdict with its reasons."""

    comparison: Comparison
    probe: Probe
    accept: AcceptCheck
    verdict: Verdict
    reasons: tuple[str, ...]  # one sentence per reason to fail; () on a pass
    mode: Mode
    program: str | None  # the program run around (--exec), by name; None in-process
    prompt_tokens: tuple[int, ...]  # the captured flow's prompt
    report: Path | None = None
    dumps: tuple[Path, Path] | None = None  # (ref, run), when kept (--keep, or a failed check's)
    program_log: Path | None = None  # the program's own output (--exec), named at the end

    @property
    def ok(self) -> bool:
        return self.verdict == "pass"

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "verdict": self.verdict,
            "reasons": list(self.reasons),
            "mode": self.mode,
            "program": self.program,
            "prompt_tokens": list(self.prompt_tokens),
            "accept": self.accept.to_json(),
            "comparison": self.comparison.to_json(),
            "probe": _probe_json(self.probe),
            "report": None if self.report is None else str(self.report),
            "dumps": None if self.dumps is None else {"ref": str(self.dumps[0]), "run": str(self.dumps[1])},
        }


def exit_code(result: CheckResult) -> int:
    """0 on a pass, 1 on a fail (an error finding, an accept gap, an accept below --min-accept)."""
    return 0 if result.ok else 1


# ---------------------------------------------------------------- the accept judgement (pure)


def judge_accept(probe_result: Probe, min_accept: float | None = None) -> AcceptCheck:
    """The run's accept against the reference's, with the margin of the module docstring."""
    diffs = [r.run_accepted - r.ref_accepted for p in probe_result.prompts for r in p.rounds if r.run_drafts]
    n = len(diffs)
    gap = sum(diffs) / n if n else 0.0
    margin = MARGIN_Z * _sample_sd(diffs) / math.sqrt(n) if n >= MIN_BLOCKS else math.nan
    return AcceptCheck(probe_result.run, probe_result.ref, n, gap, margin, min_accept)


def _sample_sd(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def _placed(f: Finding) -> str:
    """` (where: graph)`: where an error's fault lives (docs/findings.md, `where`), when it says."""
    return f" (where: {f.fields['where']})" if "where" in f.fields else ""


def reasons_to_fail(comparison: Comparison, accept: AcceptCheck) -> tuple[str, ...]:
    """One sentence per error finding, then the accept gap and the accept floor, as they apply."""
    out = [f"{f.kind} at {f.tensor}{_placed(f)}: {f.message}" for f in comparison.findings if f.severity == "error"]
    if accept.blocks < MIN_BLOCKS:
        out.append(
            f"the run drafted {plural(accept.blocks, 'block')}; the accept comparison needs at least {MIN_BLOCKS}: "
            "raise --rounds or give more prompts"
        )
    elif not accept.matches:
        out.append(
            f"accept gap: the run accepts {accept.run.mean_accepted_length:.2f} tokens per block, the "
            f"reference {accept.ref.mean_accepted_length:.2f} (gap {accept.gap:+.2f}, beyond the margin "
            f"±{accept.margin:.2f} over {accept.blocks} blocks)"
        )
    if not accept.above_min:
        out.append(f"accept rate {accept.run.rate:.1%} is below --min-accept {accept.min_accept:.1%}")
    return tuple(out)


def _stats_json(s: AcceptStats) -> dict[str, Any]:
    return {
        "rounds": s.rounds,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "rate": s.rate,
        "mean_accepted_length": s.mean_accepted_length,
    }


def _probe_json(p: Probe) -> dict[str, Any]:
    return {
        "run": _stats_json(p.run),
        "ref": _stats_json(p.ref),
        "has_gap": p.has_gap,
        "prompts": [
            {
                "label": q.label,
                "prompt_tokens": list(q.prompt_tokens),
                "run": _stats_json(q.run),
                "ref": _stats_json(q.ref),
                "server_draft_n": q.server_draft_n,
                "server_draft_n_accepted": q.server_draft_n_accepted,
                "rounds": [
                    {
                        "pos0": r.pos0,
                        "run_drafts": list(r.run_drafts),
                        "ref_drafts": list(r.ref_drafts),
                        "run_accepted": r.run_accepted,
                        "ref_accepted": r.ref_accepted,
                    }
                    for r in q.rounds
                ],
            }
            for q in p.prompts
        ],
    }
