"""`featdiff check`'s verdict: its result records and judgement (result.py), its plan (plan.py), its run
(run.py) and what it prints and writes (render.py), the accept probe and lint. This face keeps
`from featdiff.verdict import CheckResult ...` working."""

from __future__ import annotations

from featdiff.verdict.plan import DEFAULT_ROUNDS, CheckPlan, plan_check
from featdiff.verdict.render import ENV_STEP_SUMMARY, render_markdown, render_text, write_outputs
from featdiff.verdict.result import (
    MARGIN_Z,
    MIN_BLOCKS,
    AcceptCheck,
    CheckResult,
    Mode,
    Verdict,
    exit_code,
    judge_accept,
    reasons_to_fail,
)
from featdiff.verdict.run import check, run_check

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
