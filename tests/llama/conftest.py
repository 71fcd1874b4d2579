"""The device a device test runs on (tests/llama/test_device*.py): Vulkan on Mesa's llvmpipe in
`make test` (`make vulkan` installs it), and CUDA in `make test-cuda` (marker `cuda`) where an
NVIDIA GPU is present, each the pinned tree built once per machine with that backend
(featdiff.llama.extra_builds.ensure_device), or for CUDA the build $FEATDIFF_CUDA_LLAMA_DIR names."""

from __future__ import annotations

import shutil

import pytest

from featdiff.llama.extra_builds import CUDA, DEVICE_BACKENDS, VULKAN, ensure_device

from devices import Device


def _device(name: str) -> Device:
    backend = DEVICE_BACKENDS[name]
    if backend is CUDA and shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi not found): `make test-cuda` runs on one")
    return Device(backend, ensure_device(backend))


@pytest.fixture(scope="session", params=[VULKAN.name, pytest.param(CUDA.name, marks=pytest.mark.cuda)])
def device(request) -> Device:
    """Each device backend in turn (`-m "not cuda"`, `make test`, runs Vulkan's only)."""
    return _device(request.param)


@pytest.fixture(scope="session")
def vulkan() -> Device:
    """The Vulkan build alone, for what only it carries (patch 0006's device-only fault)."""
    return _device(VULKAN.name)
