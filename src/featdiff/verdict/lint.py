"""`featdiff lint`: check a drafter GGUF's metadata and tensors (DFlash, DSpark, EAGLE3, or a GGUF
carrying an MTP head), alone or against its target GGUF, without running anything. One line per
problem, each naming the file. For an MTP head, the keys and tensors of its block that featdiff's
reference does not read are listed too (torchref.mtp, which refuses them).

The checks are each kind's own (its registry entry's `checks`: kinds/dflash/checks.py,
kinds/eagle3_checks.py, kinds/mtp_checks.py), run by featdiff.kinds.preflight, which also refuses
the fatal ones before llama.cpp loads a pair (a floor below, so capture reads them too).
"""

from __future__ import annotations

from pathlib import Path

from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import read_gguf
from featdiff.kinds import registry as kinds
from featdiff.kinds.preflight import drafter_problems
from featdiff.llama import ggml_dequant


def lint_gguf(model: Path, target: Path | None) -> list[str]:
    """Problems of the drafter GGUF `model` (and its fit to `target`), one line each; [] when clean.
    InputError for a GGUF a kind refuses (kinds.registry.refused: an MTP head featdiff does not model)."""
    d = read_gguf(Path(model), ggml_dequant.load)
    refused = kinds.refused(d)
    if refused is not None:  # nothing of it to check: the whole head is refused (exit 2)
        raise InputError(f"{model}: {refused}")
    t = read_gguf(Path(target), ggml_dequant.load) if target is not None else None
    problems = [p.text for p in drafter_problems(d, t)] + kinds.of_arch(d.arch).unread_problems(d)
    return [f"{model}: {text}" for text in problems]
