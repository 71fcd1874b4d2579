"""The EAGLE3 reference (torchref/eagle3/graph.py, eagle3_flow.py): the decoder graph's wiring (concat
order, the residual, the encoder norm, the d2t scatter, the cache), the flow's eval sequence as
speculative-simple drives common_speculative_impl_draft_eagle3, following a run, the loader, and
the reference-only candidates of the export faults (what each computes, and that the d2t one
explains llama.cpp's scatter through offsets whatever thread wins a shared id)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from featdiff.factory import fixtures
from featdiff.core import names
from featdiff.diff.aligned import comparable_values
from featdiff.diff.detectors.base import Evidence
from featdiff.diff.detectors.wiring import detect_wrong_source, detect_wrong_source_of_vocabulary
from featdiff.diff.tolerance import Tolerance
from featdiff.dump.records import Round
from featdiff.core.errors import InputError
from featdiff.core.phases import Phase
from featdiff.torchref.eagle3 import graph as eagle3
from featdiff.torchref.attention import empty_cache
from featdiff.torchref.eagle3.graph import (
    Eagle3Draft,
    check_eagle3_pair,
    decode,
    eagle3_from_gguf,
    encode,
    encode_candidates,
    scattered_at_offsets,
)
from featdiff.torchref.eagle3.flow import run_flow
from featdiff.torchref.steps import top1_probability
from featdiff.torchref.load import load_target
from featdiff.torchref.numerics import Numerics, linear, rms_norm
from featdiff.torchref.rounds import FollowError
from featdiff.torchref.weights import Hparams, Layer, Source, Target

F32 = Numerics(torch.float32, torch.device("cpu"), "f32")
F16_KV = Numerics(torch.float32, torch.device("cpu"), "f16")
TARGET_LAYERS = (1, 3, 5)  # of the clean fixture's 6-layer qwen3 target
N_HEAD, N_HEAD_KV, N_FF = 4, 2, 128
PROMPT = (5, 17, 42, 7)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Target:
    d = fixtures.write_fixture(tmp_path_factory.mktemp("eagle3"), "clean")
    return load_target(d / "target.gguf", torch.float32, torch.device("cpu"))


def random_draft(target: Target, seed: int = 0, **over) -> Eagle3Draft:
    """A seeded EAGLE3 drafter on `target`'s width, borrowing its embeddings and head."""
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm(n: int) -> torch.Tensor:
        return 1.0 + w(n, scale=0.2)

    n_embd = target.hparams.n_embd
    d = n_embd // N_HEAD
    hp = Hparams(
        arch=names.ARCH_EAGLE3,
        n_layer=1,
        n_embd=n_embd,
        n_head=N_HEAD,
        n_head_kv=N_HEAD_KV,
        n_embd_head=d,
        n_ff=N_FF,
        n_vocab=target.hparams.n_vocab,
        rms_eps=1e-6,
        rope_base=10000.0,
        rope_type="normal",
        n_rot=d,
    )
    layer = Layer(
        attn_norm=norm(n_embd),
        wq=w(N_HEAD * d, 2 * n_embd),
        wk=w(N_HEAD_KV * d, 2 * n_embd),
        wv=w(N_HEAD_KV * d, 2 * n_embd),
        wo=w(n_embd, N_HEAD * d),
        q_norm=None,
        k_norm=None,
        ffn_norm=norm(n_embd),
        ffn_gate=w(N_FF, n_embd),
        ffn_up=w(N_FF, n_embd),
        ffn_down=w(n_embd, N_FF),
    )
    draft = Eagle3Draft(
        source=Source(Path("eagle3-test.gguf"), is_gguf=False),
        hparams=hp,
        target_layers=TARGET_LAYERS,
        n_embd_tgt=n_embd,
        norm_before_fc=False,
        norm_before_residual=False,
        fc=w(n_embd, 3 * n_embd, scale=0.05),
        enc_norm=norm(3 * n_embd),
        layer=layer,
        attn_norm_2=norm(n_embd),
        output_norm=norm(n_embd),
        output=None,
        token_embd=None,
    )
    return replace(draft, **over)


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _cache(draft: Eagle3Draft, numerics: Numerics = F32):
    hp = draft.hparams
    return empty_cache(1, hp.n_head_kv, hp.n_embd_head, numerics.kv_dtype, numerics.device)


def _records(named) -> dict[str, torch.Tensor]:
    return {n.name: n.array for n in named}


def _g(draft: Eagle3Draft, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, draft.hparams.n_embd, generator=torch.Generator().manual_seed(seed))


# --- the graphs ----------------------------------------------------------------------------------


def test_d2t_scatter_puts_each_head_row_at_its_target_id(target):
    gen = torch.Generator().manual_seed(3)
    d2t = torch.randperm(target.hparams.n_vocab, generator=gen)[:40].sort().values
    head = torch.randn(40, target.hparams.n_embd, generator=gen) * 0.2
    draft = random_draft(target, d2t=d2t, output=head)
    dp = decode(draft, target, _ids(3, 9), _g(draft, 2), _ids(0, 1), _cache(draft))
    reduced = linear(_records(dp.records)[names.RESULT_NORM], head)  # (2, 40)
    assert dp.logits.shape == (2, target.hparams.n_vocab)
    assert torch.equal(dp.logits[:, d2t], reduced)
    off = torch.ones(target.hparams.n_vocab, dtype=torch.bool)
    off[d2t] = False
    assert torch.isneginf(dp.logits[:, off]).all()
    assert set(dp.logits.argmax(-1).tolist()) <= set(d2t.tolist())  # a draft is always a mapped id


# --- the export faults' candidates ---------------------------------------------------------------


def _fc_blocks(fc: torch.Tensor, order: list[int]) -> torch.Tensor:
    """fc `(n_embd, 3 * n_embd_tgt)` whose column block k holds block order[k]."""
    return fc.reshape(fc.shape[0], 3, -1)[:, order].reshape(fc.shape)  # (n_embd, 3 * n_embd_tgt)


@pytest.mark.parametrize("norm_before_fc", [False, True])
def test_the_slot_candidates_are_fc_with_its_column_blocks_permuted(target, norm_before_fc):
    draft = random_draft(target, norm_before_fc=norm_before_fc)
    features = torch.randn(3, 3 * draft.n_embd_tgt, generator=torch.Generator().manual_seed(2))
    cand = _records(encode_candidates(draft, features))
    slots = [k for k in cand if "@slots=" in k]
    assert len(slots) == 5 and "fc_out@slots=0,1,2" not in cand
    order = [1, 2, 0]  # the GGUF's block k holds the checkpoint's block order[k]
    g_run, _ = encode(replace(draft, fc=_fc_blocks(draft.fc, order)), features)
    inverse = ",".join(str(order.index(k)) for k in range(3))  # candidate slot k carries ref slot perm[k]
    assert inverse == "2,0,1"
    assert torch.allclose(cand[f"fc_out@slots={inverse}"], g_run, atol=1e-5)
    assert not any(torch.allclose(cand[k], g_run, atol=1e-3) for k in slots if k != f"fc_out@slots={inverse}")


def test_the_norm_candidates_are_fc_without_or_with_a_unit_norm(target):
    draft = random_draft(target)
    features = torch.randn(3, 3 * draft.n_embd_tgt, generator=torch.Generator().manual_seed(2))
    plain = _records(encode_candidates(draft, features))
    unit = torch.ones(3 * draft.n_embd_tgt)
    g_added, _ = encode(replace(draft, norm_before_fc=True, enc_norm=unit), features)
    assert "fc_out@norm=none" not in plain and torch.equal(plain["fc_out@norm=unit"], g_added)
    normed = _records(encode_candidates(replace(draft, norm_before_fc=True), features))
    g_dropped, _ = encode(draft, features)  # the run without the norm
    assert "fc_out@norm=unit" not in normed and torch.equal(normed["fc_out@norm=none"], g_dropped)


def _offsets_draft(target: Target) -> tuple[Eagle3Draft, torch.Tensor]:
    """A drafter with a reduced head whose d2t holds runs of consecutive ids (rows sharing an offset)."""
    gen = torch.Generator().manual_seed(5)
    d2t = torch.cat([torch.arange(3), torch.arange(10, 16), torch.arange(40, 44), torch.tensor([60, 90])])  # (15,)
    head = torch.randn(d2t.numel(), target.hparams.n_embd, generator=gen) * 0.2  # (15, n_embd)
    return random_draft(target, d2t=d2t, output=head), d2t


def test_the_offsets_candidate_scatters_each_row_to_its_offset(target):
    draft, d2t = _offsets_draft(target)
    head = torch.randn(2, d2t.numel(), generator=torch.Generator().manual_seed(6))  # (2, 15)
    cand = scattered_at_offsets(draft, head)
    assert cand is not None and cand.shape == (2, target.hparams.n_vocab)
    offsets = (d2t - torch.arange(d2t.numel())).tolist()  # [0,0,0, 7 x6, 31 x4, 47, 76]
    shared = {o for o in offsets if offsets.count(o) > 1}
    assert shared == {0, 7, 31}
    for i, o in enumerate(offsets):
        if o not in shared:
            assert torch.equal(cand[:, o], head[:, i])
    assert torch.isnan(cand[:, sorted(shared)]).all()  # which row stays is a race in ggml_set_rows
    hit = torch.zeros(target.hparams.n_vocab, dtype=torch.bool)
    hit[offsets] = True
    assert torch.isneginf(cand[:, ~hit]).all()
    assert scattered_at_offsets(random_draft(target), head) is None  # no d2t


def test_decode_records_the_candidates_its_drafter_can_carry(target):
    draft, _ = _offsets_draft(target)
    own = replace(draft, token_embd=target.token_embd * 0.5)
    rec = _records(decode(own, target, _ids(4, 8), _g(own, 2), _ids(0, 1), _cache(own)).records)
    assert torch.equal(rec["inp_embd@table=target"], target.token_embd[_ids(4, 8)])
    assert rec["result_output@d2t=offsets"].shape == rec[names.RESULT_OUTPUT].shape
    plain = _records(decode(random_draft(target), target, _ids(4, 8), _g(draft, 2), _ids(0, 1), _cache(draft)).records)
    # borrowed table, no d2t: only the concat order is hypothesized, [g_norm, embd_norm]
    assert [k for k in plain if names.CANDIDATE_SEP in k] == ["concat_embd-0@slots=1,0"]
    assert torch.equal(plain["concat_embd-0@slots=1,0"], torch.cat([plain["g_norm-0"], plain["embd_norm-0"]], dim=1))


def _race(candidate: np.ndarray, head: np.ndarray, offsets: list[int], rng: np.random.Generator) -> np.ndarray:
    """What llama.cpp's scatter through `offsets` leaves: the candidate, with each shared id holding
    one of its rows, which one by chance (the threads' race)."""
    run = candidate.copy()
    for o in {o for o in offsets if offsets.count(o) > 1}:
        rows = [i for i, x in enumerate(offsets) if x == o]
        run[:, o] = head[:, rows[rng.integers(len(rows))]]
    return run


@pytest.mark.parametrize("record", [names.RESULT_OUTPUT, names.DRAFT_LOGITS])
def test_the_offsets_candidate_names_a_run_scattered_through_offsets(target, record):
    draft, d2t = _offsets_draft(target)
    head = torch.randn(3, d2t.numel(), generator=torch.Generator().manual_seed(6))  # (3, 15)
    ref = eagle3._scattered(draft, head).numpy()  # (3, n_vocab): the checkpoint's ids
    cand = scattered_at_offsets(draft, head)
    assert cand is not None
    offsets = (d2t - torch.arange(d2t.numel())).tolist()
    tol = Tolerance(rel=1e-5, sources=("f32",))
    for seed in range(3):
        run = _race(cand.numpy(), head.numpy(), offsets, np.random.default_rng(seed))
        ref_rows, run_rows = comparable_values(record, ref, run)
        ev = Evidence(tensor=record, ref=ref_rows, run=run_rows, tolerance=tol, record=record,
                      candidates={f"{record}@d2t=offsets": cand.numpy()})  # fmt: skip
        found = detect_wrong_source_of_vocabulary(ev)
        assert found is not None and found.kind == "wrong_source"
        assert found.fields == {"source": "offsets", "candidate": f"{record}@d2t=offsets"}
        assert detect_wrong_source(ev) == found  # the chain's wrong_source tries it last
    same_ref, same_run = comparable_values(record, ref, ref.copy())  # a correct run: no offsets there
    ev = Evidence(tensor=record, ref=same_ref, run=same_run, tolerance=tol, record=record,
                  candidates={f"{record}@d2t=offsets": cand.numpy()})  # fmt: skip
    assert detect_wrong_source_of_vocabulary(ev) is None


def test_concat_is_embd_norm_then_g_norm(target):
    draft = random_draft(target)
    g, tokens = _g(draft, 3), _ids(4, 8, 15)
    rec = _records(decode(draft, target, tokens, g, _ids(0, 1, 2), _cache(draft)).records)
    eps = draft.hparams.rms_eps
    embd_norm = rms_norm(target.token_embd[tokens], draft.layer.attn_norm, eps)
    g_norm = rms_norm(g, draft.attn_norm_2, eps)
    assert torch.equal(rec[names.INP_EMBD], target.token_embd[tokens])  # the target's table, borrowed
    assert torch.equal(rec["embd_norm-0"], embd_norm) and torch.equal(rec["g_norm-0"], g_norm)
    assert torch.equal(rec["concat_embd-0"], torch.cat([embd_norm, g_norm], dim=1))
    assert not torch.allclose(rec["concat_embd-0"], torch.cat([g_norm, embd_norm], dim=1))
    assert torch.equal(rec["Qcur-0"], linear(rec["concat_embd-0"], draft.layer.wq))


def test_own_token_embd_replaces_the_targets(target):
    own = torch.randn(target.hparams.n_vocab, target.hparams.n_embd, generator=torch.Generator().manual_seed(5))
    draft = random_draft(target, token_embd=own)
    rec = _records(decode(draft, target, _ids(4, 8), _g(draft, 2), _ids(0, 1), _cache(draft)).records)
    assert torch.equal(rec[names.INP_EMBD], own[_ids(4, 8)])


def test_norm_before_fc_norms_the_features_first(target):
    draft = random_draft(target)
    features = torch.randn(3, 3 * draft.n_embd_tgt, generator=torch.Generator().manual_seed(2))
    g_plain, plain = encode(draft, features)
    g_normed, normed = encode(replace(draft, norm_before_fc=True), features)
    assert [n.name for n in plain] == [names.INP_TARGET_FEATURES, names.EAGLE3_FC_OUT]
    assert [n.name for n in normed] == [names.INP_TARGET_FEATURES, names.EAGLE3_ENC_INPUT_NORM, names.EAGLE3_FC_OUT]
    assert draft.enc_norm is not None
    assert torch.equal(g_plain, linear(features, draft.fc))
    assert torch.equal(g_normed, linear(rms_norm(features, draft.enc_norm, draft.hparams.rms_eps), draft.fc))
    assert not torch.allclose(g_plain, g_normed)


def test_norm_before_residual_adds_g_norm_instead_of_g(target):
    draft = random_draft(target)
    g, tokens, positions = _g(draft, 2), _ids(4, 8), _ids(0, 1)
    for flag in (False, True):
        rec = _records(
            decode(replace(draft, norm_before_residual=flag), target, tokens, g, positions, _cache(draft)).records
        )
        residual = rec["ffn_inp-0"] - linear(rec["kqv_out-0"], draft.layer.wo)
        assert torch.allclose(residual, rec["g_norm-0"] if flag else g, atol=1e-6)
        assert torch.equal(rec["eagle3_prenorm-0"], rec["ffn_out-0"] + rec["ffn_inp-0"])


@pytest.mark.parametrize("numerics", [F32, F16_KV], ids=["f32", "f16"])
def test_a_batch_equals_its_rows_decoded_one_by_one_through_the_cache(target, numerics):
    draft = random_draft(target)
    g, tokens = _g(draft, 3), _ids(4, 8, 15)
    batch = decode(draft, target, tokens, g, _ids(0, 1, 2), _cache(draft, numerics))
    cache, rows = _cache(draft, numerics), []
    for i in range(3):
        one = decode(draft, target, tokens[i : i + 1], g[i : i + 1], _ids(i), cache)
        cache = one.cache
        rows.append(one.logits)
    assert torch.allclose(batch.logits, torch.cat(rows), atol=1e-4)
    assert torch.equal(batch.cache.positions, cache.positions)
    assert torch.allclose(batch.cache.k[0].float(), cache.k[0].float(), atol=1e-3)
    first = decode(draft, target, tokens[:1], g[:1], _ids(0), _cache(draft, numerics))
    assert torch.allclose(batch.prenorm[:1], first.prenorm, atol=1e-5)  # causal: later rows are not seen


def test_rope_rotates_with_the_position(target):
    draft = random_draft(target)
    g, tokens = _g(draft, 1), _ids(4)
    at0 = _records(decode(draft, target, tokens, g, _ids(0), _cache(draft)).records)
    at5 = _records(decode(draft, target, tokens, g, _ids(5), _cache(draft)).records)
    assert torch.equal(at0["Qcur-0"], at5["Qcur-0"])
    assert torch.equal(at0["Qcur_rope-0"].reshape(1, -1), at0["Qcur-0"])  # position 0: no rotation
    assert not torch.allclose(at0["Qcur_rope-0"], at5["Qcur_rope-0"])


def test_top1_probability_is_the_softmax_over_the_top_ten():
    row = torch.tensor([0.0, 5.0, 1.0, 2.0, -1.0, 3.0, 0.5, 0.1, 4.0, 1.5, 2.5, -9.0, float("-inf")])
    top = row.sort(descending=True).values[:10]
    assert top1_probability(row) == pytest.approx(float(torch.softmax(top, 0)[0]))


# --- the flow ------------------------------------------------------------------------------------


def _decoded(ev) -> tuple[str, str, tuple[int, ...], tuple[int, ...], int]:
    return (ev.eval.role, ev.eval.phase, ev.eval.positions, ev.eval.token_ids, ev.eval.round)


def test_flow_evals_follow_speculative_simple(target):
    draft = random_draft(target)
    trace = run_flow(target, draft, PROMPT, 2, F16_KV, draft_max=3)
    r1, r2 = trace.rounds
    d = r1.drafts
    assert (r1.pos0, r1.anchor, len(d)) == (3, PROMPT[3], 3)
    assert r2.pos0 == 3 + r1.accepted + 1 and r2.anchor == r1.target_tokens[-1]
    seen = [_decoded(ev) for ev in trace.evals]
    n2 = r2.pos0
    assert (
        seen[:9]
        == [
            ("target", Phase.PREFILL, (0, 1, 2), PROMPT[:3], 0),
            ("draft", Phase.INJECT, (0, 1, 2), (), 0),  # the encoder
            ("draft", Phase.INJECT, (0, 1), PROMPT[1:3], 0),  # (token t+1, g t) at t
            ("draft", Phase.DRAFT, (2,), (PROMPT[3],), 1),  # the seed: the pending row at n_past - 1
            ("draft", Phase.DRAFT, (3,), (d[0],), 1),
            ("draft", Phase.DRAFT, (4,), (d[1],), 1),  # draft_max 3: the last draft is never decoded
            ("target", Phase.VERIFY, (3, 4, 5, 6), (PROMPT[3], *d), 1),
            ("draft", Phase.INJECT, (3, 4, 5, 6), (), 1),  # numbered on from the draft cache's last cell
            ("draft", Phase.INJECT, (3, 4, 5), d, 1),
        ]
    )
    assert seen[9] == ("draft", Phase.DRAFT, (n2 - 1,), (r2.anchor,), 2)
    assert [ev.eval.call for ev in trace.evals[:3]] == [names.CALL_DECODE, names.CALL_ENCODE, names.CALL_DECODE]
    assert [ev.eval.eval for ev in trace.evals] == list(range(len(trace.evals)))

    rec = [_records(ev.records) for ev in trace.evals]
    fc0, fc1 = rec[1][names.EAGLE3_FC_OUT], rec[7][names.EAGLE3_FC_OUT]
    assert torch.equal(rec[2][names.INP_G_EMBEDDINGS], fc0[:2])  # g 0, g 1
    assert torch.equal(rec[3][names.INP_G_EMBEDDINGS], fc0[2:3])  # the pending g
    assert torch.equal(rec[4][names.INP_G_EMBEDDINGS], rec[3]["eagle3_prenorm-0"])  # recycled prenorm
    assert torch.equal(rec[5][names.INP_G_EMBEDDINGS], rec[4]["eagle3_prenorm-0"])
    assert torch.equal(rec[8][names.INP_G_EMBEDDINGS], fc1[:3])
    assert torch.equal(rec[9][names.INP_G_EMBEDDINGS], fc1[r1.accepted : r1.accepted + 1])  # accept()'s row
    for i in (3, 4, 5, 9):
        assert torch.equal(rec[i][names.DRAFT_LOGITS], rec[i][names.RESULT_OUTPUT])
    with_logits = [ev.eval.phase == Phase.DRAFT for ev in trace.evals]
    assert [names.DRAFT_LOGITS in r for r in rec] == with_logits
    assert tuple(int(rec[i][names.DRAFT_LOGITS].argmax()) for i in (3, 4, 5)) == d


def test_the_flow_records_the_candidates_beside_their_records(target):
    draft, _ = _offsets_draft(target)
    trace = run_flow(target, draft, PROMPT, 1, F32, draft_max=2)
    for ev in trace.evals:
        rec = _records(ev.records)
        if ev.eval.call == names.CALL_ENCODE:
            assert {"fc_out@slots=1,0,2", "fc_out@norm=unit"} <= set(rec)
        elif ev.eval.role == names.ROLE_DRAFT:
            assert "result_output@d2t=offsets" in rec
        if ev.eval.phase == Phase.DRAFT:
            same = rec["draft_logits@d2t=offsets"], rec["result_output@d2t=offsets"]
            torch.testing.assert_close(*same, rtol=0, atol=0, equal_nan=True)


def test_inject_features_are_the_tapped_layer_inputs(target):
    draft = random_draft(target)
    trace = run_flow(target, draft, PROMPT, 1, F32, draft_max=2)
    tgt, enc = _records(trace.evals[0].records), _records(trace.evals[1].records)
    slots = [tgt[names.layer_name(names.LAYER_INP, il)] for il in TARGET_LAYERS]
    assert torch.equal(enc[names.INP_TARGET_FEATURES], torch.cat(slots, dim=1))


@pytest.mark.parametrize("accepted", [None, 1, 3], ids=["own", "one-accepted", "all-accepted"])
def test_the_draft_cache_holds_the_seed_and_drops_the_rest(target, accepted):
    """Round 2's seed sees the cells < n_past - 1 only: equal to a decode over a cache rebuilt from
    the inject rows kept (the prefill's 0..1, round 1's seed at 2, and the verify rows accepted
    before n_past - 1); `accepted` rounds are guided by a run whose first draft is the target's token."""
    draft = random_draft(target)
    guide: tuple[Round, ...] = ()
    if accepted is not None:
        t0 = run_flow(target, draft, PROMPT, 1, F32, draft_max=3).rounds[0].target_tokens[0]
        plan = Round(round=1, pos0=3, anchor=PROMPT[3], drafts=(t0, 1, 2), accepted=accepted, target_tokens=())
        guide = (plan,)  # round 1 decodes the run's tokens, round 2 the reference's own
    trace = run_flow(target, draft, PROMPT, 2, F32, draft_max=3, guide=guide)
    r1, r2 = trace.rounds
    assert accepted is None or (r1.accepted, r2.pos0) == (accepted, 3 + accepted + 1)
    rec = [_records(ev.records) for ev in trace.evals]
    cache = decode(draft, target, _ids(*PROMPT[1:3]), rec[2][names.INP_G_EMBEDDINGS], _ids(0, 1), _cache(draft)).cache
    seed1 = decode(draft, target, _ids(PROMPT[3]), rec[3][names.INP_G_EMBEDDINGS], _ids(2), cache)
    assert torch.equal(seed1.logits, rec[3][names.RESULT_OUTPUT])
    kept = r1.accepted  # verify decoder rows at 3 .. 3 + accepted - 1 stay; the seed rewrites 3 + accepted
    cache = seed1.cache
    if kept:
        toks, g = _ids(*r1.drafts[:kept]), rec[8][names.INP_G_EMBEDDINGS][:kept]
        cache = decode(draft, target, toks, g, _ids(*range(3, 3 + kept)), cache).cache
    assert trace.evals[9].eval.positions == (r2.pos0 - 1,)
    assert torch.equal(rec[9][names.INP_G_EMBEDDINGS], rec[7][names.EAGLE3_FC_OUT][kept : kept + 1])
    seed2 = decode(draft, target, _ids(r2.anchor), rec[9][names.INP_G_EMBEDDINGS], _ids(r2.pos0 - 1), cache)
    assert torch.allclose(seed2.logits, rec[9][names.RESULT_OUTPUT], atol=1e-5)


def test_p_min_above_one_drafts_nothing_and_skips_the_empty_decoder_batch(target):
    draft = random_draft(target)
    trace = run_flow(target, draft, PROMPT, 1, F32, draft_max=3, p_min=1.5)
    assert trace.rounds[0].drafts == ()
    assert [_decoded(ev)[:3] for ev in trace.evals[3:]] == [
        ("draft", Phase.DRAFT, (2,)),  # the seed is decoded and read, then drafting stops
        ("target", Phase.VERIFY, (3,)),
        ("draft", Phase.INJECT, (3,)),  # the encoder only: one verify row leaves no (t+1, g t) pair
    ]


def test_a_prompt_of_two_tokens_has_no_prefill_decoder_batch(target):
    trace = run_flow(target, random_draft(target), PROMPT[:2], 1, F32, draft_max=2)
    assert [_decoded(ev)[:3] for ev in trace.evals[:3]] == [
        ("target", Phase.PREFILL, (0,)),
        ("draft", Phase.INJECT, (0,)),
        ("draft", Phase.DRAFT, (0,)),
    ]


def test_cached_prefix_bridges_the_pending_row_into_the_next_batch(target):
    prompt = (5, 17, 42, 7, 9, 11)
    trace = run_flow(target, random_draft(target), prompt, 1, F32, draft_max=2, cached=2)
    assert (
        [_decoded(ev) for ev in trace.evals[:6]]
        == [
            ("target", Phase.WARMUP, (0, 1), prompt[:2], 0),
            ("draft", Phase.WARMUP, (0, 1), (), 0),
            ("draft", Phase.WARMUP, (0,), prompt[1:2], 0),
            ("target", Phase.PREFILL, (2, 3, 4), prompt[2:5], 0),
            ("draft", Phase.INJECT, (1, 2, 3), (), 0),  # placeholder positions: the draft cache ends at 0
            ("draft", Phase.INJECT, (1, 2, 3), prompt[2:5], 0),  # the bridge (token 2, g 1) at 1 first
        ]
    )
    whole = run_flow(target, random_draft(target), prompt, 1, F32, draft_max=2)
    assert trace.rounds == whole.rounds


def test_a_row_the_run_kept_at_the_last_cached_position_is_held_by_the_warm_up_not_bridged(target):
    """llama-server kept the drafter's row 1 (its process() bridges only where no cell holds the
    position): the warm-up writes (the kept token, g 1) at 1 and the prefill decodes no bridge."""
    prompt = (5, 17, 42, 7, 9, 11)
    draft = random_draft(target)
    same = run_flow(target, draft, prompt, 1, F32, draft_max=2, cached=2, draft_cached=(17, prompt[2]))
    assert (
        [_decoded(ev) for ev in same.evals[1:6]]
        == [
            ("draft", Phase.WARMUP, (0, 1), (), 0),
            ("draft", Phase.WARMUP, (0, 1), prompt[1:3], 0),  # the kept row at 1 with the warm-up's g
            ("target", Phase.PREFILL, (2, 3, 4), prompt[2:5], 0),
            ("draft", Phase.INJECT, (2, 3, 4), (), 0),
            ("draft", Phase.INJECT, (2, 3), prompt[3:5], 0),  # no bridge: row 1 is held
        ]
    )
    whole = run_flow(target, draft, prompt, 1, F32, draft_max=2)
    assert same.rounds == whole.rounds  # the kept row is the one the flow prescribes: the same drafts
    other = run_flow(target, draft, prompt, 1, F32, draft_max=2, cached=2, draft_cached=(17, 300))
    assert _decoded(other.evals[2])[3] == (17, 300)  # a row kept from another prompt is held as the run held it
    none = run_flow(target, draft, prompt, 1, F32, draft_max=2, cached=2, draft_cached=(17, -3))
    assert _decoded(none.evals[5])[3] == prompt[2:5]  # no row held there: the prefill bridges it, as upstream does


# p_min 0.17 stops this drafter's rounds at 0, 0 and 3 of 4 drafts (its top-1 probabilities are ~0.13-0.21)
@pytest.mark.parametrize("numerics, draft_max, p_min", [(F16_KV, 3, 0.0), (F32, 4, 0.17)], ids=["draft-max", "p-min"])
def test_following_a_flows_rounds_reproduces_it(target, numerics, draft_max, p_min):
    draft = random_draft(target)
    flow = {"draft_max": draft_max, "p_min": p_min}
    own = run_flow(target, draft, PROMPT, 3, numerics, **flow)
    if p_min:
        assert any(0 < len(r.drafts) < draft_max for r in own.rounds) and any(not r.drafts for r in own.rounds)
    followed = run_flow(target, draft, PROMPT, 3, numerics, **flow, follow=own.rounds)
    guided = run_flow(target, draft, PROMPT, 3, numerics, **flow, guide=own.rounds)
    for other in (followed, guided):
        assert other.rounds == own.rounds
        assert [ev.eval for ev in other.evals] == [ev.eval for ev in own.evals]
        for a, b in zip(own.evals, other.evals):
            assert [n.name for n in a.records] == [n.name for n in b.records]
            assert all(torch.equal(x.array, y.array) for x, y in zip(a.records, b.records))


def test_following_decodes_the_runs_drafts(target):
    draft = random_draft(target)
    run_round = Round(round=1, pos0=3, anchor=PROMPT[3], drafts=(11, 12), accepted=1, target_tokens=(11, 99))
    trace = run_flow(target, draft, PROMPT, 1, F32, draft_max=3, follow=(run_round,))
    draft_evals = [_decoded(ev)[2:4] for ev in trace.evals if ev.eval.phase == Phase.DRAFT]
    # two drafts under draft_max 3: p_min stopped the run at the third row, so both were decoded
    assert draft_evals == [((2,), (PROMPT[3],)), ((3,), (11,)), ((4,), (12,))]
    assert trace.rounds[0] == run_round
    stray = replace(run_round, round=2, pos0=9)
    with pytest.raises(FollowError, match="round 2 of the run starts at position 9"):
        run_flow(target, draft, PROMPT, 2, F32, draft_max=3, follow=(run_round, stray))


def test_check_refuses_the_targets_nextn_and_out_of_range_layers(target):
    n_layer = target.hparams.n_layer
    with pytest.raises(InputError, match="t_h_nextn.*does not model it"):
        check_eagle3_pair(target, random_draft(target, target_layers=(1, 3, n_layer)))
    with pytest.raises(InputError, match="ids must be in"):
        check_eagle3_pair(target, random_draft(target, target_layers=(1, 3, n_layer + 1)))
    with pytest.raises(InputError, match="fc takes"):
        check_eagle3_pair(target, random_draft(target, fc=torch.zeros(target.hparams.n_embd, 10)))


def test_models_entry_names_the_eagle3_layers(target):
    entry = eagle3.eagle3_models_entry(random_draft(target))
    assert entry["architecture"] == names.ARCH_EAGLE3 and entry["target_layers"] == list(TARGET_LAYERS)


# --- the loader ----------------------------------------------------------------------------------


def write_eagle3_gguf(path: Path, draft: Eagle3Draft, n_vocab: int, extra_keys: dict | None = None) -> Path:
    """`draft` as the pinned converter lays an eagle3 GGUF out (keys, tensor names, I64 d2t)."""
    hp, arch = draft.hparams, names.ARCH_EAGLE3
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hp.n_embd)
    w.add_feed_forward_length(hp.n_ff)
    w.add_head_count(hp.n_head)
    w.add_head_count_kv(hp.n_head_kv)
    w.add_layer_norm_rms_eps(hp.rms_eps)
    w.add_rope_freq_base(hp.rope_base)
    w.add_rope_dimension_count(hp.n_embd_head)
    w.add_array(names.KEY_EAGLE3_TARGET_LAYERS, list(draft.target_layers))
    w.add_uint32(names.KEY_EAGLE3_TARGET_HIDDEN, draft.n_embd_tgt)
    w.add_bool(names.KEY_EAGLE3_NORM_BEFORE_FC, draft.norm_before_fc)
    w.add_bool(names.KEY_EAGLE3_NORM_BEFORE_RESIDUAL, draft.norm_before_residual)
    w.add_token_list([f"t{i}" for i in range(n_vocab)])
    for key, value in (extra_keys or {}).items():
        w.add_uint32(key, value)
    layer = {
        "attn_norm": draft.layer.attn_norm,
        eagle3.T_ATTN_NORM_2: draft.attn_norm_2,
        "attn_q": draft.layer.wq,
        "attn_k": draft.layer.wk,
        "attn_v": draft.layer.wv,
        "attn_output": draft.layer.wo,
        "ffn_norm": draft.layer.ffn_norm,
        "ffn_gate": draft.layer.ffn_gate,
        "ffn_up": draft.layer.ffn_up,
        "ffn_down": draft.layer.ffn_down,
    }
    tensors = {names.T_FC: draft.fc, names.T_OUTPUT_NORM: draft.output_norm}
    tensors |= {f"blk.0.{k}.weight": t for k, t in layer.items()}
    if draft.norm_before_fc and draft.enc_norm is not None:
        tensors[names.T_ENC_NORM] = draft.enc_norm
    if draft.output is not None:
        tensors[names.T_OUTPUT] = draft.output
    for name, t in tensors.items():
        w.add_tensor(name, t.numpy().astype(np.float32))
    if draft.d2t is not None:
        w.add_tensor(names.T_D2T, draft.d2t.numpy().astype(np.int64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_round_trip_decodes_the_same(target, tmp_path):
    gen = torch.Generator().manual_seed(7)
    d2t = torch.randperm(target.hparams.n_vocab, generator=gen)[:64].sort().values
    draft = random_draft(
        target, norm_before_fc=True, norm_before_residual=True, d2t=d2t, output=torch.randn(64, 64, generator=gen)
    )
    path = write_eagle3_gguf(tmp_path / "draft.gguf", draft, target.hparams.n_vocab)
    loaded = eagle3_from_gguf(path, torch.float32, torch.device("cpu"))
    assert (loaded.target_layers, loaded.norm_before_fc, loaded.norm_before_residual) == (TARGET_LAYERS, True, True)
    assert loaded.hparams.rope_type == "normal" and loaded.hparams.n_layer == 1
    assert loaded.d2t is not None and torch.equal(loaded.d2t, d2t)
    g, tokens, positions = _g(draft, 2), _ids(4, 8), _ids(0, 1)
    want = decode(draft, target, tokens, g, positions, _cache(draft)).logits
    assert torch.equal(decode(loaded, target, tokens, g, positions, _cache(loaded)).logits, want)
    assert eagle3.eagle3_models_entry(loaded)["target_layers"] == list(TARGET_LAYERS)


def test_loader_refuses_what_it_does_not_model(target, tmp_path):
    draft = random_draft(target)
    n_vocab = target.hparams.n_vocab
    extra = write_eagle3_gguf(tmp_path / "extra.gguf", draft, n_vocab, {"eagle3.attention.sliding_window": 8})
    with pytest.raises(InputError, match="eagle3.attention.sliding_window, which featdiff's EAGLE3 reference"):
        eagle3_from_gguf(extra, torch.float32, torch.device("cpu"))
    two = write_eagle3_gguf(tmp_path / "two.gguf", replace(draft, target_layers=(1, 3)), n_vocab)
    with pytest.raises(InputError, match="requires exactly 3"):
        eagle3_from_gguf(two, torch.float32, torch.device("cpu"))
    no_norm = write_eagle3_gguf(tmp_path / "no-norm.gguf", replace(draft, norm_before_fc=True, enc_norm=None), n_vocab)
    with pytest.raises(InputError, match="lacks enc.output_norm.weight"):
        eagle3_from_gguf(no_norm, torch.float32, torch.device("cpu"))


def test_loader_refuses_another_architecture(tmp_path):
    d = fixtures.write_fixture(tmp_path, "clean")
    with pytest.raises(InputError, match="expected 'eagle3'"):
        eagle3_from_gguf(d / "draft.gguf", torch.float32, torch.device("cpu"))


# --- the pinned converter's drafters (featdiff.factory.eagle3) and llama.cpp ---------------------

LLAMA_TOL = 1e-4  # llama.cpp's eagle3 decoder against the reference, both on an f16 KV cache (seen: ~1e-6)


@pytest.fixture
def converted(eagle3_pairs):
    """variant -> its fixture directory (converted once per session: tests/conftest.py)."""
    return eagle3_pairs


def _eagle3_variants() -> list[str]:
    from featdiff.factory.eagle3 import EAGLE3_VARIANTS

    return list(EAGLE3_VARIANTS)


@pytest.mark.slow
@pytest.mark.parametrize("variant", _eagle3_variants())
def test_converted_drafter_loads_and_runs_two_rounds(converted, variant):
    d = converted(variant)
    # a target family through transformers is read from its HF checkpoint (torchref.load.load_target)
    target = d / ("target-hf" if variant.endswith("qwen3moe") else "target.gguf")
    tgt = load_target(target, torch.float32, torch.device("cpu"))
    draft = eagle3_from_gguf(d / "draft.gguf", torch.float32, torch.device("cpu"))
    check_eagle3_pair(tgt, draft)
    assert draft.hparams.rope_type == "normal" and draft.n_embd_tgt == tgt.hparams.n_embd
    trace = run_flow(tgt, draft, PROMPT, 2, F16_KV, draft_max=3)
    r1, r2 = trace.rounds
    assert (r1.pos0, len(r1.drafts), r2.pos0) == (3, 3, 3 + r1.accepted + 1)
    if draft.d2t is not None:
        assert set(r1.drafts + r2.drafts) <= set(draft.d2t.tolist())
    phases = [ev.eval.phase for ev in trace.evals]
    per_round = [Phase.DRAFT] * 3 + [Phase.VERIFY, Phase.INJECT, Phase.INJECT]
    assert phases == [Phase.PREFILL, Phase.INJECT, Phase.INJECT, *per_round, *per_round]
    assert eagle3.eagle3_models_entry(draft)["target_layers"] == list(draft.target_layers)


@pytest.fixture(scope="module")
def runtime():
    from featdiff.llama.runtime import Runtime

    return Runtime.load()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["eagle3", "eagle3-llama", "eagle3-norm-before-fc", "eagle3-own-embd"])
def test_decoder_matches_llama_cpp_with_normal_rope(converted, runtime, variant):
    """llama.cpp's encoder and a 4-row decoder batch at positions 0..3 (RoPE at work) equal the
    reference's on the converter's GGUF: normal RoPE on its permuted q/k rows; NeoX would not."""
    from featdiff.llama.runtime import Context, Model

    d, positions, tokens = converted(variant), [0, 1, 2, 3], [5, 9, 33, 2]
    tgt_path, draft_path = d / "target.gguf", d / "draft.gguf"
    target = load_target(tgt_path, torch.float32, torch.device("cpu"))
    draft = eagle3_from_gguf(draft_path, torch.float32, torch.device("cpu"))
    features = np.random.default_rng(1).standard_normal((4, draft.fc.shape[1])).astype(np.float32)
    tgt, dft = Model.load(runtime, tgt_path), Model.load(runtime, draft_path)
    ctx_tgt = Context.new(runtime, tgt, 16, 2)
    ctx_dft = Context.new(runtime, dft, 16, 2, ctx_other=ctx_tgt)
    try:
        runtime.lib.fd_set_embeddings_nextn(ctx_dft.ptr, True, True)  # as common/speculative.cpp does
        g = ctx_dft.process_encode(features, positions)  # (4, n_embd)
        ctx_dft.decode_tokens_embd(tokens, g, positions, outputs=True)
        run = np.stack([ctx_dft.logits(i) for i in range(4)])  # (4, n_vocab)
    finally:
        for handle in (ctx_dft, ctx_tgt, dft, tgt):
            handle.free()
    g_ref, _ = encode(draft, torch.from_numpy(features))
    assert np.allclose(g_ref.numpy(), g, atol=LLAMA_TOL)
    for rope_type, agrees in (("normal", True), ("neox", False)):
        hp = replace(draft.hparams, rope_type=rope_type)
        dp = decode(
            replace(draft, hparams=hp),
            target,
            _ids(*tokens),
            torch.from_numpy(g),
            _ids(*positions),
            _cache(draft, F16_KV),
        )
        ref = dp.logits.numpy()
        assert np.array_equal(np.isfinite(ref), np.isfinite(run))  # -inf off the d2t rows
        finite = np.isfinite(ref)
        assert np.allclose(ref[finite], run[finite], atol=LLAMA_TOL) == agrees, rope_type
