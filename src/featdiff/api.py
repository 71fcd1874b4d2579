"""The Python API: one function per stage command, each taking every option of its command as a
keyword with the command's default (both come from featdiff.core.options; tests/test_api.py checks
them against the CLI), and the CLI's commands call these.

    capture(target, model, output, ...) -> Path        the run dump (driver/capture.py)
    reference(target, model, output, ...) -> Path      the reference dump (torchref/dflash/run.py)
    compare(ref, run, name_map=None, ...) -> Comparison findings (compare/)
    report(ref, run, output, ...) -> Path              the HTML page (report/)
    check(target, model, ...) -> CheckResult           all of them and the accept probe (verdict/run.py)

The command line's `--exec -- PROGRAM ...` is `command=[PROGRAM, ...]` here. Paths may be `str`.
Each stage is imported on first call, so importing this module loads neither torch nor llama.cpp.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from featdiff.core import options as o
from featdiff.core.errors import InputError

if TYPE_CHECKING:
    from featdiff.diff.result import Comparison
    from featdiff.llama.options import RunOptions
    from featdiff.verdict.result import CheckResult

PathLike = str | Path


def capture(
    target: PathLike | None,
    model: PathLike | None,
    output: PathLike,
    *,
    prompt: str | None = o.PROMPT.default,
    tokens: str | None = o.TOKENS.default,
    rounds: int = o.ROUNDS.default,
    filters: list[str] | None = o.FILTERS.default,
    llama_dir: PathLike | None = o.LLAMA_DIR.default,
    draft_max: int | None = o.DRAFT_MAX.default,
    p_min: float | None = o.P_MIN.default,
    command: list[str] | None = None,
    requests: int | None = o.REQUESTS.default,
    options: RunOptions | list[str] | None = None,
) -> Path:
    """Capture a run dump from a real llama.cpp build; return its path.

    In-process from `target` and `model` (llama.cpp's run `options`: KV types, flash attention,
    offload, threads, context; or their flags as llama.cpp's programs spell them, `["-ctk",
    "q8_0"]`), or around the llama.cpp program `command` (its argv; then `target` and `model` are
    None and the program's command line sets blocks and p_min).
    """
    from featdiff.driver import capture as capture_mod
    from featdiff.programs import exec as exec_program

    if command is not None:
        return exec_program.capture_program(
            list(command),
            Path(output),
            filters,
            _path(llama_dir),
            prompt,
            tokens,
            draft_max=draft_max,
            p_min=p_min,
            n_requests=requests,
        )
    if requests is not None:
        raise InputError(
            f"--requests {requests} counts llama-server's requests: give it with --exec -- llama-server ..."
        )
    if isinstance(options, list):
        from featdiff.llama.options import parse_run_options

        options = parse_run_options(options)
    return capture_mod.capture(
        _path(target),
        _path(model),
        Path(output),
        prompt=prompt,
        tokens=tokens,
        rounds=rounds,
        filters=filters,
        llama_dir=_path(llama_dir),
        draft_max=draft_max,
        p_min=p_min,
        options=options if options is not None else capture_mod.DEFAULT_OPTIONS,
    )


def reference(
    target: PathLike,
    model: PathLike,
    output: PathLike,
    *,
    prompt: str | None = o.PROMPT.default,
    tokens: str | None = o.TOKENS.default,
    rounds: int = o.ROUNDS.default,
    dtype: str = o.DTYPE.default,
    device: str = o.DEVICE.default,
    kv_dtype: str = o.KV_DTYPE.default,
    llama_dir: PathLike | None = o.REF_LLAMA_DIR.default,
    block: int | None = o.BLOCK.default,
    run: PathLike | None = o.BLOCKS_OF_RUN.default,
    p_min: float | None = o.P_MIN.default,
    follow: PathLike | None = o.FOLLOW.default,
    layer_ids_mean: str | None = o.LAYER_IDS_MEAN.default,
) -> Path:
    """Compute the reference dump in PyTorch from the same weights and tokens; return its path."""
    from featdiff.torchref.kind import reference as run_reference

    return run_reference(
        Path(target),
        Path(model),
        Path(output),
        prompt=prompt,
        tokens=tokens,
        rounds=rounds,
        dtype=dtype,
        device=device,
        kv_dtype=kv_dtype,
        llama_dir=_path(llama_dir),
        block=block,
        run=_path(run),
        p_min=p_min,
        follow=_path(follow),
        layer_ids_mean=layer_ids_mean,
    )


def compare(
    ref: PathLike,
    run: PathLike,
    name_map: PathLike | None = o.NAME_MAP.default,
    *,
    json_out: str | None = o.JSON_OUT.default,
    report: PathLike | None = o.ALSO_REPORT.default,
) -> Comparison:
    """Compare two dumps; return the `Comparison` (findings, metrics, coverage). `json_out` writes
    the findings JSON there ("-": stdout), `report` the HTML triage report."""
    from featdiff.diff import compare_dumps, write_json

    comparison = compare_dumps(Path(ref), Path(run), _path(name_map))
    if json_out is not None:
        write_json(comparison, json_out)
    if report is not None:
        from featdiff.html import write_report

        write_report(
            Path(ref), Path(run), Path(report), comparison=comparison, name_map=_path(name_map), output_flag="--report"
        )
    return comparison


def report(
    ref: PathLike,
    run: PathLike,
    output: PathLike,
    *,
    comparison: Comparison | None = None,
    png_dir: PathLike | None = o.PNG_DIR.default,
    name_map: PathLike | None = o.NAME_MAP.default,
) -> Path:
    """Write the HTML triage report of two dumps (compared first unless `comparison` is given)."""
    from featdiff.html import write_report

    if comparison is None:
        comparison = compare(ref, run, name_map)
    return write_report(
        Path(ref), Path(run), Path(output), comparison=comparison, png_dir=_path(png_dir), name_map=_path(name_map)
    )


def check(
    target: PathLike,
    model: PathLike,
    *,
    ref_target: PathLike | None = o.REF_TARGET.default,
    ref_model: PathLike | None = o.REF_MODEL.default,
    llama_dir: PathLike | None = o.LLAMA_DIR.default,
    prompts: PathLike | None = o.CHECK_PROMPTS.default,
    rounds: int | None = o.CHECK_ROUNDS.default,
    min_accept: float | None = o.MIN_ACCEPT.default,
    keep: PathLike | None = o.KEEP.default,
    json_out: str | None = o.CHECK_JSON_OUT.default,
    report: PathLike | None = o.ALSO_REPORT.default,
    summary_md: PathLike | None = o.SUMMARY_MD.default,
    command: list[str] | None = None,
    run: PathLike | None = o.JUDGED_RUN.default,
    layer_ids_mean: str | None = o.LAYER_IDS_MEAN.default,
) -> CheckResult:
    """Capture, reference, compare and probe accept; return the `CheckResult` and write the
    outputs asked for (featdiff.verdict.check)."""
    from featdiff.verdict.run import check as run_check

    return run_check(
        Path(target),
        Path(model),
        ref_target=_path(ref_target),
        ref_model=_path(ref_model),
        llama_dir=_path(llama_dir),
        command=command,
        prompts=_path(prompts),
        rounds=rounds,
        min_accept=min_accept,
        keep=_path(keep),
        report=_path(report),
        json_out=json_out,
        summary_md=_path(summary_md),
        run=_path(run),
        layer_ids_mean=layer_ids_mean,
    )


def _path(p: PathLike | None) -> Path | None:
    return None if p is None else Path(p)


def program_command(args: list[str], is_exec: bool, command_name: str) -> list[str] | None:
    """The program's command line of `featdiff COMMAND --exec -- PROGRAM ...` (None without
    --exec); arguments left over without --exec are a program's command line that forgot it:
    one line saying so (InputError), not an in-process run that ignores them."""
    if is_exec:
        return list(args)
    if args:
        raise InputError(
            f"{args[0]}: featdiff {command_name} runs a program only after --exec; did you mean --exec? "
            f"`featdiff {command_name} ... --exec -- {' '.join(args[:3])} ...`"
        )
    return None
