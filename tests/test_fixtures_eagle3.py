"""The EAGLE3 fixture pairs (featdiff.factory.eagle3): the checkpoint each variant writes, the
pinned converter's GGUF of it (keys, tensors and shapes as src/models/eagle3.cpp loads them,
values as the checkpoint's), llama.cpp loading and running the pair as the checkpoint says, and
the trained pair's target, drafter and held-out prompts (its accept: tests/training/test_eagle3_training.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.factory.converter import CONVERTER
from featdiff.factory.eagle3 import (
    DRAFT,
    EAGLE3_SETTINGS,
    EAGLE3_VARIANTS,
    FC_NORM_TENSOR,
    GGUF_FROM_HF,
    HF_ARCH,
    HF_AUX_LAYER_IDS,
    N_EXTRACT,
    N_SPECIAL,
    ROPE_PERMUTED,
    TRAINED_N_VOCAB,
    Eagle3Variant,
    converted_weights,
    eagle3_weights,
    write_eagle3_fixture,
)
from featdiff.factory.fixtures import HELD_OUT_PROMPTS, PROMPTS_FILE, _permute_qk_for_ggml, write_fixture
from featdiff.factory.pairs import RMS_EPS, TINY

N_TGT = TINY.target.n_embd
UNTRAINED = [name for name, v in EAGLE3_SETTINGS.items() if not v.is_trained]  # drawn, not trained: fast
TRAINED = "trained-eagle3"
N_CTX, N_THREADS = 16, 2
PROBE_TOKEN = 5  # any token: with one row at position 0 attention is that row's V, q/k play no part
# llama.cpp's logits against the numpy drafter's: the KV cache holds V in f16 (~1e-3 relative)
KV_F16_TOL = 1e-2
FC_TOL = 1e-5  # the encoder: one f32 matmul (and an RMSNorm) each side


@pytest.fixture
def pair(eagle3_pairs):
    """variant -> its fixture directory (converted once per session: tests/conftest.py)."""
    return eagle3_pairs


def _contents(path: Path) -> tuple[dict, dict]:
    """A GGUF's keys and tensors: name -> value, name -> (ggml type, array in numpy order)."""
    reader = GGUFReader(str(path))
    keys = {f.name: f.contents() for f in reader.fields.values()}
    return keys, {t.name: (t.tensor_type.name, np.array(t.data)) for t in reader.tensors}


def _expected_shapes(v: Eagle3Variant) -> dict[str, tuple[int, ...]]:
    """What llama_model_eagle3::load_arch_tensors creates (its ne reversed: numpy order)."""
    s, n_inp = DRAFT, N_EXTRACT * N_TGT
    shapes = {
        "fc.weight": (s.n_embd, n_inp),
        "output_norm.weight": (s.n_embd,),
        "output.weight": (v.n_vocab_draft, s.n_embd),
        "d2t": (v.n_vocab_draft,),
        "blk.0.attn_norm.weight": (s.n_embd,),
        "blk.0.attn_norm_2.weight": (s.n_embd,),
        "blk.0.attn_q.weight": (s.n_head * s.n_embd_head, 2 * s.n_embd),
        "blk.0.attn_k.weight": (s.n_head_kv * s.n_embd_head, 2 * s.n_embd),
        "blk.0.attn_v.weight": (s.n_head_kv * s.n_embd_head, 2 * s.n_embd),
        "blk.0.attn_output.weight": (s.n_embd, s.n_head * s.n_embd_head),
        "blk.0.ffn_norm.weight": (s.n_embd,),
        "blk.0.ffn_gate.weight": (s.n_ff, s.n_embd),
        "blk.0.ffn_up.weight": (s.n_ff, s.n_embd),
        "blk.0.ffn_down.weight": (s.n_embd, s.n_ff),
    }
    if v.norm_before_fc:
        shapes["enc.output_norm.weight"] = (n_inp,)
    if v.has_own_embeddings:
        shapes["token_embd.weight"] = (v.n_vocab, s.n_embd)
    return shapes


def _expected_target_layers(v: Eagle3Variant) -> list[int]:
    n = TINY.target.n_layer
    return list(v.target_layers) if v.target_layers is not None else [2, n // 2, n - 3]  # the converter's default


# --- the checkpoint ------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [write_eagle3_fixture, eagle3_weights])
def test_an_unknown_variant_is_refused_in_one_line_naming_the_choices(tmp_path, call):
    args = (tmp_path / "out", "eagle4") if call is write_eagle3_fixture else ("eagle4", 0)
    with pytest.raises(InputError) as e:
        call(*args)
    assert "\n" not in str(e.value) and "'eagle4'" in str(e.value)
    assert all(name in str(e.value) for name in EAGLE3_VARIANTS)
    assert not (tmp_path / "out").exists()


def test_the_variant_table_and_its_settings_agree():
    assert EAGLE3_VARIANTS == {name: v.doc for name, v in EAGLE3_SETTINGS.items()}
    assert {"eagle3", "eagle3-full-vocab", "eagle3-norm-before-fc", "eagle3-llama", "eagle3-default-layers"} <= set(
        EAGLE3_VARIANTS
    )
    assert [name for name, v in EAGLE3_SETTINGS.items() if v.is_trained] == [TRAINED]


def test_the_trained_variant_is_the_trained_pairs_shape():
    """What the table states of the trained pair (without importing torch) is what training makes."""
    from featdiff.factory.training import TRAINED_SIZES
    from featdiff.factory.training.eagle3 import eagle3_layers

    v = EAGLE3_SETTINGS[TRAINED]
    assert v.n_vocab == v.n_vocab_draft == TRAINED_N_VOCAB == TRAINED_SIZES.n_vocab
    assert v.target_layers == eagle3_layers(TRAINED_SIZES) and v.target_variant == "clean"
    assert (v.norm_before_fc, v.has_own_embeddings) == (False, False)


@pytest.mark.parametrize("variant", UNTRAINED)
def test_draft_vocabulary_is_sorted_target_ids_holding_the_special_tokens(variant):
    v, w = EAGLE3_SETTINGS[variant], eagle3_weights(variant, seed=0)
    ids = w["d2t"] + np.arange(w["d2t"].size)  # HF offsets -> target ids
    assert w["d2t"].dtype == np.int64 and ids.size == v.n_vocab_draft == w["lm_head.weight"].shape[0]
    assert np.all(np.diff(ids) > 0) and ids[0] == 0 and ids[-1] < TINY.n_vocab
    assert set(range(N_SPECIAL)) <= set(ids.tolist())
    assert w["t2d"].dtype == np.bool_ and np.array_equal(np.flatnonzero(w["t2d"]), ids)
    if v.n_vocab_draft == TINY.n_vocab:
        assert not w["d2t"].any()  # identity: all offsets zero


@pytest.mark.parametrize("variant", UNTRAINED)
def test_weights_are_seeded_and_hold_the_variants_tensors(variant):
    v, w = EAGLE3_SETTINGS[variant], eagle3_weights(variant, seed=0)
    again, other = eagle3_weights(variant, seed=0), eagle3_weights(variant, seed=1)
    assert all(np.array_equal(w[k], again[k]) for k in w)
    assert not np.array_equal(w["fc.weight"], other["fc.weight"])
    assert ("input_norm.weight" in w) == v.norm_before_fc
    assert ("embed_tokens.weight" in w) == v.has_own_embeddings
    assert set(converted_weights(w)) - {"t2d"} <= set(GGUF_FROM_HF)
    assert (FC_NORM_TENSOR.format(k=0) in w) == v.fc_norm
    assert w["fc.weight"].shape == (DRAFT.n_embd, N_EXTRACT * N_TGT)


# --- the converter's GGUF ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("variant", EAGLE3_VARIANTS)
def test_converted_drafter_has_the_keys_and_tensors_eagle3_cpp_loads(pair, variant):
    v, d = EAGLE3_SETTINGS[variant], pair(variant)
    keys, tensors = _contents(d / "draft.gguf")
    assert keys[names.KEY_ARCH] == names.ARCH_EAGLE3
    assert keys[names.KEY_EAGLE3_TARGET_LAYERS] == _expected_target_layers(v)
    assert keys[names.KEY_EAGLE3_TARGET_HIDDEN] == N_TGT
    flags = (keys[names.KEY_EAGLE3_NORM_BEFORE_RESIDUAL], keys[names.KEY_EAGLE3_NORM_BEFORE_FC])
    assert flags == (False, v.norm_before_fc)
    assert {n: a.shape for n, (_, a) in tensors.items()} == _expected_shapes(v)
    assert {n: t for n, (t, _) in tensors.items()} == {n: "I64" if n == "d2t" else "F32" for n in tensors}
    line = (d / "VARIANT").read_text()
    assert line == f"{variant}: {v.doc} (converted by {CONVERTER})\n"


@pytest.mark.slow
@pytest.mark.parametrize("variant", EAGLE3_VARIANTS)
def test_converted_tensors_are_the_checkpoints_with_qk_permuted_and_d2t_absolute(pair, variant):
    w = converted_weights(eagle3_weights(variant, seed=0))
    _, tensors = _contents(pair(variant) / "draft.gguf")
    for hf, a in w.items():
        if hf == "t2d":
            continue
        got = tensors[GGUF_FROM_HF[hf]][1]
        if hf == "d2t":
            want = a + np.arange(a.size)  # the converter writes absolute target ids
        elif hf in ROPE_PERMUTED:
            want = _permute_qk_for_ggml(a, ROPE_PERMUTED[hf])
            assert not np.array_equal(got, a)
        else:
            want = a
        assert np.array_equal(got, want), hf


@pytest.mark.slow
def test_default_layers_are_the_converters_two_half_and_minus_three(pair):
    """The 6-layer target, no `eagle_aux_hidden_state_layer_ids`: [2, 6 // 2, 6 - 3]."""
    config = json.loads((pair("eagle3-default-layers") / "draft-hf" / "config.json").read_text())
    assert HF_AUX_LAYER_IDS not in config
    keys, _ = _contents(pair("eagle3-default-layers") / "draft.gguf")
    assert keys[names.KEY_EAGLE3_TARGET_LAYERS] == [2, 3, 3]


@pytest.mark.slow
def test_writing_twice_over_a_dflash_pair_gives_the_same_files(tmp_path):
    d = write_fixture(tmp_path / "fx", "clean")  # a DFlash draft-hf/ in the way
    write_eagle3_fixture(d, "eagle3")
    first = _files(d)
    write_eagle3_fixture(d, "eagle3")
    assert _files(d) == first
    assert sorted(first) == [
        "VARIANT",
        "draft-hf/config.json",
        "draft-hf/model.safetensors",
        "draft.gguf",
        "target-hf/config.json",
        "target-hf/model.safetensors",
        "target-hf/tokenizer.model",
        "target.gguf",
    ]
    assert sorted(p.name for p in d.iterdir()) == ["VARIANT", "draft-hf", "draft.gguf", "target-hf", "target.gguf"]
    assert json.loads((d / "draft-hf" / "config.json").read_text())["architectures"] == [HF_ARCH]


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# --- llama.cpp -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime():
    from featdiff.llama.runtime import Runtime

    return Runtime.load()


@pytest.mark.slow
@pytest.mark.parametrize("variant", EAGLE3_VARIANTS)
def test_llama_cpp_runs_the_pair_as_the_checkpoint_says(pair, runtime, variant):
    """llama.cpp loads the pair (the drafter borrowing the target's context), reads the target
    layers, and its encoder (fc) and one decoder row agree with the HF weights in numpy."""
    from featdiff.llama.runtime import Context, Model

    v, d, w = EAGLE3_SETTINGS[variant], pair(variant), converted_weights(eagle3_weights(variant, seed=0))
    features = np.random.default_rng(1).standard_normal((1, N_EXTRACT * N_TGT)).astype(np.float32)
    tgt, dft = Model.load(runtime, d / "target.gguf"), Model.load(runtime, d / "draft.gguf")
    ctx_tgt = Context.new(runtime, tgt, N_CTX, N_THREADS)
    ctx_dft = Context.new(runtime, dft, N_CTX, N_THREADS, ctx_other=ctx_tgt)
    try:
        assert dft.target_layer_ids() == _expected_target_layers(v)
        runtime.lib.fd_set_embeddings_nextn(ctx_dft.ptr, True, True)  # as common/speculative.cpp does for EAGLE3
        g = ctx_dft.process_encode(features, [0])  # (1, n_embd)
        assert np.allclose(g, _fc(w, features), atol=FC_TOL)
        ctx_dft.decode_tokens_embd([PROBE_TOKEN], g, [0], outputs=True)
        logits = ctx_dft.logits(0)  # (n_vocab,)
    finally:
        for handle in (ctx_dft, ctx_tgt, dft, tgt):
            handle.free()
    table = w["embed_tokens.weight"] if v.has_own_embeddings else _target_table(d)
    want = _decoder_logits(w, table[PROBE_TOKEN], g[0], v.n_vocab)
    assert np.array_equal(np.isfinite(logits), np.isfinite(want))  # -inf off the draft vocabulary
    finite = np.isfinite(want)
    assert np.allclose(logits[finite], want[finite], rtol=KV_F16_TOL, atol=KV_F16_TOL)


def _target_table(d: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(str(d / "target-hf" / "model.safetensors"))["model.embed_tokens.weight"]


def _rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + RMS_EPS) * weight


def _fc(w: dict, features: np.ndarray) -> np.ndarray:
    if "input_norm.weight" in w:
        features = _rms(features, w["input_norm.weight"])
    return features @ w["fc.weight"].T  # (n_tokens, n_embd)


def _decoder_logits(w: dict, embd: np.ndarray, g: np.ndarray, n_vocab: int) -> np.ndarray:
    """The EAGLE3 layer on one row at position 0 from the HF weights: attention over that row
    alone is its V (each head reading its KV head), so q/k and RoPE drop out; logits over the
    target vocabulary, -inf off the draft one."""
    m = "midlayer."
    x = np.concatenate(
        [_rms(embd, w[m + "input_layernorm.weight"]), _rms(g, w[m + "hidden_norm.weight"])]
    )  # (2 n_embd,)
    v = w[m + "self_attn.v_proj.weight"] @ x  # (n_head_kv * n_embd_head,)
    per_kv = v.reshape(DRAFT.n_head_kv, DRAFT.n_embd_head)  # (n_head_kv, n_embd_head)
    heads = np.repeat(per_kv, DRAFT.n_head // DRAFT.n_head_kv, axis=0)  # (n_head, n_embd_head): head h reads h // 2
    h = g + w[m + "self_attn.o_proj.weight"] @ heads.reshape(-1)  # residual: the raw g (norm_before_residual false)
    y = _rms(h, w[m + "post_attention_layernorm.weight"])
    gate, up = w[m + "mlp.gate_proj.weight"] @ y, w[m + "mlp.up_proj.weight"] @ y
    h = h + w[m + "mlp.down_proj.weight"] @ (gate / (1 + np.exp(-gate)) * up)
    draft = w["lm_head.weight"] @ _rms(h, w["norm.weight"])  # (n_vocab_draft,)
    logits = np.full(n_vocab, -np.inf, dtype=np.float32)
    logits[w["d2t"] + np.arange(w["d2t"].size)] = draft
    return logits


# --- the trained pair ----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_trained_pair_is_the_trained_target_drafter_and_held_out_prompts(pair):
    from safetensors.numpy import load_file

    from featdiff.factory.training import TRAINED_SIZES, held_out_prompts
    from featdiff.factory.training.eagle3 import target_weights, trained_eagle3
    from featdiff.verdict.probe import read_prompts

    d = pair(TRAINED)
    target = load_file(str(d / "target-hf" / "model.safetensors"))
    assert np.array_equal(target["model.embed_tokens.weight"], target_weights(0)["token_embd"])
    assert np.array_equal(target["lm_head.weight"], target_weights(0)["output"])
    drafter = load_file(str(d / "draft-hf" / "model.safetensors"))
    assert drafter.keys() == trained_eagle3(0).draft.keys()
    assert all(np.array_equal(drafter[k], a) for k, a in trained_eagle3(0).draft.items())
    config = json.loads((d / "draft-hf" / "config.json").read_text())
    assert (config["vocab_size"], config["draft_vocab_size"]) == (TRAINED_N_VOCAB, TRAINED_N_VOCAB)
    prompts = tuple(p.tokens for p in read_prompts(d / PROMPTS_FILE))
    assert prompts == held_out_prompts(0, HELD_OUT_PROMPTS, TRAINED_SIZES)
    keys, tensors = _contents(d / "target.gguf")
    assert len(keys["tokenizer.ggml.tokens"]) == TRAINED_N_VOCAB == tensors["token_embd.weight"][1].shape[0]


@pytest.mark.slow
def test_an_untrained_pair_over_a_trained_one_drops_its_prompts(pair, tmp_path):
    d = tmp_path / "fx"
    shutil.copytree(pair(TRAINED), d)
    assert (d / PROMPTS_FILE).is_file()
    write_eagle3_fixture(d, "eagle3")
    assert not (d / PROMPTS_FILE).exists()
    assert sorted(p.name for p in d.iterdir()) == ["VARIANT", "draft-hf", "draft.gguf", "target-hf", "target.gguf"]
