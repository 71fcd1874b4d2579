"""Tiny targets of the families featdiff runs through transformers' own model code (issue 24):
each written by transformers' config and model classes at a tiny size, with seeded random
weights, saved as a HF directory, and converted to GGUF by the pinned tree's converter, with
the fixtures' DFlash drafter (`featdiff.fixtures`) for it.

A family directory has the fixture layout (`target.gguf`, `draft.gguf`, `target-hf/`,
`draft-hf/`): both GGUFs are the converter's. The target's sizes are the tiny pair's (`pairs.TINY`),
so the fixtures' drafter, its `target_layers` and its vocabulary fit it as they fit qwen3.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featdiff import pairs
from featdiff.converter import (
    DRAFT_GGUF,
    DRAFT_HF,
    TARGET_GGUF,
    TARGET_HF,
    TOKENIZER_MODEL,
    convert_checkpoint,
    write_spm_tokenizer,
)
from featdiff.errors import InputError
from featdiff.fixtures import VOCAB_SPM, write_fixture
from featdiff.outputs import check_output_dir, replaced

EMBD_STD = 1.0  # token embeddings ~ N(0, 1), as pairs.target_weights draws them
NORM_SPREAD = 0.1  # norm weights 1 + N(0, 0.1): pairs._norm
N_EXPERT, N_EXPERT_USED = 4, 2  # the tiny MoE: 4 experts, top-2
N_FF_EXPERT = 32  # each expert's FFN width


@dataclass(frozen=True)
class Family:
    """One target family: its transformers config, as a function of the tiny sizes."""

    name: str  # llama.cpp's architecture name (the converted GGUF's general.architecture)
    doc: str
    config: Callable[[pairs.Sizes], object]


def _qwen3moe_config(sz: pairs.Sizes) -> object:
    from transformers import Qwen3MoeConfig

    s = sz.target
    fields: dict[str, Any] = {  # head_dim goes through the config's **kwargs (typed without it)
        "vocab_size": sz.n_vocab,
        "hidden_size": s.n_embd,
        "intermediate_size": s.n_ff,
        "moe_intermediate_size": N_FF_EXPERT,
        "num_hidden_layers": s.n_layer,
        "num_attention_heads": s.n_head,
        "num_key_value_heads": s.n_head_kv,
        "head_dim": s.n_embd_head,
        "num_experts": N_EXPERT,
        "num_experts_per_tok": N_EXPERT_USED,
        "norm_topk_prob": True,  # Qwen3-30B-A3B's, and llama.cpp's qwen3moe graph's
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "rms_norm_eps": pairs.RMS_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": pairs.ROPE_BASE},
        "tie_word_embeddings": False,
    }
    return Qwen3MoeConfig(**fields)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (Family("qwen3moe", f"Qwen3-MoE target: {N_EXPERT} experts, top-{N_EXPERT_USED}", _qwen3moe_config),)
}


def checked_family(name: str) -> Family:
    """The family `name`, else an InputError listing the known ones."""
    if name not in FAMILIES:
        raise InputError(f"target family {name!r}: choose one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def write_family_fixture(outdir: str | Path, family: str, seed: int = 0) -> Path:
    """`family`'s tiny target and the fixtures' clean drafter in `outdir`, as HF directories and
    as the pinned converter's GGUFs; return `outdir`."""
    fam = checked_family(family)
    out = check_output_dir(Path(outdir), (), "OUTDIR")
    write_fixture(out, "clean", seed, vocab=VOCAB_SPM)  # the drafter: draft-hf/ fits any target of TINY's sizes
    write_spm_tokenizer(out / TARGET_HF / TOKENIZER_MODEL, pairs.TINY.n_vocab)
    # The drafter converts against the fixtures' qwen3 target-hf/ (the same tokenizer.model):
    # upstream DFlashModel.set_vocab calls the target class's set_vocab on itself, and
    # Qwen3MoeModel.set_vocab's super() then fails ("TypeError: super(type, obj)"), so the pinned
    # converter cannot convert a drafter against a Qwen3-MoE directory. The vocabulary, the only
    # thing it reads there, is the same.
    convert_checkpoint(out / DRAFT_HF, out / DRAFT_GGUF, target_dir=out / TARGET_HF)
    write_hf_target(out / TARGET_HF, fam, seed)
    write_spm_tokenizer(out / TARGET_HF / TOKENIZER_MODEL, pairs.TINY.n_vocab)
    convert_checkpoint(out / TARGET_HF, out / TARGET_GGUF, spm_vocab=True)
    with replaced(out / "VARIANT") as tmp:
        tmp.write_text(f"{fam.name} (transformers target, converted): {fam.doc}\n")
    return out


def write_hf_target(path: Path, fam: Family, seed: int) -> Path:
    """`fam`'s tiny model, built by transformers from its config with seeded weights, saved in
    the checkpoint layout (`save_pretrained`) into `path` (replacing a target there)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    config = fam.config(pairs.TINY)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _seeded(model, seed)
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _seeded(model: object, seed: int) -> None:
    """Every parameter drawn from `seed`: matrices N(0, 1/n_in) as pairs._linear, vectors (norms)
    1 + N(0, NORM_SPREAD), the embedding table N(0, EMBD_STD); transformers' own init is too
    small for a random model to route, attend or decode distinctly."""
    import torch

    g = torch.Generator().manual_seed(seed)
    embed = model.get_input_embeddings().weight  # type: ignore[attr-defined]
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):  # type: ignore[attr-defined]
            draw = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p is embed:
                p.copy_(draw * EMBD_STD)
            elif p.ndim == 1:
                p.copy_(1.0 + NORM_SPREAD * draw)
            else:
                p.copy_(draw / math.sqrt(p.shape[-1]))
