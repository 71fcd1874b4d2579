"""Capture on a GPU build of llama.cpp: the same records as on the CPU, within the tolerance
compare derives. Runs when $FEATDIFF_CUDA_LLAMA_DIR names a CUDA build (a checkout with its
CMake build dir, or an install prefix) and a GPU is present; skips with the reason otherwise."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS

ENV_CUDA_DIR = "FEATDIFF_CUDA_LLAMA_DIR"


def _cuda_build() -> Path:
    build = os.environ.get(ENV_CUDA_DIR)
    if not build:
        pytest.skip(f"no CUDA build of llama.cpp: set {ENV_CUDA_DIR} to one to run this test")
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi not found)")
    return Path(build)


@pytest.mark.cuda
def test_cuda_capture_matches_the_cpu_capture(fixture_models, captured, tmp_path):
    from featdiff.diff import compare_dumps
    from featdiff.llama.capture import capture

    llama_dir = _cuda_build()
    d = fixture_models("clean")
    run = capture(
        d / "target.gguf",
        d / "draft.gguf",
        tmp_path / "cuda.npz",
        tokens=DEFAULT_TOKENS,
        rounds=DEFAULT_ROUNDS,
        llama_dir=llama_dir,
    )
    comparison = compare_dumps(captured("clean"), run, None)
    assert comparison.ok, [f.message for f in comparison.findings]
