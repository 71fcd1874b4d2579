"""Qwen3-Next's MTP head (issue 44, llama.cpp's qwen3next): the `mtp-qwen3next` fixture as the pinned
converter writes it (the head counted from the checkpoint's `mtp.layers.*`, config.json says no
count), the head read from the GGUF equal to the head read from the checkpoint, and the two runs the
pinned tree allows: one round in-process compares clean, and more are refused by name (llama.cpp keeps
no recurrent-state snapshots for qwen3next, so the rejected drafts cannot be rolled back), and llama-speculative-simple
and llama-server, which take their state-checkpoint path there, compare clean up to the first restore
and are named at each replay: upstream's MTP driver pairs the replayed batch's first token with the rejected verify's
last hidden (process() set pending_h to it, and no accept() follows a checkpoint restore)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core import names
from featdiff.core.gguf_reader import int_meta, meta, read_gguf
from featdiff.diff import compare_dumps
from featdiff.driver.capture import capture
from featdiff.dump.reader import read_dump
from featdiff.factory.hf_families import N_EXPERT, QWEN35_LINEAR_K_HEADS, QWEN35_LINEAR_V_HEADS
from featdiff.factory.mtp import HF_N_MTP
from featdiff.factory.mtp_qwen3next import QWEN3NEXT_ROTARY
from featdiff.factory.pairs import TINY
from featdiff.programs import exec as exec_capture
from featdiff.torchref.kind import reference
from featdiff.torchref.mtp.head import mtp_from_gguf
from featdiff.torchref.mtp.hf import mtp_from_hf

pytestmark = pytest.mark.slow  # the pinned converter makes the pair (cached per machine)

VARIANT = "mtp-qwen3next"
ARCH = names.ARCH_QWEN3NEXT
TOKENS = "7,21,3,99,140,5,260,33,18,402,77,9"
SPEC_ARGS = ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "-c", "256", "-t", "1"]
RUN_TIMEOUT_S = 120
S = TINY.target


def test_the_converter_counts_the_head_the_config_does_not(mtp_pairs):
    """Qwen3-Next's config.json carries no MTP count; the converter counts the checkpoint's
    mtp.layers.* and writes one head, block n_layer, past the hybrid trunk's recurrent layers."""
    d = mtp_pairs(VARIANT)
    config = json.loads((d / "target-hf" / names.HF_CONFIG).read_text())
    assert config[names.HF_MODEL_TYPE] == "qwen3_next" and HF_N_MTP not in config
    m = read_gguf(d / "target.gguf")
    assert m.arch == ARCH
    assert int_meta(m, names.KEY_NEXTN_LAYERS.format(arch=ARCH)) == 1
    assert int_meta(m, names.KEY_BLOCK_COUNT.format(arch=ARCH)) == S.n_layer + 1
    kinds = [t == "linear_attention" for t in config["layer_types"]]
    assert meta(m, f"{ARCH}.attention.recurrent_layers") == [*kinds, False]  # the head attends
    assert int_meta(m, f"{ARCH}.rope.dimension_count") == int(S.n_embd_head * QWEN3NEXT_ROTARY)
    assert int_meta(m, f"{ARCH}.ssm.group_count") == QWEN35_LINEAR_K_HEADS
    assert int_meta(m, f"{ARCH}.ssm.time_step_rank") == QWEN35_LINEAR_V_HEADS  # more value heads: the q/k repeat
    assert int_meta(m, f"{ARCH}.expert_count") == N_EXPERT
    assert "blk.0.attn_gate.weight" in m.tensors  # in_proj_qkvz split into attn_qkv and attn_gate


def test_the_head_from_the_gguf_is_the_head_from_the_checkpoint(mtp_pairs):
    """torchref reads the same head from target.gguf and from target-hf/ (norms + 1, experts
    stacked, as Qwen3NextModel writes them): the export is the checkpoint's."""
    d, f32, cpu = mtp_pairs(VARIANT), torch.float32, torch.device("cpu")
    g, h = mtp_from_gguf(d / "target.gguf", f32, cpu), mtp_from_hf(d / "target-hf", f32, cpu)
    assert (g.hparams.arch, g.il, g.hparams.n_rot) == (h.hparams.arch, h.il, h.hparams.n_rot) == (ARCH, S.n_layer, 4)
    assert g.routing == h.routing and g.routing is not None
    assert set(g.block) == set(h.block)
    for name in sorted(g.block):
        assert torch.allclose(g.block[name], h.block[name].reshape(g.block[name].shape), atol=1e-6), name
    for field in ("eh_proj", "enorm", "hnorm", "head_norm", "token_embd", "output"):
        assert torch.allclose(getattr(g, field), getattr(h, field), atol=1e-6), field


@pytest.mark.parametrize("head", ["target.gguf", "target-hf"])
def test_one_in_process_round_compares_clean(mtp_pairs, tmp_path, head):
    """One round in-process (prefill, the head's catch-up, its draft steps, the verify and the
    catch-up after it: the last round needs no rollback) compares clean against the reference of
    the head from the GGUF or from the checkpoint, nothing skipped; the catch-up decodes' residual
    rows are empty on both sides (qwen3next.cpp takes the output rows before the residual)."""
    d = mtp_pairs(VARIANT)
    run = capture(d / "target.gguf", d / "target.gguf", tmp_path / "run.npz", tokens=TOKENS, rounds=1)
    ref = reference(
        d / "target-hf", d / head, tmp_path / "ref.npz", prompt=None, tokens=TOKENS, rounds=1, dtype="float32",
        device="cpu", kv_dtype="f16", llama_dir=None, run=run,
    )  # fmt: skip
    c = compare_dumps(ref, run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    assert not c.skipped
    paired = {(p.name, p.phase) for p in c.pairs}
    assert {("mtp_h_input", "inject"), ("mtp_h_input", "draft"), ("mtp_attn_residual-6", "draft")} <= paired
    with read_dump(run) as dump:
        m = dump.manifest
        assert m.models["draft"]["architecture"] == ARCH and m.rounds[0].drafts
        residual = [r for r in m.records if r.name == "mtp_attn_residual-6" and r.phase == "inject"]
        assert residual and all(r.shape[0] == 0 for r in residual)


def test_the_in_process_flow_is_refused_by_name(mtp_pairs, tmp_path):
    """The pinned tree keeps no recurrent-state snapshots for qwen3next (llm_arch_supports_rs_rollback),
    so a verify's rejected rows cannot leave the target's memory: capture stops in one line, exit 2,
    naming the architecture, rather than verifying the next round on the rejected rows' state."""
    d = mtp_pairs(VARIANT)
    args = ["capture", "--target", str(d / "target.gguf"), "--model", str(d / "target.gguf")]
    result = CliRunner().invoke(app, [*args, "--tokens", TOKENS, "--rounds", "3", "-o", str(tmp_path / "run.npz")])
    assert result.exit_code == 2, result.output
    assert "could not roll the target's recurrent state back" in result.output and ARCH in result.output
    assert not (tmp_path / "run.npz").exists()


@pytest.mark.parametrize("program", ["llama-speculative-simple", "llama-server"])
def test_the_checkpoint_replay_of_each_program_is_named(tools, mtp_pairs, tmp_path, program):
    """llama-speculative-simple and llama-server on qwen3next (no partial removal: a state
    checkpoint before each verify and, on a partial accept, a restore and a replay of the accepted
    tokens). The first flow, up to the first restore, compares clean; each replay is named at its
    first row as wrong_source `stale_pending` at mtp_h_input (where: driver): the head is handed the
    pending hidden of the rejected verify instead of the hidden of the last kept position."""
    d, is_server = mtp_pairs(VARIANT), program == "llama-server"
    cmd = [str(tools.program(program)), "-m", str(d / "target.gguf"), *SPEC_ARGS]
    cmd += [] if is_server else ["-p", "hello world", "-n", "16", "--temp", "0"]
    tokens = TOKENS if is_server else None  # the request capture_exec sends the server
    run = exec_capture.capture_exec(cmd, tmp_path / "run.npz", tokens=tokens, timeout_s=RUN_TIMEOUT_S)
    with read_dump(run) as dump:
        assert dump.manifest.models["draft"]["architecture"] == ARCH
    ref = reference(
        d / "target-hf", d / "target.gguf", tmp_path / "ref.npz", prompt=None, tokens=None, rounds=0,
        dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None, follow=run,
    )  # fmt: skip
    c = compare_dumps(ref, run)
    errors = [f for f in c.findings if f.severity == "error"]
    assert errors, "the replays' stale pending rows were not named"
    named = {(f.kind, f.tensor, f.fields["source"], f.fields["where"]) for f in errors}
    assert named == {("wrong_source", names.MTP_H_INPUT, "stale_pending", "driver")}, [f.message for f in errors]
    assert not any(f.message.startswith("flow 0 ") for f in errors)  # the run before its first restore
    noise = [f for f in c.findings if f.kind == "numeric_noise"]
    assert noise and all(f.severity == "info" for f in noise)
