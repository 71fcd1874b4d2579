"""Train the pair's drafters on the target's corpus: a plain DFlash drafter; a GIDD log-SNR
conditioned one, trained with the conditioning it runs with (its noise rows carry
`log_snr_embed`: anchor rows at max_log_snr, mask rows at min_log_snr, as the reference computes
it; no intermediate noise levels are sampled); and an anchor-first DSpark drafter (dspark.py).
Deterministic given the seed and the torch build (one rng stream per purpose, a fixed torch
thread count).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from featdiff.factory import pairs
from featdiff.factory.pairs import BLOCK_SIZE, Sizes
from featdiff.torchref.weights import Draft, DSpark, Target, present
from featdiff.factory.training import dspark
from featdiff.factory.training.corpus import Corpus, held_out_prompts, make_corpus, prompts
from featdiff.factory.training.objective import block_loss, mean_accepted_length, packed_batch
from featdiff.factory.training.records import (
    DSPARK_KEYS,
    draft_record,
    draft_weights_of,
    dspark_record,
    dspark_weights_of,
    parameters,
    target_record,
)
from featdiff.factory.training.target import lookback_target

log = logging.getLogger(__name__)

TRAINED_SIZES = pairs.Sizes(n_vocab=256)  # a small vocabulary: a short training sees every token often
STREAM_INIT, STREAM_STEPS, STREAM_DSPARK = 3, 4, 5  # rng streams per seed (corpus.py holds 1 and 2)
MARKOV_RANK = 16  # R of DSpark's Markov head: markov_w1 and markov_w2 are (n_vocab, R)
DSPARK_BLOCKS = tuple(range(2, BLOCK_SIZE + 1))  # block lengths DSpark trains on: any --spec-draft-n-max runs
LOG_SNR_INIT_GAIN = 4.0  # the log-SNR term starts about as large as a token embedding, so the drafter leans on it
CONF_LR_GAIN = 10.0  # the confidence head's bias travels to logit(accept rate) ~ 3 while AdamW moves it ~lr a step
PEAK_LR = "peak_lr"  # our key in an optimizer param group: the group's lr before the schedule
LR_WARMUP = 20  # steps of linear warm-up before the cosine decay
LOG_EVERY = 40  # steps between debug lines of the loss


@dataclass(frozen=True)
class TrainConfig:
    """How much corpus and training; the defaults take about 30 s on two CPU cores."""

    n_prompts: int = 64
    n_tokens: int = 48  # per corpus sequence: prompt + greedy continuation
    n_held_out: int = 16  # held-out prompts the accepted length is measured on
    steps: int = 160
    dspark_steps: int = 160
    seqs_per_step: int = 8
    anchors_per_seq: int = 16
    lr: float = 1e-2
    threads: int = 2  # torch intra-op threads: the machine is shared


DEFAULT_CONFIG = TrainConfig()


@dataclass(frozen=True)
class TrainedPair:
    """The target and its three trained drafters (fixtures layout), and how training went."""

    target: dict
    draft: dict
    draft_log_snr: dict
    draft_dspark: dict  # anchor-first DSpark: a DFlash body plus DSPARK_KEYS (Markov and confidence heads)
    meta: dict  # train_seconds (dspark_train_seconds of them), each drafter's held-out mean accepted
    #             length (reference, offline), and the DSpark confidence head's held-out ranking (AUC)


def train_pair(seed: int, sizes: Sizes = TRAINED_SIZES, config: TrainConfig = DEFAULT_CONFIG) -> TrainedPair:
    """The target of `seed`, its corpus, and the three drafters trained on it."""
    start = time.perf_counter()
    with _torch_threads(config.threads):
        target_w, inits = _target_and_inits(seed, sizes)
        target = target_record(target_w, sizes, seed)
        corpus = make_corpus(target, prompts(seed, config.n_prompts, sizes), config.n_tokens)
        held_out = make_corpus(target, held_out_prompts(seed, config.n_held_out, sizes), config.n_tokens)
        rng = np.random.default_rng((seed, STREAM_STEPS))
        drafts = [train_drafter(target, corpus, w, sizes, config, rng) for w in inits]
        accepted = [mean_accepted_length(draft_record(w, sizes, trainable=False), target, held_out) for w in drafts]
        draft_dspark, dspark_seconds = _timed_dspark(seed, target, corpus, sizes, config)
        dspark_accepted, auc = _dspark_held_out(draft_dspark, target, held_out, sizes)
    meta = {
        "train_seconds": round(time.perf_counter() - start, 1),
        "dspark_train_seconds": round(dspark_seconds, 1),
        "held_out_mean_accepted_length": {
            "draft": accepted[0],
            "draft_log_snr": accepted[1],
            "draft_dspark": dspark_accepted,
        },
        "held_out_dspark_confidence_auc": auc,
    }
    return TrainedPair(target=target_w, draft=drafts[0], draft_log_snr=drafts[1], draft_dspark=draft_dspark, meta=meta)


def train_drafter(
    target: Target, corpus: Corpus, init: dict, sizes: Sizes, config: TrainConfig, rng: np.random.Generator
) -> dict:
    """A DFlash drafter trained from `init` (fixtures layout) on the corpus; its weights, same layout."""
    draft = draft_record(init, sizes, trainable=True)
    _fit([(parameters(draft), config.lr)], config.steps, _dflash_losses(draft, target, corpus, config, sizes, rng))
    return draft_weights_of(draft)


def train_dspark(
    target: Target, corpus: Corpus, init: dict, sizes: Sizes, config: TrainConfig, rng: np.random.Generator
) -> dict:
    """An anchor-first DSpark drafter trained from `init` (a fixtures drafter plus DSPARK_KEYS);
    its weights, same layout."""
    draft, dsp = draft_record(init, sizes, trainable=True), dspark_record(init, trainable=True)
    conf = [present(dsp.conf_w, "conf_proj"), present(dsp.conf_b, "conf_proj_b")]
    groups = [(parameters(draft) + [dsp.markov_w1, dsp.markov_w2], config.lr), (conf, config.lr * CONF_LR_GAIN)]
    _fit(groups, config.dspark_steps, _dspark_losses(draft, dsp, target, corpus, config, sizes, rng))
    return dspark_weights_of(draft, dsp)


def _timed_dspark(seed: int, target: Target, corpus: Corpus, sizes: Sizes, config: TrainConfig) -> tuple[dict, float]:
    """The DSpark drafter of `seed` (its own rng stream), and the seconds it took."""
    start = time.perf_counter()
    rng = np.random.default_rng((seed, STREAM_DSPARK))
    w = train_dspark(target, corpus, _dspark_init(rng, sizes), sizes, config, rng)
    return w, time.perf_counter() - start


def _dspark_held_out(w: dict, target: Target, held_out: Corpus, sizes: Sizes) -> tuple[float, float | None]:
    """A DSpark drafter's held-out mean accepted length (N_DRAFT drafts), and how its confidence
    ranks right drafts above wrong ones with BLOCK_SIZE drafts: there the last row (the permuted
    anchor, which no context row holds) is mostly wrong, so the head has wrong drafts to rank."""
    body, heads = draft_record(w, sizes, trainable=False), dspark_record(w, trainable=False)
    accepted = dspark.mean_accepted_length(dspark.draft_held_out(body, heads, target, held_out))
    return accepted, dspark.confidence_auc(dspark.draft_held_out(body, heads, target, held_out, n_draft=BLOCK_SIZE))


def _dflash_losses(
    draft: Draft, target: Target, corpus: Corpus, config: TrainConfig, sizes: Sizes, rng: np.random.Generator
) -> Iterator[torch.Tensor]:
    """The DFlash loss of each step's batch: blocks of BLOCK_SIZE rows, labels to the block's end."""
    while True:
        seqs, anchors = _sample_anchors(corpus, config, rng, BLOCK_SIZE - 1)
        yield block_loss(draft, target, packed_batch(corpus, seqs, anchors, sizes.mask_token_id))


def _dspark_losses(
    draft: Draft,
    dsp: DSpark,
    target: Target,
    corpus: Corpus,
    config: TrainConfig,
    sizes: Sizes,
    rng: np.random.Generator,
) -> Iterator[torch.Tensor]:
    """The DSpark loss of each step's batch: anchor-first blocks of a length drawn from
    DSPARK_BLOCKS, labels one past the block's end."""
    while True:
        n_block = int(rng.choice(DSPARK_BLOCKS))
        seqs, anchors = _sample_anchors(corpus, config, rng, n_block)
        batch = dspark.anchor_first_batch(corpus, seqs, anchors, sizes.mask_token_id, n_block)
        yield dspark.dspark_loss(draft, dsp, target, batch)


def _fit(groups: list[tuple[list[torch.Tensor], float]], steps: int, losses: Iterable[torch.Tensor]) -> None:
    """AdamW on each group of tensors at its peak learning rate, for `steps` losses (each
    computed after the previous step)."""
    opt = torch.optim.AdamW([{"params": params, "lr": lr, PEAK_LR: lr} for params, lr in groups], weight_decay=0.0)
    for step, loss in zip(range(steps), losses):
        for group in opt.param_groups:
            group["lr"] = group[PEAK_LR] * _schedule(step, steps)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % LOG_EVERY == 0 or step == steps - 1:
            log.debug("step %d: loss %.4f", step, loss.item())


def _target_and_inits(seed: int, sizes: Sizes) -> tuple[dict, tuple[dict, dict]]:
    """The target of `seed`, and the two drafters' initial weights (the fixtures' random init)."""
    target_w = lookback_target(np.random.default_rng(seed), sizes)
    rng = np.random.default_rng((seed, STREAM_INIT))
    plain = pairs.draft_weights(rng, pairs.VARIANTS["trained"], sizes)
    conditioned = pairs.draft_weights(rng, pairs.VARIANTS["trained-log-snr"], sizes)
    for k in ("log_snr_fc2", "log_snr_fc2_b"):
        conditioned[k] = conditioned[k] * LOG_SNR_INIT_GAIN
    return target_w, (plain, conditioned)


def _dspark_init(rng: np.random.Generator, sizes: Sizes) -> dict:
    """A DSpark drafter's initial weights: the fixtures' random drafter, a random markov_w1 and
    zero markov_w2 (the Markov bias starts at 0), and a confidence head at 0.5."""
    w = pairs.draft_weights(rng, pairs.VARIANTS["trained"], sizes)
    w1 = rng.standard_normal((sizes.n_vocab, MARKOV_RANK)).astype(np.float32)
    zeros = (np.zeros((sizes.n_vocab, MARKOV_RANK)), np.zeros((1, sizes.draft.n_embd + MARKOV_RANK)), np.zeros(1))
    w.update(zip(DSPARK_KEYS, (w1, *(a.astype(np.float32) for a in zeros))))
    return w


def _sample_anchors(
    corpus: Corpus, config: TrainConfig, rng: np.random.Generator, n_after: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`seqs_per_step` sequences `(n_seq,)` and `anchors_per_seq` distinct anchors in each one's
    continuation `(n_seq, n_anchor)`, each with `n_after` tokens after it (its block's labels)."""
    n_seq, n_tokens = corpus.tokens.shape
    seqs = rng.choice(n_seq, config.seqs_per_step, replace=False)
    last = n_tokens - 1 - n_after
    anchors = [
        rng.choice(np.arange(int(corpus.first_anchor[s]), last + 1), config.anchors_per_seq, replace=False)
        for s in seqs
    ]
    return torch.from_numpy(seqs), torch.from_numpy(np.stack(anchors))


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
