"""Converter faults, planted: the pinned converter's correct GGUFs (featdiff.factory.converter) rewritten with
gguf-py, every key and tensor copied but the one a plausible converter bug changes. Consumes a
converted fixture directory; produces the same layout (`target.gguf`, `draft.gguf`, `target-hf/`,
`draft-hf/`, the truth) with the fault in `draft.gguf`, and the record compare should name it at.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.outputs import replaced
from featdiff.factory.converter import (
    DRAFT_GGUF,
    DRAFT_HF,
    TARGET_GGUF,
    TARGET_HF,
    convert_checkpoint,
    write_converted_fixture,
)
from featdiff.factory.gguf_rewrite import DROP, Changes, rewrite_gguf
from featdiff.kinds.dflash.modelled import KEY_SLIDING_WINDOW, KEY_SLIDING_WINDOW_PATTERN

ROPE_KEY_INFIX = ".rope."  # `{arch}.rope.*`: a stack's RoPE base, dims and scaling keys
ROPE_DIMS_SUFFIX = ".rope.dimension_count"  # the head's rotated dims, not the RoPE's layout
# A target whose RoPE differs from the drafter's, as the converter writes one (qwen3 keys): its
# base (a long-context Qwen3's rope_theta), or YaRN (pairs.ROPE_SCALINGS["yarn"]'s values)
TARGET_BASE = 1_000_000.0
TARGET_YARN = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64}
# A drafter whose first layer slides (Qwen3's config.json fields, which DFlashModel converts): a
# window of 4 positions, narrower than the context a tiny test decodes
SLIDING_WINDOW = {
    "use_sliding_window": True,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"],
}


@dataclass(frozen=True)
class Plant:
    """What one fault changes: the drafter's keys and tensors, given both GGUFs' readers."""

    keys: Changes = field(default_factory=dict)
    tensors: Changes = field(default_factory=dict)


@dataclass(frozen=True)
class ConverterFault:
    """One plausible converter bug, planted into a converted fixture."""

    name: str
    doc: str
    variant: str  # the correct fixture variant converted first
    plant: Callable[[Any, Any], Plant]  # (draft reader, target reader) -> the change
    first_shows: str  # the run record compare names first
    target_rope: Mapping[str, Any] = field(default_factory=dict)  # the target's own RoPE keys (no arch)
    checkpoint: Mapping[str, Any] = field(default_factory=dict)  # config.json fields the drafter adds


def _ones(tensor: str, draft, target) -> Plant:
    """A norm's weight written as ones: what a converter that drops the norm's weights produces."""
    return Plant(tensors={tensor: np.ones(_tensor(draft, tensor).shape, np.float32)})


def _rope_from_target(draft, target) -> Plant:
    """The drafter's RoPE keys (and `rope_freqs`) replaced by the target's: a converter that reads
    the RoPE from `--target-model-dir` instead of the drafter's own config.json."""
    arch = str(target.fields[names.KEY_ARCH].contents())
    keys: dict[str, Any] = {k: DROP for k in draft.fields if _is_rope_key(k)}
    keys |= {names.ARCH_DFLASH + k[len(arch) :]: f.contents() for k, f in target.fields.items() if _is_rope_key(k)}
    tensors: dict[str, Any] = {names.T_ROPE_FREQS: DROP}
    if names.T_ROPE_FREQS in {t.name for t in target.tensors}:
        tensors[names.T_ROPE_FREQS] = np.array(_tensor(target, names.T_ROPE_FREQS).data)
    return Plant(keys=keys, tensors=tensors)


def _is_rope_key(key: str) -> bool:
    return ROPE_KEY_INFIX in key and not key.endswith(ROPE_DIMS_SUFFIX)


def _full_attention(draft, target) -> Plant:
    """The sliding window's keys left out: every layer attends over the whole context."""
    return Plant(keys={KEY_SLIDING_WINDOW: DROP, KEY_SLIDING_WINDOW_PATTERN: DROP})


def _no_rope_freqs(draft, target) -> Plant:
    """llama3's `rope_freqs` left out: what the pinned DFlashModel (a Qwen3Model) writes for a
    drafter whose config.json says `rope_scaling: llama3` (its target's LlamaModel writes them)."""
    return Plant(tensors={names.T_ROPE_FREQS: DROP})


FAULTS: dict[str, ConverterFault] = {
    f.name: f
    for f in (
        ConverterFault(
            "enc-norm-dropped",
            "the feature norm's weight dropped (enc.output_norm.weight written as ones)",
            "clean",
            partial(_ones, names.T_ENC_NORM),
            names.INP_G_EMBEDDINGS,
        ),
        ConverterFault(
            "k-norm-dropped",
            "layer 0's key norm weight dropped (blk.0.attn_k_norm.weight written as ones)",
            "clean",
            partial(_ones, "blk.0.attn_k_norm.weight"),
            "Kcur_injected-0",
        ),
        ConverterFault(
            "rope-base-from-target",
            f"the drafter's RoPE base taken from a target whose rope_theta is {TARGET_BASE:g}",
            "clean",
            _rope_from_target,
            "Kcur_injected-0",
            target_rope={"rope.freq_base": TARGET_BASE},
        ),
        ConverterFault(
            "yarn-from-target",
            "YaRN on a drafter that has none: the target's rope.scaling keys copied into the drafter",
            "clean",
            _rope_from_target,
            "Kcur_injected-0",
            target_rope=TARGET_YARN,
        ),
        ConverterFault(
            "window-dropped",
            "a sliding window run as full attention (dflash.attention.sliding_window and _pattern left out)",
            "clean",
            _full_attention,
            "l_out-0",
            checkpoint=SLIDING_WINDOW,
        ),
        ConverterFault(
            "rope-freqs-dropped",
            "llama3's rope_freqs dropped (the pinned converter's own fault on a llama3-scaled drafter)",
            "llama3-rope",
            _no_rope_freqs,
            "Kcur_injected-0",
        ),
    )
}


def write_fault_fixture(outdir: str | Path, fault: str, seed: int = 0, planted: bool = True) -> Path:
    """The converted fixture of `fault`'s variant in `outdir`, its target given the fault's own
    RoPE (a correct target) and its drafter the fault (unless not `planted`: the control, whose
    drafter is the converter's own); return `outdir`."""
    if fault not in FAULTS:
        raise InputError(f"converter fault {fault!r}: choose one of {', '.join(FAULTS)}")
    f = FAULTS[fault]
    out = write_converted_fixture(outdir, f.variant, seed)
    if f.checkpoint:
        config_path = out / DRAFT_HF / names.HF_CONFIG
        config = {**json.loads(config_path.read_text()), **f.checkpoint}
        with replaced(config_path) as tmp:
            tmp.write_text(json.dumps(config, indent=1))
        convert_checkpoint(out / DRAFT_HF, out / DRAFT_GGUF, target_dir=out / TARGET_HF)
    if f.target_rope:
        arch = str(_reader(out / TARGET_GGUF).fields[names.KEY_ARCH].contents())
        rewrite_gguf(out / TARGET_GGUF, out / TARGET_GGUF, keys={f"{arch}.{k}": v for k, v in f.target_rope.items()})
    if not planted:
        return out
    plant = f.plant(_reader(out / DRAFT_GGUF), _reader(out / TARGET_GGUF))
    rewrite_gguf(out / DRAFT_GGUF, out / DRAFT_GGUF, plant.keys, plant.tensors)
    with replaced(out / "VARIANT") as tmp:
        tmp.write_text(f"{f.variant} converted, then the converter fault {fault}: {f.doc}\n")
    return out


def _reader(path: Path):
    from gguf import GGUFReader

    return GGUFReader(str(path))


def _tensor(reader, name: str):
    found = next((t for t in reader.tensors if t.name == name), None)
    if found is None:
        raise InputError(f"the converted GGUF has no tensor {name}; plant this fault into a drafter that has it")
    return found
