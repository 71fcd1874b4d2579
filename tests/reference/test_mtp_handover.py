"""The MTP reference's candidates of the state a head is handed and normed (issue 42 item 2): one
decode records its two input norms each with the other's weight (`mtp_hnorm-<il>@norm=enorm`,
`mtp_enorm-<il>@norm=hnorm`), what a graph that crosses them computes, and its handed-layer
alternatives under their own names (`@h=l_out-<il>`)."""

from __future__ import annotations

import pytest
import torch

from featdiff.core import names
from featdiff.torchref.attention import empty_cache
from featdiff.torchref.mtp.head import decode, mtp_from_gguf
from featdiff.torchref.numerics import rms_norm

SLOW = pytest.mark.slow  # the pinned converter makes the pairs (cached per machine)


@SLOW
@pytest.mark.parametrize("variant", ["mtp", "mtp-glm4moe"])
def test_one_decode_records_the_crossed_norms_and_each_handed_layer(mtp_pairs, variant):
    head = mtp_from_gguf(mtp_pairs(variant) / "target.gguf", torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    h, earlier = (torch.randn(3, head.hparams.n_embd, generator=gen) for _ in range(2))  # (3, n_embd) each
    cache = empty_cache(1, head.hparams.n_head_kv, head.hparams.n_embd_head, "f32", torch.device("cpu"))
    tokens, eps, il = torch.tensor([5, 6, 7]), head.hparams.rms_eps, head.il
    mp = decode(head, tokens, h, torch.arange(3), cache, {names.h_layer_hypothesis(4): earlier}, outputs=False)
    got = {r.name: r.array for r in mp.records}
    assert not torch.equal(head.hnorm, head.enorm)  # the fixture's two norms differ: the candidates can tell
    assert torch.equal(got[f"mtp_hnorm-{il}@norm=enorm"], rms_norm(h, head.enorm, eps))
    e = head.token_embd[tokens]  # (3, n_embd)
    assert torch.equal(got[f"mtp_enorm-{il}@norm=hnorm"], rms_norm(e, head.hnorm, eps))
    assert torch.equal(got["mtp_h_input@h=l_out-4"], earlier)
    assert torch.equal(got[f"mtp_hnorm-{il}@h=l_out-4"], rms_norm(earlier, head.hnorm, eps))


@pytest.mark.parametrize(
    ("n_layer", "n_embd", "layers"),
    [
        (6, 32, [4, 3, 2, 1, 0]),  # the fixtures: every layer before the last
        (1, 32, []),  # no layer before the last
        (61, 7168, [59 - k for k in range(9)]),  # DeepSeek-V3's width: the 9 nearest fit in 65536 values
        (40, 65536, [38, 37]),  # wider than the budget: still the two nearest
    ],
)
def test_the_handed_layer_hypotheses_cover_every_layer_that_fits(n_layer, n_embd, layers):
    from featdiff.torchref.mtp.flow import shallower_layers

    assert list(shallower_layers(n_layer, n_embd)) == layers
