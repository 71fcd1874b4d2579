"""Cohere2-MoE's MTP head (issue 44, llama.cpp's cohere2moe): the `mtp-cohere2moe` fixture (a
transformers `cohere2_moe` trunk; the head, which transformers has no model code for, laid out as
conversion/command_r.py Cohere2MoeModel expects: one more decoder layer `model.layers.<n_layer>`),
the correct pair compared clean in-process and around llama-speculative-simple and llama-server,
what the reference does not compute refused by name, and a planted driver fault named on it."""

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
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core import names
from featdiff.core.filters import ROLE_SEP, default_specs
from featdiff.core.gguf_reader import array_from_tensor, int_meta, meta, read_gguf
from featdiff.diff import compare_dumps
from featdiff.driver.capture import capture
from featdiff.dump.reader import read_dump
from featdiff.factory.gguf_rewrite import rewrite_gguf
from featdiff.factory.hf_families import N_EXPERT
from featdiff.factory.mtp import HF_SAFETENSORS
from featdiff.factory.mtp_cohere2moe import COHERE2MOE_LOGIT_SCALE, GGUF_FROM_HF_COHERE2MOE
from featdiff.factory.pairs import TINY
from featdiff.kinds.mtp import MTP_TARGET_WIRING, MTP_WIRING
from featdiff.torchref.kind import reference

pytestmark = pytest.mark.slow  # the pinned converter makes the pair (cached per machine)

VARIANT = "mtp-cohere2moe"
ARCH = names.ARCH_COHERE2MOE
IL = TINY.target.n_layer  # the head's block
HEAD = f"mtp_post_ffn-{IL}"
GATING_SIGMOID = 2  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID, as the converter writes expert_selection_fn "sigmoid"


def test_the_head_is_block_n_layer_with_the_checkpoints_values(mtp_pairs):
    """The converter keeps the head's layer as block n_layer: its attention (no q/k norms), the one
    input norm of the parallel block, the router, the stacked experts, the shared expert and the
    nextn tensors, every one the checkpoint's values as they are; sigmoid routing (the config's
    expert_selection_fn), renormalized, the RMS epsilon and Cohere's logit_scale written."""
    from safetensors.numpy import load_file

    d = mtp_pairs(VARIANT)
    m, w = read_gguf(d / "target.gguf"), load_file(str(d / "target-hf" / HF_SAFETENSORS))
    assert m.arch == ARCH
    assert int_meta(m, names.KEY_NEXTN_LAYERS.format(arch=ARCH)) == 1
    assert int_meta(m, names.KEY_BLOCK_COUNT.format(arch=ARCH)) == IL + 1
    assert set(GGUF_FROM_HF_COHERE2MOE.values()) == {t for t in m.tensors if t.startswith(f"blk.{IL}.")}
    assert m.tensors[f"blk.{IL}.ffn_up_exps.weight"].ne[2] == N_EXPERT
    assert int_meta(m, f"{ARCH}.expert_gating_func") == GATING_SIGMOID and meta(m, f"{ARCH}.expert_weights_norm")
    assert meta(m, f"{ARCH}.logit_scale") == pytest.approx(COHERE2MOE_LOGIT_SCALE)
    assert meta(m, names.KEY_RMS_EPS.format(arch=ARCH)) > 0
    for hf, name in GGUF_FROM_HF_COHERE2MOE.items():
        got = array_from_tensor(m, name)
        if expert := re.search(r"\.experts\.(\d+)\.", hf):
            got = got[int(expert.group(1))]
        assert np.array_equal(got, w[hf]), hf


def test_lint_finds_nothing_unread_in_the_head(mtp_pairs):
    """lint reads the head block as the reference does: nothing is left."""
    head = mtp_pairs(VARIANT) / "target.gguf"
    out = CliRunner().invoke(app, ["lint", str(head), "--target", str(head)])
    assert out.exit_code == 0 and out.output.strip() == f"{head}: ok", out.output


def test_the_in_process_flow_compares_clean(mtp_pairs, tmp_path):
    """Three rounds in-process compare clean, nothing skipped: the head (its attention output alone,
    asked for beside the kind's wiring, and the parallel layer's output) and its hand-over (the
    target's h_nextn at verify, each draft step's at draft) paired, and the scaled logits."""
    d = mtp_pairs(VARIANT)
    specs = [*default_specs((), MTP_WIRING, MTP_TARGET_WIRING), f"draft{ROLE_SEP}{names.MTP_ATTN_OUT}-*"]
    run = capture(d / "target.gguf", d / "target.gguf", tmp_path / "run.npz", tokens=TOKENS, rounds=3, filters=specs)
    ref = reference(
        d / "target-hf", d / "target.gguf", tmp_path / "ref.npz", prompt=None, tokens=TOKENS, rounds=3,
        dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None, run=run,
    )  # fmt: skip
    c = compare_dumps(ref, run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    assert not c.skipped
    paired = {(p.name, p.phase) for p in c.pairs}
    expected = {("mtp_h_input", "draft"), (f"{names.MTP_ATTN_OUT}-{IL}", "draft"), (HEAD, "draft")}
    assert expected | {(names.H_NEXTN, "draft"), (names.H_NEXTN, "verify")} <= paired
    with read_dump(run) as dump:
        m = dump.manifest
    assert m.models["draft"]["architecture"] == ARCH and len([r for r in m.rounds if r.drafts]) == 3


@pytest.mark.parametrize("program", PROGRAMS)
def test_around_the_program_compares_clean(tools, mtp_pairs, tmp_path, program):
    """llama-speculative-simple and llama-server with `--spec-type draft-mtp` on the pair compare
    clean against the reference that follows the run."""
    assert_clean_around(tools, program, mtp_pairs(VARIANT), tmp_path, ARCH, HEAD)


def test_what_the_reference_does_not_compute_is_refused_by_name(mtp_pairs, tmp_path):
    """One line, exit 2, no dump written: a head whose norms llama.cpp runs as LayerNorm (RMS epsilon
    0), a tensor of the head block it does not read, and the head from the checkpoint directory
    (transformers has the trunk's model code, not the head's: read it from the GGUF)."""
    d = mtp_pairs(VARIANT)
    layer_norm = rewrite_gguf(
        d / "target.gguf", tmp_path / "layernorm.gguf", keys={names.KEY_RMS_EPS.format(arch=ARCH): 0.0}
    )
    extra = {f"blk.{IL}.ffn_norm.weight": np.ones((TINY.target.n_embd,), np.float32)}
    unread = rewrite_gguf(d / "target.gguf", tmp_path / "unread.gguf", tensors=extra)
    cases = (
        (layer_norm, f"{names.KEY_RMS_EPS.format(arch=ARCH)} is missing or 0"),
        (unread, f"blk.{IL}.ffn_norm.weight"),
        (d / "target-hf", "model_type 'cohere2_moe'"),
    )
    for model, said in cases:
        assert_refused(d, model, said, tmp_path)


def test_a_driver_fault_is_named_on_this_head(tools, mtp_pairs, monkeypatch, tmp_path):
    """0002-driver-faults.patch's `mtp-no-shift` (common/speculative.cpp pairs token p with the hidden
    of p, not p - 1) around llama-speculative-simple on this pair: row_shift at mtp_h_input, where: driver."""
    d = mtp_pairs(VARIANT)
    monkeypatch.setenv("FEATDIFF_FAULT", "mtp-no-shift")
    assert_no_shift_named(tools, d, tmp_path)
