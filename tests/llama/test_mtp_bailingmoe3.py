"""Ling 3.0's MTP head (issue 44, llama.cpp's bailingmoe3): the `mtp-bailingmoe3` fixture (a
transformers `bailing_hybrid` trunk of KDA and gated MLA layers; the head, which transformers has no
model code for, laid out as conversion/bailingmoe3.py expects: one more decoder layer
`model.layers.<n_layer>`), the correct pair compared clean in-process and around
llama-speculative-simple and llama-server, what the reference does not compute refused by name, and
a planted driver fault caught on it."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from mtp_head_runs import PROGRAMS, TOKENS, assert_clean_around, assert_no_shift_named, assert_refused
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core import names
from featdiff.core.gguf_reader import array_from_tensor, int_meta, meta, read_gguf
from featdiff.diff import compare_dumps
from featdiff.driver.capture import capture
from featdiff.dump.reader import read_dump
from featdiff.factory.gguf_rewrite import rewrite_gguf
from featdiff.factory.hf_families import N_EXPERT
from featdiff.factory.mtp import HF_SAFETENSORS
from featdiff.factory.mtp_bailingmoe3 import (
    BAILINGMOE3_ROUTED_SCALE,
    GGUF_FROM_HF_BAILINGMOE3,
    HF_KV_B,
    QK_NOPE_HEAD_DIM,
)
from featdiff.factory.pairs import TINY
from featdiff.torchref.kind import reference
from featdiff.torchref.mtp.hf_mla import split_kv_b

pytestmark = pytest.mark.slow  # the pinned converter makes the pair (cached per machine)

VARIANT = "mtp-bailingmoe3"
ARCH = names.ARCH_BAILINGMOE3
IL = TINY.target.n_layer  # the head's block
HEAD = f"mtp_eh_proj-{IL}"  # the one record of its layer bailingmoe3.cpp's graph_mtp names
GATING_SIGMOID = 2  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID, as the converter writes score_function "sigmoid"


def test_the_head_is_block_n_layer_with_the_checkpoints_values(mtp_pairs):
    """The converter keeps the head's layer as block n_layer: the MLA attention (a plain query, kv_b split
    into k_b and v_b per head), the head-wise gate, the FFN norm, the router and its choice bias, the
    stacked experts, the shared expert and the nextn tensors (the layer's final_layernorm as
    layer_output_norm), every one the checkpoint's values; one MQA head in the head block, sigmoid
    routing in one group, renormalized and scaled."""
    from safetensors.numpy import load_file

    d = mtp_pairs(VARIANT)
    m, w = read_gguf(d / "target.gguf"), load_file(str(d / "target-hf" / HF_SAFETENSORS))
    assert m.arch == ARCH
    assert int_meta(m, names.KEY_NEXTN_LAYERS.format(arch=ARCH)) == 1
    assert int_meta(m, names.KEY_BLOCK_COUNT.format(arch=ARCH)) == IL + 1
    assert meta(m, names.KEY_HEAD_COUNT_KV.format(arch=ARCH))[IL] == 1
    split = {f"blk.{IL}.attn_k_b.weight", f"blk.{IL}.attn_v_b.weight"}
    assert set(GGUF_FROM_HF_BAILINGMOE3.values()) | split == {t for t in m.tensors if t.startswith(f"blk.{IL}.")}
    assert m.tensors[f"blk.{IL}.ffn_up_exps.weight"].ne[2] == N_EXPERT
    assert int_meta(m, f"{ARCH}.expert_gating_func") == GATING_SIGMOID and meta(m, f"{ARCH}.expert_weights_norm")
    assert int_meta(m, f"{ARCH}.expert_group_count") == 1
    assert meta(m, f"{ARCH}.expert_weights_scale") == pytest.approx(BAILINGMOE3_ROUTED_SCALE)
    for hf, name in GGUF_FROM_HF_BAILINGMOE3.items():
        got = array_from_tensor(m, name)
        if expert := re.search(r"\.experts\.(\d+)\.", hf):
            got = got[int(expert.group(1))]
        assert np.array_equal(got, w[hf]), hf
    halves = split_kv_b(torch.from_numpy(w[HF_KV_B]), TINY.target.n_head, QK_NOPE_HEAD_DIM)
    for key, want in halves.items():
        assert np.array_equal(array_from_tensor(m, f"blk.{IL}.{key}.weight"), want.numpy()), key


def test_lint_finds_nothing_unread_in_the_head(mtp_pairs):
    """lint reads the head block as the reference does (its query, gate and layer_output_norm): nothing is left."""
    head = mtp_pairs(VARIANT) / "target.gguf"
    out = CliRunner().invoke(app, ["lint", str(head), "--target", str(head)])
    assert out.exit_code == 0 and out.output.strip() == f"{head}: ok", out.output


def test_the_in_process_flow_compares_clean(mtp_pairs, tmp_path):
    """Three rounds in-process compare clean, nothing skipped: the head's eh_proj and its hand-over (the
    target's h_nextn at verify, each draft step's at draft) paired; the records its graph does not name
    (mtp_hnorm, mtp_post_ffn, ...) are not in the reference."""
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
    expected = {("mtp_h_input", "draft"), (HEAD, "draft"), ("draft_logits", "draft")}
    assert expected | {(names.H_NEXTN, "draft"), (names.H_NEXTN, "verify")} <= paired
    with read_dump(ref) as dump:
        assert not {r.name for r in dump.manifest.records} & {f"mtp_hnorm-{IL}", f"mtp_post_ffn-{IL}"}
    with read_dump(run) as dump:
        m = dump.manifest
    assert m.models["draft"]["architecture"] == ARCH and len([r for r in m.rounds if r.drafts]) == 3


@pytest.mark.parametrize("program", PROGRAMS)
def test_around_the_program_compares_clean(tools, mtp_pairs, tmp_path, program):
    """llama-speculative-simple and llama-server with `--spec-type draft-mtp` on the pair compare
    clean against the reference that follows the run."""
    assert_clean_around(tools, program, mtp_pairs(VARIANT), tmp_path, ARCH, HEAD)


def test_what_the_reference_does_not_compute_is_refused_by_name(mtp_pairs, tmp_path):
    """One line, exit 2, no dump written: group-limited routing (expert_group_count 2), a VL file's
    M-RoPE sections, a SwiGLU clamp on the head's layer, a tensor of the head block it does not read,
    and the head from the checkpoint directory (transformers has the trunk's model code, not the
    head's: read it from the GGUF)."""
    d = mtp_pairs(VARIANT)
    groups = rewrite_gguf(d / "target.gguf", tmp_path / "groups.gguf", keys={f"{ARCH}.expert_group_count": 2})
    sections = rewrite_gguf(
        d / "target.gguf", tmp_path / "mrope.gguf", keys={f"{ARCH}.rope.dimension_sections": [4, 2, 2, 0]}
    )
    clamp = [0.0] * IL + [7.0]  # Ling's expert_swiglu_limit_list with a limit on the head's layer
    clamped = rewrite_gguf(d / "target.gguf", tmp_path / "clamp.gguf", keys={f"{ARCH}.swiglu_clamp_exp": clamp})
    extra = {f"blk.{IL}.ffn_latent_down.weight": np.zeros((TINY.target.n_embd, TINY.target.n_embd), np.float32)}
    unread = rewrite_gguf(d / "target.gguf", tmp_path / "unread.gguf", tensors=extra)
    cases = (
        (groups, f"{ARCH}.expert_group_count = 2"),
        (sections, f"{ARCH}.rope.dimension_sections is set"),
        (clamped, f"{ARCH}.swiglu_clamp_exp = "),
        (unread, f"blk.{IL}.ffn_latent_down.weight"),
        (d / "target-hf", "model_type 'bailing_hybrid'"),
    )
    for model, said in cases:
        assert_refused(d, model, said, tmp_path)


def test_a_driver_fault_is_caught_on_this_head(tools, mtp_pairs, monkeypatch, tmp_path):
    """0002-driver-faults.patch's `mtp-no-shift` (common/speculative.cpp pairs token p with the hidden
    of p, not p - 1) around llama-speculative-simple on this pair is named `row_shift` at the head's
    input `mtp_h_input`, placed in the driver, as on the other MTP heads. bailingmoe3.cpp's graph names
    no record of the hidden rows alone (no mtp_hnorm), and eh_proj mixes them with the token's,
    unshifted: only the input itself, which only the head's norm reads (the capture reads a norm's
    source before the norm runs), shows the rows one position off."""
    d = mtp_pairs(VARIANT)
    monkeypatch.setenv("FEATDIFF_FAULT", "mtp-no-shift")
    assert_no_shift_named(tools, d, tmp_path)
