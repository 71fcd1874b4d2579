"""`featdiff lint`: check a DFlash (or DSpark) drafter GGUF's metadata and tensors, alone or
against its target GGUF, without running anything. One line per problem, each naming the file.

The checks, and `preflight` which runs them before llama.cpp loads a pair and refuses the fatal
ones, are featdiff.preflight's (a floor below, so capture reads them too).
"""

from __future__ import annotations

from pathlib import Path

from featdiff.gguf_reader import read_gguf
from featdiff.llama import ggml_dequant
from featdiff.preflight import drafter_problems


def lint_gguf(model: Path, target: Path | None) -> list[str]:
    """Problems of the drafter GGUF `model` (and its fit to `target`), one line each; [] when clean."""
    d = read_gguf(Path(model), ggml_dequant.load)
    t = read_gguf(Path(target), ggml_dequant.load) if target is not None else None
    return [f"{model}: {p.text}" for p in drafter_problems(d, t)]
