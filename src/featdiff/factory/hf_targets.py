"""Tiny targets of the families featdiff runs through transformers' own model code (issue 24):
each written by transformers' config and model classes at a tiny size, with seeded random
weights, saved as a HF directory, and converted to GGUF by the pinned tree's converter, with
the fixtures' DFlash drafter (`featdiff.factory.fixtures`) for it.

A family directory has the fixture layout (`target.gguf`, `draft.gguf`, `target-hf/`,
`draft-hf/`): both GGUFs are the converter's. The target's sizes are the tiny pair's (`pairs.TINY`),
so the fixtures' drafter, its `target_layers` and its vocabulary fit it as they fit qwen3.
"""

from __future__ import annotations

import math
from pathlib import Path

from featdiff.core.errors import InputError
from featdiff.core.outputs import check_output_dir, replaced
from featdiff.factory import pairs
from featdiff.factory.converter import (
    DRAFT_GGUF,
    DRAFT_HF,
    TARGET_GGUF,
    TARGET_HF,
    TOKENIZER_MODEL,
    convert_checkpoint,
    write_bpe_tokenizer,
    write_spm_tokenizer,
)
from featdiff.factory.fixtures import VOCAB_SPM, write_fixture
from featdiff.factory.hf_families import (
    BOOTSTRAP_OF,
    EMBD_STD,
    FAMILIES,
    NORM_SPREAD,
    TOKENIZER_BYTE_BPE,
    TOKENIZER_SPM,
    Family,
)


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
    # The drafter converts against the fixtures' qwen3 target-hf/ (the same tokenizer.model):
    # upstream DFlashModel.set_vocab calls the target class's set_vocab on itself, and
    # Qwen3MoeModel.set_vocab's super() then fails ("TypeError: super(type, obj)"), so the pinned
    # converter cannot convert a drafter against a Qwen3-MoE directory. The vocabulary, the only
    # thing it reads there, is the same.
    if not fam.draft_against_target:
        write_spm_tokenizer(out / TARGET_HF / TOKENIZER_MODEL, pairs.TINY.n_vocab)
        convert_checkpoint(out / DRAFT_HF, out / DRAFT_GGUF, target_dir=out / TARGET_HF)
    write_hf_target(out / TARGET_HF, fam, seed)
    if fam.tokenizer == TOKENIZER_SPM:
        write_spm_tokenizer(out / TARGET_HF / TOKENIZER_MODEL, pairs.TINY.n_vocab)
    else:
        write_bpe_tokenizer(out / TARGET_HF, pairs.TINY.n_vocab, byte_level=fam.tokenizer == TOKENIZER_BYTE_BPE)
    bootstrap = BOOTSTRAP_OF[fam.tokenizer]
    convert_checkpoint(out / TARGET_HF, out / TARGET_GGUF, bootstrap=bootstrap, no_mtp=fam.no_mtp)
    if fam.draft_against_target:
        convert_checkpoint(out / DRAFT_HF, out / DRAFT_GGUF, target_dir=out / TARGET_HF, bootstrap=bootstrap)
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
    _seeded(model, seed, dict(fam.gains), fam.buffers)
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _seeded(model: object, seed: int, gains: dict[str, float], buffers: tuple[str, ...] = ()) -> None:
    """Every parameter drawn from `seed`: matrices N(0, 1/n_in) as pairs._linear, vectors (norms,
    biases, sinks) and the buffers named in `buffers` 1 + N(0, NORM_SPREAD), each draw times the
    family's gain for a tensor named in `gains`, the embedding table N(0, EMBD_STD);
    transformers' own init is too small for a random model to route, attend or decode distinctly."""
    import torch

    g = torch.Generator().manual_seed(seed)
    embed = model.get_input_embeddings().weight  # type: ignore[attr-defined]
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):  # type: ignore[attr-defined]
            draw = torch.randn(p.shape, generator=g, dtype=torch.float32) * gain_of(name, gains)
            if p is embed:
                p.copy_(draw * EMBD_STD)
            elif p.ndim == 1:
                p.copy_(1.0 + NORM_SPREAD * draw)
            else:
                p.copy_(draw / math.sqrt(p.shape[-1]))
        for name, b in sorted(model.named_buffers()):  # type: ignore[attr-defined]
            if name.rsplit(".", 1)[-1] in buffers:
                draw = torch.randn(b.shape, generator=g, dtype=torch.float32) * gain_of(name, gains)
                b.copy_(1.0 + NORM_SPREAD * draw)


def gain_of(name: str, gains: dict[str, float]) -> float:
    """The factor on the seeded draw of the tensor `name`: the family's gain of its suffix, else 1."""
    return next((f for suffix, f in gains.items() if name.endswith(suffix)), 1.0)
