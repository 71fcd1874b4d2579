"""The command line: one typer function per command. Each parses, calls one library function,
renders and exits; `main` is the only place that turns `InputError` into exit code 2, and SIGINT /
SIGTERM into `Interrupted` and exit code 130 / 143.

Library imports sit inside the commands so that `featdiff compare` never loads torch or the
llama.cpp binding. The stage commands' options are defined in featdiff.core.options (flags, help,
default), and each stage command calls its featdiff.api function: the Python API, with the same
options and defaults.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperGroup

from featdiff.core import options as o
from featdiff.core.errors import InputError, Interrupted
from featdiff.core.outputs import is_no_room, no_room_error


class _App(TyperGroup):
    """The one place an `InputError` becomes a one-line message and exit code 2, an interruption
    (SIGINT, SIGTERM) one line saying what was kept and exit code 128 + signal (130, 143), and any
    other exception (a bug of featdiff's) a one-line message and exit code 3, its traceback in a file."""

    def invoke(self, ctx: typer.Context) -> object:  # type: ignore[override]  # typer.Context: click's, narrowed
        try:
            return super().invoke(ctx)
        except InputError as e:
            typer.echo(f"featdiff: error: {e}", err=True)
            raise typer.Exit(EXIT_INPUT) from None
        except BrokenPipeError:
            # the reader of featdiff's output left (`featdiff ... | head`): stop quietly, as a Unix
            # tool killed by SIGPIPE would; stdout is pointed at /dev/null so the final flush is mute
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(EXIT_BROKEN_PIPE) from None
        except OSError as e:
            if not is_no_room(e):
                raise _internal_error(e) from None
            # a write out of room that no writer named (outputs.replaced and the dump writer do)
            typer.echo(f"featdiff: error: {no_room_error(e.filename or 'an output', e)}", err=True)
            raise typer.Exit(EXIT_INPUT) from None
        except KeyboardInterrupt as e:
            stop = e if isinstance(e, Interrupted) else Interrupted.of(e)
            typer.echo(f"featdiff: {stop}", err=True)
            raise typer.Exit(stop.exit_code) from None
        except Exception as e:  # noqa: BLE001 - the contract: a bug exits 3 with one line, not a traceback
            if type(e).__module__.startswith(CLI_FRAMEWORK_MODULES):
                raise  # usage errors, --help, typer.Exit: the framework's own way out
            raise _internal_error(e) from None


def _internal_error(e: Exception) -> typer.Exit:
    """Say that `e` is a bug of featdiff's, its traceback in a file; the exit to raise."""
    typer.echo(
        f"featdiff: internal error (a bug in featdiff, not in your input): {type(e).__name__}: {e}; {_crash_report()}",
        err=True,
    )
    return typer.Exit(EXIT_INTERNAL)


def _crash_report() -> str:
    """Write the current exception's traceback to a new file in the temp dir; say where. A report
    that cannot be written (a full temp dir) is removed and said so: a bug still exits 3, in one line."""
    try:
        fd, path = tempfile.mkstemp(prefix="featdiff-crash-", suffix=".txt")
    except OSError as failed:
        return _unwritten(tempfile.gettempdir(), failed)
    try:
        with os.fdopen(fd, "w") as out:
            traceback.print_exc(file=out)
    except OSError as failed:
        Path(path).unlink(missing_ok=True)
        return _unwritten(path, failed)
    return f"the traceback is in {path}"


def _unwritten(path: str, failed: OSError) -> str:
    """Why the crash report `path` is not there, for the internal error's line."""
    why = no_room_error(path, failed) if is_no_room(failed) else f"{path}: {failed.strerror or failed}"
    return f"no crash report: {why}"


app = typer.Typer(
    cls=_App,
    add_completion=False,
    no_args_is_help=True,
    help="featdiff: which tensor a llama.cpp drafter port gets wrong, and why.",
)

EXIT_OK, EXIT_FINDINGS, EXIT_INPUT, EXIT_INTERNAL = 0, 1, 2, 3  # and 128 + signal when interrupted: 130, 143
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # 141: the reader of our output went away, as for any Unix tool
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # each raises Interrupted; a second one ends featdiff at once
CLI_FRAMEWORK_MODULES = ("click", "typer")  # exceptions of these modules are the CLI framework's (typer vendors click)


def _show_version(asked: bool) -> None:
    """`featdiff --version`: the version, on stdout, and exit 0 before any command runs."""
    if asked:
        from featdiff.version import VERSION

        typer.echo(f"featdiff {VERSION}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _main_options(
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_show_version, help="Print the version and exit.")
    ] = False,
) -> None:
    # featdiff's own options, before the command (typer's group callback); the help is the app's
    pass


def _log_level(verbose: bool) -> None:
    """Per-round detail (logged at DEBUG) reaches stderr only with -v; the rest of featdiff's
    log (INFO: one line per stage) always does."""
    logging.getLogger("featdiff").setLevel(logging.DEBUG if verbose else logging.INFO)


def _option(d: o.Option) -> Any:
    """typer's option of a featdiff.core.options definition (its default is the parameter's: `= d.default`)."""
    return typer.Option(*d.flags, help=d.help, min=d.min, max=d.max, exists=d.exists, dir_okay=d.dir_okay)


TokensOpt = Annotated[Optional[str], _option(o.TOKENS)]
PromptOpt = Annotated[Optional[str], _option(o.PROMPT)]
RoundsOpt = Annotated[int, _option(o.ROUNDS)]
DraftMaxOpt = Annotated[Optional[int], _option(o.DRAFT_MAX)]
LlamaDirOpt = Annotated[Optional[Path], _option(o.LLAMA_DIR)]
RefTargetOpt = Annotated[Optional[Path], _option(o.REF_TARGET)]
RefModelOpt = Annotated[Optional[Path], _option(o.REF_MODEL)]
PMinOpt = Annotated[Optional[float], _option(o.P_MIN)]
NameMapOpt = Annotated[Optional[Path], _option(o.NAME_MAP)]
LayerIdsMeanOpt = Annotated[Optional[str], _option(o.LAYER_IDS_MEAN)]


@app.command()
def fixture(
    outdir: Annotated[
        Optional[Path], typer.Argument(help="Directory to write target.gguf, draft.gguf and the HF dirs into.")
    ] = None,
    variant: Annotated[
        str, typer.Option("--variant", help="Which planted bug (see `featdiff fixture --list`).")
    ] = "clean",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the tiny models.")] = 0,
    list_variants: Annotated[bool, typer.Option("--list", help="List the variants and exit.")] = False,
) -> None:
    """Write tiny seeded target + drafter models (GGUF and HF) with one planted wiring bug."""
    from featdiff.factory import variants as fixture_variants

    if list_variants or outdir is None:
        typer.echo(fixture_variants.describe())
        return
    typer.echo(fixture_variants.write(outdir, variant, seed))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def capture(
    ctx: typer.Context,
    output: Annotated[Path, _option(o.DUMP_OUTPUT)],
    target: Annotated[Optional[Path], _option(o.TARGET_GGUF)] = o.TARGET_GGUF.default,
    model: Annotated[Optional[Path], _option(o.MODEL_GGUF)] = o.MODEL_GGUF.default,
    prompt: PromptOpt = o.PROMPT.default,
    tokens: TokensOpt = o.TOKENS.default,
    rounds: RoundsOpt = o.ROUNDS.default,
    filters: Annotated[Optional[list[str]], _option(o.FILTERS)] = o.FILTERS.default,
    llama_dir: LlamaDirOpt = o.LLAMA_DIR.default,
    draft_max: DraftMaxOpt = o.DRAFT_MAX.default,
    p_min: PMinOpt = o.P_MIN.default,
    exec_: Annotated[bool, _option(o.EXEC)] = o.EXEC.default,
    requests: Annotated[Optional[int], _option(o.REQUESTS)] = o.REQUESTS.default,
) -> None:
    """Capture named tensors from a real llama.cpp build into a dump. In-process, llama.cpp's run options follow the
    featdiff options as the programs spell them: -ctk/-ctv, -ctkd/-ctvd (drafter), -fa on|off|auto, -ngl, -ngld, -t, -c."""
    from featdiff import api

    command, run_options = (list(ctx.args), None) if exec_ else (None, list(ctx.args))
    typer.echo(
        api.capture(
            target,
            model,
            output,
            prompt=prompt,
            tokens=tokens,
            rounds=rounds,
            filters=filters,
            llama_dir=llama_dir,
            draft_max=draft_max,
            p_min=p_min,
            command=command,
            requests=requests,
            options=run_options,
        )
    )


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def probe(
    ctx: typer.Context,
    target: Annotated[Path, typer.Option("--target", exists=True, dir_okay=False, help="Target model GGUF (the run).")],
    model: Annotated[Path, typer.Option("--model", exists=True, dir_okay=False, help="Drafter GGUF (the run).")],
    prompts: Annotated[
        Optional[Path],
        typer.Option(
            "--prompts",
            exists=True,
            dir_okay=False,
            help="One prompt per line; `tokens: 1,2,3` for token ids. Default: two built-in prompts.",
        ),
    ] = None,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Speculative rounds per prompt (in-process run).")] = 6,
    n_predict: Annotated[
        int, typer.Option("--n-predict", min=1, help="Tokens per request (run through llama-server).")
    ] = 16,
    ref_target: RefTargetOpt = o.REF_TARGET.default,
    ref_model: RefModelOpt = o.REF_MODEL.default,
    llama_dir: LlamaDirOpt = o.LLAMA_DIR.default,
    draft_max: DraftMaxOpt = o.DRAFT_MAX.default,
    exec_: Annotated[
        bool,
        typer.Option("--exec", help="Run through the llama-server command given after `--` instead of in-process."),
    ] = False,
    layer_ids_mean: LayerIdsMeanOpt = o.LAYER_IDS_MEAN.default,
) -> None:
    """Greedy accept-rate probe: the real spec loop side by side with the reference drafter."""
    from featdiff import api
    from featdiff.verdict.probe import exit_code as probe_exit_code
    from featdiff.verdict.probe import probe as run_probe
    from featdiff.verdict.probe import render_probe

    result = run_probe(
        target,
        model,
        prompts=prompts,
        rounds=rounds,
        ref_target=ref_target,
        ref_model=ref_model,
        command=api.program_command(ctx.args, exec_, "probe"),
        n_predict=n_predict,
        llama_dir=llama_dir,
        draft_max=draft_max,
        layer_ids_mean=layer_ids_mean,
    )
    typer.echo(render_probe(result))
    raise typer.Exit(probe_exit_code(result))


@app.command()
def pack(
    spool: Annotated[Path, typer.Argument(help="Spool prefix left by an interrupted capture (e.g. run.npz.spool).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Dump to write (.npz).")],
) -> None:
    """Pack the complete records of a capture spool into a dump (after a crash or a kill)."""
    from featdiff.programs.recover import pack_spool

    packed = pack_spool(spool, output)
    typer.echo(f"featdiff: {packed.summary()}", err=True)
    typer.echo(packed.path)


@app.command()
def reference(
    target: Annotated[Path, _option(o.REF_TARGET_ANY)],
    model: Annotated[Path, _option(o.REF_MODEL_ANY)],
    output: Annotated[Path, _option(o.DUMP_OUTPUT)],
    prompt: PromptOpt = o.PROMPT.default,
    tokens: TokensOpt = o.TOKENS.default,
    rounds: RoundsOpt = o.ROUNDS.default,
    dtype: Annotated[str, _option(o.DTYPE)] = o.DTYPE.default,
    device: Annotated[str, _option(o.DEVICE)] = o.DEVICE.default,
    kv_dtype: Annotated[str, _option(o.KV_DTYPE)] = o.KV_DTYPE.default,
    llama_dir: Annotated[Optional[Path], _option(o.REF_LLAMA_DIR)] = o.REF_LLAMA_DIR.default,
    block: Annotated[Optional[int], _option(o.BLOCK)] = o.BLOCK.default,
    run: Annotated[Optional[Path], _option(o.BLOCKS_OF_RUN)] = o.BLOCKS_OF_RUN.default,
    p_min: PMinOpt = o.P_MIN.default,
    follow: Annotated[Optional[Path], _option(o.FOLLOW)] = o.FOLLOW.default,
    verbose: Annotated[bool, _option(o.LOG_VERBOSE)] = o.LOG_VERBOSE.default,
    layer_ids_mean: LayerIdsMeanOpt = o.LAYER_IDS_MEAN.default,
) -> None:
    """Compute the reference dump in PyTorch from the same weights and tokens."""
    from featdiff import api

    _log_level(verbose)
    typer.echo(
        api.reference(
            target,
            model,
            output,
            prompt=prompt,
            tokens=tokens,
            rounds=rounds,
            dtype=dtype,
            device=device,
            kv_dtype=kv_dtype,
            llama_dir=llama_dir,
            block=block,
            run=run,
            p_min=p_min,
            follow=follow,
            layer_ids_mean=layer_ids_mean,
        )
    )


@app.command()
def compare(
    ref: Annotated[Path, typer.Argument(help="Reference dump (or any dump taken as the truth).")],
    run: Annotated[Path, typer.Argument(help="Run dump to diagnose.")],
    json_out: Annotated[Optional[str], _option(o.JSON_OUT)] = o.JSON_OUT.default,
    report: Annotated[Optional[Path], _option(o.ALSO_REPORT)] = o.ALSO_REPORT.default,
    name_map: NameMapOpt = o.NAME_MAP.default,
    verbose: Annotated[bool, _option(o.VERBOSE)] = o.VERBOSE.default,
) -> None:
    """Align two dumps, find the first divergent tensor and name the wiring fault."""
    from featdiff import api
    from featdiff.diff import exit_code, render_summary

    comparison = api.compare(ref, run, name_map, json_out=json_out, report=report)
    if json_out != "-":
        render_summary(comparison, verbose=verbose)
    if report is not None:
        typer.echo(report, err=True)
    raise typer.Exit(exit_code(comparison))


@app.command()
def report(
    ref: Annotated[Path, typer.Argument(help="Reference dump.")],
    run: Annotated[Path, typer.Argument(help="Run dump.")],
    output: Annotated[Path, _option(o.HTML_OUTPUT)],
    png_dir: Annotated[Optional[Path], _option(o.PNG_DIR)] = o.PNG_DIR.default,
    name_map: NameMapOpt = o.NAME_MAP.default,
) -> None:
    """Write a self-contained HTML triage report with heatmaps."""
    from featdiff import api
    from featdiff.diff import exit_code

    comparison = api.compare(ref, run, name_map)
    typer.echo(api.report(ref, run, output, comparison=comparison, png_dir=png_dir, name_map=name_map))
    raise typer.Exit(exit_code(comparison))


@app.command()
def inspect(
    path: Annotated[
        Path, typer.Argument(exists=True, help="A dump (.npz), a model (.gguf) or an EAGLE3 HF checkpoint directory.")
    ],
) -> None:
    """List a dump's records by eval and phase, a GGUF's DFlash metadata, or an EAGLE3 checkpoint's trainer."""
    from featdiff.inspect import describe

    typer.echo(describe(path))


@app.command()
def lint(
    model: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Drafter GGUF.")],
    target: Annotated[
        Optional[Path],
        typer.Option("--target", exists=True, dir_okay=False, help="Target GGUF, to check ids and widths against."),
    ] = None,
) -> None:
    """Check a drafter GGUF's DFlash metadata and tensors; one line per problem."""
    from featdiff.verdict.lint import lint_gguf

    problems = lint_gguf(model, target)
    for line in problems:
        typer.echo(line)
    if not problems:
        typer.echo(f"{model}: ok")
    raise typer.Exit(EXIT_FINDINGS if problems else EXIT_OK)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def check(
    ctx: typer.Context,
    target: Annotated[Path, _option(o.RUN_TARGET)],
    model: Annotated[Path, _option(o.RUN_MODEL)],
    ref_target: RefTargetOpt = o.REF_TARGET.default,
    ref_model: RefModelOpt = o.REF_MODEL.default,
    llama_dir: LlamaDirOpt = o.LLAMA_DIR.default,
    prompts: Annotated[Optional[Path], _option(o.CHECK_PROMPTS)] = o.CHECK_PROMPTS.default,
    rounds: Annotated[Optional[int], _option(o.CHECK_ROUNDS)] = o.CHECK_ROUNDS.default,
    min_accept: Annotated[Optional[float], _option(o.MIN_ACCEPT)] = o.MIN_ACCEPT.default,
    keep: Annotated[Optional[Path], _option(o.KEEP)] = o.KEEP.default,
    json_out: Annotated[Optional[str], _option(o.CHECK_JSON_OUT)] = o.CHECK_JSON_OUT.default,
    report: Annotated[Optional[Path], _option(o.ALSO_REPORT)] = o.ALSO_REPORT.default,
    summary_md: Annotated[Optional[Path], _option(o.SUMMARY_MD)] = o.SUMMARY_MD.default,
    exec_: Annotated[bool, _option(o.CHECK_EXEC)] = o.CHECK_EXEC.default,
    run: Annotated[Optional[Path], _option(o.JUDGED_RUN)] = o.JUDGED_RUN.default,
    verbose: Annotated[bool, _option(o.LOG_VERBOSE)] = o.LOG_VERBOSE.default,
    layer_ids_mean: LayerIdsMeanOpt = o.LAYER_IDS_MEAN.default,
) -> None:
    """One CI verdict: capture, reference, compare and accept probe; exit 1 on a wiring fault or an accept gap."""
    from featdiff import api
    from featdiff.verdict.result import exit_code as check_exit_code
    from featdiff.verdict.render import render_text

    _log_level(verbose)
    result = api.check(
        target,
        model,
        ref_target=ref_target,
        ref_model=ref_model,
        llama_dir=llama_dir,
        prompts=prompts,
        rounds=rounds,
        min_accept=min_accept,
        keep=keep,
        json_out=json_out,
        report=report,
        summary_md=summary_md,
        command=api.program_command(ctx.args, exec_, "check"),
        run=run,
        layer_ids_mean=layer_ids_mean,
    )
    if json_out != "-":
        typer.echo(render_text(result))
    raise typer.Exit(check_exit_code(result))


def _raise_interrupted(signum: int, frame: object) -> None:
    """The first SIGINT or SIGTERM unwinds featdiff as an `Interrupted` (the running command packs
    what it has); a second one takes the signal's default action and ends it at once."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    raise Interrupted(signum)


def main() -> None:
    """Console entry point: configure logging once, turn SIGINT / SIGTERM into `Interrupted`,
    and run the app."""
    logging.basicConfig(level=logging.WARNING, format="featdiff: %(message)s", stream=sys.stderr)
    logging.getLogger("featdiff").setLevel(logging.INFO)
    for s in STOP_SIGNALS:
        signal.signal(s, _raise_interrupted)
    # past a file-size limit (`ulimit -f`) a write then fails with EFBIG, which names the output
    # (featdiff.core.outputs), instead of SIGXFSZ killing featdiff; subprocess restores it for programs
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    app()
