"""featdiff.factory.training.eagle3: the batched training forward is the reference's EAGLE3 decoder (step
one over the sequence, each recycled TTT step over the draft cache a draft step sees), its corpus
is the target's greedy one, training lowers the loss, and the trained drafter accepts clearly more
than an untrained one on held-out prompts: in the reference, on the pinned converter's GGUFs of
the `trained-eagle3` fixture pair, and on the real llama.cpp."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from featdiff.factory.fixtures import PROMPTS_FILE
from featdiff.factory.eagle3 import GGUF_FROM_HF, TARGET_LAYERS
from featdiff.torchref.attention import empty_cache, truncated
from featdiff.torchref.eagle3.graph import decode, encode
from featdiff.torchref.numerics import Numerics
from featdiff.factory.training import TRAINED_SIZES, held_out_prompts
from featdiff.factory.training.corpus import greedy_continuation, prompts
from featdiff.factory.training.eagle3 import (
    DEFAULT_CONFIG,
    DRAFT_MAX,
    T2D,
    draft_record,
    eagle3_layers,
    eagle3_loss,
    forward_steps,
    init_weights,
    make_corpus,
    target_weights,
    train_drafter,
    trained_eagle3,
    weights_of,
)
from featdiff.factory.training.records import target_record

SEED = 0  # the trained fixture variants' seed
N_SEQ, N_TOKENS = 4, 24  # the small corpus of the fast tests
N_STEPS = DRAFT_MAX  # step one and two recycled steps, as training runs them
SAME_AS_DECODE_ATOL = 1e-5  # batched steps vs decode one eval at a time: float32 summation order
MIN_ACCEPTED = 1.5  # mean accepted drafts of DRAFT_MAX a held-out round, trained (seed 0: 2.8)
MAX_UNTRAINED_ACCEPTED = 0.5  # ... untrained: a random drafter (seed 0: 0.02)
SHORT_TRAINING = replace(DEFAULT_CONFIG, steps=40, seqs_per_step=N_SEQ)
LOSS_DROP = 0.7  # 40 steps on the small corpus take the loss below this share of the first one
CAPTURE_ROUNDS, CAPTURED_PROMPTS = 4, 4  # the llama.cpp runs: rounds of the first prompts of prompts.txt
F16_KV = Numerics(torch.float32, torch.device("cpu"), "f16")  # the reference as llama.cpp runs: an f16 KV cache
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def small():
    """(target, small greedy corpus, untrained drafter) of SEED."""
    target = target_record(target_weights(SEED), TRAINED_SIZES, SEED)
    corpus = make_corpus(target, prompts(SEED, N_SEQ, TRAINED_SIZES), N_TOKENS, eagle3_layers(TRAINED_SIZES))
    return target, corpus, draft_record(init_weights(SEED, TRAINED_SIZES), TRAINED_SIZES, eagle3_layers(TRAINED_SIZES))


def test_layers_are_the_fixtures_and_weights_are_the_checkpoint_layout(small):
    *_, draft = small
    assert eagle3_layers(TRAINED_SIZES) == TARGET_LAYERS
    w = init_weights(SEED, TRAINED_SIZES)
    assert set(w) - {T2D} == set(GGUF_FROM_HF) - {"input_norm.weight", "embed_tokens.weight"}
    assert not w["d2t"].any() and w[T2D].all() and w["lm_head.weight"].shape[0] == TRAINED_SIZES.n_vocab
    back = weights_of(draft)
    assert back.keys() == w.keys() and all(np.array_equal(back[k], w[k]) for k in w)
    assert not np.array_equal(w["fc.weight"], init_weights(SEED + 1, TRAINED_SIZES)["fc.weight"])


def test_the_corpus_is_the_targets_greedy_continuation_and_its_layer_inputs(small):
    target, corpus, draft = small
    for i, p in enumerate(prompts(SEED, N_SEQ, TRAINED_SIZES)):
        assert tuple(corpus.tokens[i].tolist()) == greedy_continuation(target, p, N_TOKENS)
        assert int(corpus.first_anchor[i]) == len(p) - 1
    from featdiff.torchref.eagle3.flow import features
    from featdiff.torchref.target import forward_target
    from featdiff.factory.training.corpus import f32_cache

    tp = forward_target(target, corpus.tokens[0], torch.arange(N_TOKENS), f32_cache(target.hparams), False)
    assert torch.equal(corpus.features[0], features(tp, draft))  # the flow's feature rows of the sequence


def _step_one_by_decode(draft, target, corpus, s: int, n_rows: int):
    """decode over sequence `s`'s rows (token t+1, g_t) at positions 0 .. n_rows-1, as process() runs them."""
    g, _ = encode(draft, corpus.features[s, :n_rows])
    hp = draft.hparams
    cache = empty_cache(1, hp.n_head_kv, hp.n_embd_head, "f32", CPU)
    return decode(draft, target, corpus.tokens[s, 1 : 1 + n_rows], g, torch.arange(n_rows), cache)


def test_step_one_is_decode_over_each_sequence(small):
    target, corpus, draft = small
    steps, n_rows = forward_steps(draft, target, corpus.tokens, corpus.features, N_STEPS), N_TOKENS - 1 - N_STEPS
    for s in range(N_SEQ):
        dp = _step_one_by_decode(draft, target, corpus, s, n_rows)
        rows = slice(s * n_rows, (s + 1) * n_rows)
        assert torch.allclose(steps[0].logits[rows], dp.logits, atol=SAME_AS_DECODE_ATOL)
        assert torch.allclose(steps[0].prenorm[rows], dp.prenorm, atol=SAME_AS_DECODE_ATOL)


def test_each_recycled_step_is_a_draft_step_of_decode(small):
    """Row t of step k: decode of (token t+k, step k-1's prenorm) at position t+k-1 over the draft
    cache a draft step sees: step one's rows up to t, then the steps before it (eagle3_flow._draft)."""
    target, corpus, draft = small
    steps, n_rows = forward_steps(draft, target, corpus.tokens, corpus.features, N_STEPS), N_TOKENS - 1 - N_STEPS
    for s in (0, N_SEQ - 1):
        step_one = _step_one_by_decode(draft, target, corpus, s, n_rows).cache
        for t in range(n_rows):
            cache, g = truncated(step_one, t + 1), steps[0].prenorm[s * n_rows + t][None, :]
            for k in range(1, N_STEPS):
                token, position = corpus.tokens[s, t + k + 1 : t + k + 2], torch.tensor([t + k])
                dp = decode(draft, target, token, g, position, cache)
                assert torch.allclose(steps[k].logits[s * n_rows + t], dp.logits[0], atol=SAME_AS_DECODE_ATOL)
                cache, g = dp.cache, dp.prenorm


def test_training_lowers_the_loss(small):
    target, corpus, _ = small
    init = init_weights(SEED, TRAINED_SIZES)
    trained = train_drafter(target, corpus, init, TRAINED_SIZES, SHORT_TRAINING, np.random.default_rng(0))
    layers, every = eagle3_layers(TRAINED_SIZES), torch.arange(N_SEQ)
    with torch.no_grad():
        before, after = (
            float(eagle3_loss(draft_record(w, TRAINED_SIZES, layers), target, corpus, every, N_STEPS, 0.8))
            for w in (init, trained)
        )
    assert after < LOSS_DROP * before, (before, after)


# --- the trained drafter (trained once per machine, then cached) -----------------------------------


@pytest.fixture(scope="module")
def trained():
    return trained_eagle3(SEED)


@pytest.mark.slow
def test_trained_drafter_accepts_clearly_more_than_an_untrained_one(trained):
    meta = trained.meta
    assert meta["held_out_mean_accepted"] >= MIN_ACCEPTED, meta
    assert meta["untrained_held_out_mean_accepted"] <= MAX_UNTRAINED_ACCEPTED, meta
    assert meta["target_layers"] == list(TARGET_LAYERS)
    assert trained.draft.keys() == init_weights(SEED, TRAINED_SIZES).keys()


@pytest.mark.slow
def test_its_target_is_the_trained_pairs(trained):
    from featdiff.factory.training import trained_pair

    target = trained_pair(SEED).target
    assert all(np.array_equal(trained.target[k], target[k]) for k in ("token_embd", "output", "output_norm"))
    assert all(
        np.array_equal(a[k], b[k]) for a, b in zip(trained.target["layers"], target["layers"], strict=True) for k in a
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The `trained-eagle3` fixture pair: the pinned converter's GGUFs of its HF checkpoints."""
    from featdiff.factory.eagle3 import write_eagle3_fixture

    return write_eagle3_fixture(tmp_path_factory.mktemp("trained-eagle3"), "trained-eagle3", SEED)


def _gguf_pair(d: Path):
    from featdiff.torchref.eagle3.graph import eagle3_from_gguf
    from featdiff.torchref.load import load_target

    return load_target(d / "target.gguf", torch.float32, CPU), eagle3_from_gguf(d / "draft.gguf", torch.float32, CPU)


@pytest.mark.slow
def test_the_converted_pair_accepts_what_training_measured(trained, converted):
    from featdiff.factory.training.eagle3 import held_out_accepted

    target, draft = _gguf_pair(converted)
    assert draft.target_layers == TARGET_LAYERS and draft.hparams.rope_type == "normal"
    chosen = held_out_prompts(SEED, DEFAULT_CONFIG.n_held_out, TRAINED_SIZES)
    accepted = held_out_accepted(target, draft, chosen, DEFAULT_CONFIG.held_out_rounds)
    assert accepted == trained.meta["held_out_mean_accepted"]


@pytest.mark.slow
def test_llama_cpp_accepts_what_the_reference_accepts(converted, tmp_path):
    """The in-process driver on the converted pair, round by round, against the reference's flow
    on the same GGUFs (f16 KV cache, as the run): the same drafts, the same accepted counts."""
    from featdiff.dump.reader import read_dump
    from featdiff.driver.capture import capture
    from featdiff.verdict.probe import read_prompts
    from featdiff.torchref.eagle3.flow import run_flow

    target, draft = _gguf_pair(converted)
    run_accepted, ref_accepted = [], []
    for i, p in enumerate(read_prompts(converted / PROMPTS_FILE)[:CAPTURED_PROMPTS]):
        tokens = tuple(p.tokens)
        out = capture(
            converted / "target.gguf",
            converted / "draft.gguf",
            tmp_path / f"run{i}.npz",
            tokens=",".join(map(str, tokens)),
            rounds=CAPTURE_ROUNDS,
        )
        with read_dump(out) as dump:
            run_rounds = dump.manifest.rounds
        ref_rounds = run_flow(target, draft, tokens, CAPTURE_ROUNDS, F16_KV, draft_max=DRAFT_MAX).rounds
        assert [(r.drafts, r.accepted) for r in run_rounds] == [(r.drafts, r.accepted) for r in ref_rounds]
        run_accepted += [r.accepted for r in run_rounds]
        ref_accepted += [r.accepted for r in ref_rounds]
    assert np.mean(run_accepted) >= MIN_ACCEPTED, run_accepted
