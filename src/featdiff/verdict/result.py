"""`featdiff check`: one verdict a CI job (or a pytest test) acts on.

Consumes a GGUF pair, the reference's models and a llama.cpp build (in-process) or a program to
run around (`--exec`: llama-server or llama-speculative-simple); runs the stages in order: a short
capture, the reference on the run's prompt tokens and block length, following the run's tokens
from wherever its own choice parts from them (`reference --run`: a parting at a near-tie is
information, the rounds after it are still compared), compare, and the greedy accept probe of run
and reference (featdiff.verdict.probe). Produces a `CheckResult`: the comparison, the
probe, the accept judgement, the verdict and its reasons; writes the JSON, the HTML report and
the Markdown summary (for a CI job's page) on request. `check` plans (`plan_check`: every input
and output checked before a model runs), then executes (`run_check`).

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

import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from featdiff.core.errors import InputError, ProgramFailed
from featdiff.core.outputs import append_text, check_output, check_output_dir, replaced
from featdiff.core.words import plural
from featdiff.diff.result import Comparison, Finding
from featdiff.dump.manifest import Manifest
from featdiff.verdict.probe import AcceptStats, Probe

MARGIN_Z = 2.576  # two-sided 99% normal quantile: a CI gate should rarely fail a right wiring by chance
MIN_BLOCKS = 2  # a sample standard deviation needs two blocks
DEFAULT_ROUNDS = 4  # in-process: rounds of the capture, and of the probe per prompt
RUN_DUMP, REF_DUMP = "run.npz", "ref.npz"  # the intermediate dumps, in --keep DIR or a temporary one
ENV_STEP_SUMMARY = "GITHUB_STEP_SUMMARY"  # GitHub Actions: Markdown appended here shows on the run's page
Mode = Literal["in-process", "llama-server", "program", "capture"]
Verdict = Literal["pass", "fail"]

log = logging.getLogger(__name__)


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


# ---------------------------------------------------------------- running the stages


@dataclass(frozen=True)
class CheckPlan:
    """What a check runs, checked before anything runs: the models, the build or program, the
    prompts (the capture takes the first), the rounds and where each output goes."""

    target: Path
    model: Path
    ref_target: Path  # the reference's target: --ref-target, else --target
    ref_model: Path  # the reference drafter: --ref-model (e.g. the trained HF checkpoint), else --model
    mode: Mode
    command: tuple[str, ...]  # the program run around (--exec); () in-process
    llama_dir: Path | None
    prompts: Path | None  # None: probe's built-in prompts
    rounds: int
    min_accept: float | None
    keep: Path | None  # where the dumps stay; None: a temporary directory
    report: Path | None
    json_out: str | None  # a path, or "-" for stdout
    summary_md: Path | None
    run: Path | None = None  # a capture to judge (mode "capture"): no program is run
    layer_ids_mean: str | None = None  # --layer-ids-mean: what an EAGLE3 HF reference drafter's ids name


def plan_check(
    target: Path,
    model: Path,
    *,
    ref_target: Path | None = None,
    ref_model: Path | None = None,
    llama_dir: Path | None = None,
    command: list[str] | None = None,
    prompts: Path | None = None,
    rounds: int | None = None,
    min_accept: float | None = None,
    keep: Path | None = None,
    report: Path | None = None,
    json_out: str | None = None,
    summary_md: Path | None = None,
    run: Path | None = None,
    layer_ids_mean: str | None = None,
) -> CheckPlan:
    """The checked plan of `check`: every output checked against the inputs (featdiff.core.outputs)."""
    from featdiff.programs.exec import command_files

    if run is not None and (command or prompts is not None):
        raise InputError(
            f"--run {run} judges that capture as it is: drop {'--exec' if command else '--prompts'} (the capture "
            "already holds the prompts and the program's rounds)"
        )
    mode: Mode = "capture" if run is not None else _mode(command)
    if mode == "program" and prompts is not None:
        raise InputError(
            f"{prompts}: {(command or [''])[0]} decodes the prompt of its own command line (-p); "
            "drop --prompts, or check through llama-server or in-process"
        )
    rounds = DEFAULT_ROUNDS if rounds is None else rounds
    if rounds < 1:
        raise InputError(f"--rounds {rounds}: expected >= 1 speculative round per prompt")
    named = (target, model, ref_target, ref_model, prompts, run)
    inputs = tuple(Path(p) for p in named if p is not None) + (command_files(command) if command else ())
    if keep is not None:
        keep = check_output_dir(Path(keep), inputs, "--keep")
    for what, path in (("--report", report), ("--json", json_out), ("--summary-md", summary_md)):
        if path is not None and str(path) != "-":
            check_output(Path(path), inputs, what)
    return CheckPlan(
        Path(target),
        Path(model),
        Path(ref_target or target),
        Path(ref_model or model),
        mode,
        tuple(command or ()),
        _path(llama_dir),
        _path(prompts),
        rounds,
        min_accept,
        keep,
        _path(report),
        None if json_out is None else str(json_out),
        _path(summary_md),
        _path(run),
        layer_ids_mean,
    )


def _path(p: str | Path | None) -> Path | None:
    return None if p is None else Path(p)


def check(target: Path, model: Path, **options: Any) -> CheckResult:
    """Capture, reference, compare and probe; return the verdict and write the outputs asked for.

    `options` are `plan_check`'s. In-process (no `command`) the capture and the probe run
    `rounds` rounds per prompt; through llama-server the probe sends one request per prompt;
    around another program (e.g. llama-speculative-simple with its own `-p`) the probe is the
    captured flow's own rounds. The dumps go to `keep` (a directory) or a temporary one, which
    is removed after a pass and kept after a fail or an error (its messages name what it holds).
    """
    plan = plan_check(target, model, **options)
    if plan.keep is not None:
        plan.keep.mkdir(parents=True, exist_ok=True)
        result = run_check(plan, plan.keep)
    else:
        result = _in_temporary_dir(plan)
    write_outputs(result, plan.json_out, plan.summary_md)
    return result


def _in_temporary_dir(plan: CheckPlan) -> CheckResult:
    """`run_check` with its dumps in a new temporary directory: removed after a pass (or an
    error before anything was written there), kept and said after a fail or an error."""
    work = Path(tempfile.mkdtemp(prefix="featdiff-check-"))
    try:
        result = run_check(plan, work)
    except BaseException:
        _kept_or_removed(work)
        raise
    if result.ok:
        shutil.rmtree(work)
        return replace(result, dumps=None)
    log.warning("featdiff check failed; its dumps are kept in %s (%s, %s)", work, REF_DUMP, RUN_DUMP)
    return result


def _kept_or_removed(work: Path) -> None:
    """A stopped check's temporary directory: kept when it holds a dump a message may name."""
    if any(work.iterdir()):
        log.warning("featdiff check stopped; what it wrote is kept in %s", work)
    else:
        work.rmdir()


def _mode(command: list[str] | None) -> Mode:
    from featdiff.programs import server

    if not command:
        return "in-process"
    return "llama-server" if server.is_server(command) else "program"


def run_check(plan: CheckPlan, work: Path) -> CheckResult:
    """Run the plan's stages with the dumps in `work`; the report is written, the rest returned."""
    from featdiff.diff import compare_dumps
    from featdiff.dump.reader import read_dump
    from featdiff.torchref.kind import reference

    program_log = _program_log(plan, work)
    try:
        run = plan.run if plan.run is not None else _capture(plan, work / RUN_DUMP, program_log)
    except ProgramFailed as failed:  # what it decoded before failing is the evidence: judge it
        log.warning("%s; featdiff check judges what it decoded", failed)
        run = failed.dump
    with read_dump(run) as dump:
        manifest = dump.manifest
    drafted = sum(1 for r in manifest.rounds if r.drafts)  # the reference drafts every round
    followed = run if _drafted_a_block(manifest) else None  # a run that failed first: the default block
    ref = reference(
        plan.ref_target,
        plan.ref_model,
        work / REF_DUMP,
        prompt=None,
        tokens=",".join(map(str, manifest.prompt_tokens)),
        rounds=drafted,
        dtype="float32",
        device="cpu",
        kv_dtype="f16",
        llama_dir=plan.llama_dir,
        run=followed,  # the block length, p_min, and the run's tokens to follow after a parting
        layer_ids_mean=plan.layer_ids_mean,
    )
    comparison = compare_dumps(ref, run)
    report = None
    if plan.report is not None:
        from featdiff.html import write_report

        report = write_report(ref, run, plan.report, comparison=comparison, output_flag="--report")
    probed = _probe_beside(plan, manifest, comparison)
    accept = judge_accept(probed, plan.min_accept)
    reasons = reasons_to_fail(comparison, accept)
    program = Path(plan.command[0]).name if plan.command else None
    return CheckResult(
        comparison,
        probed,
        accept,
        "fail" if reasons else "pass",
        reasons,
        plan.mode,
        program,
        manifest.prompt_tokens,
        report,
        (ref, run),
        program_log,
    )


def _program_log(plan: CheckPlan, work: Path) -> Path | None:
    """Where the program's own output goes (--exec): beside the run dump in --keep DIR, else a
    file of the temp dir that outlives the check's temporary one; None when no program runs."""
    from featdiff.programs.exec import program_log

    if plan.mode not in ("program", "llama-server") or plan.run is not None:
        return None
    if plan.keep is not None:
        return program_log(work / RUN_DUMP)
    fd, path = tempfile.mkstemp(prefix="featdiff-check-", suffix=".log")
    os.close(fd)
    return Path(path)


def _capture(plan: CheckPlan, output: Path, log: Path | None) -> Path:
    """The short flow: the first prompt, in-process or through llama-server; another program's own."""
    from featdiff.driver import capture as capture_mod
    from featdiff.programs import exec as exec_program
    from featdiff.verdict.probe import read_prompts

    first = read_prompts(plan.prompts)[0]
    tokens = None if first.tokens is None else ",".join(map(str, first.tokens))
    if plan.mode == "program":
        return exec_program.capture_program(list(plan.command), output, None, plan.llama_dir, log_path=log)
    if plan.mode == "llama-server":
        return exec_program.capture_program(
            list(plan.command), output, None, plan.llama_dir, first.text, tokens, log_path=log
        )
    return capture_mod.capture(
        plan.target, plan.model, output, prompt=first.text, tokens=tokens, rounds=plan.rounds, llama_dir=plan.llama_dir
    )


def _drafted_a_block(manifest: Manifest) -> bool:
    """Whether the run decoded a draft llama.cpp did not refuse (what gives the block length)."""
    from featdiff.core.phases import Phase

    return any(e.phase == Phase.DRAFT and e.rc == 0 for e in manifest.evals)


def _probe_beside(plan: CheckPlan, manifest: Manifest, comparison: Comparison) -> Probe:
    """The probe; where its own run of the program fails as the captured one did (a fault that
    makes llama-server answer 500) and compare already named an error, no accept is measured
    (the verdict is compare's and says the run drafted too few blocks) instead of stopping."""
    from featdiff.programs.server import RequestFailed

    try:
        return _probe(plan, manifest)
    except (RequestFailed, ProgramFailed) as failed:
        if comparison.ok:
            raise
        log.warning("the accept probe's run failed too (%s); the accept is not measured", failed)
        return Probe(())


def _probe(plan: CheckPlan, manifest: Manifest) -> Probe:
    """The accept probe of every prompt (featdiff.verdict.probe); around another program, of its captured flow."""
    from featdiff.verdict.probe import probe

    if plan.mode in ("program", "capture"):
        program = plan.command[0] if plan.command else str(plan.run)
        return _probe_of_flows(manifest, program, plan.ref_target, plan.ref_model, plan.layer_ids_mean)
    return probe(
        plan.target,
        plan.model,
        prompts=plan.prompts,
        rounds=plan.rounds,
        ref_target=plan.ref_target,
        ref_model=plan.ref_model,
        command=list(plan.command) if plan.mode == "llama-server" else None,
        llama_dir=plan.llama_dir,
        layer_ids_mean=plan.layer_ids_mean,
    )


def _probe_of_flows(
    manifest: Manifest, program: str, ref_target: Path, ref_model: Path, layer_ids_mean: str | None = None
) -> Probe:
    """The probe of a capture: each flow's rounds (one per request and sequence: docs/flow.md),
    and the reference drafter's at the same places."""
    from featdiff.diff.align import drafter_arch
    from featdiff.dump.blocks import run_block_rows
    from featdiff.dump.manifest import flow_view
    from featdiff.kinds import registry as kinds
    from featdiff.verdict.probe import RunTrace, probe_traces

    flows = manifest.flow_ids()
    steps = not kinds.of_arch(drafter_arch(manifest)).block_flow  # EAGLE3, MTP: one decode per draft
    traces = []
    for k in flows:
        if manifest.flow_info(k).why_unreplayable():  # compare named it: no accept rate rests on it
            continue
        view = flow_view(manifest, k)
        label = Path(program).name if len(flows) == 1 else f"flow {k} (sequence {view.flow_info(k).seq_id})"
        rows = run_block_rows(view.evals, program, steps)
        traces.append(RunTrace(label, view.prompt_tokens, view.rounds, rows, sampler=view.sampler(k)))
    return probe_traces(tuple(traces), ref_target, ref_model, layer_ids_mean=layer_ids_mean)


# ---------------------------------------------------------------- what people and scripts read


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
