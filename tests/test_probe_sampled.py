"""The accept probe of a sampled run (issue 45): the reference's accepted length is what the run's
sampler would accept on average where the reference target verifies the reference's drafts
(llama.cpp keeps drafts while the target's sample equals them), on the real fixture target."""

from __future__ import annotations

from dataclasses import replace

import pytest

from featdiff.dump.sampling import Sampler
from featdiff.verdict.probe import AcceptStats, Probe, PromptProbe, RoundPair, expected_ref_accepted
from featdiff.verdict.result import judge_accept

PROMPT = (1, 17, 42, 99, 7, 3)
N_DRAFTS = 3


@pytest.fixture(scope="module")
def target(fixture_models):
    from featdiff.torchref.dflash.run import numerics_from_options
    from featdiff.torchref.load import load_target

    numerics = numerics_from_options("float32", "cpu", "f16")
    return load_target(fixture_models("clean") / "target.gguf", numerics.dtype, numerics.device), numerics


def test_a_greedy_sampler_expects_the_argmax_drafts_accepted_and_temperature_lowers_it(target):
    model, numerics = target
    import torch

    from featdiff.torchref.attention import empty_cache
    from featdiff.torchref.target import forward_target

    hp = model.hparams
    drafts: tuple[int, ...] = ()
    for _ in range(N_DRAFTS):  # the target's own greedy continuation of PROMPT
        seq = PROMPT + drafts
        cache = empty_cache(hp.n_layer, hp.n_head_kv, hp.n_embd_head, numerics.kv_dtype, numerics.device)
        ids, pos = torch.tensor(seq), torch.arange(len(seq))
        drafts += (int(forward_target(model, ids, pos, cache, True).logits[-1].argmax()),)
    greedy = Sampler(flow=0, source="request", temperature=0.0)
    assert expected_ref_accepted(model, PROMPT, drafts, numerics, greedy) == N_DRAFTS
    wrong = (drafts[0], (drafts[1] + 1) % 50, drafts[2])
    assert expected_ref_accepted(model, PROMPT, wrong, numerics, greedy) == 1.0
    sampled = expected_ref_accepted(model, PROMPT, drafts, numerics, replace(greedy, temperature=0.8))
    assert 0.0 < sampled < N_DRAFTS


def _probe(pairs: list[tuple[int, float]]) -> Probe:
    rounds = tuple(RoundPair(i, (5, 6, 7), (5, 6, 7), run, ref) for i, (run, ref) in enumerate(pairs))
    return Probe((PromptProbe("p", (1, 2), rounds),))


def test_the_accept_judgement_pairs_the_runs_count_with_the_references_expected_count():
    close = judge_accept(_probe([(1, 1.2), (2, 1.7), (0, 0.4), (1, 1.1)]))
    assert close.matches and close.blocks == 4
    far = judge_accept(_probe([(0, 2.6), (0, 2.4), (1, 2.8), (0, 2.5)]))
    assert not far.matches and far.gap < -2
    assert isinstance(close.ref, AcceptStats) and close.ref.accepted == pytest.approx(4.4)
