"""The Nemotron-H family (llama.cpp's nemotron_h_moe) through transformers' model code (issue 24):
a tiny NemotronH target built as Nemotron 3 Nano is (one block kind per layer: Mamba2, attention
without RoPE, an MoE of squared-ReLU experts with a shared expert and a sigmoid router with a
choice bias), with a GPT-2 byte-level tokenizer.json, converted by the pinned converter with the
fixtures' DFlash drafter converted against it. Rejected drafts must leave the Mamba2 state; the
pair compares clean in-process and around llama-server, `featdiff check` passes, and a drafter
tapping the layers one too high, in reverse slot order, or a run whose recurrent state kept the
rejected drafts, is named."""

from __future__ import annotations

import json

import pytest
import torch

from featdiff.core import names
from featdiff.factory.hf_families import NEMOTRON_H_BLOCKS
from featdiff.factory.hf_targets import write_family_fixture
from featdiff.torchref.hf_taps import L_OUT_NAMES, layer_out_name
from featdiff.torchref.hf_target import target_from_transformers
import families
from real_flow import DEFAULT_TOKENS

pytestmark = pytest.mark.slow  # the pair is converted (cached per machine)
PROMPT = tuple(int(t) for t in DEFAULT_TOKENS.split(","))
EAGER_BOUND = 1e-5  # rel L2, the cached forward with its rolled-back Mamba2 state vs eager (measured below 1e-6)
BLOCK_OUT = L_OUT_NAMES["nemotron_h"]


@pytest.fixture(scope="session")
def nemotron(tmp_path_factory):
    """The tiny Nemotron-H pair, converted by the pinned tree's converter (made once)."""
    return write_family_fixture(tmp_path_factory.mktemp("fam-nemotron-h"), "nemotron_h")


def test_fixture_runs_what_llama_cpp_must_reproduce(nemotron):
    """Mamba2, attention and MoE blocks, the router's choice bias, a byte-level vocabulary, and
    taps on an attention and an MoE layer's inputs behind Mamba2 layers."""
    from gguf import GGUFReader

    config = json.loads((nemotron / "target-hf" / names.HF_CONFIG).read_text())
    assert config["model_type"] == "nemotron_h" and config["layers_block_type"] == list(NEMOTRON_H_BLOCKS)
    g = GGUFReader(str(nemotron / "target.gguf"))
    assert g.fields["general.architecture"].contents() == "nemotron_h_moe"
    assert g.fields["tokenizer.ggml.model"].contents() == "gpt2"
    tensors = {t.name for t in g.tensors}
    assert {"blk.0.ssm_in.weight", "blk.1.exp_probs_b.bias", "blk.2.attn_q.weight"} <= tensors
    tapped = [il for il in families.draft_layers(nemotron / "draft.gguf")]  # inputs of these layers
    assert [NEMOTRON_H_BLOCKS[il] for il in tapped] == ["full_attention", "moe"]
    assert NEMOTRON_H_BLOCKS[0] == "linear_attention"  # a Mamba2 state before both taps
    d = GGUFReader(str(nemotron / "draft.gguf"))
    assert d.fields["tokenizer.ggml.model"].contents() == "gpt2"  # converted against its target


def test_rolled_back_mamba_state_equals_transformers_eager(nemotron):
    """Prefill, a rejected block rolled back, the accepted rows: each Mamba2 layer rerun over the
    accepted history equals transformers' eager forward over the whole sequence."""
    families.assert_cached_forward_equals_eager(nemotron, PROMPT, EAGER_BOUND)


def test_reference_names_the_layer_outputs_as_the_graph_does(nemotron):
    """nemotron-h.cpp's `l_out` is an FFN block's output before the residual; the layer's output is
    `nemotron_h_block_out`. The reference writes both under those names."""
    from featdiff.torchref.attention import empty_cache
    from featdiff.torchref.hf_target import forward_hf

    hf = target_from_transformers(nemotron / "target-hf", torch.float32, torch.device("cpu"))
    hp = hf.hparams
    cache = empty_cache(hp.n_layer, hp.n_head_kv, hp.n_embd_head, "f32", torch.device("cpu"))
    with torch.no_grad():
        ran = forward_hf(hf, torch.tensor(PROMPT), torch.arange(len(PROMPT)), cache, True)
    got = {r.name: r.array for r in ran.records}
    moe = [il for il, kind in enumerate(NEMOTRON_H_BLOCKS) if kind == "moe"]
    assert {names.layer_name(names.L_OUT, il) for il in range(hp.n_layer)} & set(got) == {
        names.layer_name(names.L_OUT, il) for il in moe
    }
    for il in moe:  # the block's output is its input plus the FFN's
        block = got[layer_out_name(hp.arch, il)] - got[names.layer_name(names.LAYER_INP, il)]
        assert torch.allclose(block, got[names.layer_name(names.L_OUT, il)], atol=1e-5)
    assert {f"{layer_out_name(hp.arch, il)}@{names.HYP_ROUTER_MARGIN}" for il in moe} <= set(got)


def test_nemotron_pair_compares_clean_with_nothing_skipped(nemotron, tmp_path):
    families.assert_clean_in_process(nemotron, tmp_path, l_out=BLOCK_OUT)


def test_nemotron_pair_around_llama_server_compares_clean(nemotron, tools, tmp_path):
    families.assert_clean_around_server(nemotron, tools, tmp_path)


def test_nemotron_check_passes_and_its_accept_agrees(nemotron, tmp_path):
    families.assert_check_passes(nemotron, tmp_path)


def test_nemotron_layers_off_by_one_is_a_layer_offset(nemotron, tools, tmp_path):
    families.assert_layer_offset_named(nemotron, tools, tmp_path)


def test_nemotron_slots_reversed_is_a_slot_permutation(nemotron, tools, tmp_path):
    families.assert_slots_reversed_named(nemotron, tools, tmp_path)


def test_nemotron_mamba_state_that_kept_the_rejected_drafts_is_named(nemotron, tmp_path, monkeypatch):
    f = families.assert_recurrent_kept_rejected_named(nemotron, tmp_path, monkeypatch)
    assert f["tensor"].split("-")[0] in (BLOCK_OUT, names.L_OUT)


def test_nemotron_gguf_as_reference_target_exits_2_asking_for_its_hf_dir(nemotron, tmp_path):
    """The converted GGUF says nemotron_h_moe, not the HF model_type's name: still refused by name."""
    from typer.testing import CliRunner

    from featdiff.cli import app

    args = ["reference", "--target", str(nemotron / "target.gguf"), "--model", str(nemotron / "draft.gguf")]
    result = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "r.npz"), "--tokens", "1,2,3"])
    assert result.exit_code == 2, result.output
    assert "'nemotron_h_moe' runs through transformers" in result.output and "HF checkpoint directory" in result.output
