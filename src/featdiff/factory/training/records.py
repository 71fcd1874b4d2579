"""The reference's weight records (`featdiff.torchref.weights`) of fixtures weight dicts, and
back: training runs the reference's own forward on them, the fixtures' writers save the result.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

from featdiff.core import names
from featdiff.factory import pairs
from featdiff.factory.pairs import BLOCK_SIZE, HF_TARGET_LAYER_IDS, Shape, Sizes
from featdiff.torchref.weights import (
    DSpark,
    Draft,
    Hparams,
    Layer,
    LogSnr,
    Source,
    Target,
    layer_from_tensors,
    present,
    tensors_of_layer,
)

LOG_SNR_KEYS = ("log_snr_fc1", "log_snr_fc1_b", "log_snr_fc2", "log_snr_fc2_b")  # fixtures' keys, in LogSnr's order
DSPARK_KEYS = ("markov_w1", "markov_w2", "conf_proj", "conf_proj_b")  # fixtures' keys of DSpark's heads


def target_record(w: dict, sizes: Sizes, seed: int) -> Target:
    """The reference's `Target` of a fixtures target weight dict (frozen tensors)."""
    return Target(
        source=Source(Path(f"<trained target, seed {seed}>"), is_gguf=False),
        hparams=_hparams(sizes.target, names.ARCH_QWEN3, sizes.n_vocab),
        token_embd=_tensor(w["token_embd"]),
        output_norm=_tensor(w["output_norm"]),
        output=_tensor(w["output"]),
        layers=tuple(_layer(layer) for layer in w["layers"]),
    )


def draft_record(w: dict, sizes: Sizes, trainable: bool) -> Draft:
    """The reference's `Draft` of a fixtures drafter weight dict, borrowing the target's tables;
    with `trainable`, its tensors are autograd leaves."""
    snr = None
    if LOG_SNR_KEYS[0] in w:
        snr = LogSnr(pairs.MIN_LOG_SNR, pairs.MAX_LOG_SNR, *(_tensor(w[k], trainable) for k in LOG_SNR_KEYS))
    return Draft(
        source=Source(Path("<trained drafter>"), is_gguf=False),
        hparams=_hparams(sizes.draft, names.ARCH_DFLASH, sizes.n_vocab),
        target_layers=tuple(i + 1 for i in HF_TARGET_LAYER_IDS),  # gguf = hf + 1
        block_size=BLOCK_SIZE,
        mask_token_id=sizes.mask_token_id,
        fc=_tensor(w["fc"], trainable),
        enc_norm=_tensor(w["hidden_norm"], trainable),
        output_norm=_tensor(w["norm"], trainable),
        token_embd=None,
        output=None,
        layers=tuple(_layer(layer, trainable) for layer in w["layers"]),
        log_snr=snr,
    )


def draft_weights_of(draft: Draft) -> dict:
    """A `Draft` back as a fixtures drafter weight dict (what the fixtures' writers take)."""
    w = {
        "fc": _array(draft.fc),
        "hidden_norm": _array(draft.enc_norm),
        "norm": _array(draft.output_norm),
        "layers": [
            {k: _array(t) for k, t in tensors_of_layer(layer).items() if t is not None} for layer in draft.layers
        ],
    }
    if draft.log_snr is not None:
        snr = draft.log_snr
        w.update(zip(LOG_SNR_KEYS, map(_array, (snr.fc1_w, snr.fc1_b, snr.fc2_w, snr.fc2_b))))
    return w


def dspark_record(w: dict, trainable: bool) -> DSpark:
    """The reference's `DSpark` heads of a fixtures DSpark weight dict: anchor-first, no scale
    tensor, no reduced vocabulary. (`draft_record` of the same dict is its DFlash body.)"""
    w1, w2, conf_w, conf_b = (_tensor(w[k], trainable) for k in DSPARK_KEYS)
    return DSpark(
        markov_w1=w1, markov_w2=w2, markov_w2_scale=None, conf_w=conf_w, conf_b=conf_b, sample_from_anchor=True
    )


def dspark_weights_of(draft: Draft, dsp: DSpark) -> dict:
    """A DFlash body and its DSpark heads back as one fixtures weight dict."""
    w = draft_weights_of(draft)
    w.update(zip(DSPARK_KEYS, map(_array, (dsp.markov_w1, dsp.markov_w2, dsp.conf_w, dsp.conf_b))))
    return w


def parameters(draft: Draft) -> list[torch.Tensor]:
    """Every tensor of a drafter record (the trainable ones of a `trainable` record)."""
    out = [draft.fc, draft.enc_norm, draft.output_norm]
    out += [getattr(layer, f.name) for layer in draft.layers for f in fields(layer)]
    if draft.log_snr is not None:
        out += [draft.log_snr.fc1_w, draft.log_snr.fc1_b, draft.log_snr.fc2_w, draft.log_snr.fc2_b]
    return [t for t in out if t is not None]


def _hparams(s: Shape, arch: str, n_vocab: int) -> Hparams:
    return Hparams(
        arch=arch,
        n_layer=s.n_layer,
        n_embd=s.n_embd,
        n_head=s.n_head,
        n_head_kv=s.n_head_kv,
        n_embd_head=s.n_embd_head,
        n_ff=s.n_ff,
        n_vocab=n_vocab,
        rms_eps=pairs.RMS_EPS,
        rope_base=pairs.ROPE_BASE,
        rope_type="neox",
    )  # HF orientation: rotate-half RoPE


def _layer(layer: dict, trainable: bool = False) -> Layer:
    return layer_from_tensors({k: _tensor(layer[k], trainable) if k in layer else None for k in names.GGUF_TO_HF_LAYER})


def _tensor(a: np.ndarray, trainable: bool = False) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float32, requires_grad=trainable)


def _array(t: torch.Tensor | None) -> np.ndarray:
    return present(t, "a trained tensor").detach().cpu().numpy().astype(np.float32)
