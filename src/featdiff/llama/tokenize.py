"""Tokenize a prompt with llama.cpp's own vocabulary, so capture and reference see the same ids."""

from __future__ import annotations

from pathlib import Path

from featdiff.llama.runtime import Model, Runtime


def tokenize(model_gguf: Path, text: str, llama_dir: Path | None = None) -> list[int]:
    """The token ids llama.cpp gives `text` with the vocabulary of `model_gguf` (BOS as the model says)."""
    rt = Runtime.load(llama_dir)
    model = Model.load(rt, Path(model_gguf), vocab_only=True)
    try:
        return model.tokenize(text)
    finally:
        model.free()
