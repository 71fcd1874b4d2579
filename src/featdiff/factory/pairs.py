"""The fixture pairs before any file is written: their dimensions, their variants (what the
checkpoint is, what its GGUF export gets wrong) and their seeded random weights.

`featdiff.factory.fixtures` writes a pair as GGUF and HF files; `featdiff.factory.training` trains a drafter
starting from these weights. Both import this module, neither imports the other at module level.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from featdiff.core import names

N_VOCAB = 512
MASK_TOKEN_ID = N_VOCAB - 1
N_POS_TRAIN = 4096
RMS_EPS = 1e-6
ROPE_BASE = 10000.0


@dataclass(frozen=True)
class Shape:
    """Dimensions of one transformer stack, in llama.cpp's vocabulary."""

    n_layer: int
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_embd_head: int = 16
    n_ff: int = 128


TARGET = Shape(n_layer=6)
DRAFT = Shape(n_layer=2)


@dataclass(frozen=True)
class Sizes:
    """The dimensions of a fixture pair; the default is the tiny pair the tests use."""

    target: Shape = TARGET
    draft: Shape = DRAFT
    n_vocab: int = N_VOCAB

    @property
    def mask_token_id(self) -> int:
        return self.n_vocab - 1


TINY = Sizes()
HF_TARGET_LAYER_IDS = (1, 3)  # output-of-layer ids; GGUF stores them + 1 = [2, 4]
BLOCK_SIZE = 4
MIN_LOG_SNR, MAX_LOG_SNR = -9.0, 9.0
MARKOV_RANK = 16  # R of a random DSpark's Markov head
MARKOV_W2_SCALE = 2.0  # markov_w2.scale where a variant ships one
CONF_GAIN = 2.0  # the confidence logit's spread: sigmoid spans most of (0, 1)


# The RoPE scalings of the `rope` variants, as a HF config's `rope_scaling` states them. The
# original context is small, so that the few positions a test decodes reach the scaled dims.
ROPE_SCALINGS: dict[str, dict] = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@dataclass(frozen=True)
class Variant:
    """What the checkpoint is, and what the GGUF the run loads gets wrong about it."""

    name: str
    doc: str
    target_arch: str = "qwen3"
    checkpoint_own_embd: bool = False  # the trained drafter has its own token_embd/output
    checkpoint_log_snr: bool = False  # the trained drafter is GIDD log-SNR conditioned
    gguf_layer_delta: int = 0  # added to every GGUF target layer id
    gguf_swap_fc_blocks: bool = False  # fc column blocks 0 and 1 swapped in the GGUF
    gguf_drop_own_embd: bool = False  # GGUF omits the drafter's own embeddings/head
    gguf_drop_log_snr: bool = False  # GGUF omits the log-SNR tensors and keys (upstream loads it)
    checkpoint_dspark: bool = False  # the trained drafter is DSpark: DFlash plus a Markov head
    checkpoint_conf_head: bool = False  # ... with a confidence head
    checkpoint_markov_scale: bool = False  # ... shipping markov_w2.scale
    checkpoint_bonus_anchor: bool = False  # ... laid out bonus-anchor (sample_from_anchor false)
    checkpoint_d2t: bool = False  # ... with a reduced draft vocabulary: own head of half the rows, d2t
    gguf_drop_markov: bool = False  # GGUF omits the Markov and confidence tensors, keeps the dflash.* keys
    gguf_flip_anchor: bool = False  # GGUF's dflash.sample_from_anchor is the opposite of the checkpoint's
    rope: str = ""  # RoPE scaling of both stacks: "" plain, "llama3" (rope_freqs), "yarn" (ROPE_SCALINGS)
    is_trained: bool = False  # the drafter is trained on its target (featdiff.factory.training), not random


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("clean", "qwen3 target, drafter borrowing the target's embeddings and head"),
        Variant("own-embd", "drafter with its own token_embd/output", checkpoint_own_embd=True),
        Variant("llama", "llama-arch target, borrowing drafter", target_arch="llama"),
        Variant(
            "log-snr",
            "GIDD log-SNR conditioned drafter (upstream llama.cpp refuses to load it)",
            checkpoint_log_snr=True,
        ),
        Variant(
            "no-log-snr",
            "log-SNR trained drafter exported without its conditioning",
            checkpoint_log_snr=True,
            gguf_drop_log_snr=True,
        ),
        Variant("layers-plus1", "dflash.target_layers one too high", gguf_layer_delta=+1),
        Variant("layers-minus1", "dflash.target_layers without the +1 of the converter", gguf_layer_delta=-1),
        Variant("slots-swapped", "fc column blocks of slots 0 and 1 swapped", gguf_swap_fc_blocks=True),
        Variant(
            "borrowed-embd",
            "own-embeddings drafter exported without them, so the run borrows the target's",
            checkpoint_own_embd=True,
            gguf_drop_own_embd=True,
        ),
        Variant(
            "dspark",
            "anchor-first DSpark drafter: Markov head with markov_w2.scale, confidence head",
            checkpoint_dspark=True,
            checkpoint_conf_head=True,
            checkpoint_markov_scale=True,
        ),
        Variant("dspark-no-conf", "anchor-first DSpark drafter with a Markov head only", checkpoint_dspark=True),
        Variant(
            "dspark-bonus",
            "bonus-anchor DSpark drafter (sample_from_anchor false) with a confidence head",
            checkpoint_dspark=True,
            checkpoint_conf_head=True,
            checkpoint_bonus_anchor=True,
        ),
        Variant(
            "dspark-d2t",
            "anchor-first DSpark drafter drafting a reduced vocabulary (own head, d2t)",
            checkpoint_dspark=True,
            checkpoint_conf_head=True,
            checkpoint_d2t=True,
        ),
        Variant(
            "dspark-lost-markov",
            "DSpark drafter exported without its Markov and confidence heads, keys kept",
            checkpoint_dspark=True,
            checkpoint_conf_head=True,
            checkpoint_markov_scale=True,
            gguf_drop_markov=True,
        ),
        Variant(
            "dspark-anchor-flipped",
            "anchor-first DSpark drafter exported with dflash.sample_from_anchor = false",
            checkpoint_dspark=True,
            checkpoint_conf_head=True,
            gguf_flip_anchor=True,
        ),
        Variant(
            "llama3-rope",
            "llama target and drafter with llama3 RoPE scaling (rope_freqs)",
            target_arch="llama",
            rope="llama3",
        ),
        Variant("yarn", "qwen3 target and drafter with YaRN RoPE scaling", rope="yarn"),
        Variant("trained", "drafter trained on its target: accept rate means something", is_trained=True),
        Variant(
            "trained-layers-minus1",
            "trained drafter, dflash.target_layers without the +1 of the converter",
            gguf_layer_delta=-1,
            is_trained=True,
        ),
        Variant(
            "trained-log-snr",
            "trained GIDD log-SNR conditioned drafter (upstream llama.cpp refuses it)",
            checkpoint_log_snr=True,
            is_trained=True,
        ),
        Variant(
            "trained-no-log-snr",
            "trained log-SNR drafter exported without its conditioning",
            checkpoint_log_snr=True,
            gguf_drop_log_snr=True,
            is_trained=True,
        ),
        Variant(
            "trained-dspark",
            "trained anchor-first DSpark drafter with a confidence head",
            checkpoint_dspark=True,
            checkpoint_conf_head=True,
            is_trained=True,
        ),
    )
}


# --- weights (HF orientation: (out, in); equal to the GGUF numpy arrays) -----------------------


def _linear(rng: np.random.Generator, n_out: int, n_in: int) -> np.ndarray:
    return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _layer(rng: np.random.Generator, s: Shape, qk_norm: bool) -> dict[str, np.ndarray]:
    w = {
        "attn_norm": _norm(rng, s.n_embd),
        "attn_q": _linear(rng, s.n_head * s.n_embd_head, s.n_embd),
        "attn_k": _linear(rng, s.n_head_kv * s.n_embd_head, s.n_embd),
        "attn_v": _linear(rng, s.n_head_kv * s.n_embd_head, s.n_embd),
        "attn_output": _linear(rng, s.n_embd, s.n_head * s.n_embd_head),
        "ffn_norm": _norm(rng, s.n_embd),
        "ffn_gate": _linear(rng, s.n_ff, s.n_embd),
        "ffn_up": _linear(rng, s.n_ff, s.n_embd),
        "ffn_down": _linear(rng, s.n_embd, s.n_ff),
    }
    if qk_norm:
        w["attn_q_norm"] = _norm(rng, s.n_embd_head)
        w["attn_k_norm"] = _norm(rng, s.n_embd_head)
    return w


def target_weights(rng: np.random.Generator, arch: str, sz: Sizes) -> dict:
    """A random target (HF orientation), drawn from `rng`."""
    s = sz.target
    return {
        "token_embd": rng.standard_normal((sz.n_vocab, s.n_embd)).astype(np.float32),
        "output": _linear(rng, sz.n_vocab, s.n_embd),
        "output_norm": _norm(rng, s.n_embd),
        "layers": [_layer(rng, s, qk_norm=arch == "qwen3") for _ in range(s.n_layer)],
    }


def draft_weights(rng: np.random.Generator, v: Variant, sz: Sizes) -> dict:
    """A random drafter for variant `v`'s checkpoint (HF orientation), drawn from `rng`."""
    s = sz.draft
    n_extract = len(HF_TARGET_LAYER_IDS)
    w = {
        "fc": _linear(rng, s.n_embd, n_extract * sz.target.n_embd),
        "hidden_norm": _norm(rng, s.n_embd),
        "norm": _norm(rng, s.n_embd),
        "layers": [_layer(rng, s, qk_norm=True) for _ in range(s.n_layer)],
    }
    if v.checkpoint_own_embd:
        w["token_embd"] = rng.standard_normal((sz.n_vocab, s.n_embd)).astype(np.float32)
        w["output"] = _linear(rng, sz.n_vocab, s.n_embd)
    if v.checkpoint_log_snr:
        w["log_snr_fc1"] = _linear(rng, s.n_embd, names.LOG_SNR_N_FREQ)
        w["log_snr_fc1_b"] = (0.1 * rng.standard_normal(s.n_embd)).astype(np.float32)
        w["log_snr_fc2"] = _linear(rng, s.n_embd, s.n_embd)
        w["log_snr_fc2_b"] = (0.1 * rng.standard_normal(s.n_embd)).astype(np.float32)
    if v.checkpoint_dspark:
        w.update(_dspark_weights(rng, v, sz))
    return w


def _dspark_weights(rng: np.random.Generator, v: Variant, sz: Sizes) -> dict:
    """A random DSpark head set for variant `v` (HF orientation; `d2t` absolute ids), drawn from `rng`.

    The Markov bias `markov_w2 @ markov_w1[prev]` has a spread of about 1 (x markov_w2.scale), as
    the random drafter's logits do, so it moves the argmax of most rows.
    """
    s = sz.draft
    n_vocab_draft = sz.n_vocab // 2 if v.checkpoint_d2t else sz.n_vocab
    w = {
        "markov_w1": rng.standard_normal((sz.n_vocab, MARKOV_RANK)).astype(np.float32),
        "markov_w2": _linear(rng, n_vocab_draft, MARKOV_RANK),
    }
    if v.checkpoint_markov_scale:
        w["markov_w2_scale"] = np.array([MARKOV_W2_SCALE], dtype=np.float32)
    if v.checkpoint_conf_head:
        w["conf_proj"] = CONF_GAIN * _linear(rng, 1, s.n_embd + MARKOV_RANK)  # (1, n_embd + R)
        w["conf_proj_b"] = (0.1 * rng.standard_normal(1)).astype(np.float32)
    if v.checkpoint_d2t:
        w["d2t"] = np.sort(rng.choice(sz.n_vocab, n_vocab_draft, replace=False)).astype(np.int64)
        w["output"] = _linear(rng, n_vocab_draft, s.n_embd)  # the reduced head: one row per d2t entry
    return w
