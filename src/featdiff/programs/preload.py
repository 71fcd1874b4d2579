"""The preload library that `capture --exec` loads into a llama.cpp program, and the
environment that loads it.

Consumes native/featdiff_preload.c + the shim and the llama.cpp headers of the build the program
uses (default: the pinned one); produces the compiled library, cached like the cffi binding
(keyed by sources, headers and compiler), and a `Preload` to run a program with.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from featdiff.core import names
from featdiff.core.cache_dir import cache_root
from featdiff.core.errors import InputError
from featdiff.core.filters import FilterSet, capture_filters
from featdiff.kinds import registry as kinds
from featdiff.llama import binding

log = logging.getLogger(__name__)

PRELOAD_SOURCES = ("featdiff_preload.c", "featdiff_shim.c")
PRELOAD_HEADERS = ("featdiff_shim.h",)
LLAMA_HEADERS = ("llama.h", "ggml.h", "ggml-backend.h")
IS_MACOS = sys.platform == "darwin"
PRELOAD_VAR = "DYLD_INSERT_LIBRARIES" if IS_MACOS else "LD_PRELOAD"
PRELOAD_NAME = "libfeatdiff_preload.dylib" if IS_MACOS else "libfeatdiff_preload.so"
# the library links no llama/ggml: their symbols resolve to the program's own libraries
LINK_FLAGS = ("-dynamiclib", "-undefined", "dynamic_lookup") if IS_MACOS else ("-shared", "-ldl", "-pthread")
# the preload's environment (native/featdiff_preload.c reads these)
ENV_SPOOL = "FEATDIFF_SPOOL"
ENV_FILTERS = "FEATDIFF_FILTERS"
ENV_ARCH_KEY = "FEATDIFF_ARCH_KEY"
ENV_DRAFT_ARCH = "FEATDIFF_DRAFT_ARCH"
# the pid of the featdiff that runs the program: the preload makes each process it loads into die
# with its parent (Linux PR_SET_PDEATHSIG), and the program exit at once if featdiff is already gone
ENV_PARENT_PID = "FEATDIFF_PARENT_PID"


@dataclass(frozen=True)
class Preload:
    """The compiled preload library and the environment that loads it into a program."""

    library: Path
    env: tuple[tuple[str, str], ...]

    def environ(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this process's environment) plus the preload's variables, and this
        process's pid as the parent the program dies with (`ENV_PARENT_PID`)."""
        merged = dict(os.environ if base is None else base)
        for key, value in self.env:
            merged[key] = f"{value}:{merged[key]}" if key == PRELOAD_VAR and merged.get(key) else value
        merged[ENV_PARENT_PID] = str(os.getpid())
        return merged


def preload_library(llama_dir: Path | None = None) -> Path:
    """The preload library for the headers of `llama_dir` (default: the pinned build), compiled once."""
    build = binding.find_build(llama_dir)
    key = _preload_key(build)
    path = cache_root() / "preload" / key / PRELOAD_NAME
    if not path.is_file():
        _compile_preload(build, path)
    return path


def build_of_program(program: Path, llama_dir: Path | None = None) -> Path | None:
    """The build whose headers the preload must be compiled against for `program`: the one whose
    libllama the program loads. The preload passes llama.h's structs by value between the program
    and its library, so headers of another build would hand the program a struct of the wrong
    layout. With no build named (`llama_dir`, $FEATDIFF_LLAMA_DIR) that is the build found beside
    the program's libllama; a named build that is not the program's is refused. A program whose
    libraries cannot be listed (no `ldd`, a script, a static build) keeps `llama_dir`."""
    linked = _linked_libllama(program)
    if linked is None:
        return llama_dir
    named = llama_dir or (Path(os.environ[binding.ENV_LLAMA_DIR]) if os.environ.get(binding.ENV_LLAMA_DIR) else None)
    if named is not None:
        chosen = binding.find_build(named)
        if chosen.libllama.resolve() != linked.resolve():
            raise InputError(
                f"{program}: loads {linked}, not the build named by --llama-dir ({chosen.libllama}); the preload is "
                f"compiled against the program's own llama.h: pass --llama-dir of the build that made {linked.name}"
            )
        return named
    default = _default_libllama()
    if default is not None and default.resolve() == linked.resolve():
        return None
    root = _root_of(linked)
    if root is None:
        raise InputError(
            f"{program}: loads {linked}, another build than featdiff's default ({default or 'none found'}), with no "
            "llama.h beside it nor a CMakeCache.txt above it; pass --llama-dir of the program's build (its checkout, "
            "CMake build directory or install prefix)"
        )
    log.info("%s loads %s: compiling the preload against %s", program.name, linked, root)
    return root


def _default_libllama() -> Path | None:
    """The libllama of featdiff's default build, or None when there is none (a pip-installed
    featdiff without llama-cpp-python): a program's own build then needs no default to differ from."""
    try:
        return binding.find_build(None).libllama
    except InputError:
        return None


def _linked_libllama(program: Path) -> Path | None:
    """The libllama the dynamic linker finds for `program` (`ldd`), or None when it cannot say."""
    if shutil.which("ldd") is None:
        return None
    try:
        done = subprocess.run(["ldd", str(program)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in done.stdout.splitlines():
        name, _, where = line.strip().partition(" => ")
        if name.startswith("libllama.") and where.startswith("/"):
            return Path(where.split(" (")[0])
    return None


def _root_of(libllama: Path) -> Path | None:
    """The checkout, install prefix or CMake build directory a libllama belongs to (`find_build`
    accepts each), if any: <root>/build/bin, <root>/lib, else the build directory above it whose
    CMakeCache.txt names its source (`cmake -S SRC -B elsewhere`)."""
    for root in (libllama.parent.parent.parent, libllama.parent.parent):  # <root>/build/bin, <root>/lib
        if (root / "include" / "llama.h").is_file():
            return root
    return binding.build_dir_of(libllama)


def preload(prefix: Path, filters: FilterSet | None = None, llama_dir: Path | None = None) -> Preload:
    """What to add to a program's environment to capture what `filters` keep (default: the
    wiring, `capture_filters(None)`) into the spool at `prefix`."""
    lines = (filters or capture_filters(None)).env_lines()
    library = preload_library(llama_dir)
    return Preload(
        library,
        (
            (PRELOAD_VAR, str(library)),
            (ENV_SPOOL, str(prefix)),
            (ENV_FILTERS, lines),
            (ENV_ARCH_KEY, names.KEY_ARCH),
            (ENV_DRAFT_ARCH, ",".join(kinds.DRAFTER_ARCHS)),
        ),
    )


def _preload_key(build: binding.LlamaBuild) -> str:
    h = hashlib.sha256()
    files = [binding.NATIVE_DIR / n for n in PRELOAD_SOURCES + PRELOAD_HEADERS]
    files += [d / n for d in build.include_dirs for n in LLAMA_HEADERS if (d / n).is_file()]
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(f"{sys.platform}:{_compiler()}:{LINK_FLAGS}".encode())
    return h.hexdigest()[:16]


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise InputError("cc: no C compiler on PATH (or $CC); capture --exec compiles a small preload library once")
    return cc


def _compile_preload(build: binding.LlamaBuild, path: Path) -> None:
    log.info("compiling the preload library against %s (once per build)", build.root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    includes = [f"-I{d}" for d in (*build.include_dirs, binding.NATIVE_DIR)]
    sources = [str(binding.NATIVE_DIR / s) for s in PRELOAD_SOURCES]
    # which batch API generation's hooks to compile in (native/featdiff_preload.c), from the headers
    api = f"-DFDP_BATCH_EXT={int(build.batch_api == binding.BATCH_EXT)}"
    mtp = f"-DFDP_MTP={int(build.has_mtp)}"  # whether the context params carry ctx_type (an MTP context)
    cmd = [_compiler(), "-O2", "-fPIC", "-std=c11", api, mtp, *includes, *sources, "-o", str(tmp), *LINK_FLAGS]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise InputError(
            f"{binding.NATIVE_DIR / PRELOAD_SOURCES[0]}: compiling against {build.root} failed "
            f"({done.stderr.strip().splitlines()[-1:]}); check that the headers match the program's llama.cpp"
        )
    tmp.replace(path)  # rename: a concurrent build never sees a half-written library
