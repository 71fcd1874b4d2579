"""The Gemma 4 family (llama.cpp's gemma4) through transformers' model code (issue 24): a tiny
Gemma4 text target built as the dense 31B is (sliding-window layers the tests' prompt outgrows,
full-attention layers with wider heads, keys reused as values and proportional RoPE, q/k/v norms,
attention scale 1, per-layer output scalars, embeddings scaled by sqrt(n_embd), a softcapped tied
head), with its BPE tokenizer.json, converted by the pinned converter with the fixtures' DFlash
drafter converted against it. Its pair compares clean in-process and around llama-server,
`featdiff check` passes, and a drafter tapping the layers one too high, or in reverse slot order,
is named."""

from __future__ import annotations

import json

import pytest
import torch

import featdiff
from featdiff.core import names
from featdiff.factory.hf_families import (
    GEMMA4_GLOBAL_HEAD_DIM,
    GEMMA4_KV_SHARED,
    GEMMA4_PLE_WIDTH,
    GEMMA4_SOFTCAP,
    SLIDING_WINDOW,
    gemma4_layer_types,
)
from featdiff.factory.hf_targets import write_family_fixture
from featdiff.torchref.hf_target import target_from_transformers
import families
from real_flow import DEFAULT_TOKENS

pytestmark = pytest.mark.slow  # the pair is converted (cached per machine)
PROMPT = tuple(int(t) for t in DEFAULT_TOKENS.split(","))
# rel L2 of a layer input, the reference's cached windowed forward vs transformers' eager
# attention over the whole sequence at once (f32 cache): float32 op order only
EAGER_BOUND = 1e-6
NO_WINDOW_MIN = 1e-2  # rel L2 at the first sliding layer's output when the window is ignored


@pytest.fixture(scope="session")
def gemma4(tmp_path_factory):
    """The tiny Gemma 4 pair, converted by the pinned tree's converter (made once)."""
    return write_family_fixture(tmp_path_factory.mktemp("fam-gemma4"), "gemma4")


@pytest.fixture(scope="session")
def gemma4_ple_moe(tmp_path_factory):
    """The second tiny Gemma 4 pair: per-layer embeddings, shared KV layers, an MoE block."""
    return write_family_fixture(tmp_path_factory.mktemp("fam-gemma4-ple-moe"), "gemma4-ple-moe")


@pytest.fixture(params=["gemma4", "gemma4_ple_moe"])
def either(request):
    """Each Gemma 4 pair in turn."""
    return request.getfixturevalue(request.param)


def test_fixture_runs_what_llama_cpp_must_reproduce(gemma4):
    """The window (outgrown by the prompt), the full layers' wide heads, keys as values and
    proportional RoPE, the layer scalars, softcapping and the drafter's taps on both layer kinds."""
    from gguf import GGUFReader

    config = json.loads((gemma4 / "target-hf" / names.HF_CONFIG).read_text())
    assert config["model_type"] == "gemma4_text" and config["sliding_window"] == SLIDING_WINDOW < len(PROMPT)
    assert config["attention_k_eq_v"] and config["rope_parameters"]["full_attention"]["rope_type"] == "proportional"
    g = GGUFReader(str(gemma4 / "target.gguf"))
    assert g.fields["general.architecture"].contents() == "gemma4"
    assert g.fields["tokenizer.ggml.model"].contents() == "gemma4"  # the converter read tokenizer.json
    assert g.fields["gemma4.attention.key_length"].contents() == GEMMA4_GLOBAL_HEAD_DIM
    assert g.fields["gemma4.final_logit_softcapping"].contents() == GEMMA4_SOFTCAP
    swa = [bool(x) for x in g.fields["gemma4.attention.sliding_window_pattern"].contents()]
    assert swa == [t == "sliding_attention" for t in gemma4_layer_types(len(swa))]
    tensors = {t.name: t for t in g.tensors}
    assert "rope_freqs.weight" in tensors and "blk.2.attn_v.weight" not in tensors  # keys as values
    scalars = [float(tensors[f"blk.{il}.layer_output_scale.weight"].data[0]) for il in range(len(swa))]
    assert all(abs(s - 1.0) > 1e-4 for s in scalars)  # each layer's scalar is applied, not a no-op
    tapped = [il - 1 for il in families.draft_layers(gemma4 / "draft.gguf")]  # outputs of these layers
    assert {swa[il + 1] for il in tapped} == {True, False}  # inputs of a sliding and a full layer
    d = GGUFReader(str(gemma4 / "draft.gguf"))
    assert d.fields["tokenizer.ggml.model"].contents() == "gemma4"  # converted against its target


def test_second_fixture_runs_per_layer_embeddings_shared_kv_and_experts(gemma4_ple_moe):
    from gguf import GGUFReader

    g = GGUFReader(str(gemma4_ple_moe / "target.gguf"))
    assert g.fields["gemma4.attention.shared_kv_layers"].contents() == GEMMA4_KV_SHARED
    assert g.fields["gemma4.embedding_length_per_layer_input"].contents() == GEMMA4_PLE_WIDTH
    n_ff = [int(x) for x in g.fields["gemma4.feed_forward_length"].contents()]
    assert n_ff[-1] == 2 * n_ff[0]  # the shared layers' double-wide MLPs
    tensors = {t.name for t in g.tensors}
    assert {"per_layer_token_embd.weight", "blk.0.ffn_gate_inp.weight", "blk.0.inp_gate.weight"} <= tensors
    assert "blk.5.attn_k.weight" not in tensors  # a shared layer keeps no K of its own


def test_cached_windowed_forward_equals_transformers_eager(either):
    """The flow's cache through the ggml attention (shared KV layers included) equals
    transformers' own eager attention over the whole sequence, softcapped logits too; ignoring
    the window does not."""
    families.assert_cached_forward_equals_eager(either, PROMPT, EAGER_BOUND, NO_WINDOW_MIN)


def test_published_layout_runs_as_its_text_model(gemma4, tmp_path):
    """A published Gemma 4 directory (model_type gemma4: Gemma4ForConditionalGeneration, the text
    model under `model.language_model.*` beside a vision tower) gives the reference the same
    target as the text-only directory: its layer inputs and logits bit for bit."""
    from transformers import AutoModelForCausalLM, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    from featdiff.torchref.attention import empty_cache
    from featdiff.torchref.hf_target import forward_hf

    text = AutoModelForCausalLM.from_pretrained(gemma4 / "target-hf")
    vision = Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16,
    )  # fmt: skip
    composite = Gemma4ForConditionalGeneration(
        Gemma4Config(text_config=text.config.to_dict(), vision_config=vision.to_dict(), audio_config=None)
    )
    composite.model.language_model.load_state_dict(text.model.state_dict())
    composite.save_pretrained(tmp_path / "published")
    assert json.loads((tmp_path / "published" / names.HF_CONFIG).read_text())["model_type"] == "gemma4"
    tokens = torch.tensor(PROMPT)
    passes = []
    for path in (gemma4 / "target-hf", tmp_path / "published"):
        hf = target_from_transformers(path, torch.float32, torch.device("cpu"))
        hp = hf.hparams
        assert (hp.arch, hp.n_layer, hp.n_swa) == ("gemma4", len(gemma4_layer_types(hp.n_layer)), SLIDING_WINDOW)
        cache = empty_cache(hp.n_layer, hp.n_head_kv, hp.n_embd_head, "f32", torch.device("cpu"))
        with torch.no_grad():
            passes.append(forward_hf(hf, tokens, torch.arange(len(tokens)), cache, True))
    a, b = passes
    assert all(torch.equal(x, y) for x, y in zip(a.layer_inputs, b.layer_inputs, strict=True))
    assert torch.equal(a.logits, b.logits)


def test_gemma4_pair_compares_clean_with_nothing_skipped(either, tmp_path):
    result = families.assert_clean_in_process(either, tmp_path, embd="inp_scaled")
    paired = {(r["role"], r["name"]) for r in result["records"]}
    assert ("target", names.TARGET_EMBD) in paired  # the unscaled lookup too, not aliased to layer 0


def test_gemma4_moe_reference_records_its_router_margins(gemma4_ple_moe, tmp_path):
    """Gemma 4's router returns probabilities: the margins are its projection's logits'."""
    from featdiff.dump.reader import read_dump

    ref = featdiff.reference(
        gemma4_ple_moe / "target-hf", gemma4_ple_moe / "draft.gguf", tmp_path / "ref.npz", tokens=DEFAULT_TOKENS
    )
    d = read_dump(ref)
    margins = [r for r in d.manifest.records if r.name.endswith("@" + names.HYP_ROUTER_MARGIN)]
    assert {r.name for r in margins} == {f"l_out-{il}@{names.HYP_ROUTER_MARGIN}" for il in range(6)}
    first = d.array(margins[0])  # (n_tokens, 2): top-k margin, router logits' rms
    assert (first[:, 0] >= 0).all() and (first[:, 1] > 0).all()


def test_gemma4_pair_around_llama_server_compares_clean(either, tools, tmp_path):
    families.assert_clean_around_server(either, tools, tmp_path)


def test_gemma4_check_passes_and_its_accept_agrees(gemma4, tmp_path):
    families.assert_check_passes(gemma4, tmp_path)


def test_gemma4_layers_off_by_one_is_a_layer_offset(gemma4, tools, tmp_path):
    families.assert_layer_offset_named(gemma4, tools, tmp_path)


def test_gemma4_slots_reversed_is_a_slot_permutation(gemma4, tools, tmp_path):
    families.assert_slots_reversed_named(gemma4, tools, tmp_path)
