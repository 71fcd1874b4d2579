"""What every MTP head's own test file runs around the programs (test_mtp_hy_v3, _cohere2moe,
_nemotron): `capture --exec` of llama-speculative-simple or llama-server with `--spec-type
draft-mtp` on a head's fixture, the reference that follows it, and the clean comparison."""

from __future__ import annotations

from pathlib import Path

from featdiff.core import names
from featdiff.diff import compare_dumps
from featdiff.dump.reader import read_dump
from featdiff.programs import exec as exec_capture
from featdiff.torchref.kind import reference

TOKENS = "7,21,3,99,140,5,260,33,18,402,77,9"
SPEC_ARGS = ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "-c", "256", "-t", "1"]
RUN_TIMEOUT_S = 120
PROGRAMS = ["llama-speculative-simple", "llama-server"]


def program_run(tools, program: str, d: Path, tmp_path: Path) -> Path:
    """`capture --exec` of `program` with `--spec-type draft-mtp` on the pair in `d` (llama-server:
    one request of TOKENS; llama-speculative-simple: 16 tokens of a prompt, greedy)."""
    is_server = program == "llama-server"
    cmd = [str(tools.program(program)), "-m", str(d / "target.gguf"), *SPEC_ARGS]
    cmd += [] if is_server else ["-p", "hello world", "-n", "16", "--temp", "0"]
    tokens = TOKENS if is_server else None
    return exec_capture.capture_exec(cmd, tmp_path / "run.npz", tokens=tokens, timeout_s=RUN_TIMEOUT_S)


def follow(d: Path, run: Path, tmp_path: Path) -> Path:
    """The reference that follows the run, its head read from target.gguf."""
    return reference(
        d / "target-hf", d / "target.gguf", tmp_path / "ref.npz", prompt=None, tokens=None, rounds=0,
        dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None, follow=run,
    )  # fmt: skip


def assert_clean_around(tools, program: str, d: Path, tmp_path: Path, arch: str, head: str) -> None:
    """`program` on the pair in `d` drafts with the head of `arch` (its record `head` captured) and
    compares clean against the reference that follows the run."""
    run = program_run(tools, program, d, tmp_path)
    with read_dump(run) as dump:
        m = dump.manifest
    assert m.models["draft"]["architecture"] == arch and any(r.drafts for r in m.rounds)
    assert {(r.role, r.name) for r in m.records} >= {("target", names.H_NEXTN), ("draft", head)}
    ref = follow(d, run, tmp_path)
    c = compare_dumps(ref, run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    expected = ("a warm-up or probe decode", "output no rows")  # llama-server samples its prefill's last row
    assert not [s for s in c.skipped if not any(e in s for e in expected)], c.skipped


def assert_refused(d: Path, model: Path, said: str, tmp_path: Path) -> None:
    """`featdiff reference` of the head `model` on `d`'s target exits 2 with one error line that
    says `said`, and writes no dump."""
    from featdiff_process import refused_in_one_line

    args = ["reference", "--target", str(d / "target-hf"), "--model", str(model), "--tokens", "7,21,3"]
    refused_in_one_line([*args, "-o", str(tmp_path / "ref.npz")], said)
    assert not (tmp_path / "ref.npz").exists()


def assert_no_shift_named(tools, d: Path, tmp_path: Path) -> None:
    """0002-driver-faults.patch's `mtp-no-shift` (common/speculative.cpp pairs token p with the
    hidden of p, not p - 1; FEATDIFF_FAULT set by the caller) around llama-speculative-simple on
    the pair in `d`: row_shift by one at the head's input mtp_h_input (a graph input only the head's
    norm reads, captured since issue 42), where: driver."""
    run = program_run(tools, "llama-speculative-simple", d, tmp_path)
    ref = follow(d, run, tmp_path)
    errors = [f for f in compare_dumps(ref, run).findings if f.severity == "error"]
    assert errors and (errors[0].kind, errors[0].tensor) == ("row_shift", names.MTP_H_INPUT), [
        f.message for f in errors
    ]
    assert errors[0].fields["where"] == "driver", errors[0].fields["where_reason"]
    assert errors[0].fields["shift"] == 1
