"""The llama.cpp options of a run that change its numerics or where it computes, spelled as
llama.cpp's programs spell them (common/arg.cpp): KV cache types, flash attention, offloaded
layers, threads, context size.

Consumes an in-process capture's extra arguments (`featdiff capture ... -ctk q8_0 -fa on`), which
must all be known, or a program's command line and environment under `--exec`, from which the
known ones are read; produces one `RunOptions`, which a manifest records in `build.kv_types` and
`build.run_options` (docs/dump.md) and the tolerance model reads (featdiff.diff.tolerance).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.dump.manifest import KV_TYPE_DEFAULT, CacheTypes, kv_types_json

# llama.cpp's --cache-type-k/-v choices (common/arg.cpp kv_cache_types)
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
FLASH_ATTN = ("on", "off", "auto")  # -fa; llama.cpp's default: auto

# (role, K or V) -> the flags that set it, and the environment variable llama.cpp reads instead
KV_OPTIONS: dict[tuple[names.Role, str], tuple[tuple[str, ...], str]] = {
    ("target", "k"): (("-ctk", "--cache-type-k"), "LLAMA_ARG_CACHE_TYPE_K"),
    ("target", "v"): (("-ctv", "--cache-type-v"), "LLAMA_ARG_CACHE_TYPE_V"),
    ("draft", "k"): (("--spec-draft-type-k", "-ctkd", "--cache-type-k-draft"), "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K"),
    ("draft", "v"): (("--spec-draft-type-v", "-ctvd", "--cache-type-v-draft"), "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V"),
}
FLASH_ATTN_FLAGS = ("-fa", "--flash-attn")
GPU_LAYERS_FLAGS = ("-ngl", "--gpu-layers", "--n-gpu-layers")
GPU_LAYERS_DRAFT_FLAGS = ("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl")
THREADS_FLAGS = ("-t", "--threads")
THREADS_ENV = "LLAMA_ARG_THREADS"  # llama.cpp's programs read -t from it where the command line has none
MAX_THREADS = 8  # an in-process run's threads without -t or THREADS_ENV: the cores, at most this
CTX_FLAGS = ("-c", "--ctx-size")
UBATCH_FLAGS = ("-ub", "--ubatch-size")  # a batch larger than this is computed as several graphs


def _default_kv() -> dict[names.Role, CacheTypes]:
    return {role: CacheTypes() for role in names.ROLES}


@dataclass(frozen=True)
class RunOptions:
    """What a run was told beyond llama.cpp's defaults (None: the default)."""

    kv: dict[names.Role, CacheTypes] = field(default_factory=_default_kv)
    flash_attn: str = "auto"
    n_gpu_layers: int | None = None  # target (-ngl)
    n_gpu_layers_draft: int | None = None  # drafter (-ngld)
    threads: int | None = None
    n_ctx: int | None = None  # at least this context (in-process: grown to what the flow needs)
    n_ubatch: int | None = None  # -ub: both contexts' micro-batch (llama.cpp's default 512)

    def to_json(self) -> dict[str, Any]:
        """`build.run_options` (the KV types go to `build.kv_types`)."""
        return {
            "flash_attn": self.flash_attn,
            "n_gpu_layers": self.n_gpu_layers,
            "n_gpu_layers_draft": self.n_gpu_layers_draft,
            "threads": self.threads,
            "n_ctx": self.n_ctx,
            "n_ubatch": self.n_ubatch,
        }

    def build_json(self) -> dict[str, Any]:
        """What a manifest's `build` records of these options."""
        return {"kv_types": kv_types_json(self.kv), "run_options": self.to_json()}


def parse_run_options(args: Sequence[str]) -> RunOptions:
    """An in-process run's llama.cpp options, `-flag VALUE` each; anything else is an InputError."""
    values: dict[str, str] = {}
    known = _flag_names()
    i = 0
    while i < len(args):
        flag = args[i]
        if flag not in known:
            raise InputError(
                f"{flag}: not a featdiff capture option nor a llama.cpp run option of an in-process capture; "
                f"did you mean --exec? (`featdiff capture -o OUT --exec -- PROGRAM ...` runs a program; "
                "`featdiff capture --help` lists the run options)"
            )
        if i + 1 >= len(args):
            raise InputError(f"{flag}: expects a value, e.g. {flag} {_example(flag)}")
        values[flag] = args[i + 1]
        i += 2
    return _options(lambda flags: next((values[f] for f in reversed(list(values)) if f in flags), None), {})


def run_threads(options: RunOptions, environ: Mapping[str, str]) -> int:
    """The CPU threads an in-process run computes on: its -t, else THREADS_ENV where set to a
    positive count (llama.cpp's programs read it so, and take 0 or less as the cores), else the
    cores, at most MAX_THREADS."""
    if options.threads:
        return options.threads
    value = environ.get(THREADS_ENV, "").strip()
    try:
        n = int(value) if value else 0
    except ValueError:
        raise InputError(f"{THREADS_ENV}={value}: expected a thread count (an integer), as llama.cpp's -t") from None
    return n if n > 0 else min(os.cpu_count() or 1, MAX_THREADS)


def options_of_command(command: Sequence[str], environ: Mapping[str, str]) -> RunOptions:
    """A program's options from its command line (its last `-flag VALUE` of each) and environment;
    flags featdiff does not read, and values it cannot read (`bash -c SCRIPT` is no context size),
    are the program's business: those are recorded as not given."""
    try:
        return _options(lambda flags: _last_option(command, flags), environ)
    except InputError:
        return _options(lambda flags: _readable(_last_option(command, flags), flags), environ)


def _options(value_of, environ: Mapping[str, str]) -> RunOptions:
    kv = {
        role: CacheTypes(k=_kv(value_of, environ, role, "k"), v=_kv(value_of, environ, role, "v"))
        for role in names.ROLES
    }
    fa = (value_of(FLASH_ATTN_FLAGS) or environ.get("LLAMA_ARG_FLASH_ATTN") or "auto").lower()
    if fa not in FLASH_ATTN:
        raise InputError(f"-fa {fa}: expected one of {', '.join(FLASH_ATTN)}, as llama.cpp's --flash-attn")
    return RunOptions(
        kv=kv,
        flash_attn=fa,
        n_gpu_layers=_int(value_of(GPU_LAYERS_FLAGS), "-ngl"),
        n_gpu_layers_draft=_int(value_of(GPU_LAYERS_DRAFT_FLAGS), "-ngld"),
        threads=_int(value_of(THREADS_FLAGS), "-t", 1) or _env_threads(environ),
        n_ctx=_int(value_of(CTX_FLAGS), "-c", 0),
        n_ubatch=_int(value_of(UBATCH_FLAGS), "-ub", 1),
    )


def _env_threads(environ: Mapping[str, str]) -> int | None:
    """A program's THREADS_ENV where it is a positive count; anything else is the program's to judge."""
    value = environ.get(THREADS_ENV, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _kv(value_of, environ: Mapping[str, str], role: names.Role, part: str) -> str:
    flags, var = KV_OPTIONS[(role, part)]
    kind = (value_of(flags) or environ.get(var) or KV_TYPE_DEFAULT).lower()
    if kind not in KV_TYPES:
        raise InputError(
            f"{flags[0]} {kind}: not a KV cache type llama.cpp takes; expected one of {', '.join(KV_TYPES)}"
        )
    return kind


def _int(value: str | None, flag: str, low: int = -1) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        n = low - 1
    if n < low:
        raise InputError(f"{flag} {value}: expected an integer >= {low}")
    return n


def _readable(value: str | None, flags: tuple[str, ...]) -> str | None:
    """`value` of one of `flags` if featdiff can read it as that option, else None."""
    if value is None:
        return None
    try:
        _options(lambda asked: value if asked == flags else None, {})
    except InputError:
        return None
    return value


def _last_option(command: Sequence[str], flags: tuple[str, ...]) -> str | None:
    """The value after the last of `flags` in `command` (llama.cpp takes `-flag VALUE` only)."""
    given = [command[i + 1] for i, arg in enumerate(command[:-1]) if arg in flags]
    return given[-1] if given else None


def _flag_names() -> set[str]:
    groups = [f for flags, _ in KV_OPTIONS.values() for f in flags]
    return {
        *groups,
        *FLASH_ATTN_FLAGS,
        *GPU_LAYERS_FLAGS,
        *GPU_LAYERS_DRAFT_FLAGS,
        *THREADS_FLAGS,
        *CTX_FLAGS,
        *UBATCH_FLAGS,
    }


def _example(flag: str) -> str:
    return "on" if flag in FLASH_ATTN_FLAGS else "q8_0" if any(flag in f for f, _ in KV_OPTIONS.values()) else "4"
