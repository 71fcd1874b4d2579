"""Chained MTP heads (issue 44 item 2): MiMo-V2's three heads converted by the pinned converter
(factory/mtp_chain.py), run in-process (driver/mtp_chain.py) and by unmodified
`llama-speculative-simple` and `llama-server` (`--spec-type draft-mtp`) under capture --exec (common/speculative.cpp
chain_heads: draft step k runs head k), compare clean against the reference that follows the run
(torchref/mtp/chain.py); a chain missing a head block is refused by name; a GGUF whose head blocks are
permuted, or all head 0, is named wrong_source `chain_head` with `where: export` against the
reference made from the clean checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from featdiff.core import names
from featdiff.core.gguf_reader import int_meta, read_gguf
from featdiff.diff import compare_dumps
from featdiff.diff.detectors.chain import CHAIN_HEAD_SOURCE
from featdiff.driver.capture import capture
from featdiff.dump.reader import read_dump
from featdiff.factory.gguf_rewrite import DROP, rewrite_gguf
from featdiff.factory.mtp_chain import N_CHAIN, write_mtp_chain_fixture
from featdiff.programs import exec as exec_capture
from featdiff.torchref.kind import reference
from featdiff_process import check_passes

SPEC_ARGS = ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "-c", "256", "-t", "1", "--temp", "0"]
RUN_TIMEOUT_S = 120

pytestmark = pytest.mark.slow  # the pinned converter makes the pairs (cached per machine)


@pytest.fixture(scope="module")
def chain_pairs(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = write_mtp_chain_fixture(tmp_path_factory.mktemp(variant), variant)
        return made[variant]

    return get


def _run(tools, d: Path, n_predict: int, tmp: Path) -> Path:
    cmd = [str(tools.program("llama-speculative-simple")), "-m", str(d / "target.gguf"), *SPEC_ARGS]
    cmd += ["-p", "hello world", "-n", str(n_predict)]
    return exec_capture.capture_exec(cmd, tmp / "run.npz", timeout_s=RUN_TIMEOUT_S)


def _follow(d: Path, head: Path, run: Path, tmp: Path) -> Path:
    return reference(
        d / "target-hf", head, tmp / "ref.npz", prompt=None, tokens=None, rounds=0, dtype="float32", device="cpu",
        kv_dtype="f16", llama_dir=None, follow=run,
    )  # fmt: skip


def test_the_chain_fixture_carries_every_head_of_mimo(chain_pairs):
    g = read_gguf(chain_pairs("mtp-mimo2-chain") / "target.gguf")
    n_layer = int_meta(g, names.KEY_BLOCK_COUNT) - N_CHAIN
    assert int_meta(g, names.KEY_NEXTN_LAYERS) == N_CHAIN == 3
    assert all(names.T_NEXTN.format(il=n_layer + k, name=names.NEXTN_EH_PROJ) in g.tensors for k in range(N_CHAIN))


def test_chained_heads_around_the_program_compare_clean(tools, chain_pairs, tmp_path):
    d = chain_pairs("mtp-mimo2-chain")
    run = _run(tools, d, 6, tmp_path)
    with read_dump(run) as dump:
        m = dump.manifest
    steps = [e for e in m.evals if (e.role, e.phase) == (names.ROLE_DRAFT, "draft") and e.round == 1]
    assert [e.n_tokens for e in steps] == [1, 2, 3]  # step k re-decodes the round's k + 1 rows
    heads = {r.name for r in m.records if r.eval in {e.eval for e in steps} and r.name.startswith("mtp_enorm-")}
    assert heads == {f"mtp_enorm-{il}" for il in (6, 7, 8)}  # one head per step
    c = compare_dumps(_follow(d, d / "target.gguf", run, tmp_path), run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]


def test_check_around_the_program_passes_and_measures_the_accept(tools, chain_pairs, tmp_path):
    """`featdiff check --exec -- llama-speculative-simple` on MiMo-V2's three chained heads: the
    wiring compares clean and the accept probe replays the chain's rounds (before: exit 2, the
    probe modelled a single head only)."""
    d = chain_pairs("mtp-mimo2-chain")
    cmd = [str(tools.program("llama-speculative-simple")), "-m", str(d / "target.gguf"), *SPEC_ARGS]
    args = ["--target", d / "target.gguf", "--model", d / "target.gguf", "--ref-target", d / "target-hf"]
    check_passes([*args, "--exec", "--", *cmd, "-p", "hello world", "-n", "16"], tmp_path)


@pytest.mark.parametrize(
    "variant, ran, own",
    [("mtp-mimo2-chain-permuted", 2, 0), ("mtp-mimo2-chain-same", 0, 1)],
)
def test_a_gguf_with_other_heads_in_its_blocks_is_a_wrong_source_chain_head(
    tools, chain_pairs, variant, ran, own, tmp_path
):
    d = chain_pairs(variant)
    run = _run(tools, d, 3, tmp_path)
    c = compare_dumps(_follow(d, d / "target-hf", run, tmp_path), run)  # the clean checkpoint's heads
    errors = [f for f in c.findings if f.severity == "error"]
    assert [(f.kind, f.fields["source"], f.fields["where"]) for f in errors] == [
        ("wrong_source", CHAIN_HEAD_SOURCE, "export")
    ]
    f = errors[0]
    assert f.fields["candidate"].endswith(f"@head={ran}") and f.tensor.endswith(f"-{6 + own}")
    assert f"is what head {ran} computes" in f.message and f"block of head {own} holds head {ran}'s" in f.message


def test_chained_heads_around_llama_server_compare_clean(tools, chain_pairs, tmp_path):
    d = chain_pairs("mtp-mimo2-chain")
    cmd = [str(tools.program("llama-server")), "-m", str(d / "target.gguf"), *SPEC_ARGS[:-2]]
    run = exec_capture.capture_exec(cmd, tmp_path / "run.npz", tokens="7,21,3,99,140,5,260,33", timeout_s=RUN_TIMEOUT_S)
    c = compare_dumps(_follow(d, d / "target.gguf", run, tmp_path), run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]


@pytest.mark.parametrize("head", ["target.gguf", "target-hf"])  # the GGUF's blocks, or model.mtp.layers.<k>
def test_chained_heads_in_process_compare_clean(chain_pairs, head, tmp_path):
    d = chain_pairs("mtp-mimo2-chain")
    run = capture(d / "target.gguf", d / "target.gguf", tmp_path / "run.npz", tokens="7,21,3,99,140,5,260,33", rounds=3)
    with read_dump(run) as dump:
        m = dump.manifest
    inject = [e for e in m.evals if (e.role, e.phase, e.round) == (names.ROLE_DRAFT, "inject", 1)]
    assert len(inject) == N_CHAIN  # process() under every head
    c = compare_dumps(_follow(d, d / head, run, tmp_path), run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]


def test_a_chain_missing_a_head_block_is_refused_by_name(chain_pairs, tmp_path):
    d = chain_pairs("mtp-mimo2-chain")
    gone = names.T_NEXTN.format(il=8, name=names.NEXTN_EH_PROJ)
    gguf = rewrite_gguf(d / "target.gguf", tmp_path / "two.gguf", tensors={gone: DROP})
    out = tmp_path / "run.npz"
    done = subprocess.run(
        [sys.executable, "-c", "from featdiff.cli import main; main()", "capture", "--target", str(gguf),
         "--model", str(gguf), "--tokens", "7,21,3", "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and not out.exists(), done.stderr
    assert gone in lines[0] and "nextn_predict_layers = 3 declares heads at blocks 6..8" in lines[0], lines[0]
