"""The problem record and severities of lint's checks, and the consistency rules more than one kind
shares (layer ids, d2t), used by the reference's loaders (which refuse), `lint` (which lists) and
capture's preflight (which refuses the fatal ones): each returns problem sentences without the
file name; the caller prefixes it. Each kind's own rules are its own modules' (kinds/dflash/,
kinds/eagle3_checks.py, kinds/mtp_checks.py). Pure rules on values: below every stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from featdiff.core import names
from featdiff.core.gguf_reader import GgufModel

Severity = Literal["fatal", "advisory", "unmodelled"]
# fatal: llama.cpp aborts on it (GGML_ASSERT), refuses to load the file, or misruns from the first
# decode, so `preflight` refuses the pair. advisory: llama.cpp loads and runs the file, otherwise
# than trained; a capture shows what that does, and lint lists it. unmodelled: llama.cpp runs it as
# the file says, but featdiff's reference does not compute it (featdiff.kinds.dflash.modelled): capture goes on
# (and records it), `featdiff reference` refuses the drafter.
FATAL: Severity = "fatal"
ADVISORY: Severity = "advisory"
UNMODELLED: Severity = "unmodelled"
# one check of a drafter GGUF `d` (and its target `t`, None when not given): problem sentences
Check = Callable[[GgufModel, GgufModel | None], list[str]]
# a kind's lint table (DrafterKind.checks): each check and the severity of its problems, in lint's order
CheckTable = tuple[tuple[Check, Severity], ...]


@dataclass(frozen=True)
class Problem:
    """One problem of a drafter GGUF: a sentence without the file name, and its severity."""

    text: str
    severity: Severity


def layer_id_problems(key: str, ids: list[int], n_layer: int | None) -> list[str]:
    """The drafter's target layer ids (`key` as the file spells it) against the target's
    `n_layer` (None: unknown): what lint, the preflight and the reference refuse, worded once."""
    problems = [f"{key} = {ids} has negative ids; ids are target layer indices"] if ids and min(ids) < 0 else []
    if n_layer is not None and ids and max(ids) >= n_layer:
        problems.append(
            f"{key} = {ids} but the target has {n_layer} layers; ids must be < n_layer "
            "(an id equal to n_layer aborts llama.cpp)"
        )
    return problems


def d2t_problems(d2t: np.ndarray, n_vocab: int, head_rows: int) -> list[str]:
    """A reduced draft vocabulary `d2t` (absolute ids, `(n_vocab_draft,)`): int64, one distinct
    target id below `n_vocab` per head row (llama.cpp scatters row i of the drafter's logits to
    target token `d2t[i]`, src/models/dflash.cpp)."""
    if d2t.dtype != np.int64:
        return [f"{names.T_D2T} is stored as {d2t.dtype}, llama.cpp reads int64 (I64) ids; re-export d2t as int64"]
    problems = []
    if d2t.shape != (head_rows,):
        problems.append(
            f"{names.T_D2T} maps {d2t.size} draft rows but the drafter's head scores {head_rows}; "
            "export the reduced head (output.weight) with one row per d2t entry"
        )
    if d2t.size and not 0 <= d2t.min() <= d2t.max() < n_vocab:
        problems.append(
            f"{names.T_D2T} holds ids {d2t.min()}..{d2t.max()} outside the vocabulary of {n_vocab} "
            "tokens; d2t must hold absolute target ids (HF stores offsets: id = d2t[i] + i)"
        )
    if np.unique(d2t).size != d2t.size:
        problems.append(f"{names.T_D2T} maps two draft rows to one target id; re-export d2t")
    return problems
