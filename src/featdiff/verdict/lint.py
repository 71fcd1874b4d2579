"""`featdiff lint`: check a drafter GGUF's metadata and tensors (DFlash, DSpark, EAGLE3, or a GGUF
carrying an MTP head), alone or against its target GGUF, without running anything. One line per
problem, each naming the file. For an MTP head, the keys and tensors of its block that featdiff's
reference does not read are listed too (torchref.mtp, which refuses them).

The checks, and `preflight` which runs them before llama.cpp loads a pair and refuses the fatal
ones, are featdiff.kinds.preflight's (a floor below, so capture reads them too).
"""

from __future__ import annotations

from pathlib import Path

from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import read_gguf
from featdiff.kinds.mtp import refused_head
from featdiff.kinds.preflight import drafter_problems, mtp_head_block
from featdiff.llama import ggml_dequant
from featdiff.torchref.mtp.head import unread_head_tensors, unread_nextn_keys
from featdiff.torchref.mtp.layer import MTP_ARCHS


def lint_gguf(model: Path, target: Path | None) -> list[str]:
    """Problems of the drafter GGUF `model` (and its fit to `target`), one line each; [] when clean.
    InputError for an MTP head featdiff does not model (kinds.mtp.UNMODELLED_HEADS)."""
    d = read_gguf(Path(model), ggml_dequant.load)
    refused = refused_head(d)
    if refused is not None:  # nothing of it to check: the whole head is refused (exit 2)
        raise InputError(f"{model}: {refused}")
    t = read_gguf(Path(target), ggml_dequant.load) if target is not None else None
    lines = [f"{model}: {p.text}" for p in drafter_problems(d, t)]
    il = mtp_head_block(d) if d.arch in MTP_ARCHS else None
    if il is not None:
        unread = [*unread_head_tensors(d, il), *unread_nextn_keys(d)]
        lines += [
            f"{model}: {name} is in the MTP head (block {il}) but featdiff's MTP reference does not read it, and "
            "refuses this head (a comparison would leave it out); model it in src/featdiff/torchref/mtp/head.py, or "
            "re-convert without it"
            for name in unread
        ]
    return lines
