"""The device tests' shared parts (tests/llama/test_device*.py): a device build as the tests use
it, and the placements of the fixture pair's layers they run it at."""

from __future__ import annotations

from dataclasses import dataclass

from featdiff.llama.extra_builds import DeviceBackend
from featdiff.llama.tools import ToolBuild

# label -> llama.cpp run options. The target has 6 layers and the drafter 2 (featdiff.factory.fixtures);
# llama.cpp offloads the last N of the layers and the output (src/llama-model.cpp: i_gpu_start =
# n_layer + 1 - N), so -ngl 3 puts the target's layers 4, 5 and its output on the device, -ngld 1
# the drafter's output only
PLACEMENTS = {
    "cpu": ("-ngl", "0", "-ngld", "0"),
    "device": ("-ngl", "99", "-ngld", "99"),
    "partial": ("-ngl", "3", "-ngld", "1"),
    "target-on-device": ("-ngl", "99", "-ngld", "0"),
    "draft-on-device": ("-ngl", "0", "-ngld", "99"),
}
RUN_TIMEOUT_S = 600  # a first run on llvmpipe compiles its shaders (featdiff.llama.extra_builds.SOFTWARE_VULKAN_ENV)


@dataclass(frozen=True)
class Device:
    """A device backend's build of the pinned tree (featdiff.llama.extra_builds.ensure_device)."""

    backend: DeviceBackend
    build: ToolBuild

    @property
    def name(self) -> str:
        """ggml's name of its first device: a record's backend, the manifest's placement."""
        return self.backend.device
