"""Page: the self-contained HTML triage report.

Consumes a `Comparison`, the two dump manifests and the drawn pictures (PNG bytes); produces
one HTML string with the images embedded as base64 data URIs and no script, so it opens from
disk or as an e-mail attachment. Pure string building: no I/O.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from featdiff.diff.result import Alignment, Comparison, Coverage, Finding, PairMetrics
from featdiff.dump.manifest import Manifest
from featdiff.html.figure import eval_label
from featdiff.version import VERSION

MAX_INTS_SHOWN = 12  # a row list longer than this is shown as ranges, then cut


@dataclass(frozen=True)
class Picture:
    """One figure of the page: a PNG, or the reason it could not be drawn."""

    slug: str  # element id and PNG file stem, e.g. "layer-match"
    title: str
    caption: str  # plain sentences: what is shown and what it suggests
    png: bytes | None = None
    missing: str = ""  # why there is no picture, when png is None


def render_page(comparison: Comparison, ref: Manifest, run: Manifest, pictures: Sequence[Picture]) -> str:
    """The whole report: verdict, findings, figures, the per-record table, alignments, dumps."""
    title = f"featdiff report: {comparison.run_path} vs {comparison.ref_path}"
    body = "\n".join(
        [
            f"<header><h1>featdiff triage report</h1><p class='paths'>ref <code>{_e(comparison.ref_path)}</code>"
            f" ({_e(ref.source)}) &middot; run <code>{_e(comparison.run_path)}</code> ({_e(run.source)})</p></header>",
            _verdict(comparison),
            _findings(comparison.findings),
            *(_picture(i + 1, p) for i, p in enumerate(pictures)),
            _records(comparison, len(pictures) + 1),
            _alignments(comparison.alignments),
            _dumps(ref, run, comparison.types),
            f"<footer>featdiff {_e(VERSION)}</footer>",
        ]
    )
    return (
        f"<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


def verdict_sentence(comparison: Comparison) -> str:
    """One line: OK or FAIL, how many error findings, and the first divergent record."""
    errors = sum(f.severity == "error" for f in comparison.findings)
    head = "OK: no error finding" if comparison.ok else f"FAIL: {errors} error finding{'s' * (errors != 1)}"
    if comparison.first_divergence is None:
        return f"{head}; no compared record is out of tolerance."
    p = comparison.pairs[comparison.first_divergence]
    return (
        f"{head}; the first divergent record is {p.name} ({eval_label(p)}), "
        f"nmse {p.nmse:.3g} against a tolerance of {p.tolerance:.3g}."
    )


def _verdict(comparison: Comparison) -> str:
    css = "ok" if comparison.ok else "fail"
    return (
        f"<section id='verdict' class='verdict {css}'>{_e(verdict_sentence(comparison))}"
        f"{_coverage(comparison.coverage)}</section>"
    )


def coverage_sentence(coverage: Coverage) -> str:
    """What the verdict rests on: record sets and rows compared, and what was left out."""
    return (
        f"Compared {coverage.pairs} record sets ({coverage.rows} rows); {coverage.skipped_phrase()}"
        f"{' (listed under the records table)' if coverage.skips else ''}."
    )


def _coverage(coverage: Coverage) -> str:
    if coverage == Coverage():
        return ""  # a comparison made without a plan (by hand) has no coverage to state
    return f"<p class='coverage'>{_e(coverage_sentence(coverage))}</p>"


def _findings(findings: Sequence[Finding]) -> str:
    if not findings:
        return "<section id='findings'><h2>Findings</h2><p>No findings.</p></section>"
    items = "".join(
        f"<li class='{_e(f.severity)}'><span class='sev'>{_e(f.severity)}</span>{_where(f)} {_e(f.message)}"
        f"<div class='fields'>{_e(_finding_fields(f))}</div></li>"
        for f in findings
    )
    return f"<section id='findings'><h2>Findings</h2><ol>{items}</ol></section>"


def _where(f: Finding) -> str:
    """Where an error's fault lives (docs/findings.md, `where`), the evidence as its tooltip."""
    if "where" not in f.fields:
        return ""
    return (
        f" <span class='where' title='{_e(str(f.fields.get('where_reason', '')))}'>{_e(str(f.fields['where']))}</span>"
    )


def _finding_fields(f: Finding) -> str:
    shown = {k: v for k, v in f.fields.items() if k != "where"}  # the badge shows it
    fields = " ".join(f"{k}={_field_value(v)}" for k, v in sorted(shown.items()))
    return f"{f.kind} on {f.tensor}" + (f": {fields}" if fields else "")


def _field_value(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else json.dumps(value)


def _picture(number: int, p: Picture) -> str:
    head = f"<h2>{number}. {_e(p.title)}</h2>"
    if p.png is None:
        return f"<section class='figure' id='{_e(p.slug)}'>{head}<p class='missing'>Not drawn: {_e(p.missing)}</p></section>"
    data = base64.b64encode(p.png).decode("ascii")
    return (
        f"<section class='figure' id='{_e(p.slug)}'>{head}<figure>"
        f"<img src='data:image/png;base64,{data}' alt='{_e(p.title)}'>"
        f"<figcaption>{_e(p.caption)}</figcaption></figure></section>"
    )


_RECORD_COLUMNS = (
    "#",
    "eval",
    "record",
    "max_abs",
    "nmse",
    "tolerance (nmse)",
    "row tolerance",
    "cos_min",
    "cos_median",
    "rel_p50",
    "rel_p99",
    "within",
)


def _records(comparison: Comparison, number: int) -> str:
    rows = "".join(_record_row(i, p, i == comparison.first_divergence) for i, p in enumerate(comparison.pairs))
    return (
        f"<section id='records'><h2>{number}. Records: metrics and the tolerance used</h2>"
        f"<p>One row per compared record in compare's order. A record is within tolerance when its nmse "
        f"and every row's relative error are within theirs; red rows are not, &ldquo;inherited&rdquo; ones "
        f"only because an input they depend on is not. The first divergence is marked &#9654;.</p>"
        f"<table><thead>{_header(_RECORD_COLUMNS)}</thead><tbody>{rows}</tbody></table>"
        f"{_skipped(comparison.skipped)}</section>"
    )


def _record_row(i: int, p: PairMetrics, is_first: bool) -> str:
    css = " ".join(c for c, on in (("bad", not p.within), ("first", is_first)) if on)
    name = p.name if p.occurrence == 0 else f"{p.name}#{p.occurrence}"
    renamed = f" <span class='note'>(run: {_e(p.run_name)})</span>" if p.run_name and p.run_name != p.name else ""
    within = "yes" if p.within else ("no, inherited" if p.inherited else "no")
    cells = [
        ("&#9654; " if is_first else "") + str(i),
        _e(eval_label(p)),
        f"<code>{_e(name)}</code>{renamed}",
        *(_number(v) for v in (p.max_abs, p.nmse, p.tolerance)),
        _number(p.row_tolerance) if p.row_tolerance else "-",
        *(_number(v) for v in (p.cos_min, p.cos_median, p.rel_p50, p.rel_p99)),
        within,
    ]
    return f"<tr class='{css}'>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def _skipped(skipped: Sequence[str]) -> str:
    if not skipped:
        return ""
    items = "".join(f"<li>{_e(line)}</li>" for line in skipped)
    return f"<h3>Not compared</h3><ul class='skipped'>{items}</ul>"


_ALIGNMENT_COLUMNS = (
    "run record",
    "ref record",
    "name map",
    "layout",
    "ref row of each run row",
    "run rows",
    "positions",
    "note",
)


def _alignments(alignments: Sequence[Alignment]) -> str:
    if not alignments:
        return "<section id='alignments'><h2>Alignments</h2><p>compare recorded no alignments.</p></section>"
    rows = "".join(_alignment_row(a) for a in alignments)
    return (
        f"<section id='alignments'><h2>Alignments: what was assumed</h2>"
        f"<p>How compare matched each run record to a ref record before measuring: keys of the records "
        f"stacked on each side, the name map and layout applied, and which rows met which "
        f"(&ldquo;identity&rdquo;: row i with row i).</p>"
        f"<table><thead>{_header(_ALIGNMENT_COLUMNS)}</thead><tbody>{rows}</tbody></table></section>"
    )


def _alignment_row(a: Alignment) -> str:
    note = a.note if a.comparable else "; ".join(x for x in ("not comparable", a.note) if x)
    cells = (
        f"<code>{_e(a.run_key.replace(',', ', '))}</code>",
        f"<code>{_e(a.ref_key.replace(',', ', '))}</code>",
        _e(a.name_map or "-"),
        _e(a.layout),
        _e(summarise_ints(a.rows) if a.rows else "identity"),
        _e(summarise_ints(a.run_rows) if a.run_rows else "identity"),
        _e(summarise_ints(a.positions) if a.positions else "-"),
        _e(note or "-"),
    )
    css = "" if a.comparable else " class='bad'"
    return f"<tr{css}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def _dumps(ref: Manifest, run: Manifest, types: dict[str, Any]) -> str:
    blocks = "".join(
        f"<div><h3>{side} ({_e(m.source)})</h3>{_key_values(_dump_facts(m))}</div>"
        for side, m in (("ref", ref), ("run", run))
    )
    tolerance = f"<h3>Types the tolerance model used</h3>{_key_values(sorted(types.items()))}" if types else ""
    return f"<section id='dumps'><h2>Dumps</h2><div class='sides'>{blocks}</div>{tolerance}</section>"


def _dump_facts(m: Manifest) -> list[tuple[str, Any]]:
    facts: list[tuple[str, Any]] = [
        (f"{role}.{k}", v)
        for role, meta in sorted(m.models.items())
        if isinstance(meta, dict)
        for k, v in sorted(meta.items())
    ]
    facts += [(f"build.{k}", v) for k, v in sorted(m.build.items())]
    return facts + [("evals", len(m.evals)), ("records", len(m.records)), ("rounds", len(m.rounds))]


def _key_values(facts: Iterable[tuple[str, Any]]) -> str:
    rows = "".join(
        f"<tr><th>{_e(k)}</th><td>{_e(v if isinstance(v, str) else json.dumps(v))}</td></tr>" for k, v in facts
    )
    return f"<table class='kv'>{rows}</table>"


def summarise_ints(values: Sequence[int]) -> str:
    """Integers as ranges, `0..11, 14, 20..23`, cut after MAX_INTS_SHOWN pieces."""
    spans: list[list[int]] = []  # [first, last] of each run of consecutive integers
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    pieces = [str(a) if a == b else f"{a}..{b}" for a, b in spans]
    cut = pieces[:MAX_INTS_SHOWN]
    return ", ".join(cut) + (f", ... ({len(values)} in all)" if len(pieces) > len(cut) else "")


def _header(columns: Iterable[str]) -> str:
    return "<tr>" + "".join(f"<th>{_e(c)}</th>" for c in columns) + "</tr>"


def _number(value: float) -> str:
    return f"{value:.3g}"


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


_CSS = """
body{font:15px/1.45 -apple-system,'Segoe UI',Roboto,'DejaVu Sans',sans-serif;color:#1d1d1f;
 max-width:1180px;margin:24px auto;padding:0 18px;background:#fff}
h1{font-size:24px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px}h3{font-size:15px;margin:8px 0}
.paths{color:#555;margin:0}code{font:13px 'DejaVu Sans Mono',Menlo,monospace}
.verdict{font-size:17px;font-weight:600;padding:12px 16px;border-radius:6px;margin:18px 0}
.verdict.ok{background:#e5f6e8;border-left:6px solid #2e9e44}
.verdict.fail{background:#fdeaea;border-left:6px solid #d93025}
.verdict p.coverage{font-size:13px;font-weight:400;margin:6px 0 0}
#findings ol{padding-left:22px}#findings .where{font-weight:bold;padding:0 4px;border:1px solid #888}#findings li{margin:6px 0}
.sev{display:inline-block;font-size:12px;font-weight:700;text-transform:uppercase;padding:1px 6px;
 border-radius:4px;margin-right:6px;background:#eee}
li.error .sev{background:#d93025;color:#fff}li.info .sev{background:#5f6368;color:#fff}
.fields{color:#666;font-size:13px;margin-left:2px}
figure{margin:0}figure img{max-width:100%;height:auto;border:1px solid #ddd}
figcaption{color:#444;font-size:14px;margin-top:6px;max-width:900px}.missing{color:#8a6d00}
table{border-collapse:collapse;font-size:13px;width:100%}
th,td{border-bottom:1px solid #e3e3e3;padding:3px 8px;text-align:left;vertical-align:top}
thead th{background:#f4f4f4;position:sticky;top:0}
tr.bad td{background:#fff1f0}tr.first td{background:#ffd9d6;font-weight:600}
.sides{display:flex;gap:24px;flex-wrap:wrap}.sides>div{flex:1;min-width:320px}
table.kv th{width:40%;font-weight:500;color:#555}td{word-break:break-word}
.note{color:#777;font-size:12px}ul.skipped{font-size:13px;color:#555}
footer{color:#888;font-size:12px;margin:32px 0 12px}
"""
