"""An EAGLE3 drafter from its Hugging Face checkpoint, as its trainer wrote it (SpecForge's
`midlayer.*` with `eagle_config`, Eagle3Speculator's `layers.0.*`, EAGLE's own `midlayer.*`:
featdiff.kinds.eagle3.TRAINERS), into the same `Eagle3Draft` the GGUF loader makes (eagle3.py).

What differs from the GGUF: the q/k rows stay in HF's rotate-half order and RoPE runs NeoX style
(the converter permutes them into ggml's interleaved pairs for RoPE NORM: the same rotation);
`d2t` holds offsets (target id = d2t[i] + i), made absolute here; the layer ids mean what the
trainer's code taps (a layer's input or its output; the output of L is the input of L + 1, the
GGUF id llama.cpp taps), else the converter's default [2, n_layer // 2, n_layer - 3] inputs of the
target; SpecForge's per-slot `fc_norm` is modelled beside the whole-vector `input_norm`. Whatever
the checkpoint holds that the reference does not read is refused by name (InputError).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.kinds.eagle3 import (
    FLAG,
    HF_AUX_LAYER_IDS,
    HF_EAGLE_CONFIG,
    HF_FC_NORM,
    HF_FC_NORM_TENSOR,
    HF_HIDDEN_NORM,
    HF_INPUT_NORM,
    HF_LAYER_PREFIXES,
    LAYER_IDS_INPUT,
    LAYER_IDS_MEANINGS,
    LAYER_IDS_OUTPUT,
    STATED,
    Trainer,
    eagle3_config,
    is_eagle3_config,
    stated_layer_ids,
    trainer_of,
    unread_keys,
    unread_tensors,
)
from featdiff.torchref.eagle3.graph import Eagle3Draft
from featdiff.torchref.load_hf import _hparams, _weights, read_config
from featdiff.torchref.weights import Source, Target, layer_from_tensors

HF_TARGET_HIDDEN_SIZE = "target_hidden_size"
HF_NORM_BEFORE_FC = "norm_before_fc"
HF_NORM_BEFORE_RESIDUAL = "norm_before_residual"
N_SLOTS = 3  # EAGLE3 reads exactly three target layers
# The converter's names for the checkpoint's tensors outside the layer (t2d it drops): HF -> GGUF
GGUF_FROM_HF = {
    names.HF_FC: names.T_FC,
    HF_INPUT_NORM: names.T_ENC_NORM,
    names.HF_EMBED_TOKENS: names.T_TOKEN_EMBD,
    names.HF_NORM: names.T_OUTPUT_NORM,
    names.HF_LM_HEAD: names.T_OUTPUT,
    names.HF_D2T: names.T_D2T,
}


def eagle3_from_hf(
    path: Path, target: Target, dtype: torch.dtype, device: torch.device, layer_ids_mean: str | None = None
) -> Eagle3Draft:
    """The EAGLE3 drafter at the HF directory `path`, for `target` (its layer count sets the
    default target layers); `layer_ids_mean` ("input" / "output", --layer-ids-mean) states what
    its ids name where the checkpoint cannot tell. InputError naming the file for what the
    reference does not read or model."""
    config = eagle3_config(read_config(path))
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
    prefix = next((p for p in HF_LAYER_PREFIXES if f"{p}{HF_HIDDEN_NORM}.weight" in w), None)
    if prefix is None:
        raise InputError(
            f"{path}: no {HF_LAYER_PREFIXES[0]}{HF_HIDDEN_NORM}.weight; an EAGLE3 checkpoint's layer is missing"
        )
    _refuse_unread(path, config, w, prefix)
    target_layers, checkpoint = layer_ids_of(path, config, w, target.hparams.n_layer, layer_ids_mean)
    layer = layer_from_tensors({k: w.get(f"{prefix}{hf}.weight") for k, hf in names.GGUF_TO_HF_LAYER.items()})
    norm_before_fc = bool(_setting(config, HF_NORM_BEFORE_FC, False))
    fc_norm = _fc_norm(path, config, w, norm_before_fc)  # first: both norms say more than a missing input_norm
    hp = replace(_hparams(path, config, names.ARCH_EAGLE3), n_vocab=target.hparams.n_vocab)
    output = w.get(names.HF_LM_HEAD)
    n_vocab_draft = int(config[names.HF_DRAFT_VOCAB_SIZE])
    if output is not None and output.shape[0] != n_vocab_draft:
        raise InputError(
            f"{path}: {names.HF_LM_HEAD} has {output.shape[0]} rows but config.json {names.HF_DRAFT_VOCAB_SIZE} = "
            f"{n_vocab_draft}; the head drafts draft_vocab_size tokens: save the config of this head"
        )
    return Eagle3Draft(
        source=Source(Path(path), is_gguf=False),
        hparams=hp,
        target_layers=target_layers,
        n_embd_tgt=int(config.get(HF_TARGET_HIDDEN_SIZE) or target.hparams.n_embd),
        norm_before_fc=norm_before_fc,
        norm_before_residual=bool(_setting(config, HF_NORM_BEFORE_RESIDUAL, False)),
        fc=_required(w, path, names.HF_FC),
        enc_norm=_required(w, path, HF_INPUT_NORM) if norm_before_fc else None,
        layer=layer,
        attn_norm_2=_required(w, path, f"{prefix}{HF_HIDDEN_NORM}.weight"),
        output_norm=_required(w, path, names.HF_NORM),
        output=output,
        token_embd=w.get(names.HF_EMBED_TOKENS),
        d2t=_absolute_d2t(w, device),
        fc_norm=fc_norm,
        checkpoint=checkpoint,
    )


def layer_ids_of(
    path: Path, config: Mapping[str, Any], tensors: Mapping[str, Any], n_layer: int, layer_ids_mean: str | None
) -> tuple[tuple[int, int, int], dict[str, Any]]:
    """The GGUF ids (layer inputs, what llama.cpp taps) of the checkpoint's three target layers,
    and the manifest's `checkpoint` entry (docs/dump.md): its trainer, its ids as stated, what
    they mean and who said so. An id naming layer L's output is the input of L + 1."""
    cfg = path / names.HF_CONFIG
    if layer_ids_mean is not None and layer_ids_mean not in LAYER_IDS_MEANINGS:
        raise InputError(f"{FLAG} {layer_ids_mean!r}: pass one of {', '.join(LAYER_IDS_MEANINGS)}")
    trainer = trainer_of(config, tensors)
    if trainer is None and layer_ids_mean is None:
        raise InputError(
            f"{cfg}: {HF_AUX_LAYER_IDS} = {config.get(HF_AUX_LAYER_IDS)} at the top level beside "
            f"{HF_EAGLE_CONFIG} = {config.get(HF_EAGLE_CONFIG)}: whether they name target layer inputs (llama.cpp, "
            f"vLLM) or outputs (SpecForge) cannot be told; pass {FLAG} input|output"
        )
    told_by = "flag" if layer_ids_mean is not None else "checkpoint"
    stated: Trainer = trainer if trainer is not None else STATED
    ids = stated_layer_ids(config, stated) if trainer is not None else config.get(HF_AUX_LAYER_IDS)
    mean = layer_ids_mean or stated.layer_ids_mean
    if not ids:  # every trainer's default names the same tensors: inputs of [2, n // 2, n - 3]
        ids, mean, told_by = [2, n_layer // 2, n_layer - 3], LAYER_IDS_INPUT, "default"
    if len(ids) != N_SLOTS or not all(isinstance(i, int) for i in ids):
        raise InputError(f"{cfg}: {stated.ids_at or HF_AUX_LAYER_IDS} = {ids}: EAGLE3 reads exactly 3 target layers")
    shift = 1 if mean == LAYER_IDS_OUTPUT else 0  # the output of layer L is the input of layer L + 1
    gguf = (ids[0] + shift, ids[1] + shift, ids[2] + shift)
    entry = {"trainer": stated.name, "layer_ids": list(ids), "layer_ids_mean": mean, "told_by": told_by}
    return gguf, entry


def _refuse_unread(path: Path, config: Mapping[str, Any], w: Mapping[str, Any], prefix: str) -> None:
    """InputError naming every config key and tensor the reference does not read (and does not
    list as irrelevant: featdiff.kinds.eagle3)."""
    found = [f"config.json {k}" for k in unread_keys(config)] + [f"tensor {t}" for t in unread_tensors(w, prefix)]
    if found:
        raise InputError(
            f"{path}: carries {', '.join(found)}, which featdiff's EAGLE3 reference does not read (a comparison would "
            "silently leave it out); drop it, or model it or list it as irrelevant with its reason in "
            "src/featdiff/kinds/eagle3.py"
        )


def _setting(config: Mapping[str, Any], key: str, default: Any) -> Any:
    """A setting at the top level, else in SpecForge's `eagle_config`."""
    ec = config.get(HF_EAGLE_CONFIG)
    return config.get(key, ec.get(key, default) if isinstance(ec, dict) else default)


def _fc_norm(
    path: Path, config: Mapping[str, Any], w: Mapping[str, torch.Tensor], norm_before_fc: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """SpecForge's per-slot feature norms `fc_norm.{0,1,2}.weight`, each `(n_embd_tgt,)`, when
    `fc_norm` is true; None without. InputError where the flag and the tensors disagree, or
    beside a whole-vector `input_norm` (norm_before_fc)."""
    flag = bool(_setting(config, HF_FC_NORM, False))
    tensors = [HF_FC_NORM_TENSOR.format(k=k) for k in range(N_SLOTS)]
    held = [t for t in tensors if t in w]
    if not flag and held:
        raise InputError(
            f"{path}: holds {', '.join(held)} but config.json {HF_FC_NORM} is not true; SpecForge applies them only "
            f"with {HF_FC_NORM}: true: set it, or drop the tensors"
        )
    if not flag:
        return None
    if norm_before_fc:
        raise InputError(
            f"{path}: config.json sets both {HF_NORM_BEFORE_FC} (one norm over the concatenated features) and "
            f"{HF_FC_NORM} (one per slot); no trainer applies both: keep the one it was trained with"
        )
    t = [_required(w, path, name) for name in tensors]
    return (t[0], t[1], t[2])


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
