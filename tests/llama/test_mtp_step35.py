"""Step-3.5's chained MTP heads (issue 44, llama.cpp's step35): a tiny Step-3.5 checkpoint written as
the pinned converter expects it (factory/mtp_step35.py: no transformers code for it), converted by the
pinned converter with its three heads, run in-process (driver/mtp_chain.py) and by unmodified
`llama-speculative-simple` and `llama-server` (common/speculative.cpp chain_heads: draft step k runs
head k, block n_layer + k), compares clean against the reference that follows the run
(torchref/mtp/step35.py: gated attention on half the head's dims, sigmoid-routed experts); a GGUF
whose head blocks are permuted is named wrong_source `chain_head` against the clean GGUF's heads."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import int_meta, meta, read_gguf
from featdiff.diff import compare_dumps
from featdiff.diff.detectors.chain import CHAIN_HEAD_SOURCE
from featdiff.driver.capture import capture
from featdiff.dump.reader import read_dump
from featdiff.factory.gguf_rewrite import rewrite_gguf
from featdiff.factory.mtp_chain import reorder_heads
from featdiff.factory.mtp_step35 import N_HEADS, N_LAYER, TARGET_REF, write_step35_fixture
from featdiff.programs import exec as exec_capture
from featdiff.torchref.kind import drafter_kind, reference

SPEC_ARGS = ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "-c", "256", "-t", "1"]
TOKENS = "7,21,3,99,140,5"
RUN_TIMEOUT_S = 120

pytestmark = pytest.mark.slow  # the pinned converter makes the pair (cached per machine)


@pytest.fixture(scope="module")
def step35(tmp_path_factory) -> Path:
    return write_step35_fixture(tmp_path_factory.mktemp("mtp-step35"))


def _follow(d: Path, head: Path, run: Path, tmp: Path) -> Path:
    return reference(
        d / TARGET_REF, head, tmp / "ref.npz", prompt=None, tokens=None, rounds=0, dtype="float32", device="cpu",
        kv_dtype="f16", llama_dir=None, follow=run,
    )  # fmt: skip


def _errors(c) -> list[str]:
    return [f.message for f in c.findings if f.severity == "error"]


def test_the_step35_fixture_carries_three_gated_heads(step35):
    g = read_gguf(step35 / "target.gguf")
    assert g.arch == names.ARCH_STEP35 and int_meta(g, names.KEY_NEXTN_LAYERS) == N_HEADS == 3
    assert int_meta(g, names.KEY_BLOCK_COUNT) == N_LAYER + N_HEADS
    assert meta(g, names.KEY_SLIDING_WINDOW_PATTERN_ARCH) == [True] * N_LAYER + [False] * N_HEADS
    for k in range(N_HEADS):
        il = N_LAYER + k
        assert {f"blk.{il}.attn_gate.weight", f"blk.{il}.exp_probs_b.bias", f"blk.{il}.ffn_up_shexp.weight"} <= set(
            g.tensors
        )


def test_step35_heads_in_process_compare_clean(step35, tmp_path):
    run = capture(step35 / "target.gguf", step35 / "target.gguf", tmp_path / "run.npz", tokens=TOKENS, rounds=2)
    with read_dump(run) as dump:
        m = dump.manifest
    steps = [e for e in m.evals if (e.role, e.phase, e.round) == (names.ROLE_DRAFT, "draft", 1)]
    heads = {r.name for r in m.records if r.eval in {e.eval for e in steps} and r.name.startswith("mtp_enorm-")}
    assert heads == {f"mtp_enorm-{N_LAYER + k}" for k in range(N_HEADS)}  # one head per step
    c = compare_dumps(_follow(step35, step35 / "target.gguf", run, tmp_path), run)
    assert c.ok, _errors(c)


def test_step35_heads_around_llama_speculative_simple_compare_clean(tools, step35, tmp_path):
    cmd = [str(tools.program("llama-speculative-simple")), "-m", str(step35 / "target.gguf"), *SPEC_ARGS]
    run = exec_capture.capture_exec(
        [*cmd, "--temp", "0", "-p", "hello world", "-n", "4"], tmp_path / "run.npz", timeout_s=RUN_TIMEOUT_S
    )
    c = compare_dumps(_follow(step35, step35 / "target.gguf", run, tmp_path), run)
    assert c.ok, _errors(c)


def test_step35_heads_around_llama_server_compare_clean(tools, step35, tmp_path):
    cmd = [str(tools.program("llama-server")), "-m", str(step35 / "target.gguf"), *SPEC_ARGS]
    run = exec_capture.capture_exec(cmd, tmp_path / "run.npz", tokens=TOKENS, timeout_s=RUN_TIMEOUT_S)
    c = compare_dumps(_follow(step35, step35 / "target.gguf", run, tmp_path), run)
    assert c.ok, _errors(c)


def test_permuted_step35_heads_are_a_wrong_source_chain_head(step35, tmp_path):
    permuted = reorder_heads(shutil.copyfile(step35 / "target.gguf", tmp_path / "permuted.gguf"), (2, 1, 0))
    run = capture(permuted, permuted, tmp_path / "run.npz", tokens=TOKENS, rounds=1)
    c = compare_dumps(_follow(step35, step35 / "target.gguf", run, tmp_path), run)  # the clean GGUF's heads
    errors = [f for f in c.findings if f.severity == "error"]
    assert [(f.kind, f.fields["source"]) for f in errors] == [("wrong_source", CHAIN_HEAD_SOURCE)], _errors(c)
    assert errors[0].fields["candidate"].endswith("@head=2") and errors[0].tensor.endswith(f"-{N_LAYER}")


def _reference_cli(d: Path, model: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from featdiff.cli import main; main()", "reference", "--target", str(d / TARGET_REF),
         "--model", str(model), "--tokens", "7,21,3", "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_a_swiglu_clamp_is_refused_by_name(step35, tmp_path):
    clamp = [0.0] * N_LAYER + [7.0] + [0.0] * (N_HEADS - 1)
    clamped = rewrite_gguf(step35 / "target.gguf", tmp_path / "clamp.gguf", keys={"step35.swiglu_clamp_exp": clamp})
    done = _reference_cli(step35, clamped, tmp_path / "ref.npz")
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("Loading weights")]
    assert done.returncode == 2 and len(lines) == 1 and "step35.swiglu_clamp_exp = " in lines[0], done.stderr
    assert not (tmp_path / "ref.npz").exists()


def test_the_checkpoints_heads_are_refused_by_name(step35):
    with pytest.raises(InputError, match="model_type 'step3p5'.*pass the converted GGUF as --model"):
        drafter_kind(step35 / "target-hf")
