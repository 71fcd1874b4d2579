"""`featdiff check`, planned: `plan_check` turns the command's options into a `CheckPlan`, every
input and output checked (featdiff.core.outputs) before a model runs; verdict/run.py executes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from featdiff.core.errors import InputError
from featdiff.core.outputs import check_output, check_output_dir
from featdiff.verdict.result import Mode

DEFAULT_ROUNDS = 4  # in-process: rounds of the capture, and of the probe per prompt


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


def _mode(command: list[str] | None) -> Mode:
    from featdiff.programs import server

    if not command:
        return "in-process"
    return "llama-server" if server.is_server(command) else "program"
