"""The training corpus: the target's own greedy continuations of random prompts, with the
drafter's feature rows of every token; and held-out prompts, drawn from another rng stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from featdiff.factory.pairs import HF_TARGET_LAYER_IDS, Sizes
from featdiff.verdict.probe import TOKENS_PREFIX
from featdiff.torchref.attention import KvCache, empty_cache
from featdiff.torchref.target import forward_target
from featdiff.torchref.weights import Hparams, Target
from featdiff.factory.training.target import LOOKBACK

PROMPT_LENGTHS = (LOOKBACK + 1, 12)  # inclusive bounds; the lookback rule needs LOOKBACK tokens before
STREAM_CORPUS, STREAM_HELD_OUT = 1, 2  # rng streams per seed: the two prompt sets never share a draw
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Corpus:
    """Greedy sequences of the target with their feature rows, and where each prompt ends (the
    first anchor: the flow's first block is anchored on the last prompt token)."""

    tokens: torch.Tensor  # (n_seq, n_tokens) int64
    features: torch.Tensor  # (n_seq, n_tokens, n_extract * n_embd_tgt)
    first_anchor: torch.Tensor  # (n_seq,) int64: prompt length - 1


def prompts(seed: int, n: int, sizes: Sizes, stream: int = STREAM_CORPUS) -> tuple[tuple[int, ...], ...]:
    """`n` random prompts of PROMPT_LENGTHS tokens, ids 1 .. n_vocab-2 (no pad, no mask)."""
    rng = np.random.default_rng((seed, stream))
    lengths = rng.integers(PROMPT_LENGTHS[0], PROMPT_LENGTHS[1] + 1, n)
    return tuple(tuple(int(t) for t in rng.integers(1, sizes.n_vocab - 1, k)) for k in lengths)


def held_out_prompts(seed: int, n: int, sizes: Sizes) -> tuple[tuple[int, ...], ...]:
    """Prompts the drafter never trained on: what accept is measured on."""
    return prompts(seed, n, sizes, STREAM_HELD_OUT)


def write_prompts(path: Path, chosen: tuple[tuple[int, ...], ...]) -> Path:
    """A prompts file for `featdiff probe --prompts`: one `tokens: 1,2,3` line per prompt."""
    path.write_text("".join(f"{TOKENS_PREFIX} {','.join(map(str, p))}\n" for p in chosen))
    return path


def make_corpus(target: Target, chosen: tuple[tuple[int, ...], ...], n_tokens: int) -> Corpus:
    """Each prompt continued greedily to `n_tokens`, with the feature rows of every token."""
    layers = tuple(i + 1 for i in HF_TARGET_LAYER_IDS)  # the inputs of these target layers (gguf = hf + 1)
    with torch.no_grad():
        seqs = [greedy_continuation(target, p, n_tokens) for p in chosen]
        feats = torch.stack(
            [_feature_rows(target, s, layers) for s in seqs]
        )  # (n_seq, n_tokens, n_extract * n_embd_tgt)
    return Corpus(tokens=torch.tensor(seqs), features=feats, first_anchor=torch.tensor([len(p) - 1 for p in chosen]))


def greedy_continuation(target: Target, prompt: tuple[int, ...], n_tokens: int) -> tuple[int, ...]:
    """`prompt` continued greedily by the reference target to `n_tokens` tokens (f32 KV cache)."""
    tokens, cache = list(prompt), f32_cache(target.hparams)
    new = torch.tensor(tokens)
    while len(tokens) < n_tokens:
        positions = torch.arange(len(tokens) - len(new), len(tokens))
        tp = forward_target(target, new, positions, cache, has_outputs=True)
        cache, new = tp.cache, tp.logits[-1:].argmax(-1)
        tokens.append(int(new[0]))
    return tuple(tokens)


def _feature_rows(target: Target, seq: tuple[int, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """Token-major feature rows of one sequence, `(n_tokens, n_extract * n_embd_tgt)` (docs/flow.md)."""
    tp = forward_target(target, torch.tensor(seq), torch.arange(len(seq)), f32_cache(target.hparams), has_outputs=False)
    return torch.cat([tp.layer_inputs[il] for il in layers], dim=1)  # (n_tokens, n_extract * n_embd_tgt)


def f32_cache(hp: Hparams) -> KvCache:
    """An empty float32 KV cache for a stack: training emulates no f16 cache."""
    return empty_cache(hp.n_layer, hp.n_head_kv, hp.n_embd_head, "f32", CPU)
