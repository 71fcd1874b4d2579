"""`featdiff reference` of an EAGLE3 drafter (featdiff.kinds), through the one-token-per-step
reference command (step_run.py) with the EAGLE3 flow (eagle3_flow.py), and the accept probe's side
of the kind."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from featdiff.dump.records import Round
from featdiff.torchref.eagle3.graph import Eagle3Draft, check_eagle3_pair, eagle3_from_gguf, eagle3_models_entry
from featdiff.torchref.eagle3.flow import run_flow
from featdiff.torchref.eagle3.hf import eagle3_from_hf
from featdiff.torchref.numerics import Numerics
from featdiff.torchref.step_run import StepKind, step_reference
from featdiff.torchref.weights import Target


def reference(target: Path, model: Path, output: Path, layer_ids_mean: str | None = None, **options: Any) -> Path:
    """Compute the EAGLE3 reference dump; return its path (torchref.run.reference's contract);
    `layer_ids_mean`: what a HF checkpoint's layer ids name, where it cannot tell (eagle3_hf.py)."""
    kind = replace(EAGLE3, load=partial(load_eagle3, layer_ids_mean=layer_ids_mean))
    return step_reference(kind, target, model, output, **options)


# --- the accept probe's side of the EAGLE3 kind (featdiff.verdict.probe, through featdiff.kinds) --------


def load_eagle3(
    model: Path,
    target: Target,
    numerics: Numerics,
    llama_dir: Path | None = None,
    layer_ids_mean: str | None = None,
) -> Eagle3Draft:
    """The EAGLE3 drafter at `model`: its GGUF, or its HF checkpoint directory (eagle3_hf.py),
    which needs the target (its layer count sets the converter's default layers) and, where the
    checkpoint cannot tell, what its layer ids mean."""
    if Path(model).is_dir():
        return eagle3_from_hf(Path(model), target, numerics.dtype, numerics.device, layer_ids_mean)
    return eagle3_from_gguf(Path(model), numerics.dtype, numerics.device, llama_dir)


def load_pair_draft(target: Target, model: Path, numerics: Numerics, layer_ids_mean: str | None = None) -> Eagle3Draft:
    """The EAGLE3 drafter at `model` (GGUF or HF checkpoint), checked against `target`."""
    draft = load_eagle3(Path(model), target, numerics, layer_ids_mean=layer_ids_mean)
    check_eagle3_pair(target, draft)
    return draft


def probe_round(
    target: Target, draft: Eagle3Draft, prompt: tuple[int, ...], numerics: Numerics, block_rows: int
) -> Round:
    """The reference's one round after `prompt`: up to `block_rows` - 1 drafts (a round verifies
    the anchor and its drafts), verified."""
    return run_flow(target, draft, prompt, 1, numerics, draft_max=block_rows - 1).rounds[0]


EAGLE3 = StepKind("EAGLE3", load_eagle3, run_flow, eagle3_models_entry, reads_run_batches=True)
