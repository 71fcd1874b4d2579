"""`featdiff check`'s verdict: its result records and judgement (`verdict/result.py`), the accept probe
and lint. This face keeps `from featdiff.verdict import CheckResult ...` working."""

from __future__ import annotations

from featdiff.verdict.result import (
    DEFAULT_ROUNDS,
    ENV_STEP_SUMMARY,
    MARGIN_Z,
    MIN_BLOCKS,
    AcceptCheck,
    CheckPlan,
    CheckResult,
    Mode,
    Verdict,
    check,
    exit_code,
    judge_accept,
    plan_check,
    reasons_to_fail,
    render_markdown,
    render_text,
    run_check,
    write_outputs,
)

__all__ = [
    "AcceptCheck",
    "CheckPlan",
    "CheckResult",
    "DEFAULT_ROUNDS",
    "ENV_STEP_SUMMARY",
    "MARGIN_Z",
    "MIN_BLOCKS",
    "Mode",
    "Verdict",
    "check",
    "exit_code",
    "judge_accept",
    "plan_check",
    "reasons_to_fail",
    "render_markdown",
    "render_text",
    "run_check",
    "write_outputs",
]
