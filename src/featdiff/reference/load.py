"""Load a target or a drafter from a GGUF file or a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

import torch

from featdiff.reference import load_gguf, load_hf
from featdiff.reference.weights import Draft, Target


def load_target(path: Path, dtype: torch.dtype, device: torch.device, llama_dir: Path | None = None) -> Target:
    """The target from a GGUF file or a Hugging Face directory; a GGUF's quantized weights are
    dequantized by the build `llama_dir`'s ggml when one is named, else gguf-py (gguf_io)."""
    path = Path(path)
    if path.is_dir():
        return load_hf.target_from_hf(path, dtype, device)
    return load_gguf.target_from_gguf(path, dtype, device, llama_dir)


def load_draft(path: Path, dtype: torch.dtype, device: torch.device, llama_dir: Path | None = None) -> Draft:
    """The drafter from a GGUF file or a Hugging Face directory (DFlash reference layout),
    dequantized as `load_target` does."""
    path = Path(path)
    if path.is_dir():
        return load_hf.draft_from_hf(path, dtype, device)
    return load_gguf.draft_from_gguf(path, dtype, device, llama_dir)
