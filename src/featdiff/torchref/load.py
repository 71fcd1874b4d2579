"""Load a target or a drafter from a GGUF file or a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

import torch

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import read_gguf
from featdiff.llama import ggml_dequant
from featdiff.torchref import load_gguf, load_hf
from featdiff.torchref.hf_target import GGUF_ARCHS, hf_arch, target_from_transformers
from featdiff.torchref.weights import Draft, Target


def load_target(path: Path, dtype: torch.dtype, device: torch.device, llama_dir: Path | None = None) -> Target:
    """The target from a GGUF file or a Hugging Face directory; a GGUF's quantized weights are
    dequantized by the build `llama_dir`'s ggml when one is named, else gguf-py (featdiff.core.gguf_reader).

    qwen3 and llama run on featdiff's own streamed stack; the other architectures of HF_ARCHS
    through transformers' model code (hf_target.py), from their HF directory."""
    path = Path(path)
    if path.is_dir():
        if hf_arch(path, load_hf.read_config(path).get(names.HF_MODEL_TYPE)) in names.TARGET_ARCHS:
            return load_hf.target_from_hf(path, dtype, device)
        return target_from_transformers(path, dtype, device)
    arch = read_gguf(path, ggml_dequant.load).arch
    if arch not in names.TARGET_ARCHS and arch in GGUF_ARCHS:
        raise InputError(
            f"{path}: architecture {arch!r} runs through transformers' model code, from its Hugging Face "
            "directory; pass the target's HF checkpoint directory as --target"
        )
    return load_gguf.target_from_gguf(path, dtype, device, llama_dir)


def load_draft(path: Path, dtype: torch.dtype, device: torch.device, llama_dir: Path | None = None) -> Draft:
    """The drafter from a GGUF file or a Hugging Face directory (DFlash reference layout),
    dequantized as `load_target` does."""
    path = Path(path)
    if path.is_dir():
        return load_hf.draft_from_hf(path, dtype, device)
    return load_gguf.draft_from_gguf(path, dtype, device, llama_dir)
