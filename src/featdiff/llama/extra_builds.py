"""The builds of the pinned llama.cpp that only some tests need, beside the tools' build
(featdiff.llama.tools): an older release for the legacy batch API, the tree with a GPU backend of
ggml (Vulkan, CUDA) and the library with its backends loaded at run time. Each is built once per
machine under its own build lock, and `python -m featdiff.llama.extra_builds NAME...` builds the
ones named (tests/conftest.py starts those its session's tests need in the background).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from featdiff.core.errors import InputError
from featdiff.llama.binding import LIBLLAMA, tools_dir
from featdiff.llama.tools import (
    CMAKE_OPTIONS,
    STAMP,
    ToolBuild,
    _build,
    _build_lock,
    _download,
    _run,
    _unpack,
    build_key,
    source_tree,
)

log = logging.getLogger(__name__)


# An older llama.cpp, for the tests that prove featdiff against the batch API generation before
# llama_batch_ext / llama_process: llama-cpp-python 0.3.35 is the last release on llama_batch +
# llama_decode, and already has the dflash arch (its drafter injects in two steps, llama_encode
# then llama_decode). Built unpatched, CPU only, with the two programs `capture --exec` runs.
LEGACY_SDIST = "llama-cpp-python==0.3.35"
LEGACY_TARGETS = ("llama", "llama-simple", "llama-speculative-simple")
# Builds only the tests run (the older release, the backend-loaded library) compile unoptimized:
# they run the tiny fixtures, where -O0 costs milliseconds, and -O0 compiles 2-5x faster than
# Release's -O3 (llama-vocab.cpp 5.7 s -> 2.5 s, ggml-cpu/ops.cpp 9.2 s -> 1.7 s). On a fresh
# clone the two builds took 325 s and 120 s of `make test`, 178 s and 62 s so. NDEBUG stays.
TEST_BUILD_FLAGS = ("-DCMAKE_C_FLAGS_RELEASE=-O0 -DNDEBUG", "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG")
LEGACY_OPTIONS = (*(o for o in CMAKE_OPTIONS if "SERVER" not in o), "-DLLAMA_BUILD_SERVER=OFF", *TEST_BUILD_FLAGS)


def ensure_release(
    spec: str = LEGACY_SDIST,
    root: Path | None = None,
    targets: tuple[str, ...] = LEGACY_TARGETS,
    options: tuple[str, ...] = LEGACY_OPTIONS,
) -> ToolBuild:
    """A llama.cpp release as its sdist ships it (no patches), built once into `root` (default
    build/release-<version>) as a checkout: `--llama-dir <root>/src` binds it."""
    version = spec.split("==")[1]
    root = Path(root or tools_dir().parent / f"release-{version}")
    with _build_lock(root):
        return _ensure_release(spec, root, targets, options)


def _ensure_release(spec: str, root: Path, targets: tuple[str, ...], options: tuple[str, ...]) -> ToolBuild:
    source, build_dir = root / "src", root / "src" / "build"
    want = {"spec": spec, "targets": list(targets), "options": list(options)}
    stamp = root / STAMP
    built = json.loads(stamp.read_text()) if stamp.is_file() else {}
    if built.get("want") == want and all((build_dir / "bin" / t).is_file() for t in targets if t.startswith("llama-")):
        return ToolBuild(root, source, build_dir / "bin", float(built["seconds"]))
    if not (source / "include" / "llama.h").is_file():
        _unpack(_download(root / "sdist", spec), source)
    stamp.unlink(missing_ok=True)  # as _ensure_tools: a build killed part-way leaves no stamp
    seconds = _build(source, build_dir, targets, options)
    stamp.write_text(json.dumps({"want": want, "seconds": round(seconds, 1)}, indent=1))
    log.info("built %s %s in %.0f s", spec, ", ".join(targets), seconds)
    return ToolBuild(root, source, build_dir / "bin", seconds)


# The pinned tree with a GPU backend of ggml, for the tests that capture on a device
# (tests/llama/test_device.py, test_device_exec.py): each built once per machine from the project's
# patched tree into a build directory of its own beside the CPU build (`--llama-dir
# build/llama.cpp-vulkan`). Unoptimized like the other test-only builds: the CPU backend's code at
# -O0; the device code (the shaders glslc compiles, CUDA's kernels) is the same either way. The
# library only: the programs `capture --exec` runs on the device are the tools build's, run against
# the device build's libraries (device_program_env). They link libllama and ggml dynamically, and
# neither common/, tools/server nor speculative-simple holds a backend-specific line (no
# GGML_USE_*), so they run what a device build of them runs, without compiling them twice (about 9
# minutes on 2 cores at -O0).
DEVICE_TARGETS = ("llama",)
DEVICE_STAMP = "featdiff-{name}.json"  # in the build directory


@dataclass(frozen=True)
class DeviceBackend:
    """A GPU backend of ggml the device tests run on: how its build is made and how a run sees it."""

    name: str  # "vulkan", "cuda"
    device: str  # ggml's name of its first device (the manifest's placement, a record's backend)
    cmake_option: str  # the option that builds it into ggml
    build_dir: str  # beside the CPU build, under build/
    env: Mapping[str, str]  # what a run (in-process or a program) needs to see the device
    packages: str  # what building it needs, and how to get it (the error's fix)
    user_build_env: str = ""  # names a build of the user's own instead (CUDA: a CMake build dir)
    more_options: tuple[str, ...] = ()

    def options(self) -> tuple[str, ...]:
        flag = self.cmake_option.split("=")[0]
        kept = (o for o in CMAKE_OPTIONS if not o.startswith(flag + "="))
        return (*kept, self.cmake_option, *self.more_options, *TEST_BUILD_FLAGS)


VULKAN_PACKAGES = ("libvulkan-dev", "glslc", "spirv-headers", "mesa-vulkan-drivers")
VULKAN_HEADER = Path("/usr/include/vulkan/vulkan.h")
# What a run on Mesa's llvmpipe (a Vulkan device that computes on the CPU) needs, and two settings
# that only change how fast its first run compiles. ggml skips Vulkan devices of the CPU type unless
# named visible (ggml-vulkan.cpp ggml_vk_instance_init). llvmpipe compiles each of ggml's pipelines
# with LLVM the first time a process on the machine uses it (Mesa caches them in
# ~/.cache/mesa_shader_cache), the biggest part of the device tests on a fresh clone. Measured on
# 2 idle cores, cold caches, the clean pair wholly on the device (tests/llama/test_device.py): 179 s
# as ggml and Mesa default; 56 s without ggml-vulkan's fused kernels (GGML_VK_DISABLE_FUSION: the
# same ops, one kernel each, and fewer, smaller pipelines); 39 s also without LLVM's optimization
# passes (GALLIVM_PERF=nopt). A warm run takes 2 s either way. The device tests keep one run with
# fusion on (test_a_run_with_fused_kernels_records_the_same_and_compares_clean); the numerics were
# calibrated with these settings (diff/tolerance.py REL_DEVICE).
LLVMPIPE_VISIBLE = {"GGML_VK_VISIBLE_DEVICES": "0"}
VULKAN_UNFUSED = "GGML_VK_DISABLE_FUSION"
SOFTWARE_VULKAN_ENV = {**LLVMPIPE_VISIBLE, VULKAN_UNFUSED: "1", "GALLIVM_PERF": "nopt"}
VULKAN = DeviceBackend(
    name="vulkan",
    device="Vulkan0",
    cmake_option="-DGGML_VULKAN=ON",
    build_dir="llama.cpp-vulkan",
    env=SOFTWARE_VULKAN_ENV,
    # patch 0005 lets ggml-vulkan.cpp compile against Debian 12's Vulkan 1.3.239 headers; Mesa 25 or
    # later runs the programs (on Debian 12's 22.3 every run of llama-speculative-simple -ngl 99
    # crashed inside llvmpipe's queue thread, without featdiff too: scripts/vulkan-packages.sh)
    packages=f"`make vulkan` (as root), or apt-get install {' '.join(VULKAN_PACKAGES)}",
)
CUDA = DeviceBackend(
    name="cuda",
    device="CUDA0",
    cmake_option="-DGGML_CUDA=ON",
    build_dir="llama.cpp-cuda",
    env={},
    packages="the CUDA toolkit (nvcc and cuBLAS) on PATH",
    user_build_env="FEATDIFF_CUDA_LLAMA_DIR",
    # the kernels for the GPU present only, not ggml's list of every architecture
    more_options=("-DCMAKE_CUDA_ARCHITECTURES=native",),
)
DEVICE_BACKENDS = {b.name: b for b in (VULKAN, CUDA)}


def device_program_env(build: ToolBuild, backend: DeviceBackend, env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a tools-build program run on the device build `build`: the dynamic linker takes
    libllama and ggml from the device build first (the programs' RUNPATH yields to
    LD_LIBRARY_PATH), the rest (libllama-common, the server's) from the tools build."""
    paths = [str(build.bin_dir), *filter(None, env.get("LD_LIBRARY_PATH", "").split(os.pathsep))]
    return {**env, **backend.env, "LD_LIBRARY_PATH": os.pathsep.join(paths)}


def ensure_device(backend: DeviceBackend, root: Path | None = None) -> ToolBuild:
    """The project's patched tree built with `backend` into `root` (default build/<backend.build_dir>),
    once per source, patches and options; `ToolBuild.root` is the `--llama-dir` (a CMake build
    directory whose CMakeCache.txt names the tree). Where $<backend.user_build_env> names a build
    of the user's own, that one, as it is."""
    user = os.environ.get(backend.user_build_env) if backend.user_build_env else None
    if user:
        build_dir = Path(user)
        if not (build_dir / "bin" / LIBLLAMA).exists():
            raise InputError(f"{build_dir}: ${backend.user_build_env} names no CMake build dir with bin/{LIBLLAMA}")
        return ToolBuild(build_dir, build_dir, build_dir / "bin", 0.0)
    root = Path(root or tools_dir().parent / backend.build_dir)
    with _build_lock(root):
        return _ensure_device(backend, root)


def _ensure_device(backend: DeviceBackend, root: Path) -> ToolBuild:
    source = _locked_source_tree()
    want = {"key": build_key(source), "targets": list(DEVICE_TARGETS), "options": list(backend.options())}
    stamp = root / DEVICE_STAMP.format(name=backend.name)
    built = json.loads(stamp.read_text()) if stamp.is_file() else {}
    if built.get("want") == want and (root / "bin" / LIBLLAMA).exists():
        return ToolBuild(root, source, root / "bin", float(built["seconds"]))
    _require_sdk(backend)
    stamp.unlink(missing_ok=True)
    seconds = _build(source, root, DEVICE_TARGETS, backend.options())
    stamp.write_text(json.dumps({"want": want, "seconds": round(seconds, 1)}, indent=1))
    log.info("built the %s %s in %.0f s", backend.name, ", ".join(DEVICE_TARGETS), seconds)
    return ToolBuild(root, source, root / "bin", seconds)


def ensure_vulkan(root: Path | None = None) -> ToolBuild:
    """ensure_device(VULKAN)."""
    return ensure_device(VULKAN, root)


def _locked_source_tree() -> Path:
    """source_tree of the tools dir, under its build lock (a build of the tools may be patching it)."""
    with _build_lock(tools_dir()):
        return source_tree(tools_dir())


# The pinned tree's library built with GGML_BACKEND_DL=ON (the usual packaging of CUDA and Vulkan
# builds: each backend a library loaded at run time), CPU backend only, installed into a prefix
# beside the tools' build (build/llama.cpp/dl/prefix), for tests/llama/test_backend_dl.py.
BACKEND_DL_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_BACKEND_DL=ON",
    "-DGGML_NATIVE=OFF",  # llama.cpp refuses GGML_NATIVE with GGML_BACKEND_DL
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_LLGUIDANCE=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    *TEST_BUILD_FLAGS,
)
BACKEND_DL_DIR = "dl"  # in the tools dir


def ensure_backend_dl(root: Path | None = None) -> Path:
    """The install prefix of the backend-loaded build (built once per source and options into
    `root`, default build/llama.cpp/dl); its `lib/` holds libllama and the libggml-cpu*.so it loads."""
    root = Path(root or tools_dir() / BACKEND_DL_DIR)
    with _build_lock(root):
        return _ensure_backend_dl(root)


def _ensure_backend_dl(root: Path) -> Path:
    source = _locked_source_tree()
    prefix, stamp, build_dir = root / "prefix", root / "stamp.json", root / "build"
    want = {"source": str(source), "options": list(BACKEND_DL_OPTIONS)}
    if stamp.is_file() and json.loads(stamp.read_text()) == want and (prefix / "lib" / LIBLLAMA).is_file():
        return prefix
    stamp.unlink(missing_ok=True)
    seconds = _build(source, build_dir, ("all",), BACKEND_DL_OPTIONS)
    _run(["cmake", "--install", str(build_dir), "--prefix", str(prefix)], build_dir)
    stamp.write_text(json.dumps(want))
    log.info("built the backend-loaded library in %.0f s", seconds)
    return prefix


# The builds only some tests need, by the name `python -m featdiff.llama.extra_builds NAME...`
# takes: tests/conftest.py starts the ones its session's tests need in the background, niced, at the
# start of the session (each under its own build lock, so the test that needs one waits for it).
TEST_BUILDS: dict[str, Callable[[], object]] = {
    "release": ensure_release,
    "vulkan": ensure_vulkan,
    "backend-dl": ensure_backend_dl,
}


def build_for_tests(names: list[str]) -> int:
    """Build each of `names` (TEST_BUILDS) in turn, going on past a failure; 1 when one failed.
    A failed build leaves no stamp: the test that needs it builds again and fails naming its log."""
    failed = 0
    for name in names:
        try:
            log.info("%s: built (%s)", name, TEST_BUILDS[name]())
        except (InputError, OSError) as e:
            log.error("%s: %s", name, e)
            failed = 1
    return failed


def _require_sdk(backend: DeviceBackend) -> None:
    """What building the backend needs first (Vulkan: the headers and glslc, a missing
    SPIRV-Headers CMake's configure step names; CUDA: nvcc, cuBLAS CMake's names)."""
    missing = {
        "vulkan": shutil.which("glslc") is None or not VULKAN_HEADER.is_file(),
        "cuda": shutil.which("nvcc") is None,
    }[backend.name]
    if missing:
        raise InputError(
            f"building llama.cpp with {backend.cmake_option} needs {backend.packages}; it is not installed here"
        )


def main() -> None:
    """Build each build named on the command line (TEST_BUILDS); exit 1 when one failed."""
    logging.basicConfig(level=logging.INFO, format="featdiff: %(message)s", stream=sys.stderr)
    unknown = sorted(set(sys.argv[1:]) - TEST_BUILDS.keys())
    if unknown or not sys.argv[1:]:
        print(
            f"featdiff: error: extra_builds takes {', '.join(TEST_BUILDS)}, not {(unknown or ['nothing'])[0]}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    raise SystemExit(build_for_tests(sys.argv[1:]))


if __name__ == "__main__":
    main()
