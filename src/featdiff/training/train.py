"""Train the pair's two drafters on the target's corpus: a plain DFlash drafter, and a GIDD
log-SNR conditioned one, trained with the conditioning it runs with (its noise rows carry
`log_snr_embed`: anchor rows at max_log_snr, mask rows at min_log_snr, as the reference computes
it; no intermediate noise levels are sampled). Deterministic given the seed and the torch build
(one rng stream per purpose, a fixed torch thread count).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from featdiff import fixtures
from featdiff.fixtures import BLOCK_SIZE, Sizes
from featdiff.reference.weights import Target
from featdiff.training.corpus import Corpus, held_out_prompts, make_corpus, prompts
from featdiff.training.objective import Batch, block_loss, mean_accepted_length, packed_batch
from featdiff.training.records import draft_record, draft_weights_of, parameters, target_record
from featdiff.training.target import lookback_target

log = logging.getLogger(__name__)

TRAINED_SIZES = fixtures.Sizes(n_vocab=256)  # a small vocabulary: a short training sees every token often
STREAM_INIT, STREAM_STEPS = 3, 4  # rng streams per seed (corpus.py holds 1 and 2)
LOG_SNR_INIT_GAIN = 4.0  # the log-SNR term starts about as large as a token embedding, so the drafter leans on it
LR_WARMUP = 20           # steps of linear warm-up before the cosine decay
LOG_EVERY = 40           # steps between debug lines of the loss


@dataclass(frozen=True)
class TrainConfig:
    """How much corpus and training; the defaults take about 20 s on two CPU cores."""

    n_prompts: int = 64
    n_tokens: int = 48        # per corpus sequence: prompt + greedy continuation
    n_held_out: int = 16      # held-out prompts the accepted length is measured on
    steps: int = 160
    seqs_per_step: int = 8
    anchors_per_seq: int = 16
    lr: float = 1e-2
    threads: int = 2          # torch intra-op threads: the machine is shared


DEFAULT_CONFIG = TrainConfig()


@dataclass(frozen=True)
class TrainedPair:
    """The target and its two trained drafters (fixtures layout), and how training went."""

    target: dict
    draft: dict
    draft_log_snr: dict
    meta: dict  # train_seconds, and each drafter's held-out mean accepted length (reference, offline)


def train_pair(seed: int, sizes: Sizes = TRAINED_SIZES, config: TrainConfig = DEFAULT_CONFIG) -> TrainedPair:
    """The target of `seed`, its corpus, and both drafters trained on it."""
    start = time.perf_counter()
    with _torch_threads(config.threads):
        target_w, inits = _target_and_inits(seed, sizes)
        target = target_record(target_w, sizes, seed)
        corpus = make_corpus(target, prompts(seed, config.n_prompts, sizes), config.n_tokens)
        held_out = make_corpus(target, held_out_prompts(seed, config.n_held_out, sizes), config.n_tokens)
        rng = np.random.default_rng((seed, STREAM_STEPS))
        drafts = [train_drafter(target, corpus, w, sizes, config, rng) for w in inits]
        accepted = [mean_accepted_length(draft_record(w, sizes, trainable=False), target, held_out) for w in drafts]
    meta = {"train_seconds": round(time.perf_counter() - start, 1),
            "held_out_mean_accepted_length": {"draft": accepted[0], "draft_log_snr": accepted[1]}}
    return TrainedPair(target=target_w, draft=drafts[0], draft_log_snr=drafts[1], meta=meta)


def train_drafter(target: Target, corpus: Corpus, init: dict, sizes: Sizes, config: TrainConfig,
                  rng: np.random.Generator) -> dict:
    """A drafter trained from `init` (fixtures layout) on the corpus; its weights, same layout."""
    draft = draft_record(init, sizes, trainable=True)
    opt = torch.optim.AdamW(parameters(draft), lr=config.lr, weight_decay=0.0)
    for step in range(config.steps):
        for group in opt.param_groups:
            group["lr"] = config.lr * _schedule(step, config.steps)
        loss = block_loss(draft, target, _sample_batch(corpus, config, sizes, rng))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % LOG_EVERY == 0 or step == config.steps - 1:
            log.debug("step %d: loss %.4f", step, loss.item())
    return draft_weights_of(draft)


def _target_and_inits(seed: int, sizes: Sizes) -> tuple[dict, tuple[dict, dict]]:
    """The target of `seed`, and the two drafters' initial weights (the fixtures' random init)."""
    target_w = lookback_target(np.random.default_rng(seed), sizes)
    rng = np.random.default_rng((seed, STREAM_INIT))
    plain = fixtures.draft_weights(rng, fixtures.VARIANTS["trained"], sizes)
    conditioned = fixtures.draft_weights(rng, fixtures.VARIANTS["trained-log-snr"], sizes)
    for k in ("log_snr_fc2", "log_snr_fc2_b"):
        conditioned[k] = conditioned[k] * LOG_SNR_INIT_GAIN
    return target_w, (plain, conditioned)


def _sample_batch(corpus: Corpus, config: TrainConfig, sizes: Sizes, rng: np.random.Generator) -> Batch:
    """`seqs_per_step` sequences, `anchors_per_seq` distinct anchors each, in their continuation."""
    n_seq, n_tokens = corpus.tokens.shape
    seqs = rng.choice(n_seq, config.seqs_per_step, replace=False)
    last = n_tokens - BLOCK_SIZE  # the last anchor whose block ends inside the sequence
    anchors = [rng.choice(np.arange(int(corpus.first_anchor[s]), last + 1), config.anchors_per_seq, replace=False)
               for s in seqs]
    return packed_batch(corpus, torch.from_numpy(seqs), torch.from_numpy(np.stack(anchors)), sizes.mask_token_id)


def _schedule(step: int, steps: int) -> float:
    """Learning-rate factor: linear warm-up, then cosine decay to zero."""
    return min(1.0, (step + 1) / LR_WARMUP) * 0.5 * (1.0 + math.cos(math.pi * step / steps))


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count inside the block; the process's own count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
