"""An EAGLE3 drafter from its Hugging Face checkpoint (SpecForge's `LlamaForCausalLMEagle3` layout,
`midlayer.*`, or Eagle3Speculator's `layers.0.*`), as the pinned converter reads it
(`conversion/llama.py` LlamaModel: a one-layer checkpoint with `draft_vocab_size`), into the same
`Eagle3Draft` the GGUF loader makes (eagle3.py).

What differs from the GGUF: the q/k rows stay in HF's rotate-half order and RoPE runs NeoX style
(the converter permutes them into ggml's interleaved pairs for RoPE NORM: the same rotation);
`d2t` holds offsets (target id = d2t[i] + i), made absolute here; `eagle_aux_hidden_state_layer_ids`
are taken as they are, else the converter's default [2, n_layer // 2, n_layer - 3] of the target.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from featdiff import names
from featdiff.errors import InputError
from featdiff.torchref.eagle3 import Eagle3Draft
from featdiff.torchref.load_hf import _hparams, _weights, read_config
from featdiff.torchref.weights import Source, Target, layer_from_tensors

HF_AUX_LAYER_IDS = "eagle_aux_hidden_state_layer_ids"
HF_TARGET_HIDDEN_SIZE = "target_hidden_size"
HF_NORM_BEFORE_FC = "norm_before_fc"
HF_NORM_BEFORE_RESIDUAL = "norm_before_residual"
HF_NESTED_LAYER_CONFIG = "transformer_layer_config"  # Eagle3Speculator's config: the layer's fields nested
HF_LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.")  # SpecForge, Eagle3Speculator, plain llama
HF_HIDDEN_NORM = "hidden_norm.weight"  # the fc output's norm: blk.0.attn_norm_2
HF_INPUT_NORM = "input_norm.weight"  # the features' norm before fc (norm_before_fc): enc.output_norm
# The converter's names for the checkpoint's tensors outside the layer (t2d it drops): HF -> GGUF
GGUF_FROM_HF = {
    names.HF_FC: names.T_FC,
    HF_INPUT_NORM: names.T_ENC_NORM,
    names.HF_EMBED_TOKENS: names.T_TOKEN_EMBD,
    names.HF_NORM: names.T_OUTPUT_NORM,
    names.HF_LM_HEAD: names.T_OUTPUT,
    names.HF_D2T: names.T_D2T,
}


def is_eagle3_config(config: dict[str, Any]) -> bool:
    """The converter's test of an EAGLE3 checkpoint: `draft_vocab_size` and one hidden layer."""
    merged = {**config, **config.get(HF_NESTED_LAYER_CONFIG, {})}
    return names.HF_DRAFT_VOCAB_SIZE in merged and merged.get(names.HF_NUM_LAYERS) == 1


def eagle3_from_hf(path: Path, target: Target, dtype: torch.dtype, device: torch.device) -> Eagle3Draft:
    """The EAGLE3 drafter at the HF directory `path`, for `target` (its layer count sets the
    default target layers); InputError naming the file for what the reference does not model."""
    raw = read_config(path)
    config = {**raw, **raw.get(HF_NESTED_LAYER_CONFIG, {})}
    if not is_eagle3_config(config):
        raise InputError(
            f"{path / names.HF_CONFIG}: not an EAGLE3 checkpoint (no {names.HF_DRAFT_VOCAB_SIZE}, or more than one "
            "hidden layer); pass the drafter's checkpoint"
        )
    if config.get("rope_scaling"):
        raise InputError(
            f"{path / names.HF_CONFIG}: rope_scaling on an EAGLE3 checkpoint is modelled from its GGUF only; convert "
            "it (convert_hf_to_gguf.py --target-model-dir) and pass draft.gguf"
        )
    w = _weights(path, dtype, device)
    prefix = next((p for p in HF_LAYER_PREFIXES if f"{p}{HF_HIDDEN_NORM}" in w), None)
    if prefix is None:
        raise InputError(f"{path}: no {HF_LAYER_PREFIXES[0]}{HF_HIDDEN_NORM}; an EAGLE3 checkpoint's layer is missing")
    layer = layer_from_tensors({k: w.get(f"{prefix}{hf}.weight") for k, hf in names.GGUF_TO_HF_LAYER.items()})
    n_layer_tgt = target.hparams.n_layer
    ids = config.get(HF_AUX_LAYER_IDS) or [2, n_layer_tgt // 2, n_layer_tgt - 3]
    if len(ids) != 3:
        raise InputError(f"{path / names.HF_CONFIG}: {HF_AUX_LAYER_IDS} = {ids}: EAGLE3 reads exactly 3 target layers")
    norm_before_fc = bool(config.get(HF_NORM_BEFORE_FC, False))
    hp = replace(_hparams(path, config, names.ARCH_EAGLE3), n_vocab=target.hparams.n_vocab)
    return Eagle3Draft(
        source=Source(Path(path), is_gguf=False),
        hparams=hp,
        target_layers=(int(ids[0]), int(ids[1]), int(ids[2])),
        n_embd_tgt=int(config.get(HF_TARGET_HIDDEN_SIZE) or target.hparams.n_embd),
        norm_before_fc=norm_before_fc,
        norm_before_residual=bool(config.get(HF_NORM_BEFORE_RESIDUAL, False)),
        fc=_required(w, path, names.HF_FC),
        enc_norm=_required(w, path, HF_INPUT_NORM) if norm_before_fc else None,
        layer=layer,
        attn_norm_2=_required(w, path, f"{prefix}{HF_HIDDEN_NORM}"),
        output_norm=_required(w, path, names.HF_NORM),
        output=w.get(names.HF_LM_HEAD),
        token_embd=w.get(names.HF_EMBED_TOKENS),
        d2t=_absolute_d2t(w, device),
    )


def _required(w, path: Path, name: str) -> torch.Tensor:
    if name not in w:
        raise InputError(f"{path}: tensor {name!r} is missing from the safetensors; pass a complete checkpoint")
    return w[name]


def _absolute_d2t(w, device: torch.device) -> torch.Tensor | None:
    """The checkpoint's d2t offsets as the absolute target ids the graph scatters to (offset + row)."""
    if names.HF_D2T not in w:
        return None
    offsets = w[names.HF_D2T].to(torch.int64).reshape(-1)  # (n_vocab_draft,)
    return (offsets + torch.arange(offsets.numel(), device=offsets.device)).to(device)
