"""The trained pair's target: a seeded qwen3 whose greedy continuation a tiny drafter can learn,
and only from the target layers it was trained on.

A random transformer's greedy continuation is close to a bigram map, which a drafter reads off
the anchor token alone: wrong context features would then cost nothing. This target's next token
is a fixed permutation of the token LOOKBACK places back, computed where DFlash taps it: layer
FEATURE_LAYER writes a feature of each row's own token (so it is in the input of layer
FEATURE_LAYER + 1, the last GGUF target layer, and not in the one below), and a positional head
in COPY_LAYER fetches that feature from LOOKBACK - 1 rows back. The other layers stay random and
faint. Every draft of a block then reads a context row, at the right depth.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from featdiff.core import names
from featdiff.factory import pairs
from featdiff.factory.pairs import BLOCK_SIZE, HF_TARGET_LAYER_IDS, Shape, Sizes
from featdiff.torchref.numerics import ffn, linear, rms_norm
from featdiff.torchref.weights import Layer, layer_from_tensors

LOOKBACK = BLOCK_SIZE  # x[t+1] = perm(x[t+1-LOOKBACK]): drafts 1..B-1 all read context rows
FEATURE_LAYER = HF_TARGET_LAYER_IDS[-1]  # HF id: its output is the drafter's last feature slot
COPY_LAYER = FEATURE_LAYER + 1
SHARED_GAIN = 2.0  # every embedding row carries this much of one direction u, which the positional head reads
BACKGROUND_GAIN = 0.1  # the other layers' outputs: random but faint, so the rule holds greedily
FEATURE_GAIN = 6.0  # the feature dwarfs the embedding: without it a drafter cannot tell what to copy
COPY_GAIN = 50.0  # the fetched feature dwarfs the row's own token in the output
QK_SHARPNESS = 5.0  # q/k norm weights of the positional head: a score margin of ~0.7 x this squared
POSITION_PAIRS = 3  # RoPE pairs (the fastest) the positional head turns; more pairs, fewer aliased distances
HEAD_SCALE = 2.0  # norm of each output row: logits of about +-16 around the greedy token


def lookback_target(rng: np.random.Generator, sizes: Sizes) -> dict:
    """The target's weights (fixtures layout, float32): random layers plus the lookback rule."""
    s = sizes.target
    if s.n_layer <= COPY_LAYER or s.n_embd_head < 2 * POSITION_PAIRS:
        raise ValueError(
            f"a lookback target needs > {COPY_LAYER} layers and heads of >= {2 * POSITION_PAIRS} "
            f"dims; got {s.n_layer} layers, heads of {s.n_embd_head}"
        )
    w = pairs.target_weights(rng, names.ARCH_QWEN3, sizes)
    u = rng.standard_normal(s.n_embd)
    u /= np.linalg.norm(u)
    off_u = np.eye(s.n_embd) - np.outer(u, u)  # (n_embd, n_embd): removes the shared direction
    w["token_embd"] = w["token_embd"] @ off_u + SHARED_GAIN * u  # (n_vocab, n_embd)
    for il, layer in enumerate(w["layers"]):  # no layer writes along u: every row keeps exactly SHARED_GAIN of it
        layer["attn_output"] = (COPY_GAIN if il == COPY_LAYER else BACKGROUND_GAIN) * off_u @ layer["attn_output"]
        layer["ffn_down"] = (FEATURE_GAIN if il == FEATURE_LAYER else BACKGROUND_GAIN) * off_u @ layer["ffn_down"]
    copy = w["layers"][COPY_LAYER]
    copy["attn_v"] = copy["attn_v"] @ off_u  # (n_head_kv * n_embd_head, n_embd): the copy carries no constant
    copy.update(_positional_head(s, u))
    w["output_norm"] = np.ones(s.n_embd)
    w["output"] = _head_reading_copies(w, sizes, rng.permutation(sizes.n_vocab - 2) + 1)
    return _as_float32(w)


def _positional_head(s: Shape, u: np.ndarray) -> dict[str, np.ndarray]:
    """Attention weights whose scores depend on the distance alone, peaking at LOOKBACK - 1.

    q and k read only the shared direction u (through an unweighted norm and the q/k norms),
    so every row has the same query and key before RoPE; NeoX pair i (dims i, i + d/2) of the
    key is turned back by (LOOKBACK - 1) * theta_i, so the rotations cancel at that distance.
    """
    d, half = s.n_embd_head, s.n_embd_head // 2
    theta = pairs.ROPE_BASE ** (-2.0 * np.arange(half) / d)  # ggml's RoPE angle per pair and position
    pair_ids = np.arange(POSITION_PAIRS)
    q0, k0 = np.zeros(d), np.zeros(d)
    q0[pair_ids] = 1.0
    k0[pair_ids], k0[pair_ids + half] = (
        np.cos((LOOKBACK - 1) * theta[pair_ids]),
        np.sin((LOOKBACK - 1) * theta[pair_ids]),
    )
    return {
        "attn_norm": np.ones(s.n_embd),  # a weighted norm would leak other directions into u
        "attn_q": np.tile(np.outer(q0, u), (s.n_head, 1)),  # (n_head * n_embd_head, n_embd)
        "attn_k": np.tile(np.outer(k0, u), (s.n_head_kv, 1)),  # (n_head_kv * n_embd_head, n_embd)
        "attn_q_norm": np.full(d, QK_SHARPNESS),
        "attn_k_norm": np.full(d, QK_SHARPNESS),
    }


def _head_reading_copies(w: dict, sizes: Sizes, perm: np.ndarray) -> np.ndarray:
    """Output rows `(n_vocab, n_embd)`: row perm[i] points along what the copy head writes for
    token i + 1, so the greedy token is perm(the token fetched). Pad (0) and mask rows stay zero."""
    copies = _copy_vectors(w, sizes)[1 : sizes.n_vocab - 1]  # (n_vocab - 2, n_embd)
    out = np.zeros((sizes.n_vocab, sizes.target.n_embd))
    out[perm] = HEAD_SCALE * copies / np.linalg.norm(copies, axis=1, keepdims=True)
    return out


def _copy_vectors(w: dict, sizes: Sizes) -> np.ndarray:
    """What COPY_LAYER adds to a row whose fetched row holds token v, for every v, `(n_vocab, n_embd)`,
    by the reference's numerics (the faint background layers left out)."""
    s = sizes.target
    feature, copy = (_frozen_layer(w["layers"][il]) for il in (FEATURE_LAYER, COPY_LAYER))
    e = torch.from_numpy(np.asarray(w["token_embd"], np.float32))  # (n_vocab, n_embd)
    x = e + ffn(rms_norm(e, feature.ffn_norm, pairs.RMS_EPS), feature)  # the input of COPY_LAYER
    v = linear(rms_norm(x, copy.attn_norm, pairs.RMS_EPS), copy.wv)
    v = v.reshape(-1, s.n_head_kv, s.n_embd_head)  # (n_vocab, n_head_kv, n_embd_head)
    heads = v.repeat_interleave(s.n_head // s.n_head_kv, dim=1)  # (n_vocab, n_head, n_embd_head): GQA
    return linear(heads.reshape(-1, s.n_head * s.n_embd_head), copy.wo).numpy()  # (n_vocab, n_embd)


def _frozen_layer(layer: dict) -> Layer:
    return layer_from_tensors(
        {k: torch.from_numpy(np.asarray(layer[k], np.float32)) if k in layer else None for k in names.GGUF_TO_HF_LAYER}
    )


def _as_float32(w: dict) -> dict:
    out: dict[str, Any] = {k: np.asarray(a, np.float32) for k, a in w.items() if k != "layers"}
    out["layers"] = [{k: np.asarray(a, np.float32) for k, a in layer.items()} for layer in w["layers"]]
    return out
