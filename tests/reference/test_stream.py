"""Weights stream: a loaded target or drafter holds no compute-dtype layer weights; a layer is read
from its file when the forward reaches it, and the forward is the same as with every layer resident."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

from featdiff.torchref.attention import empty_cache
from featdiff.torchref.load import load_draft, load_target
from featdiff.torchref.target import forward_target
from featdiff.torchref.weights import Layer, LayerStream, Target, tensors_of_layer

CPU = torch.device("cpu")


def _held_tensors(model: Target) -> list[torch.Tensor]:
    """The tensors a loaded target holds in its fields (layers aside, which it streams)."""
    return [getattr(model, f.name) for f in fields(model) if isinstance(getattr(model, f.name), torch.Tensor)]


def _layer_bytes(layer: Layer) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of_layer(layer).values() if t is not None)


@pytest.mark.parametrize("target_file", ["target.gguf", "target-hf"])
def test_target_holds_no_layer_weights(variant_dir, target_file):
    target = load_target(variant_dir("clean") / target_file, torch.float32, CPU)
    assert isinstance(target.layers, LayerStream)
    held = _held_tensors(target)
    n_vocab, n_embd = target.token_embd.shape
    # the embeddings, the head and the output norm, nothing the size of a layer more
    assert sum(t.numel() for t in held) == 2 * n_vocab * n_embd + n_embd
    assert target.layers[0] is not target.layers[0]  # built on access, never cached
    assert _layer_bytes(target.layers[-1]) > 0


@pytest.mark.parametrize("model_file", ["draft.gguf", "draft-hf"])
def test_drafter_streams_its_layers(variant_dir, model_file):
    draft = load_draft(variant_dir("clean") / model_file, torch.float32, CPU)
    assert isinstance(draft.layers, LayerStream)
    assert len(draft.layers) == draft.hparams.n_layer
    assert all(isinstance(layer, Layer) for layer in draft.layers)
    with pytest.raises(IndexError):
        draft.layers[draft.hparams.n_layer]


@pytest.mark.parametrize("target_file", ["target.gguf", "target-hf"])
def test_streamed_forward_equals_resident_forward(variant_dir, target_file):
    streamed = load_target(variant_dir("clean") / target_file, torch.float32, CPU)
    resident: Target = replace(streamed, layers=tuple(streamed.layers))
    hp = streamed.hparams
    tokens = torch.tensor([1, 5, 9, 200, 3])
    positions = torch.arange(tokens.numel())
    passes = [
        forward_target(m, tokens, positions, empty_cache(hp.n_layer, hp.n_head_kv, hp.n_embd_head, "f16", CPU), True)
        for m in (streamed, resident)
    ]
    for a, b in zip(passes[0].records, passes[1].records, strict=True):
        assert a.name == b.name
        assert torch.equal(a.array, b.array), a.name
