"""featdiff.factory.training.mtp: the head it trains is the checkpoint's as the reference loads it, its
corpus is the target's greedy text with the hidden the flow hands the head, its forward is the
flow's draft steps, training lowers the loss, and the trained head accepts clearly more than the
untrained `mtp` head on held-out prompts: in the reference, on the pinned converter's GGUF of the
`trained-mtp` fixture, and on the real llama.cpp."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from featdiff.core import names
from featdiff.factory.fixtures import PROMPTS_FILE
from featdiff.factory.mtp import FAMILY, GGUF_FROM_HF, add_mtp_head, faint_trunk
from featdiff.factory.hf_families import FAMILIES
from featdiff.factory.hf_targets import write_hf_target
from featdiff.factory.pairs import TINY
from featdiff.core.phases import Phase
from featdiff.torchref.load import load_target
from featdiff.torchref.mtp.head import mtp_from_gguf
from featdiff.torchref.mtp.hf import mtp_from_hf
from featdiff.torchref.mtp.flow import run_flow, target_hidden
from featdiff.torchref.numerics import Numerics
from featdiff.torchref.target import forward_target
from featdiff.factory.training import held_out_prompts
from featdiff.factory.training.corpus import f32_cache, greedy_continuation, prompts
from featdiff.factory.training.mtp import (
    DEFAULT_CONFIG,
    DRAFT_MAX,
    F32_KV,
    as_tensors,
    checkpoint_head,
    head_with,
    held_out_accepted,
    make_corpus,
    mtp_loss,
    recycled_steps,
    step_one,
    train_head,
    trained_mtp,
)

SEED = 0  # the trained fixture variant's seed
N_SEQ, N_TOKENS = 4, 24  # the small corpus of the fast tests
N_STEPS = DRAFT_MAX  # step one and two recycled steps, as training runs them
SAME_AS_FLOW_ATOL = 1e-4  # training's decodes vs the flow's: the target's hidden over the whole sequence vs its prefill
MIN_ACCEPTED = 1.5  # mean accepted drafts of DRAFT_MAX a held-out round, trained (seed 0: 1.95 on prompts.txt)
MAX_UNTRAINED_ACCEPTED = 0.5  # ... the untrained `mtp` head (seed 0: 0.0)
SHORT_TRAINING = replace(DEFAULT_CONFIG, steps=40, seqs_per_step=N_SEQ)
LOSS_DROP = 0.7  # 40 steps on the small corpus take the loss below this share of the first one
HELD_OUT_ROUNDS = 8  # rounds of each prompt of the fixture's prompts.txt
CAPTURE_ROUNDS, CAPTURED_PROMPTS = 4, 4  # the llama.cpp runs: rounds of the first prompts of prompts.txt
F16_KV = Numerics(torch.float32, torch.device("cpu"), "f16")  # the reference as llama.cpp runs: an f16 KV cache
F32, CPU = torch.float32, torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The `trained-mtp` checkpoint before training (write_mtp_fixture's first steps, no converter):
    the faint-trunk target of SEED with its seeded head."""
    hf = write_hf_target(tmp_path_factory.mktemp("trained-mtp-init") / "target-hf", FAMILIES[FAMILY], SEED)
    faint_trunk(hf)
    add_mtp_head(hf, SEED)
    return hf


@pytest.fixture(scope="module")
def small(checkpoint):
    """(target, head as loaded, small greedy corpus) of the checkpoint."""
    target, base = load_target(checkpoint, F32, CPU), mtp_from_hf(checkpoint, F32, CPU)
    return target, base, make_corpus(target, checkpoint, prompts(SEED, N_SEQ, TINY), N_TOKENS)


def test_the_trained_tensors_are_the_head_the_reference_loads(checkpoint, small):
    _, base, _ = small
    w = checkpoint_head(checkpoint)
    assert set(w) == set(GGUF_FROM_HF)  # every tensor the converter writes of the head, and only those
    head = head_with(base, as_tensors(w))
    for field in ("eh_proj", "enorm", "hnorm", "head_norm"):
        assert torch.equal(getattr(head, field), getattr(base, field)), field
    assert all(torch.equal(head.block[k], base.block[k]) for k in base.block)


def test_the_corpus_is_the_targets_greedy_text_and_the_hidden_the_flow_hands(small):
    target, _, corpus = small
    for i, p in enumerate(prompts(SEED, N_SEQ, TINY)):
        assert tuple(corpus.tokens[i].tolist()) == greedy_continuation(target, p, N_TOKENS)
        assert int(corpus.first_anchor[i]) == len(p) - 1
    tp = forward_target(target, corpus.tokens[0], torch.arange(N_TOKENS), f32_cache(target.hparams), True)
    assert torch.equal(corpus.features[0], target_hidden(target, tp, is_prenorm=False).handed)


def test_step_one_and_the_recycled_steps_are_the_flows_draft_steps(small):
    """Anchor q of a sequence: the flow on the prompt tokens[:q+1] drafts its first round from
    (token q, hidden q-1) at position q, then its own drafts; training's step one row q and the
    recycled steps of anchor q, fed the same drafts, are those decodes."""
    target, head, corpus = small
    for s in (0, N_SEQ - 1):
        q = int(corpus.first_anchor[s]) + 2
        with torch.no_grad():
            flow = run_flow(target, head, tuple(corpus.tokens[s, : q + 1].tolist()), 1, F32_KV, draft_max=DRAFT_MAX)
        drafts = flow.rounds[0].drafts
        steps = [dict((r.name, r.array) for r in e.records) for e in flow.evals if e.eval.phase == Phase.DRAFT]
        assert len(drafts) == len(steps) == N_STEPS
        tokens = corpus.tokens[s].clone()
        tokens[q + 1 : q + N_STEPS] = torch.tensor(drafts[:-1])  # what the flow fed its steps 2 and 3
        one = step_one(head, tokens, corpus.features[s])
        ours = [one.logits[q : q + 1], *recycled_steps(head, one, tokens, q, N_STEPS)]
        for k, (logits, step) in enumerate(zip(ours, steps, strict=True)):
            assert torch.allclose(logits, step[names.RESULT_OUTPUT], atol=SAME_AS_FLOW_ATOL), (s, k)


def test_training_lowers_the_loss(checkpoint, small):
    _, base, corpus = small
    init = checkpoint_head(checkpoint)
    trained = train_head(base, corpus, init, SHORT_TRAINING, np.random.default_rng(0))
    every, anchors = torch.arange(N_SEQ), np.tile(corpus.first_anchor.numpy()[:, None], (1, 2))  # (N_SEQ, 2)
    with torch.no_grad():
        before, after = (
            float(mtp_loss(head_with(base, as_tensors(w)), corpus, every, anchors, N_STEPS, 0.8))
            for w in (init, trained)
        )
    assert after < LOSS_DROP * before, (before, after)


# --- the trained head (trained once per machine, then cached) --------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The `trained-mtp` fixture: the pinned converter's target.gguf with the trained head inside."""
    from featdiff.factory.mtp import write_mtp_fixture

    return write_mtp_fixture(tmp_path_factory.mktemp("trained-mtp"), "trained-mtp", SEED)


def _accepted_per_round(target, head, chosen: tuple[tuple[int, ...], ...]) -> float:
    """Mean accepted drafts per round of the reference's flow, HELD_OUT_ROUNDS rounds of each prompt."""
    with torch.no_grad():
        flows = [run_flow(target, head, p, HELD_OUT_ROUNDS, F32_KV, draft_max=DRAFT_MAX) for p in chosen]
    return float(np.mean([r.accepted for f in flows for r in f.rounds]))


@pytest.mark.slow
def test_trained_head_accepts_clearly_more_than_the_untrained_mtp_head(converted, mtp_pairs):
    """On the fixture's held-out prompts (never trained on), the GGUF's trained head against the
    `mtp` fixture's seeded head, on the trained fixture's target."""
    from featdiff.verdict.probe import read_prompts

    target = load_target(converted / "target-hf", F32, CPU)
    chosen = tuple(tuple(p.tokens) for p in read_prompts(converted / PROMPTS_FILE))
    trained = _accepted_per_round(target, mtp_from_gguf(converted / "target.gguf", F32, CPU), chosen)
    untrained = _accepted_per_round(target, mtp_from_hf(mtp_pairs("mtp") / "target-hf", F32, CPU), chosen)
    assert trained >= MIN_ACCEPTED and untrained <= MAX_UNTRAINED_ACCEPTED, (trained, untrained)


@pytest.mark.slow
def test_the_converted_head_accepts_what_training_measured(checkpoint, converted):
    meta = trained_mtp(checkpoint, SEED).meta  # the fixture's training, from the cache
    assert meta["held_out_mean_accepted"] >= MIN_ACCEPTED, meta
    assert meta["untrained_held_out_mean_accepted"] <= MAX_UNTRAINED_ACCEPTED, meta
    target = load_target(converted / "target-hf", F32, CPU)
    chosen = held_out_prompts(SEED, DEFAULT_CONFIG.n_held_out, TINY)
    accepted = held_out_accepted(
        target, mtp_from_gguf(converted / "target.gguf", F32, CPU), chosen, DEFAULT_CONFIG.held_out_rounds
    )
    assert accepted == meta["held_out_mean_accepted"]


@pytest.mark.slow
def test_llama_cpp_accepts_what_the_reference_accepts(converted, tmp_path):
    """The in-process MTP driver on target.gguf (the head inside it), round by round, against the
    reference's flow on the same head and the target's checkpoint (f16 KV cache, as the run)."""
    from featdiff.dump.reader import read_dump
    from featdiff.driver.capture import capture
    from featdiff.verdict.probe import read_prompts

    target = load_target(converted / "target-hf", F32, CPU)
    head = mtp_from_gguf(converted / "target.gguf", F32, CPU)
    run_accepted = []
    for i, p in enumerate(read_prompts(converted / PROMPTS_FILE)[:CAPTURED_PROMPTS]):
        tokens = tuple(p.tokens)
        out = capture(
            converted / "target.gguf",
            converted / "target.gguf",
            tmp_path / f"run{i}.npz",
            tokens=",".join(map(str, tokens)),
            rounds=CAPTURE_ROUNDS,
            draft_max=DRAFT_MAX,
        )
        with read_dump(out) as dump:
            run_rounds = dump.manifest.rounds
        with torch.no_grad():
            ref_rounds = run_flow(target, head, tokens, CAPTURE_ROUNDS, F16_KV, draft_max=DRAFT_MAX).rounds
        assert [(r.drafts, r.accepted) for r in run_rounds] == [(r.drafts, r.accepted) for r in ref_rounds]
        run_accepted += [r.accepted for r in run_rounds]
    assert np.mean(run_accepted) >= MIN_ACCEPTED, run_accepted
