"""Build the programs `capture --exec` runs (llama-server, llama-speculative-simple,
llama-simple), llama-quantize, and their libllama from the pinned llama.cpp source, the tree
llama-cpp-python==0.3.36 builds, with the project's own patches (`patches/llama.cpp/*.patch`, applied by
featdiff.llama.patches).

Consumes the sdist (`pip download`, or $FEATDIFF_LLAMA_SRC); produces a `ToolBuild`, built once
(Release, shared libs, CPU, no SSL/UI/tests) and cached in build/llama.cpp ($FEATDIFF_TOOLS_DIR):
`pristine/` the unpacked source, `src/` the patched tree, `src/build/` the build (so
`--llama-dir build/llama.cpp/src` captures in-process from the same library). That library is
the default build of the binding and the preload: `make setup` builds it first
(`python -m featdiff.llama.tools --library`, the library targets of the same configuration), and
`make tools` adds the programs to the same build, so the pinned tree is built once.
The patches are gated: log-SNR conditioning only acts on a drafter whose GGUF sets
`dflash.log_snr_conditioning`, and the driver faults only when $FEATDIFF_FAULT names one; with
neither the programs behave as upstream's. `python -m featdiff.llama.tools` builds or finds them
and prints their bin directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from featdiff.core.errors import InputError
from featdiff.llama.binding import DEFAULT_TOOLS_DIR, LIBLLAMA, PINNED_WHEEL, PROJECT_TREE, tools_dir
from featdiff.llama.patches import apply_patches, patch_files

SERVER_PROGRAMS = ("llama-server",)

log = logging.getLogger(__name__)

PINNED_SDIST = PINNED_WHEEL  # the source of the wheel the binding falls back to
SDIST_TREE = "vendor/llama.cpp"  # where the sdist keeps the llama.cpp source
# llama-simple prints with printf (exact stdout, unlike the tools' async logger): the tests use it;
# llama-quantize writes the weight types gguf-py cannot (Q1_0, IQ*, K-quants) for the reference tests
TARGETS = (SERVER_PROGRAMS[0], "llama-speculative-simple", "llama-simple", "llama-quantize")
ENV_SRC = "FEATDIFF_LLAMA_SRC"
ENV_JOBS = "FEATDIFF_BUILD_JOBS"
DEFAULT_JOBS = 2
DEFAULT_DIR = DEFAULT_TOOLS_DIR
STAMP = "tools.json"
BUILD_LOCK = ".featdiff-build.lock"  # in the tools dir: one build of a tree at a time, across processes
PIP_TIMEOUT_S = 900
# Lean: only what the two programs need. The UI would be downloaded (prebuilt) or built with npm;
# HTTPS needs OpenSSL; neither matters on a loopback port.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",  # llama-speculative-simple is an example
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_LLGUIDANCE=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_BACKEND_DL=OFF",
    # x86-64-v3 (AVX2, FMA, F16C), not -march=native: on a CPU with AMX (a Xeon reporting amx_int8)
    # the native build's AMX q8_0 matmul crashes the process (SIGSEGV in ggml_backend_amx_mul_mat)
    # on the tiny fixtures' q8_0 target; and one build runs alike on every machine CI lands on
    "-DGGML_NATIVE=OFF",
    *(f"-DGGML_{f}=ON" for f in ("SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2")),  # said, so a reconfigure sets them
)


@dataclass(frozen=True)
class ToolBuild:
    """Where the built programs are, and what built them."""

    root: Path  # the cache directory
    source: Path  # the llama.cpp source tree
    bin_dir: Path
    build_seconds: float  # wall time of the build that made this cache (0 when unknown)

    def program(self, name: str) -> Path:
        return self.bin_dir / name


@contextlib.contextmanager
def _build_lock(root: Path) -> Iterator[None]:
    """Hold the tools dir's build lock: two processes building one CMake tree at once (a test and
    `make tools`, two test workers) interleave two ninjas over the same objects and corrupt the
    build (a link that misses objects the other removed). The second waits, then finds it built."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / BUILD_LOCK, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def ensure_tools(root: Path | None = None) -> ToolBuild:
    """The cached build of TARGETS; build it first when missing or stale."""
    root = Path(root or tools_dir())
    with _build_lock(root):
        return _ensure_tools(root)


def _ensure_tools(root: Path) -> ToolBuild:
    source = source_tree(root)
    key = build_key(source)
    cached = _cached(root, source, key)
    if cached is not None:
        return cached
    # an incremental rebuild (a recipe or patch change) adds to the time of the build it extends
    before = _stamp_seconds(root)
    # no stamp while the tree is being built: one killed part-way (a ^C, a killed `make test`) is
    # built on by the next run, never trusted, even once the source is back to the stamp's key
    (root / STAMP).unlink(missing_ok=True)
    seconds = _build(source, _build_dir(root, source)) + before
    (root / STAMP).write_text(
        json.dumps(
            {
                "key": key,
                "source": str(source),
                "seconds": round(seconds, 1),
                "targets": list(TARGETS),
                "options": list(CMAKE_OPTIONS),
                "patches": [p.name for p in patch_files()],
            },
            indent=1,
        )
    )
    log.info("built %s in %.0f s", ", ".join(TARGETS), seconds)
    return ToolBuild(root, source, _build_dir(root, source) / "bin", seconds)


LIBRARY_TARGETS = ("llama",)  # libllama and the ggml libraries it links
LIBRARY_STAMP = "library.json"


def ensure_library(root: Path | None = None) -> Path:
    """The project's libllama (`make setup`): the library targets of the tools' own configuration,
    built in the same tree and build directory, so `make tools` later only adds the programs and
    one build serves the binding, the preload and the tools. Returns its `--llama-dir`: the tree,
    or the build directory when that is out of the tree ($FEATDIFF_LLAMA_SRC; its CMakeCache.txt
    names the tree, featdiff.llama.binding.source_of)."""
    root = Path(root or tools_dir())
    with _build_lock(root):
        return _ensure_library(root)


def _ensure_library(root: Path) -> Path:
    source = source_tree(root)
    key = build_key(source)
    build_dir = _build_dir(root, source)
    llama_dir = source if build_dir == source / "build" else build_dir
    stamps = [root / STAMP, root / LIBRARY_STAMP]
    if (build_dir / "bin" / LIBLLAMA).exists() and any(
        s.is_file() and json.loads(s.read_text()).get("key") == key for s in stamps
    ):
        return llama_dir
    for stamp in stamps:  # both are of another key (stale) by now
        stamp.unlink(missing_ok=True)
    seconds = _build(source, build_dir, LIBRARY_TARGETS)
    (root / LIBRARY_STAMP).write_text(json.dumps({"key": key, "seconds": round(seconds, 1)}, indent=1))
    log.info("built %s in %.0f s", ", ".join(LIBRARY_TARGETS), seconds)
    return llama_dir


def _build_dir(root: Path, source: Path) -> Path:
    """The CMake build directory: inside the patched tree (a checkout with its build in DIR/build,
    as `--llama-dir` reads it); beside a user's own $FEATDIFF_LLAMA_SRC tree, never inside it."""
    return root / "build" if os.environ.get(ENV_SRC) else source / "build"


def build_key(source: Path) -> str:
    """A hash of the source version, the patches and the build recipe."""
    h = hashlib.sha256()
    for marker in ("CMakeLists.txt", "include/llama.h", "common/speculative.cpp"):
        h.update((source / marker).read_bytes())
    for patch in patch_files():
        h.update(patch.read_bytes())
    h.update(json.dumps([CMAKE_OPTIONS, TARGETS, sys.platform]).encode())
    return h.hexdigest()[:16]


def _stamp_seconds(root: Path) -> float:
    stamp = root / STAMP
    return float(json.loads(stamp.read_text()).get("seconds", 0.0)) if stamp.is_file() else 0.0


def _cached(root: Path, source: Path, key: str) -> ToolBuild | None:
    stamp = root / STAMP
    bin_dir = _build_dir(root, source) / "bin"
    if not stamp.is_file() or not all((bin_dir / t).is_file() for t in TARGETS):
        return None
    info = json.loads(stamp.read_text())
    if info.get("key") != key:
        return None
    return ToolBuild(root, source, bin_dir, float(info.get("seconds", 0.0)))


def source_tree(root: Path) -> Path:
    """The llama.cpp tree to build: $FEATDIFF_LLAMA_SRC as it is, else the pinned sdist unpacked
    in `root` with the project's patches applied."""
    if os.environ.get(ENV_SRC):
        src = Path(os.environ[ENV_SRC]).expanduser().resolve()
        if not (src / "CMakeLists.txt").is_file() or not (src / "include" / "llama.h").is_file():
            raise InputError(
                f"{ENV_SRC}={src}: no CMakeLists.txt and include/llama.h there; point it at a llama.cpp source tree"
            )
        return src
    pristine = root / "pristine"
    if not (pristine / "include" / "llama.h").is_file():
        _unpack(_download(root / "sdist"), pristine)
    tree = root / PROJECT_TREE
    if not (tree / "include" / "llama.h").is_file():
        shutil.rmtree(tree, ignore_errors=True)
        shutil.copytree(pristine, tree, symlinks=True)
    apply_patches(pristine, tree, patch_files())
    return tree


def _download(dest: Path, spec: str = PINNED_SDIST) -> Path:
    """The sdist of `spec` (llama-cpp-python==X) in `dest`, fetched with pip when missing."""
    name = f"llama_cpp_python-{spec.split('==')[1]}.tar.gz"
    if (dest / name).is_file():
        return dest / name
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec, "-d", str(dest)]
    log.info("fetching llama.cpp source: %s", " ".join(cmd[2:]))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    if done.returncode != 0 or not (dest / name).is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise InputError(
            f"{dest}: `pip download {spec}` failed ({tail[0]}); "
            f"set {ENV_SRC} to a llama.cpp source tree of that version instead"
        )
    return dest / name


def _unpack(sdist: Path, dest: Path) -> None:
    """Extract the sdist's vendor/llama.cpp into `dest` (renamed into place when complete)."""
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        prefix = f"{top}/{SDIST_TREE}/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix) :]
        kept = [m for m in members if m.name]
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4 / 3.10.12: refuse links out of `tmp`
            tar.extractall(tmp, members=kept, filter="data")
        else:
            tar.extractall(tmp, members=kept)
    if not (tmp / "include" / "llama.h").is_file():
        raise InputError(f"{sdist}: no {SDIST_TREE}/include/llama.h inside; is this the llama-cpp-python sdist?")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.replace(dest)


def _build(
    source: Path, build_dir: Path, targets: tuple[str, ...] = TARGETS, options: tuple[str, ...] = CMAKE_OPTIONS
) -> float:
    """Configure (`options`) and build `targets`; return the wall time in seconds."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise InputError(
                f"{tool}: not found on PATH; building {', '.join(targets)} needs cmake and a C++17 compiler"
            )
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    jobs = os.environ.get(ENV_JOBS, str(DEFAULT_JOBS))
    start = time.monotonic()
    _run(["cmake", "-S", str(source), "-B", str(build_dir), *generator, *options], build_dir)
    _run(["cmake", "--build", str(build_dir), "--target", *targets, "-j", jobs], build_dir)
    return time.monotonic() - start


def _run(cmd: list[str], build_dir: Path) -> None:
    build_dir.mkdir(parents=True, exist_ok=True)
    logfile = build_dir / "featdiff-build.log"
    log.info("%s", " ".join(cmd))
    with open(logfile, "a") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise InputError(f"{build_dir}: `{' '.join(cmd[:3])} ...` failed (exit {done.returncode}); see {logfile}")


def main() -> None:
    """Build (or find) the tools and print their bin directory; with `--library`, only the
    library (`make setup`), and print its tree."""
    logging.basicConfig(level=logging.INFO, format="featdiff: %(message)s", stream=sys.stderr)
    try:
        print(ensure_library() if sys.argv[1:] == ["--library"] else ensure_tools().bin_dir)
    except InputError as e:
        print(f"featdiff: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
