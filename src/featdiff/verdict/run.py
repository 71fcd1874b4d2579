"""`featdiff check`, executed: `run_check` runs a `CheckPlan`'s stages in order (a short capture, the
reference following the run, compare, the accept probe) and returns the `CheckResult`; `check` plans,
runs in --keep DIR or a temporary directory, and writes the outputs (verdict/render.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from featdiff.core.errors import ProgramFailed
from featdiff.diff.result import Comparison
from featdiff.dump.manifest import Manifest
from featdiff.verdict.plan import CheckPlan, plan_check
from featdiff.verdict.probe import Probe
from featdiff.verdict.render import write_outputs
from featdiff.verdict.result import CheckResult, judge_accept, reasons_to_fail

RUN_DUMP, REF_DUMP = "run.npz", "ref.npz"  # the intermediate dumps, in --keep DIR or a temporary one


log = logging.getLogger(__name__)


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
