"""`featdiff check`'s result for people and scripts: the terminal view (`render_text`), the Markdown
summary for a CI job's page (`render_markdown`), and the JSON and Markdown files (`write_outputs`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from featdiff.core.outputs import append_text, replaced
from featdiff.core.words import plural
from featdiff.verdict.probe import AcceptStats
from featdiff.verdict.result import MARGIN_Z, MIN_BLOCKS, AcceptCheck, CheckResult

ENV_STEP_SUMMARY = "GITHUB_STEP_SUMMARY"  # GitHub Actions: Markdown appended here shows on the run's page


def write_outputs(result: CheckResult, json_out: str | None, summary_md: Path | None) -> None:
    """The JSON (`-`: stdout), the Markdown summary, and that summary appended to $GITHUB_STEP_SUMMARY."""
    from featdiff.diff.render import jsonable  # NaN/Inf as null, as the findings JSON writes them

    if json_out is not None:
        text = json.dumps(jsonable(result.to_json()), indent=1, sort_keys=True, allow_nan=False) + "\n"
        if json_out == "-":
            print(text, end="", flush=True)
        else:
            with replaced(Path(json_out)) as tmp:
                tmp.write_text(text, encoding="utf-8")
    markdown = render_markdown(result)
    if summary_md is not None:
        with replaced(Path(summary_md)) as tmp:
            tmp.write_text(markdown, encoding="utf-8")
    step_summary = os.environ.get(ENV_STEP_SUMMARY)
    if step_summary:
        append_text(Path(step_summary), markdown + "\n")  # GitHub's file: appended to, never replaced


def render_text(result: CheckResult) -> str:
    """The terminal view: compare's verdict and findings, the probe table, the verdict and why."""
    from featdiff.diff import verdict
    from featdiff.verdict.probe import render_probe

    findings = [f"  {f.severity:5s} {f.kind:16s} {f.tensor}: {f.message}" for f in result.comparison.findings]
    head = (
        "PASS: the wiring compares clean and the run accepts as the reference does"
        if result.ok
        else f"FAIL: {plural(len(result.reasons), 'reason')}"
    )
    lines = [
        f"wiring: {verdict(result.comparison)}",
        *findings,
        "",
        render_probe(result.probe),
        _margin_line(result.accept),
        "",
        head,
        *(f"  - {r}" for r in result.reasons),
    ]
    if result.report is not None:
        lines.append(f"report: {result.report}")
    if result.program_log is not None:
        lines.append(f"{result.program}'s own output: {result.program_log}")
    return "\n".join(lines)


def _margin_line(a: AcceptCheck) -> str:
    if a.blocks < MIN_BLOCKS:
        return f"accept: {plural(a.blocks, 'drafted block')}, too few to judge (at least {MIN_BLOCKS})"
    word = "within" if a.matches else "beyond"
    return (
        f"accept: run {a.run.mean_accepted_length:.2f} vs reference {a.ref.mean_accepted_length:.2f} tokens "
        f"per block, gap {a.gap:+.2f} {word} the margin ±{a.margin:.2f} ({a.blocks} paired blocks, z {MARGIN_Z})"
    )


def render_markdown(result: CheckResult) -> str:
    """A short Markdown verdict for a CI job summary: reasons, accept table, coverage, report."""
    c, a = result.comparison, result.accept
    title = "pass" if result.ok else "FAIL"
    lines = [
        f"## featdiff check: {title}",
        "",
        f"Drafter wiring {_where(result)}, captured on a prompt of {len(result.prompt_tokens)} tokens.",
        "",
    ]
    if result.reasons:
        lines += ["**Why it fails**", ""] + [f"1. {_md(r)}" for r in result.reasons] + [""]
    lines += [
        "| accept (greedy) | blocks | drafted | accepted | rate | mean accepted length |",
        "|---|---:|---:|---:|---:|---:|",
        _md_row("run", a.run),
        _md_row("reference", a.ref),
        "",
        _md(_margin_line(a)) + ".",
        "",
        f"**Coverage**: {c.coverage.pairs} record sets compared ({c.coverage.rows} rows); "
        f"{_md(c.coverage.skipped_phrase())}.",
    ]
    infos = [f for f in c.findings if f.severity != "error"]
    if infos:
        lines += [
            "",
            f"{plural(len(infos), 'info finding')}: " + "; ".join(_md(f"{f.kind} at {f.tensor}") for f in infos) + ".",
        ]
    if result.report is not None:
        lines += ["", f"HTML report: [{result.report.name}]({result.report}) (`{result.report}`)"]
    return "\n".join(lines) + "\n"


def _where(result: CheckResult) -> str:
    return "in-process through the llama.cpp library" if result.program is None else f"around {result.program}"


def _md_row(side: str, s: AcceptStats) -> str:
    return f"| {side} | {s.rounds} | {s.drafted} | {s.accepted} | {s.rate:.1%} | {s.mean_accepted_length:.2f} |"


def _md(text: str) -> str:
    """Text safe inside a Markdown line or table cell."""
    return text.replace("|", "\\|").replace("\n", " ")
