"""A build that loads its backends dynamically (GGML_BACKEND_DL=ON, the usual packaging of CUDA
and Vulkan builds) captures: featdiff loads the backend libraries its install prefix holds, as
llama.cpp's programs do, and the capture compares clean against the reference.

The library is built once per machine from the tools' source tree (about 2 minutes on 2 cores),
CPU backend only, and installed into a prefix beside the tools' build (`build/llama.cpp/dl-*`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from featdiff.diff import compare_dumps
from featdiff.dump.reader import read_dump
from featdiff.llama.tools import TEST_BUILD_FLAGS

from real_flow import reference_of

DL_OPTIONS = [
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
    *TEST_BUILD_FLAGS,  # unoptimized: a test-only build of tiny runs compiles faster
]
BUILD_TIMEOUT_S = 1800
pytestmark = pytest.mark.slow  # builds a backend-loaded llama.cpp: not part of `make test-fast`


@pytest.fixture(scope="session")
def dl_prefix(tools) -> Path:
    """An install prefix of the library built with GGML_BACKEND_DL=ON (cached by source and options)."""
    root = tools.root / "dl"
    prefix, stamp = root / "prefix", root / "stamp.json"
    want = {"source": str(tools.source), "options": DL_OPTIONS}
    if stamp.is_file() and json.loads(stamp.read_text()) == want and (prefix / "lib" / "libllama.so").is_file():
        return prefix
    build = root / "build"
    for cmd in (
        ["cmake", "-S", str(tools.source), "-B", str(build), *DL_OPTIONS],
        ["cmake", "--build", str(build), "-j", "2"],
        ["cmake", "--install", str(build), "--prefix", str(prefix)],
    ):
        subprocess.run(cmd, check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
    stamp.write_text(json.dumps(want))
    return prefix


def test_a_backend_loaded_build_captures_and_compares_clean(dl_prefix, fixture_models, tmp_path):
    assert list(dl_prefix.rglob("libggml-cpu*.so")), "the DL build keeps its CPU backend as a loadable library"
    d = fixture_models("clean")
    run = tmp_path / "run.npz"
    # a process of its own: this one has the pinned libllama loaded, which shares the DL build's soname
    done = subprocess.run([sys.executable, "-c", "from featdiff.cli import main; main()", "capture", "--llama-dir",
                           str(dl_prefix), "--target", str(d / "target.gguf"), "--model", str(d / "draft.gguf"),
                           "--tokens", "1,2,3,4,5,6,7,8", "--rounds", "2", "-o", str(run)],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    with read_dump(run) as dump:
        assert dump.manifest.build["library"] == str(dl_prefix / "lib" / "libllama.so")
    ref = reference_of(d / "target.gguf", d / "draft-hf", tmp_path / "ref.npz", follow=run)
    comparison = compare_dumps(ref, run)
    assert comparison.ok and comparison.coverage.pairs > 0, [f.message for f in comparison.findings]
