"""DSpark's heads in the reference (featdiff.torchref.dflash.dspark), on hand-made tensors: the Markov
chain runs from the anchor, greedily, over the rows each layout biases; the confidence head reads
the row's norm and the previous token's markov_w1 row; p_min stops the drafts."""

from __future__ import annotations

import torch

from featdiff.torchref.dflash.dspark import Sampled, drafted, heads
from featdiff.torchref.weights import DSpark

N_VOCAB, RANK, N_EMBD = 6, 2, 3


def _dspark(anchor_first: bool = True, conf: bool = True, scale: float | None = None) -> DSpark:
    w1 = torch.zeros(N_VOCAB, RANK)
    w1[0] = torch.tensor([1.0, 0.0])  # after token 0: push token 3
    w1[3] = torch.tensor([0.0, 1.0])  # after token 3: push token 5
    w2 = torch.zeros(N_VOCAB, RANK)
    w2[3, 0] = 10.0
    w2[5, 1] = 10.0
    return DSpark(
        markov_w1=w1,
        markov_w2=w2,
        markov_w2_scale=torch.tensor([scale]) if scale is not None else None,
        conf_w=torch.ones(1, N_EMBD + RANK) if conf else None,
        conf_b=torch.tensor([-1.0]) if conf else None,
        sample_from_anchor=anchor_first,
    )


def test_anchor_first_chains_from_the_anchor_over_every_row():
    base = torch.zeros(3, N_VOCAB)
    out = heads(_dspark(), base, torch.zeros(3, N_EMBD), anchor=0, d2t=None, anchor_first=True)
    assert [int(r.argmax()) for r in out.logits] == [3, 5, 0]  # 0 -> 3 -> 5 -> (no push): argmax 0
    assert torch.equal(out.logits - base, out.bias)
    assert out.bias[0, 3] == 10.0 and out.bias[1, 5] == 10.0 and not out.bias[2].any()


def test_bonus_anchor_leaves_row_0_unbiased_and_chains_from_row_1():
    base = torch.zeros(3, N_VOCAB)
    base[0, 1] = 2.0
    out = heads(_dspark(anchor_first=False), base, torch.zeros(3, N_EMBD), anchor=0, d2t=None, anchor_first=False)
    assert torch.equal(out.logits[0], base[0]) and not out.bias[0].any()
    assert [int(r.argmax()) for r in out.logits[1:]] == [3, 5]
    assert out.conf is not None and torch.isclose(out.conf[0, 0], torch.sigmoid(base[0, 0]))  # padding


def test_scale_multiplies_the_bias_and_d2t_scatters_it():
    d2t = torch.tensor([4, 2, 0, 5, 1, 3])  # draft row j -> target id d2t[j]
    out = heads(
        _dspark(scale=0.5), torch.zeros(1, N_VOCAB), torch.zeros(1, N_EMBD), anchor=0, d2t=d2t, anchor_first=True
    )
    assert out.bias[0, 5] == 5.0 and int(out.logits[0].argmax()) == 5  # draft row 3 lands on target id 5


def test_confidence_reads_the_norm_and_the_previous_tokens_w1_row():
    norm = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = heads(_dspark(), torch.zeros(2, N_VOCAB), norm, anchor=0, d2t=None, anchor_first=True)
    # row 0: 1 (norm) + 1 (w1[0]) - 1; row 1: prev = 3, 0 + 1 - 1
    assert torch.allclose(out.conf[:, 0], torch.sigmoid(torch.tensor([1.0, 0.0])))


def test_p_min_stops_at_the_first_unconfident_row_only_with_a_confidence_head():
    logits = torch.eye(N_VOCAB)[:3]
    conf = torch.tensor([[0.9], [0.2], [0.9]])
    assert drafted(Sampled(logits, conf, ()), 0, 0.5) == (0,)
    assert drafted(Sampled(logits, conf, ()), 0, 0.0) == (0, 1, 2)
    assert drafted(Sampled(logits, None, ()), 1, 0.5) == (1, 2)
