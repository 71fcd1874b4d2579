"""What a target loaded through transformers' model code costs in memory, checked before loading.

Consumes a Hugging Face directory's `*.safetensors` headers (never their data) and the compute
dtype; produces the bytes the loaded model holds and, where the machine says how much it has
left (Linux: `MemAvailable`, and a cgroup v2 `memory.max` when a container sets one), an
InputError (exit 2) naming both figures before anything is loaded.

transformers materializes every parameter in the compute dtype (float32 by default: an 8B
checkpoint stored in bf16 becomes 32 GB), all experts of a MoE included. featdiff's own
qwen3/llama stack streams its layers from the files instead and is not checked here.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from featdiff.core import names
from featdiff.core.errors import InputError

# Loaded size / parameter bytes: transformers' model plus the reference's working set (hooks, a
# short flow's activations and KV cache, torch's allocator slack). Measured by
# bench/bench_hf_target.py on bfloat16 checkpoints loaded as float32 (resident anonymous memory
# above the imports after a 128-token forward / parameters x 4: 1.26 gpt-oss, 1.30 qwen3moe);
# rounded up. A float32 checkpoint loaded as float32 is mapped from its files instead, and needs less.
LOAD_FACTOR = 1.35
HEADROOM_BYTES = 1 << 30  # the rest of featdiff, the drafter and the dumps: 1 GiB
_HEADER_LEN = struct.Struct("<Q")  # safetensors: an 8-byte little-endian header length, then JSON
_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")
GIB = float(1 << 30)


def checkpoint_parameters(path: Path) -> int:
    """The number of parameters in the HF directory `path`'s safetensors files (headers only)."""
    total = 0
    for file in sorted(Path(path).glob(names.HF_WEIGHTS_GLOB)):
        try:
            with file.open("rb") as f:
                (size,) = _HEADER_LEN.unpack(f.read(_HEADER_LEN.size))
                header = json.loads(f.read(size))
        except (OSError, struct.error, ValueError) as e:
            raise InputError(f"{file}: not a readable safetensors file ({e}); re-download the checkpoint") from e
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for d in entry["shape"]:
                    n *= int(d)
                total += n
    return total


def loaded_bytes(n_params: int, dtype: torch.dtype) -> int:
    """What transformers' model of `n_params` parameters in `dtype` holds, with the reference's working set."""
    return int(n_params * torch.tensor([], dtype=dtype).element_size() * LOAD_FACTOR) + HEADROOM_BYTES


def available_bytes() -> int | None:
    """The memory this process may still take: MemAvailable, lowered by a cgroup v2 limit; None
    where the system says neither (not Linux)."""
    found: list[int] = []
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)  # kB
    except OSError:
        pass
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((_CGROUP / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_fits(path: Path, dtype: torch.dtype, available: int | None) -> None:
    """InputError when loading `path` through transformers in `dtype` would take more than
    `available` bytes (None: unknown, not checked)."""
    if available is None:
        return
    n_params = checkpoint_parameters(path)
    need = loaded_bytes(n_params, dtype)
    if need > available:
        raise InputError(
            f"{path}: the reference loads this target through transformers as {dtype} "
            f"({n_params / 1e9:.2f} B parameters): about {need / GIB:.1f} GiB, and this machine has "
            f"{available / GIB:.1f} GiB available; run it where {need / GIB:.0f} GiB are free"
        )
