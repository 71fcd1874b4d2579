"""Nemotron-H's MTP head (issue 44, llama.cpp's nemotron_h_moe): the `mtp-nemotron-h-moe` fixture as
the pinned converter writes it (transformers has no model code for the head: its `mtp.layers.0/1`
are laid out as conversion/nemotron.py expects and folded into block n_layer), and the correct pair
compared clean in-process (rounds with rejected drafts: nemotron_h_moe rolls its Mamba2 state back,
llm_arch_supports_rs_rollback) and around llama-speculative-simple and llama-server."""

from __future__ import annotations

import re

import numpy as np
import pytest
from mtp_head_runs import (
    PROGRAMS,
    TOKENS,
    assert_clean_around,
    assert_no_shift_named,
    assert_refused,
)

from featdiff.core import names
from featdiff.core.gguf_reader import array_from_tensor, int_meta, meta, read_gguf
from featdiff.diff import compare_dumps
from featdiff.driver.capture import capture
from featdiff.dump.reader import read_dump
from featdiff.factory.gguf_rewrite import rewrite_gguf
from featdiff.factory.hf_families import N_EXPERT
from featdiff.factory.mtp import HF_SAFETENSORS
from featdiff.factory.mtp_nemotron import GGUF_FROM_HF_NEMOTRON
from featdiff.factory.pairs import TINY
from featdiff.torchref.kind import reference

pytestmark = pytest.mark.slow  # the pinned converter makes the pair (cached per machine)

VARIANT = "mtp-nemotron-h-moe"
ARCH = names.ARCH_NEMOTRON_H_MOE
IL = TINY.target.n_layer  # the head's block
HEAD = f"mtp_post_ffn-{IL}"


def test_the_converter_folds_both_sub_layers_into_one_block(mtp_pairs):
    """Block n_layer holds the input fusion, the NoPE attention, the MoE sub-layer (squared-ReLU
    experts: up and down only, a choice bias, an ungated shared expert) and the head's LayerNorm."""
    m = read_gguf(mtp_pairs(VARIANT) / "target.gguf")
    assert m.arch == ARCH
    assert int_meta(m, names.KEY_NEXTN_LAYERS.format(arch=ARCH)) == 1
    assert int_meta(m, names.KEY_BLOCK_COUNT.format(arch=ARCH)) == IL + 1
    block = {t.removeprefix(f"blk.{IL}.") for t in m.tensors if t.startswith(f"blk.{IL}.")}
    nextn = {f"nextn.{n}.weight" for n in (names.NEXTN_EH_PROJ, "enorm", "hnorm", "shared_head_norm")}
    attention = {f"attn_{p}.weight" for p in ("norm", "q", "k", "v", "output")}
    moe = {f"ffn_{p}.weight" for p in ("up_exps", "down_exps", "up_shexp", "down_shexp", "gate_inp")}
    assert block == nextn | attention | moe | {"post_attention_norm.weight", "exp_probs_b.bias"}
    assert m.tensors[f"blk.{IL}.ffn_up_exps.weight"].ne[2] == N_EXPERT
    assert f"{ARCH}.attention.layer_norm_rms_epsilon" not in m.reader.fields  # the head norm's eps serves all
    assert meta(m, names.KEY_NORM_EPS) > 0


def test_the_heads_values_are_the_checkpoints(mtp_pairs):
    """The converter writes every tensor of the head block from the checkpoint's `mtp.layers.0/1` as it
    is (norms too: Nemotron-H's are plain weights; expert x: slice x of the stacked experts), but q
    and k, whose rows it reorders per head for RoPE (GraniteHybridModel.undo_permute: LlamaModel.permute)
    though the head has none: both the same way, so the NoPE attention's scores are the checkpoint's."""
    from safetensors.numpy import load_file

    d = mtp_pairs(VARIANT)
    w, m = load_file(str(d / "target-hf" / HF_SAFETENSORS)), read_gguf(d / "target.gguf")
    assert set(GGUF_FROM_HF_NEMOTRON.values()) == {t for t in m.tensors if t.startswith(f"blk.{IL}.")}
    for hf, name in GGUF_FROM_HF_NEMOTRON.items():
        got = array_from_tensor(m, name)
        if expert := re.search(r"\.experts\.(\d+)\.", hf):
            got = got[int(expert.group(1))]
        heads = {"attn_q": TINY.target.n_head, "attn_k": TINY.target.n_head_kv}.get(name.split(".")[2])
        assert np.array_equal(got, w[hf] if heads is None else _rope_permuted(w[hf], heads)), hf


def _rope_permuted(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute: each head's rows [first half, second half] interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def test_the_in_process_flow_compares_clean(mtp_pairs, tmp_path):
    """Three rounds in-process (every draft rejected by the random head, so the target's Mamba2
    state is rolled back each round) compare clean, nothing skipped; the catch-up decodes crop
    their rows before the head's FFN: mtp_post_ffn has none, mtp_attn_residual all."""
    d = mtp_pairs(VARIANT)
    run = capture(d / "target.gguf", d / "target.gguf", tmp_path / "run.npz", tokens=TOKENS, rounds=3)
    ref = reference(
        d / "target-hf", d / "target.gguf", tmp_path / "ref.npz", prompt=None, tokens=TOKENS, rounds=3,
        dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None, run=run,
    )  # fmt: skip
    c = compare_dumps(ref, run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    assert not c.skipped
    paired = {(p.name, p.phase) for p in c.pairs}
    assert {("mtp_h_input", "draft"), (HEAD, "draft"), (names.H_NEXTN, "draft"), (names.H_NEXTN, "verify")} <= paired
    with read_dump(run) as dump:
        m = dump.manifest
    assert m.models["draft"]["architecture"] == ARCH and len([r for r in m.rounds if r.drafts]) == 3
    catch_up = [r for r in m.records if r.phase == "inject" and r.name in (HEAD, f"mtp_attn_residual-{IL}")]
    assert {r.shape[0] == 0 for r in catch_up if r.name == HEAD} == {True}
    assert {r.shape[0] > 0 for r in catch_up if r.name != HEAD} == {True}


@pytest.mark.parametrize("program", PROGRAMS)
def test_around_the_program_compares_clean(tools, mtp_pairs, tmp_path, program):
    """llama-speculative-simple and llama-server with `--spec-type draft-mtp` on the pair compare
    clean against the reference that follows the run."""
    assert_clean_around(tools, program, mtp_pairs(VARIANT), tmp_path, ARCH, HEAD)


def test_a_latent_moe_and_the_checkpoints_head_are_refused_by_name(mtp_pairs, tmp_path):
    """What the reference does not compute is refused in one line, exit 2, no dump written: a head
    block with Nemotron 3 Super's latent MoE projections (`ffn_latent_down`, not read), and the head
    from the checkpoint directory (transformers has no model code for it: read it from the GGUF)."""
    d = mtp_pairs(VARIANT)
    latent = {f"blk.{IL}.ffn_latent_down.weight": np.zeros((TINY.target.n_embd, TINY.target.n_embd), np.float32)}
    widened = rewrite_gguf(d / "target.gguf", tmp_path / "latent.gguf", tensors=latent)
    for model, said in ((widened, f"blk.{IL}.ffn_latent_down.weight"), (d / "target-hf", "model_type 'nemotron_h'")):
        assert_refused(d, model, said, tmp_path)


def test_a_driver_fault_is_named_on_this_head(tools, mtp_pairs, monkeypatch, tmp_path):
    """0002-driver-faults.patch's `mtp-no-shift` (common/speculative.cpp pairs token p with the hidden
    of p, not p - 1) around llama-speculative-simple on this pair: row_shift at mtp_h_input, where: driver."""
    d = mtp_pairs(VARIANT)
    monkeypatch.setenv("FEATDIFF_FAULT", "mtp-no-shift")
    assert_no_shift_named(tools, d, tmp_path)
