"""featdiff.factory.training without llama.cpp: the packed training forward is the flow's drafter forward,
prompts are held out, training is deterministic given the seed, and the cache trains once."""

from __future__ import annotations

import numpy as np
import pytest

import torch

from featdiff.factory import fixtures, pairs  # noqa: E402
from featdiff.torchref.dflash.drafter import draft_block, inject  # noqa: E402
from featdiff.factory.training import TRAINED_SIZES, TrainConfig, cache, held_out_prompts, train_pair, trained_pair  # noqa: E402
from featdiff.factory.training.corpus import f32_cache, make_corpus, prompts  # noqa: E402
from featdiff.factory.training.objective import block_logits, packed_batch  # noqa: E402
from featdiff.factory.training.records import draft_record, target_record  # noqa: E402
from featdiff.factory.training.target import LOOKBACK, lookback_target  # noqa: E402

SEED = 0
TINY_RUN = TrainConfig(
    n_prompts=4, n_tokens=20, n_held_out=2, steps=2, dspark_steps=2, seqs_per_step=2, anchors_per_seq=4, threads=1
)
SAME_FORWARD_ATOL = 1e-4  # packed (one batch, masked) vs one block at a time: float32 summation order only


@pytest.fixture(scope="module")
def pair():
    """An untrained drafter on the lookback target, and a small corpus of that target."""
    target = target_record(lookback_target(np.random.default_rng(SEED), TRAINED_SIZES), TRAINED_SIZES, SEED)
    init = pairs.draft_weights(np.random.default_rng(1), pairs.VARIANTS["trained-log-snr"], TRAINED_SIZES)
    corpus = make_corpus(target, prompts(SEED, 3, TRAINED_SIZES), 24)
    return target, draft_record(init, TRAINED_SIZES, trainable=False), corpus


def test_lookback_target_continues_with_a_fixed_map_of_the_token_a_block_back(pair):
    _, _, corpus = pair
    seen: dict[int, int] = {}
    for seq, first in zip(corpus.tokens.tolist(), corpus.first_anchor.tolist()):
        for t in range(first + 1, len(seq)):
            assert seen.setdefault(seq[t - LOOKBACK], seq[t]) == seq[t]
    assert len(seen) > 20


@pytest.mark.parametrize("n_block", [3, pairs.BLOCK_SIZE])  # 3: anchor-first DSpark's default block
def test_packed_blocks_give_the_logits_of_one_block_at_a_time(pair, n_block):
    target, draft, corpus = pair
    anchors = torch.tensor([[11, 15], [12, 18], [11, 19]])
    batch = packed_batch(corpus, torch.arange(3), anchors, draft.mask_token_id, n_block)
    with torch.no_grad():
        packed = block_logits(draft, target, batch).reshape(3, 2, n_block, -1)
        for s, row in enumerate(anchors.tolist()):
            for k, a in enumerate(row):
                ctx = inject(draft, corpus.features[s, :a], torch.arange(a), f32_cache(draft.hparams))
                block = torch.tensor([int(corpus.tokens[s, a])] + [draft.mask_token_id] * (n_block - 1))
                one = draft_block(draft, target, block, torch.arange(a, a + n_block), ctx.cache).logits
                assert torch.allclose(packed[s, k], one, atol=SAME_FORWARD_ATOL), (s, a)


def test_held_out_prompts_are_not_training_prompts():
    corpus, held = set(prompts(SEED, 64, TRAINED_SIZES)), set(held_out_prompts(SEED, 16, TRAINED_SIZES))
    assert held and not corpus & held
    assert all(1 <= t < TRAINED_SIZES.mask_token_id for p in held for t in p)


@pytest.mark.slow  # trains twice: `make test` runs it, `make test-fast` leaves it out
def test_training_is_deterministic_given_the_seed():
    a, b = train_pair(3, config=TINY_RUN), train_pair(3, config=TINY_RUN)
    for name in cache.CHECKPOINTS:
        flat_a, flat_b = cache._flat(getattr(a, name)), cache._flat(getattr(b, name))
        assert flat_a.keys() == flat_b.keys()
        assert all(np.array_equal(flat_a[k], flat_b[k]) for k in flat_a), name
    assert "log_snr_fc1" in a.draft_log_snr and "log_snr_fc1" not in a.draft
    assert "markov_w1" in a.draft_dspark and "markov_w1" not in a.draft


def test_cache_trains_once_then_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATDIFF_CACHE", str(tmp_path))
    first = trained_pair(4, config=TINY_RUN)
    assert len(list((tmp_path / cache.CACHE_SUBDIR).glob("seed4-*/meta.json"))) == 1

    def _no_retraining(*args, **kwargs):
        raise AssertionError("trained again although the cache holds this key")

    monkeypatch.setattr(cache, "train_pair", _no_retraining)
    again = trained_pair(4, config=TINY_RUN)
    assert again.meta == first.meta
    assert np.array_equal(again.draft["fc"], first.draft["fc"])
    assert all(np.array_equal(x["attn_q"], y["attn_q"]) for x, y in zip(again.target["layers"], first.target["layers"]))


def test_trained_variants_write_both_formats_with_the_converter_convention(fixture_models):
    from featdiff.dump.model_info import model_info

    d = fixture_models("trained-log-snr")
    info = model_info(d / "draft.gguf")
    assert list(info.target_layers) == [i + 1 for i in pairs.HF_TARGET_LAYER_IDS]
    assert info.has_log_snr_tensors and info.block_size == pairs.BLOCK_SIZE
    config = (d / "draft-hf" / "config.json").read_text()
    assert '"target_layer_ids"' in config and '"log_snr_conditioning": true' in config
    assert len((d / fixtures.PROMPTS_FILE).read_text().splitlines()) == fixtures.HELD_OUT_PROMPTS
