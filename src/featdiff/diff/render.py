"""Turn a `Comparison` into what a person or a script reads: a rich summary on stdout (verdict,
ranked findings, the per-record table on request), the findings JSON, and the exit code.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from featdiff.core.outputs import check_output, replaced
from featdiff.core.phases import phrase
from featdiff.core.words import plural
from featdiff.diff.result import Comparison, Finding, PairMetrics

EXIT_OK, EXIT_FINDINGS = 0, 1  # the contract's codes (docs/findings.md); 2 is the CLI's, for InputError
SEVERITY_STYLE = {"error": "bold red", "info": "cyan"}
# The heading of a findings table's message column: an error's message says what to do, an info
# finding's notes what was seen (each severity gets its own table, so no row sits under the other's).
MESSAGE_HEADINGS = {"error": "what to do", "info": "note"}


def exit_code(c: Comparison) -> int:
    """0 when no finding is an error, 1 otherwise."""
    return EXIT_OK if c.ok else EXIT_FINDINGS


def jsonable(value: Any) -> Any:
    """`value` with NaN/Inf as null (strict JSON has no spelling for them), tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_json(c: Comparison, dest: str) -> None:
    """Write the findings JSON (docs/findings.md) to the file `dest` (never one of the
    comparison's inputs; replaced whole, never left half-written), or to stdout for "-"."""
    text = json.dumps(jsonable(c.to_json()), indent=1, allow_nan=False) + "\n"
    if dest == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    with replaced(check_output(Path(dest), c.inputs, "--json")) as tmp:
        tmp.write_text(text, encoding="utf-8")


def verdict(c: Comparison) -> str:
    """One line: pass/fail, the count of findings, where the run first diverges, and the coverage."""
    errors = [f for f in c.findings if f.severity == "error"]
    gap = next((f for f in c.findings if f.kind == "unmodelled"), None)
    if not errors:
        # an OK beside unmodelled features covers only what was judged: say what was not
        caveat = (
            f"; no verdict on {plural(len(gap.fields.get('not_judged', [])), 'record set')} that depend on "
            f"{', '.join(gap.fields.get('names', []))}, which the reference does not model"
            if gap is not None
            else ""
        )
        return (
            f"OK: no error finding over {plural(c.coverage.pairs, 'compared record')} "
            f"({plural(c.coverage.rows, 'row')}){caveat}; "
            f"{c.coverage.skipped_phrase()}"
        )
    where = ""
    if c.first_divergence is not None:
        p = c.pairs[c.first_divergence]
        where = f"; first divergence: {p.run_name or p.name} ({phrase(p.role, p.phase)}, eval {p.eval})"
    return f"FAIL: {plural(len(errors), 'error finding')}{where}; {c.coverage.skipped_phrase()}"


def _findings_tables(findings: tuple[Finding, ...]) -> list[Table]:
    """One table per severity present, errors first, each folded to the console's width: its
    message column headed for what the rows say (MESSAGE_HEADINGS)."""
    tables = []
    for severity, heading in MESSAGE_HEADINGS.items():
        rows = [f for f in findings if f.severity == severity]
        if not rows:
            continue
        table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        placed = severity == "error"  # every error says where its fault lives (docs/findings.md, `where`)
        for col in ("", "kind", "tensor", *(("where",) if placed else ()), heading):
            table.add_column(col, overflow="fold")
        for f in rows:
            where = (str(f.fields.get("where", "")),) if placed else ()
            table.add_row(
                f"[{SEVERITY_STYLE[severity]}]{severity}[/]", f.kind, escape(f.tensor), *where, escape(f.message)
            )
        tables.append(table)
    return tables


def _fmt(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.2g}"


def _records_table(pairs: tuple[PairMetrics, ...]) -> Table:
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col in ("eval", "phase", "tensor", "nmse", "tol", "cos", "max|d|", ""):
        numeric = col in ("eval", "nmse", "tol", "cos", "max|d|")
        table.add_column(
            col,
            justify="right" if numeric else "left",
            no_wrap=True,
            overflow="ellipsis",
            min_width=len("inherited") if col == "" else None,
        )
    for p in pairs:
        status = "ok" if p.within else ("inherited" if p.inherited else "[bold red]DIVERGES[/]")
        name = p.name if not p.run_name else f"{p.run_name} ({p.name})"
        table.add_row(
            str(p.eval),
            p.phase,
            f"{name}#{p.occurrence}" if p.occurrence else name,
            _fmt(p.nmse),
            _fmt(p.tolerance),
            _fmt(p.cos_min),
            _fmt(p.max_abs),
            status,
        )
    return table


def render_summary(c: Comparison, verbose: bool = False, console: Console | None = None) -> None:
    """Print the verdict and the ranked findings; with `verbose`, every compared record too."""
    out = console or Console()
    style = "bold green" if c.ok else "bold red"
    out.print(f"[{style}]{verdict(c)}[/]", highlight=False, soft_wrap=True)
    for table in _findings_tables(c.findings):
        out.print(table)
    if verbose:
        out.print(_records_table(c.pairs))
        for skip in c.coverage.skips:
            out.print(f"[dim]not compared: {escape(skip.line())}[/]", highlight=False)
