"""`featdiff reference` for any drafter kind: the kind of `--model` (featdiff.kinds) chooses the
module that computes its reference; each takes torchref.run.reference's options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featdiff.kinds import registry as kinds
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import read_gguf
from featdiff.llama import ggml_dequant
from featdiff.torchref.load_hf import read_config

EAGLE3 = "eagle3"  # featdiff.kinds' name of the kind


def drafter_kind(model: Path) -> kinds.DrafterKind:
    """The kind of the drafter at `model`: a GGUF's architecture and tensors, a HF checkpoint's
    config.json as each kind tells its checkpoint (`DrafterKind.is_checkpoint`, as the pinned
    converter does: conversion/llama.py for EAGLE3, conversion/qwen.py for a Qwen3.5 one with MTP layers)."""
    if model.is_dir():
        try:
            config = read_config(model)
        except InputError:
            return kinds.KINDS[0]
        return kinds.of_checkpoint(config)  # a checkpoint with its MTP head: the head is the drafter
    try:
        g = read_gguf(model, ggml_dequant.load)
    except (InputError, OSError):  # no file, not a GGUF: the DFlash path says so as it always has
        return kinds.KINDS[0]
    refused = kinds.refused(g)
    if refused is not None:  # a head llama.cpp runs and the reference does not model (kinds.mtp)
        raise InputError(f"{model}: {refused}")
    return kinds.kind_of(g.arch, g.tensors, str(model)) if g.arch in kinds.ALL_DRAFTER_ARCHS else kinds.KINDS[0]


def reference(target: Path, model: Path, output: Path, **options: Any) -> Path:
    """The reference dump of the pair, computed by the module of the drafter's kind;
    `layer_ids_mean` (--layer-ids-mean) only for an EAGLE3 HF checkpoint, which it describes."""
    options |= drafter_options(Path(model), options.pop("layer_ids_mean", None))
    return drafter_kind(Path(model)).reference_module().reference(target, model, output, **options)


def drafter_options(model: Path, layer_ids_mean: str | None) -> dict[str, Any]:
    """The drafter loader's own options of `model` (its kind module's `reference` and
    `load_pair_draft` take them): `layer_ids_mean` for an EAGLE3 HF checkpoint only; {} unset."""
    if layer_ids_mean is None:
        return {}
    kind = drafter_kind(model)
    if kind.name != EAGLE3 or not model.is_dir():
        raise InputError(
            f"{model}: --layer-ids-mean {layer_ids_mean} says what an EAGLE3 Hugging Face checkpoint's layer ids "
            f"name, and this is a {kind.name} {'checkpoint' if model.is_dir() else 'GGUF'} (GGUF ids always name "
            "layer inputs); drop the flag"
        )
    return {"layer_ids_mean": layer_ids_mean}
