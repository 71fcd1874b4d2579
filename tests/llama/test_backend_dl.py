"""A build that loads its backends dynamically (GGML_BACKEND_DL=ON, the usual packaging of CUDA
and Vulkan builds) captures: featdiff loads the backend libraries its install prefix holds, as
llama.cpp's programs do, and the capture compares clean against the reference.

The library is built once per machine from the tools' source tree (about 2 minutes on 2 cores),
CPU backend only, and installed into a prefix beside the tools' build (`build/llama.cpp/dl-*`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from featdiff.diff import compare_dumps
from featdiff.dump.reader import read_dump
from featdiff.llama.extra_builds import BACKEND_DL_DIR, ensure_backend_dl

from real_flow import reference_of

BUILD_TIMEOUT_S = 1800
pytestmark = pytest.mark.slow  # builds a backend-loaded llama.cpp: not part of `make test-fast`


@pytest.fixture(scope="session")
def dl_prefix(tools) -> Path:
    """An install prefix of the library built with GGML_BACKEND_DL=ON (featdiff.llama.extra_builds.ensure_backend_dl)."""
    return ensure_backend_dl(tools.root / BACKEND_DL_DIR)


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
