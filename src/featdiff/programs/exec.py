"""Capture around an unmodified llama.cpp program (`featdiff capture --exec -- <command>`):
running the program.

Consumes a command line; runs it with the preload library (native/featdiff_preload.c, loaded by
LD_PRELOAD / DYLD_INSERT_LIBRARIES), which chains the shim's callback into every context and
notes each decode, and stops it on a timeout, an interrupt or a signal (llama-server: one request,
or the user's traffic, featdiff.programs.server); produces the dump that featdiff.programs.pack
packs from the spool, whose phases and rounds featdiff.programs.phases infers from those notes.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from featdiff.core import names
from featdiff.core.errors import InputError, Interrupted, ProgramFailed
from featdiff.core.filters import FilterSet, capture_filters
from featdiff.core.gguf_reader import read_gguf
from featdiff.core.outputs import check_output, existing_file, failed_output, no_room_error, output_lock
from featdiff.kinds import registry as kinds
from featdiff.kinds.preflight import preflight
from featdiff.llama import ggml_dequant, spool
from featdiff.llama.options import options_of_command
from featdiff.programs import server
from featdiff.programs.pack import UNKNOWN_VERSION, pack_exec, read_flow, remove_spool, save_build
from featdiff.programs.phases import prompt_from_evals
from featdiff.programs.preload import Preload, build_of_program, preload

# read_flow and prompt_from_evals stay importable from here for featdiff.verdict.probe.
__all__ = ["capture_exec", "capture_program", "command_files", "program_path", "prompt_from_evals", "read_flow"]

# Upstream programs print their llama.cpp version for --version and exit (common/arg.cpp).
UPSTREAM_PREFIX = "llama-"
SPEC_TYPE_FLAG = "--spec-type"  # common/arg.cpp: the speculative types, comma-separated
VERSION_FLAG = "--version"
VERSION_TIMEOUT_S = 10
# The target and drafter GGUFs of a program's command line, and the environment it reads them from
# instead (common/arg.cpp: -m, and the speculative draft model)
MODEL_FLAGS, MODEL_ENV = ("-m", "--model"), "LLAMA_ARG_MODEL"
DRAFT_MODEL_FLAGS, DRAFT_MODEL_ENV = ("--spec-draft-model", "-md", "--model-draft"), "LLAMA_ARG_SPEC_DRAFT_MODEL"
LOG_SUFFIX = ".log"  # the program's own output, beside its dump: run.npz.log

log = logging.getLogger(__name__)


def program_path(command: list[str]) -> Path:
    """The program of `command`, checked to exist."""
    if not command:
        raise InputError(
            "capture --exec needs a command after `--`, e.g. -- llama-speculative-simple -m T.gguf -md D.gguf ..."
        )
    found = shutil.which(command[0])
    if found is None:
        raise InputError(f"{command[0]}: no such program (not a file, not on PATH); give its path after `--`")
    return Path(found)


def command_files(command: list[str]) -> tuple[Path, ...]:
    """The existing files a command line names, as `-m T.gguf` or `--model=T.gguf`: its inputs."""
    named = [a for arg in command for a in (arg, arg.partition("=")[2]) if a]
    return tuple(f for f in map(existing_file, named) if f is not None)


def spec_types(command: list[str]) -> tuple[str, ...]:
    """The speculative types a llama.cpp command line asks for (`--spec-type a,b` or
    `--spec-type=a`, common/arg.cpp; repeatable)."""
    found: list[str] = []
    for i, arg in enumerate(command):
        flag, eq, value = arg.partition("=")
        if flag == SPEC_TYPE_FLAG:
            given = value if eq else (command[i + 1] if i + 1 < len(command) else "")
            found += [t.strip() for t in given.split(",") if t.strip()]
    return tuple(found)


def drafter_kind(command: list[str]) -> kinds.DrafterKind | None:
    """The drafter kind the command runs (featdiff.kinds): MTP where it asks for `draft-mtp` (its
    head is the target's own, or a GGUF of the target's architecture), else the kind of the
    drafter GGUFs it names; None when they name none, or drafters of several kinds."""
    shared = _shared_model_kind(command)
    if shared is not None:
        return shared
    found = {kinds.of_arch(arch).name for arch in _gguf_archs(command) if kinds.is_drafter_arch(arch)}
    return kinds.by_name(found.pop()) if len(found) == 1 else None


def _gguf_archs(command: list[str]) -> Iterator[str]:
    """The architecture of each readable GGUF file the command names (the others left out)."""
    for f in command_files(command):
        if f.suffix != ".gguf":
            continue
        try:
            arch = read_gguf(f).arch
        except (InputError, OSError):
            continue
        yield arch


def _shared_model_kind(command: list[str]) -> kinds.DrafterKind | None:
    """The kind whose head runs on the target's own model (MTP) that the command's --spec-type asks
    for: it drafts with no -md; None when it asks for none."""
    asked = spec_types(command)
    return next((k for k in kinds.KINDS if k.shares_target_model and k.spec_type in asked), None)


def command_filters(filters: list[str] | None, command: list[str]) -> FilterSet:
    """What a capture around `command` keeps: `--filter`, else its drafter kind's wiring (the
    DFlash graph's when the command says no kind) and, on the target, every layer, the positions
    and what the kind reads of it."""
    kind = drafter_kind(command)
    if kind is None:
        return capture_filters(filters, wiring=names.DRAFT_WIRING)
    # a GGUF the command names whose graph is its own, not its kind's (Gemma 4's assistant)
    own = next((arch for arch in _gguf_archs(command) if arch in kind.arch_wiring), None)
    return capture_filters(filters, None, kind.wiring_of(own), kind.target_wiring)


def run_program(command: list[str], pre: Preload, timeout_s: float | None, log_path: Path) -> int:
    """Run `command` with the preload, its stdin the caller's and its stdout and stderr in
    `log_path`; return its exit code. Stopped (server.stop_process) if featdiff is interrupted or
    it overruns `timeout_s`."""
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(command, env=pre.environ(), stdout=out, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise InputError(
                f"{command[0]}: still running after {timeout_s:.0f} s; stopped it; its output is in {log_path}"
            ) from None
        finally:
            server.stop_process(proc)


def program_log(output: Path) -> Path:
    """Where a capture around a program keeps the program's own output: beside the dump."""
    return output.with_name(output.name + LOG_SUFFIX)


def command_models(command: list[str], environ: Mapping[str, str]) -> tuple[Path | None, Path | None]:
    """The target and drafter files a program's command line loads (its last -m and -md, as
    `-m F` or `--model=F`, else the environment's), None where it names none."""
    target = server.option_value(command, MODEL_FLAGS, MODEL_ENV, environ)
    drafter = server.option_value(command, DRAFT_MODEL_FLAGS, DRAFT_MODEL_ENV, environ)
    return (Path(target) if target else None), (Path(drafter) if drafter else None)


def check_pair(command: list[str], environ: Mapping[str, str]) -> None:
    """Refuse, before the program starts, a drafter that does not fit its target (preflight:
    lint's fatal problems, one line), as an in-process capture does; say so when llama-server
    runs without a drafter. A drafter of no drafter architecture (a plain small model drafting
    for a large one: classic speculative decoding) or a file that is not there is the program's
    business. A head featdiff refuses by name (kinds.mtp.UNMODELLED_HEADS) is refused here too."""
    target, drafter = command_models(command, environ)
    _refuse_unmodelled_head(drafter if drafter is not None or _shared_model_kind(command) is None else target)
    if drafter is None:
        if server.is_server(command) and _shared_model_kind(command) is None:
            log.warning(
                "%s runs without a drafter (no -md): the capture holds the target alone, with no draft to judge; "
                "give -md D.gguf and --spec-type to capture speculative decoding",
                Path(command[0]).name,
            )
        return
    if target is None or not (target.is_file() and drafter.is_file()):
        return
    try:
        arch = read_gguf(drafter).arch
    except (InputError, OSError):
        return  # not a GGUF featdiff reads: llama.cpp says what it makes of it
    if not kinds.is_drafter_arch(arch):
        return
    kind = kinds.of_arch(arch)
    if kind.shares_target_model and kind.spec_type not in spec_types(command):
        return  # a target-architecture model drafting as a plain small model, not as an MTP head
    preflight(drafter, target, ggml=ggml_dequant.load)


def _refuse_unmodelled_head(path: Path | None) -> None:
    """InputError, before the program starts, for the file that drafts (its -md, else the target
    whose own head --spec-type draft-mtp runs) when it is a head featdiff refuses by name, as lint,
    capture's preflight and the reference refuse it (kinds.registry.refused)."""
    if path is None or not path.is_file():
        return
    try:
        refused = kinds.refused(read_gguf(path))
    except (InputError, OSError):
        return  # not a GGUF featdiff reads: llama.cpp says what it makes of it
    if refused is not None:
        raise InputError(f"{path}: {refused}")


def program_version(program: Path) -> str:
    """The llama.cpp version an upstream program (`llama-*`, common/arg.cpp) reports for
    `--version` ("version: 0.5.0-dev (build 0, commit unknown)"), else "unknown"."""
    if not program.name.startswith(UPSTREAM_PREFIX):
        return UNKNOWN_VERSION
    try:
        done = subprocess.run(
            [str(program), VERSION_FLAG],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=VERSION_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN_VERSION
    found = re.search(r"^version: (.+)$", done.stdout + done.stderr, re.MULTILINE)
    return found.group(1).strip() if found else UNKNOWN_VERSION


def capture_exec(
    command: list[str],
    output: Path,
    filters: list[str] | None = None,
    llama_dir: Path | None = None,
    *,
    prompt: str | None = None,
    tokens: str | None = None,
    timeout_s: float | None = None,
    n_requests: int | None = None,
    log_path: Path | None = None,
) -> Path:
    """Run `command` under the preload and write its dump; llama-server is started, asked one
    greedy completion (`prompt`/`tokens`) and stopped, or without them records the user's own
    requests until featdiff is stopped or `n_requests` have completed (featdiff.programs.server). A
    program that fails or is interrupted leaves its dump at `failed_output(output)`, never over a
    dump at -o. The program's own output goes to `log_path` (default: beside the dump, run.npz.log)."""
    program = program_path(command)
    server.check_traffic(command, n_requests, prompt is not None or tokens is not None, os.environ)
    output = check_output(Path(output), (program, *command_files(command)), "-o")
    check_pair(command, os.environ)
    log_path = log_path or program_log(output)
    kept = command_filters(filters, command)
    with output_lock(output):
        prefix = spool.prefix_for(output)
        spool.set_aside(prefix, output)
        build: dict[str, Any] = {
            "command": list(command),
            "program": str(program),
            "filters": kept.to_json(),
            **options_of_command(command, os.environ).build_json(),
            "commit": program_version(program),
        }
        pre = preload(prefix, kept, build_of_program(program, llama_dir))
        save_build(prefix, build, output)
        try:
            build |= _launch(command, pre, prefix, prompt, tokens, timeout_s, n_requests, log_path)
        except KeyboardInterrupt as stop:
            raise _pack_interrupted(stop, prefix, output, build) from None
        packed = _pack_run(command, prefix, output, build, log_path)
    if filters:
        spool.warn_unmatched_filters(kept, packed)
    rc = int(build.get("exit_code", 0))
    if rc != 0 and packed.kept == 0:  # it failed before it decoded: an empty dump would say nothing
        packed.path.unlink(missing_ok=True)
        raise InputError(server.failure_line(program.name, rc, log_path, " before decoding anything"))
    if rc != 0:
        failed = build.get("server_error") or server.failure_line(program.name, rc, log_path, " under capture")
        raise ProgramFailed(
            f"{failed}; {packed.path} holds what it decoded before that (compare it against the "
            "reference to see why); run the command without featdiff to see whether it fails alone",
            packed.path,
        )
    log.info("%s's own output is in %s", program.name, log_path)
    return packed.path


def _pack_run(command: list[str], prefix: Path, output: Path, build: dict[str, Any], log_path: Path) -> spool.Packed:
    """Pack the spool of a run that ended (to -o, or beside it if the program failed) and remove it."""
    rc = int(build.get("exit_code", 0))
    if rc == -signal.SIGXFSZ:  # the program ran past the file-size limit writing the spool
        remove_spool(prefix)
        raise no_room_error(output, OSError(errno.EFBIG, os.strerror(errno.EFBIG)), f"{prefix}.*")
    try:
        packed = pack_exec(prefix, failed_output(output) if rc != 0 else output, build, log_path)
    except InputError:
        remove_spool(prefix)  # the program never reached llama.cpp: the spool holds nothing
        if rc != 0:  # it failed before any llama.cpp call: its own exit is the news
            raise InputError(
                server.failure_line(Path(command[0]).name, rc, log_path, " before decoding anything")
            ) from None
        raise
    remove_spool(prefix)
    spool.warn_dropped(packed)
    return packed


def _pack_interrupted(stop: KeyboardInterrupt, prefix: Path, output: Path, build: dict[str, Any]) -> Interrupted:
    """featdiff was interrupted while the program ran (it has been stopped): pack what it decoded
    beside a dump at -o (or to -o if there is none) and say where."""
    try:
        packed = pack_exec(prefix, failed_output(output), build)
    except InputError:
        remove_spool(prefix)
        return Interrupted.of(stop, "the program was stopped before it decoded anything; no dump written")
    remove_spool(prefix)
    return Interrupted.of(stop, f"stopped the program; {packed.summary()}")


def _launch(
    command: list[str],
    pre: Preload,
    prefix: Path,
    prompt: str | None,
    tokens: str | None,
    timeout_s: float | None,
    n_requests: int | None,
    log_path: Path,
) -> dict[str, Any]:
    """Run the program (or serve one request, or the user's traffic), its output in `log_path`;
    return what the manifest's build records of it."""
    if server.is_server(command) and prompt is None and tokens is None:
        traffic = server.record_traffic(command, pre, prefix, n_requests, log_path)
        return {"server_traffic": traffic.to_json(), "exit_code": traffic.exit_code}
    if server.is_server(command):
        request = server.request_from(prompt, tokens)
        try:
            result = server.serve_one(command, pre, request, prefix, log_path)
        except server.RequestFailed as e:  # it decoded, then failed: the dump still tells what it did
            return {"server_error": str(e), "exit_code": 1}
        return {"server": result.to_json()}
    return {"exit_code": run_program(command, pre, timeout_s, log_path)}


def capture_program(
    command: list[str],
    output: Path,
    filters: list[str] | None,
    llama_dir: Path | None,
    prompt: str | None = None,
    tokens: str | None = None,
    draft_max: int | None = None,
    p_min: float | None = None,
    n_requests: int | None = None,
    log_path: Path | None = None,
) -> Path:
    """Capture around an unmodified llama.cpp program (featdiff.programs.exec); llama-server gets
    one greedy completion request for `prompt` / `tokens`, or without them serves the user's own
    requests until Ctrl-C or `n_requests` have completed. The program's own command line sets
    its block length and p_min, so `draft_max` and `p_min` are refused. Its own output goes to
    `log_path` (default: beside the dump)."""
    if draft_max is not None or p_min is not None:
        flag = f"--draft-max {draft_max}" if draft_max is not None else f"--p-min {p_min}"
        raise InputError(
            f"{flag} drives the in-process flow; with --exec pass --spec-draft-n-max / "
            "--spec-draft-p-min in the program's command line instead"
        )

    return capture_exec(
        command, output, filters, llama_dir, prompt=prompt, tokens=tokens, n_requests=n_requests, log_path=log_path
    )
