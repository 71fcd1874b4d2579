"""The tiny Nemotron-H target (transformers' `nemotron_h`, llama.cpp's `nemotron_h_moe`) that the
`mtp-nemotron-h-moe` fixture (featdiff.factory.mtp) gives an MTP head, and where its checkpoint
keeps that head.

transformers 5.23 has no model code for Nemotron-H's head (NemotronHForCausalLM ignores `mtp.*`
on load), so the head is laid out as the pinned converter expects it (conversion/nemotron.py
NemotronHModel: `num_nextn_predict_layers` 1 in config.json, `_MTP_SPECIAL_RENAMES`):
* `mtp.layers.0.*`: the input fusion (`enorm`, `hnorm`, `eh_proj` over [enorm(embed(token)),
  hnorm(h)]) and a dense attention sub-layer without RoPE (`norm`, `mixer.{q,k,v,o}_proj`), shaped
  as a trunk attention block;
* `mtp.layers.1.*`: a MoE sub-layer (`norm`, the router `mixer.gate` and its choice bias, the
  squared-ReLU experts `mixer.experts.<x>.{up,down}_proj`, the shared expert) shaped as a trunk MoE
  block, and the head's final LayerNorm `final_layernorm`.
The converter folds both into one block, n_layer, registered as an attention and an MLP layer
(src/models/nemotron-h-moe.cpp graph_mtp reads it; nemotron-h.cpp load_arch_tensors), every tensor
as it is but q and k, whose rows it reorders per head for RoPE (GraniteHybridModel.undo_permute)
though the head has none: both alike, so the attention's scores stay the checkpoint's. The
checkpoint's tokenizer is the family's GPT-2 byte-level one (the "pre" bootstrap).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from featdiff.core import names
from featdiff.factory import pairs
from featdiff.factory.converter import TOKENIZER_MODEL, write_bpe_tokenizer, write_spm_tokenizer
from featdiff.factory.hf_families import (
    FAMILIES,
    N_EXPERT,
    N_EXPERT_USED,
    NEMOTRON_H_BLOCKS,
    TOKENIZER_BYTE_BPE,
    TOKENIZER_SPM,
    Family,
)

HF_N_MTP = "num_nextn_predict_layers"  # config.json: the converter asserts 1 (NemotronHModel.__init__)
HF_TRUNK = "backbone.layers."  # where NemotronHForCausalLM saves the trunk's blocks
HF_MTP = "mtp.layers."  # the head's two sub-layers, mtp.layers.0 and mtp.layers.1
HF_ATTENTION, HF_MOE = "full_attention", "moe"  # config.json layers_block_type: what each sub-layer copies
_FUSE, _MOE = f"{HF_MTP}0.", f"{HF_MTP}1."
HF_FC = _FUSE + "eh_proj.weight"
HF_NORMS = (_FUSE + "enorm.weight", _FUSE + "hnorm.weight", _MOE + "final_layernorm.weight")

_FAMILY = FAMILIES["nemotron_h"]
# the same model as the nemotron_h family's, named by the arch its GGUF has (the variant's `arch`)
NEMOTRON_H_MOE_TARGET = Family(
    names.ARCH_NEMOTRON_H_MOE,  # the converter's arch of a Nemotron-H checkpoint with experts
    _FAMILY.doc,
    _FAMILY.config,
    gains=_FAMILY.gains,
    tokenizer=_FAMILY.tokenizer,
    buffers=_FAMILY.buffers,
)
NEMOTRON_H_MOE_DOC = (
    f"Nemotron-H target (Mamba2, attention without RoPE, {N_EXPERT} squared-ReLU experts top-{N_EXPERT_USED} by "
    "sigmoid + a choice bias, a shared expert) with its MTP head (NoPE attention + MoE, a LayerNorm head norm) inside "
    "target.gguf (as `mtp`; llama.cpp's nemotron_h_moe)"
)

# What the converter writes of the head (NemotronHModel.modify_tensors, gguf-py's nemotron_h_moe map)
_IL = pairs.TINY.target.n_layer
_BLK = f"blk.{_IL}."
GGUF_FROM_HF_NEMOTRON = {
    HF_FC: names.T_NEXTN.format(il=_IL, name=names.NEXTN_EH_PROJ),
    HF_NORMS[0]: names.T_NEXTN.format(il=_IL, name="enorm"),
    HF_NORMS[1]: names.T_NEXTN.format(il=_IL, name="hnorm"),
    HF_NORMS[2]: names.T_NEXTN.format(il=_IL, name="shared_head_norm"),
    _FUSE + "norm.weight": _BLK + "attn_norm.weight",
    **{f"{_FUSE}mixer.{p}_proj.weight": f"{_BLK}attn_{p}.weight" for p in "qkv"},
    _FUSE + "mixer.o_proj.weight": _BLK + "attn_output.weight",
    _MOE + "norm.weight": _BLK + "post_attention_norm.weight",
    _MOE + "mixer.gate.weight": _BLK + "ffn_gate_inp.weight",
    _MOE + "mixer.gate.e_score_correction_bias": _BLK + "exp_probs_b.bias",
    **{f"{_MOE}mixer.shared_experts.{p}_proj.weight": f"{_BLK}ffn_{p}_shexp.weight" for p in ("up", "down")},
    **{
        f"{_MOE}mixer.experts.{x}.{p}_proj.weight": f"{_BLK}ffn_{p}_exps.weight"
        for p in ("up", "down")
        for x in range(N_EXPERT)
    },
}


def nemotron_head_shapes(config: dict, target: dict[str, np.ndarray], head_layer: str) -> dict[str, tuple[int, ...]]:
    """The head's two sub-layers (under `head_layer`, `mtp.layers.`): `0` shaped as the trunk's first
    attention block, `1` as its first MoE block (norm, router, choice bias, experts, shared expert)."""
    kinds: list[Any] = list(config.get("layers_block_type") or NEMOTRON_H_BLOCKS)
    shapes: dict[str, tuple[int, ...]] = {}
    for sub, kind in enumerate((HF_ATTENTION, HF_MOE)):
        layer = f"{HF_TRUNK}{kinds.index(kind)}."
        shapes |= {f"{head_layer}{sub}.{k[len(layer) :]}": a.shape for k, a in target.items() if k.startswith(layer)}
    return shapes


def write_target_tokenizer(hf: Path, fam: Family) -> None:
    """The tokenizer `fam`'s checkpoints ship, in `hf`: SentencePiece `tokenizer.model`, or a (GPT-2
    byte-level) BPE `tokenizer.json` as hf_targets.write_family_fixture writes it."""
    if fam.tokenizer == TOKENIZER_SPM:
        write_spm_tokenizer(hf / TOKENIZER_MODEL, pairs.TINY.n_vocab)
    else:
        write_bpe_tokenizer(hf, pairs.TINY.n_vocab, byte_level=fam.tokenizer == TOKENIZER_BYTE_BPE)
