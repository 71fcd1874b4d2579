"""The MTP head's reference (torchref/mtp/head.py): the head as the converter writes it into the GGUF
and as the checkpoint holds it are one head; the graph's concat order and norms are what the
candidates say; which drafter kind a path is."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from featdiff.kinds import registry as kinds
from featdiff.kinds import mtp as kinds_mtp
from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.torchref.attention import empty_cache
from featdiff.torchref.kind import drafter_kind
from featdiff.torchref.mtp.head import decode, mtp_from_gguf
from featdiff.torchref.mtp.hf import mtp_from_hf
from featdiff.torchref.mtp.layer import MIMO2_ATTENTION, MOE_CHOICE_BIAS, MoeRouting, moe_ffn

pytestmark = pytest.mark.slow  # the pinned converter makes the pairs (cached per machine)

F32, CPU = torch.float32, torch.device("cpu")


def test_the_gguf_head_and_the_checkpoint_head_are_one_head(mtp_pairs):
    d = mtp_pairs("mtp")
    g, h = mtp_from_gguf(d / "target.gguf", F32, CPU), mtp_from_hf(d / "target-hf", F32, CPU)
    assert g.il == h.il == 6 and g.hparams.n_rot == h.hparams.n_rot == 8
    for field in ("eh_proj", "enorm", "hnorm", "head_norm", "token_embd", "output"):
        assert torch.equal(getattr(g, field), getattr(h, field)), field
    assert g.block.keys() == h.block.keys()
    assert all(torch.equal(g.block[k], h.block[k]) for k in g.block)
    separate = mtp_from_gguf(mtp_pairs("mtp-separate") / "draft.gguf", F32, CPU)
    assert torch.equal(separate.eh_proj, g.eh_proj) and torch.equal(separate.output, g.output)


def test_one_decode_records_the_graph_names_and_the_swapped_concat(mtp_pairs):
    head = mtp_from_gguf(mtp_pairs("mtp") / "target.gguf", F32, CPU)
    n = 3
    h = torch.randn(n, head.hparams.n_embd, generator=torch.Generator().manual_seed(0))  # (3, n_embd)
    cache = empty_cache(1, head.hparams.n_head_kv, head.hparams.n_embd_head, "f32", CPU)
    mp = decode(head, torch.tensor([5, 6, 7]), h, torch.arange(n), cache, {names.HYP_H_PRENORM: 2 * h})
    got = {r.name: r.array for r in mp.records}
    concat, swapped = got["mtp_concat-6"], got["mtp_concat-6@slots=1,0"]
    assert torch.equal(concat[:, :64], got["mtp_enorm-6"]) and torch.equal(concat[:, 64:], got["mtp_hnorm-6"])
    assert torch.equal(swapped[:, :64], got["mtp_hnorm-6"])
    assert torch.equal(got["mtp_h_input@h=prenorm"], 2 * h)
    assert got["result_output"].shape == (n, head.hparams.n_vocab) and mp.cache.positions.tolist() == [0, 1, 2]
    quiet = decode(head, torch.tensor([5, 6, 7]), h, torch.arange(n), cache, outputs=False)
    assert quiet.logits.shape == (0, head.hparams.n_vocab)  # process()'s catch-up decode outputs nothing


def test_the_kind_of_a_head_is_mtp_wherever_it_lives(mtp_pairs):
    d, s = mtp_pairs("mtp"), mtp_pairs("mtp-separate")
    for path in (d / "target.gguf", d / "target-hf", s / "draft.gguf"):
        assert drafter_kind(path).name == kinds_mtp.MTP, path
    assert kinds.of_arch(names.ARCH_QWEN35).name == kinds_mtp.MTP
    assert not kinds.is_drafter_arch(names.ARCH_QWEN35)  # a qwen35 GGUF is a target first
    with pytest.raises(InputError, match="no MTP head"):
        mtp_from_gguf(s / "target.gguf", F32, CPU)  # converted --no-mtp


def test_a_moe_head_routes_its_experts_and_is_read_from_its_gguf(mtp_pairs):
    d = mtp_pairs("mtp-qwen35moe")
    head = mtp_from_gguf(d / "target.gguf", F32, CPU)
    assert head.hparams.arch == "qwen35moe" and head.routing == MoeRouting(2)  # softmax, renormalized
    assert head.block["ffn_gate_exps"].shape == (4, 32, 64) and "ffn_gate" not in head.block
    assert drafter_kind(d / "target.gguf").name == kinds_mtp.MTP
    h = torch.randn(2, head.hparams.n_embd, generator=torch.Generator().manual_seed(1))  # (2, n_embd)
    cache = empty_cache(1, head.hparams.n_head_kv, head.hparams.n_embd_head, "f32", CPU)
    routed = decode(head, torch.tensor([3, 4]), h, torch.arange(2), cache)
    assert torch.isfinite(routed.logits).all()


def test_a_glm_head_routes_by_sigmoid_and_its_choice_bias(mtp_pairs):
    """GLM-4.5's head (glm4-moe.cpp graph_mtp) from its GGUF: attention with q/k/v biases and RoPE on
    half the head, experts chosen by sigmoid + exp_probs_b, weighted by the sigmoids renormalized
    and scaled, an ungated shared expert; its residual named as glm4-moe.cpp names it. The choice
    bias decides some rows' experts."""
    d = mtp_pairs("mtp-glm4moe")
    head = mtp_from_gguf(d / "target.gguf", F32, CPU)
    assert head.hparams.arch == "glm4moe" and head.hparams.n_rot == 8 and head.il == 6
    assert head.routing == MoeRouting(2, 2.5, has_sigmoid_gating=True, has_weights_norm=True)
    assert {"attn_q.bias", "attn_k.bias", "attn_v.bias", MOE_CHOICE_BIAS, "ffn_up_shexp"} <= head.block.keys()
    assert not {"attn_q_norm", "ffn_gate_inp_shexp"} & head.block.keys()
    for path in (d / "target.gguf", d / "target-hf"):
        assert drafter_kind(path).name == kinds_mtp.MTP, path
    n = 16
    h = torch.randn(n, head.hparams.n_embd, generator=torch.Generator().manual_seed(2))  # (16, n_embd)
    cache = empty_cache(1, head.hparams.n_head_kv, head.hparams.n_embd_head, "f32", CPU)
    routed = decode(head, torch.arange(10, 10 + n), h, torch.arange(n), cache)
    assert {"mtp_ffn_inp-6", "mtp_concat-6@slots=1,0"} <= {r.name for r in routed.records}
    assert "mtp_attn_residual-6" not in {r.name for r in routed.records}
    unbiased = {k: w for k, w in head.block.items() if k != MOE_CHOICE_BIAS}
    assert head.routing is not None
    moved = (moe_ffn(unbiased, h, head.routing) - moe_ffn(head.block, h, head.routing)).abs().amax(dim=1)  # (16,)
    assert 0 < int((moved > 0).sum()) < n  # the bias moves some rows to other experts, not every row


@pytest.mark.parametrize("variant, arch", [("mtp-qwen35moe", "qwen35moe"), ("mtp-glm4moe", "glm4moe")])
def test_a_moe_gguf_head_and_its_checkpoint_head_are_one_head(mtp_pairs, variant, arch):
    """A MoE head read from its checkpoint (Qwen3.5-MoE's `mtp.*`, GLM-4.5's decoder layer n_layer:
    experts stacked, routing from config.json or the graph's literals) is the head the converter
    wrote into the GGUF."""
    d = mtp_pairs(variant)
    g, h = mtp_from_gguf(d / "target.gguf", F32, CPU), mtp_from_hf(d / "target-hf", F32, CPU)
    assert g.il == h.il == 6 and g.hparams.n_rot == h.hparams.n_rot == 8 and h.hparams.arch == arch
    assert g.routing == h.routing
    for field in ("eh_proj", "enorm", "hnorm", "head_norm", "token_embd", "output"):
        assert torch.equal(getattr(g, field), getattr(h, field)), field
    assert g.block.keys() == h.block.keys()
    assert all(torch.equal(g.block[k], h.block[k]) for k in g.block)


def test_a_mimo2_head_is_a_sliding_layer_that_keeps_the_prenorm_state(mtp_pairs):
    """MiMo-V2's head (mimo2.cpp graph_mtp) from its GGUF and from its checkpoint's
    `model.mtp.layers.0`: one head, a sliding-window layer (the sliding layers' KV heads and RoPE
    base, the window, the value scale) with fused q/k/v, sinks and a dense FFN, its head norm the
    checkpoint's final_layernorm. A decode recycles mtp_post_ffn, the state before the head norm,
    as h_nextn (the output rows only), and its wrong-norm candidate is `@h=postnorm`; the window
    hides the oldest rows from the last one."""
    d = mtp_pairs("mtp-mimo2")
    g, h = mtp_from_gguf(d / "target.gguf", F32, CPU), mtp_from_hf(d / "target-hf", F32, CPU)
    assert g.hparams == replace(h.hparams, rope_scaling=g.hparams.rope_scaling, rms_eps=g.hparams.rms_eps)
    assert g.hparams.rms_eps == float(torch.tensor(h.hparams.rms_eps, dtype=F32))  # the GGUF's f32 of it
    assert (g.il, g.hparams.arch, g.hparams.n_head_kv, g.hparams.n_rot) == (6, "mimo2", 2, 8)
    assert (g.hparams.n_swa, g.hparams.swa_layers, g.hparams.rope_base, g.hparams.attn_value_scale) == (
        8, (True,), 1000.0, 0.5,
    )  # fmt: skip
    assert g.block.keys() == h.block.keys() == {*MIMO2_ATTENTION, "attn_sinks", "ffn_gate", "ffn_up", "ffn_down"}
    assert all(torch.equal(g.block[k], h.block[k]) for k in g.block)
    for field in ("eh_proj", "enorm", "hnorm", "head_norm", "token_embd", "output"):
        assert torch.equal(getattr(g, field), getattr(h, field)), field
    assert g.block["attn_qkv"].shape == (4 * 16 + 2 * 16 + 2 * 8, 64)  # rows [q, k, v]: v heads 8 wide
    for path in (d / "target.gguf", d / "target-hf"):
        assert drafter_kind(path).name == kinds_mtp.MTP, path
    n = 12
    x = torch.randn(n, g.hparams.n_embd, generator=torch.Generator().manual_seed(3))  # (12, n_embd)
    cache = empty_cache(1, g.hparams.n_head_kv, g.hparams.n_embd_head, "f32", CPU)
    mp = decode(g, torch.arange(20, 20 + n), x, torch.arange(n), cache, {names.HYP_H_POSTNORM: 2 * x})
    got = {r.name: r.array for r in mp.records}
    assert torch.equal(got["h_nextn"], got["mtp_post_ffn-6"]) and torch.equal(mp.h_nextn, got["mtp_post_ffn-6"])
    assert torch.equal(got["mtp_h_input@h=postnorm"], 2 * x) and "mtp_ffn_inp-6" in got
    quiet = decode(g, torch.arange(20, 20 + n), x, torch.arange(n), cache, outputs=False)
    assert {r.name: r.array for r in quiet.records}["h_nextn"].shape == (0, 64)  # mimo2.cpp: get_rows first
    unwindowed = replace(g, hparams=replace(g.hparams, n_swa=0, swa_layers=()))
    full = decode(unwindowed, torch.arange(20, 20 + n), x, torch.arange(n), cache)
    assert torch.equal(full.logits[:8], mp.logits[:8]) and not torch.allclose(full.logits[8:], mp.logits[8:])
