"""The command line: one typer function per command. Each parses, calls one library function,
renders and exits; `main` is the only place that turns `InputError` into exit code 2, and SIGINT /
SIGTERM into `Interrupted` and exit code 130 / 143.

Library imports sit inside the commands so that `featdiff compare` never loads torch or the
llama.cpp binding.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from featdiff.errors import InputError, Interrupted
from featdiff.outputs import is_no_room, no_room_error


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
        f"featdiff: internal error (a bug in featdiff, not in your input): {type(e).__name__}: {e}; "
        f"the traceback is in {_crash_report()}",
        err=True,
    )
    return typer.Exit(EXIT_INTERNAL)


def _crash_report() -> str:
    """Write the current exception's traceback to a new file in the temp dir; return its path."""
    fd, path = tempfile.mkstemp(prefix="featdiff-crash-", suffix=".txt")
    with os.fdopen(fd, "w") as out:
        traceback.print_exc(file=out)
    return path


app = typer.Typer(
    cls=_App,
    add_completion=False,
    no_args_is_help=True,
    help="featdiff: which tensor a llama.cpp drafter port gets wrong, and why.",
)

EXIT_OK, EXIT_FINDINGS, EXIT_INPUT, EXIT_INTERNAL = 0, 1, 2, 3  # and 128 + signal when interrupted: 130, 143
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # each raises Interrupted; a second one ends featdiff at once
CLI_FRAMEWORK_MODULES = ("click", "typer")  # exceptions of these modules are the CLI framework's (typer vendors click)

TokensOpt = Annotated[Optional[str], typer.Option("--tokens", help="Comma-separated token ids, e.g. 1,2,3.")]
PromptOpt = Annotated[
    Optional[str], typer.Option("--prompt", help="Prompt text, tokenized with llama.cpp's own vocabulary.")
]
RoundsOpt = Annotated[
    int,
    typer.Option(
        "--rounds",
        min=0,
        help="Speculative rounds (draft, verify, inject) after the prefill; at most what fits the target's trained context: prompt + (rounds + 1) x block rows <= {arch}.context_length (HF: max_position_embeddings; 32768 when the target states none).",
    ),
]
DraftMaxOpt = Annotated[
    Optional[int],
    typer.Option(
        "--draft-max",
        help="Drafts per block, as llama.cpp's --spec-draft-n-max: the block is the anchor plus N masks, N clamped to dflash.block_size - 1. Default: 3, llama.cpp's default. In-process only: with --exec the program's command line decides.",
    ),
]
LlamaDirOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--llama-dir",
        help="A llama.cpp build to use: a checkout with its CMake build dir, or an install prefix. Default: $FEATDIFF_LLAMA_DIR, else featdiff's build of the pinned llama.cpp (make setup), else llama-cpp-python.",
    ),
]
RefLlamaDirOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--llama-dir",
        help="The llama.cpp build the run used: its vocabulary tokenizes --prompt and its own ggml dequantizes every quantized GGUF weight (bit for bit what the run read). Default: gguf-py dequantizes, and a type it cannot read (Q1_0) goes to the default build's ($FEATDIFF_LLAMA_DIR, else featdiff's build of the pinned llama.cpp).",
    ),
]
RefTargetOpt = Annotated[
    Optional[Path],
    typer.Option("--ref-target", exists=True, help="Reference target: GGUF or HF directory. Default: --target."),
]
RefModelOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--ref-model", exists=True, help="Reference drafter, e.g. the trained HF checkpoint. Default: --model."
    ),
]
PMinOpt = Annotated[
    Optional[float],
    typer.Option(
        "--p-min",
        min=0.0,
        max=1.0,
        help="llama.cpp's --spec-draft-p-min: a DSpark drafter with a confidence head stops drafting below it. Default 0 (reference: the --run dump's).",
    ),
]


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
    from featdiff import fixtures

    if list_variants or outdir is None:
        typer.echo(fixtures.describe_variants())
        return
    typer.echo(fixtures.write_fixture(outdir, fixtures.checked_variant(variant), seed))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def capture(
    ctx: typer.Context,
    output: Annotated[Path, typer.Option("-o", "--output", help="Dump to write (.npz).")],
    target: Annotated[
        Optional[Path], typer.Option("--target", exists=True, dir_okay=False, help="Target model GGUF.")
    ] = None,
    model: Annotated[
        Optional[Path], typer.Option("--model", exists=True, dir_okay=False, help="Drafter model GGUF.")
    ] = None,
    prompt: PromptOpt = None,
    tokens: TokensOpt = None,
    rounds: RoundsOpt = 2,
    filters: Annotated[
        Optional[list[str]],
        typer.Option("--filter", help="Glob on callback names to capture (repeatable). Default: the wiring tensors."),
    ] = None,
    llama_dir: LlamaDirOpt = None,
    draft_max: DraftMaxOpt = None,
    p_min: PMinOpt = None,
    exec_: Annotated[
        bool, typer.Option("--exec", help="Capture around an unmodified llama.cpp program given after `--`.")
    ] = False,
    requests: Annotated[
        Optional[int],
        typer.Option(
            "--requests",
            min=1,
            help="With --exec of llama-server and no --prompt/--tokens: stop after N of your own requests have completed (default: at Ctrl-C).",
        ),
    ] = None,
) -> None:
    """Capture named tensors from a real llama.cpp build into a dump. In-process, llama.cpp's run options follow the
    featdiff options as the programs spell them: -ctk/-ctv, -ctkd/-ctvd (drafter), -fa on|off|auto, -ngl, -ngld, -t, -c."""
    from featdiff.llama import capture as capture_mod

    if exec_:
        path = capture_mod.capture_exec(
            list(ctx.args),
            output,
            filters,
            llama_dir,
            prompt,
            tokens,
            draft_max=draft_max,
            p_min=p_min,
            n_requests=requests,
        )
    elif requests is not None:
        raise InputError(
            f"--requests {requests} counts llama-server's requests: give it with --exec -- llama-server ..."
        )
    else:
        from featdiff.llama.options import parse_run_options

        path = capture_mod.capture(
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
            options=parse_run_options(list(ctx.args)),
        )
    typer.echo(path)


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
    ref_target: RefTargetOpt = None,
    ref_model: RefModelOpt = None,
    llama_dir: LlamaDirOpt = None,
    draft_max: DraftMaxOpt = None,
    exec_: Annotated[
        bool,
        typer.Option("--exec", help="Run through the llama-server command given after `--` instead of in-process."),
    ] = False,
) -> None:
    """Greedy accept-rate probe: the real spec loop side by side with the reference drafter."""
    from featdiff.probe import exit_code as probe_exit_code
    from featdiff.probe import probe as run_probe
    from featdiff.probe import render_probe

    result = run_probe(
        target,
        model,
        prompts=prompts,
        rounds=rounds,
        ref_target=ref_target,
        ref_model=ref_model,
        command=list(ctx.args) if exec_ else None,
        n_predict=n_predict,
        llama_dir=llama_dir,
        draft_max=draft_max,
    )
    typer.echo(render_probe(result))
    raise typer.Exit(probe_exit_code(result))


@app.command()
def pack(
    spool: Annotated[Path, typer.Argument(help="Spool prefix left by an interrupted capture (e.g. run.npz.spool).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Dump to write (.npz).")],
) -> None:
    """Pack the complete records of a capture spool into a dump (after a crash or a kill)."""
    from featdiff.llama.recover import pack_spool

    packed = pack_spool(spool, output)
    typer.echo(f"featdiff: {packed.summary()}", err=True)
    typer.echo(packed.path)


@app.command()
def reference(
    target: Annotated[Path, typer.Option("--target", exists=True, help="Target model: GGUF or HF directory.")],
    model: Annotated[Path, typer.Option("--model", exists=True, help="Drafter: GGUF or HF directory (DFlash layout).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Dump to write (.npz).")],
    prompt: PromptOpt = None,
    tokens: TokensOpt = None,
    rounds: RoundsOpt = 2,
    dtype: Annotated[str, typer.Option("--dtype", help="Compute dtype.")] = "float32",
    device: Annotated[str, typer.Option("--device", help="Torch device.")] = "cpu",
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="Emulate the run's KV cache type: f16 or f32.")] = "f16",
    llama_dir: RefLlamaDirOpt = None,
    block: Annotated[
        Optional[int],
        typer.Option(
            "--block",
            help="Rows per draft block: the anchor and the masks; a run's --spec-draft-n-max + 1 (anchor-first DSpark: n-max), up to dflash.block_size. Default: llama.cpp's default --spec-draft-n-max 3, clamped.",
        ),
    ] = None,
    run: Annotated[
        Optional[Path],
        typer.Option(
            "--run",
            help="A run dump (.npz): draft blocks as long as its draft evals, and its --p-min. Instead of --block.",
        ),
    ] = None,
    p_min: PMinOpt = None,
    follow: Annotated[
        Optional[Path],
        typer.Option(
            "--follow",
            exists=True,
            dir_okay=False,
            help="A run dump (.npz) to replay: its prompt, rounds, drafts and accepted prefixes instead of the reference's own, so every eval of the run pairs (a quantized target, a server's own loop). Replaces --prompt/--tokens/--rounds/--block/--run.",
        ),
    ] = None,
) -> None:
    """Compute the reference dump in PyTorch from the same weights and tokens."""
    from featdiff.reference import run as reference_run

    typer.echo(
        reference_run.reference(
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
        )
    )


@app.command()
def compare(
    ref: Annotated[Path, typer.Argument(help="Reference dump (or any dump taken as the truth).")],
    run: Annotated[Path, typer.Argument(help="Run dump to diagnose.")],
    json_out: Annotated[
        Optional[str], typer.Option("--json", help="Write findings JSON to FILE, or - for stdout only.")
    ] = None,
    report_out: Annotated[Optional[Path], typer.Option("--report", help="Also write the HTML triage report.")] = None,
    name_map: Annotated[
        Optional[Path],
        typer.Option(
            "--map", exists=True, dir_okay=False, help="Name map (TOML) for forks that name tensors their own way."
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print the per-record table too.")] = False,
) -> None:
    """Align two dumps, find the first divergent tensor and name the wiring fault."""
    from featdiff.compare import compare_dumps, exit_code, render_summary, write_json

    comparison = compare_dumps(ref, run, name_map)
    if json_out is not None:
        write_json(comparison, json_out)
    if json_out != "-":
        render_summary(comparison, verbose=verbose)
    if report_out is not None:
        from featdiff.report import write_report

        typer.echo(
            write_report(ref, run, report_out, comparison=comparison, name_map=name_map, output_flag="--report"),
            err=True,
        )
    raise typer.Exit(exit_code(comparison))


@app.command()
def report(
    ref: Annotated[Path, typer.Argument(help="Reference dump.")],
    run: Annotated[Path, typer.Argument(help="Run dump.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="HTML file to write.")],
    png_dir: Annotated[Optional[Path], typer.Option("--png-dir", help="Also write each figure as a PNG here.")] = None,
    name_map: Annotated[
        Optional[Path], typer.Option("--map", exists=True, dir_okay=False, help="Name map (TOML).")
    ] = None,
) -> None:
    """Write a self-contained HTML triage report with heatmaps."""
    from featdiff.compare import compare_dumps, exit_code
    from featdiff.report import write_report

    comparison = compare_dumps(ref, run, name_map)
    typer.echo(write_report(ref, run, output, comparison=comparison, png_dir=png_dir, name_map=name_map))
    raise typer.Exit(exit_code(comparison))


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="A dump (.npz) or a model (.gguf).")],
) -> None:
    """List a dump's records by eval and phase, or a GGUF's DFlash metadata."""
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
    from featdiff.reference.lint import lint_gguf

    problems = lint_gguf(model, target)
    for line in problems:
        typer.echo(line)
    if not problems:
        typer.echo(f"{model}: ok")
    raise typer.Exit(EXIT_FINDINGS if problems else EXIT_OK)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def check(
    ctx: typer.Context,
    target: Annotated[Path, typer.Option("--target", exists=True, dir_okay=False, help="Target model GGUF (the run).")],
    model: Annotated[Path, typer.Option("--model", exists=True, dir_okay=False, help="Drafter GGUF (the run).")],
    ref_target: RefTargetOpt = None,
    ref_model: RefModelOpt = None,
    llama_dir: LlamaDirOpt = None,
    prompts: Annotated[
        Optional[Path],
        typer.Option(
            "--prompts",
            exists=True,
            dir_okay=False,
            help="One prompt per line (`tokens: 1,2,3` for ids); the capture takes the first, the accept probe all. Default: two built-in prompts.",
        ),
    ] = None,
    rounds: Annotated[
        Optional[int],
        typer.Option(
            "--rounds",
            min=1,
            help="In-process: speculative rounds of the capture and of the probe, per prompt. Default: 4.",
        ),
    ] = None,
    min_accept: Annotated[
        Optional[float],
        typer.Option(
            "--min-accept",
            min=0.0,
            max=1.0,
            help="Fail when the run's accept rate (accepted / drafted tokens) is below this fraction.",
        ),
    ] = None,
    keep: Annotated[
        Optional[Path],
        typer.Option("--keep", help="Keep the run and reference dumps in this directory (default: a temporary one)."),
    ] = None,
    json_out: Annotated[
        Optional[str], typer.Option("--json", help="Write the check's JSON to FILE, or - for stdout only.")
    ] = None,
    report_out: Annotated[Optional[Path], typer.Option("--report", help="Also write the HTML triage report.")] = None,
    summary_md: Annotated[
        Optional[Path],
        typer.Option("--summary-md", help="Write a Markdown verdict (also appended to $GITHUB_STEP_SUMMARY when set)."),
    ] = None,
    exec_: Annotated[
        bool,
        typer.Option(
            "--exec", help="Run around the llama-server or llama-speculative-simple command given after `--`."
        ),
    ] = False,
    run: Annotated[
        Optional[Path],
        typer.Option(
            "--run",
            exists=True,
            dir_okay=False,
            help="Judge this capture instead of making one (e.g. of your own llama-server traffic); the probe is its own flows' rounds.",
        ),
    ] = None,
) -> None:
    """One CI verdict: capture, reference, compare and accept probe; exit 1 on a wiring fault or an accept gap."""
    from featdiff.check import check as run_check
    from featdiff.check import exit_code as check_exit_code
    from featdiff.check import render_text

    result = run_check(
        target,
        model,
        ref_target=ref_target,
        ref_model=ref_model,
        llama_dir=llama_dir,
        command=list(ctx.args) if exec_ else None,
        prompts=prompts,
        rounds=rounds,
        min_accept=min_accept,
        keep=keep,
        report=report_out,
        json_out=json_out,
        summary_md=summary_md,
        run=run,
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
    # (featdiff.outputs), instead of SIGXFSZ killing featdiff; subprocess restores it for programs
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    app()
