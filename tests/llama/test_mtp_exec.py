"""MTP heads around unmodified upstream programs (issue 33): llama-speculative-simple and
llama-server with `--spec-type draft-mtp` under the preload, the head inside the target GGUF (the
MTP context runs on the target's own model: the preload tells it by its context type) or as a
separate `-md` head GGUF. Each dump compares clean against the reference that follows it; the MTP
driver faults of 0002-driver-faults.patch are named."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from featdiff.diff import compare_dumps
from featdiff.dump.reader import read_dump
from featdiff.factory.mtp import MTP_SETTINGS
from featdiff.programs import exec as exec_capture
from featdiff.torchref.kind import reference

TOKENS = "7,21,3,99,140,5,260,33,18,402,77,9"
SPEC_ARGS = ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "-c", "256", "-t", "1"]
RUN_TIMEOUT_S = 120

pytestmark = pytest.mark.slow  # the pinned converter makes the pairs (cached per machine)


def test_the_command_line_names_the_mtp_kind():
    cmd = ["llama-server", "-m", "T.gguf", "--spec-type=ngram-simple,draft-mtp"]
    assert exec_capture.spec_types(cmd) == ("ngram-simple", "draft-mtp")
    assert exec_capture.drafter_kind(cmd).name == "mtp"
    kept = exec_capture.command_filters(None, cmd)
    assert kept.keeps("target", "h_nextn") and kept.keeps("target", "l_out-3") and kept.keeps("draft", "mtp_concat-6")
    assert exec_capture.drafter_kind(["llama-server", "-m", "T.gguf"]) is None


def _command(tools, program: str, d: Path, separate: bool) -> list[str]:
    head = ["-md", str(d / "draft.gguf")] if separate else []
    cmd = [str(tools.program(program)), "-m", str(d / "target.gguf"), *head, *SPEC_ARGS]
    if program == "llama-speculative-simple":
        # a prompt whose positions stay clear of the qwen35 reference's rare noisier rows (up to 0.4%
        # relative at a target row the transformers gated delta-net fallback computes), which the head's
        # chain of drafts carries on: "The quick brown fox" meets one at position 32 (NMSE 3e-5 there)
        cmd += ["-p", "hello world", "-n", "16", "--temp", "0"]
    return cmd


def _follow(d: Path, head: Path, run: Path, tmp: Path) -> Path:
    return reference(
        d / "target-hf", head, tmp / "ref.npz", prompt=None, tokens=None, rounds=0, dtype="float32", device="cpu",
        kv_dtype="f16", llama_dir=None, follow=run,
    )  # fmt: skip


@pytest.mark.parametrize(
    "program, variant",
    [
        ("llama-speculative-simple", "mtp"),
        ("llama-speculative-simple", "mtp-separate"),
        ("llama-server", "mtp"),
        ("llama-server", "mtp-separate"),
        ("llama-speculative-simple", "mtp-mimo2"),  # MiMo-V2: the head handed the pre-norm hidden
        ("llama-server", "mtp-mimo2"),
        ("llama-speculative-simple", "mtp-qwen35moe"),  # Qwen3.5-MoE: the head's FFN routed over experts
        ("llama-server", "mtp-qwen35moe"),
        ("llama-speculative-simple", "mtp-glm4moe"),  # GLM-4.5 (llama-server: two slots at once, below)
        ("llama-speculative-simple", "mtp-deepseek2"),  # DeepSeek-V3: MLA, its head an MoE layer
        ("llama-server", "mtp-deepseek2"),
        ("llama-speculative-simple", "mtp-deepseek32"),  # DeepSeek-V3.2: deepseek2's head, the trunk's indexer dense
        ("llama-server", "mtp-deepseek32"),
        ("llama-speculative-simple", "mtp-glm-dsa"),  # GLM-5: deepseek32's head, sigmoid routing unsaid in the file
        ("llama-server", "mtp-glm-dsa"),
    ],
)
def test_mtp_around_the_program_compares_clean(tools, mtp_pairs, program, variant, tmp_path):
    d, separate = mtp_pairs(variant), variant == "mtp-separate"
    tokens = TOKENS if program == "llama-server" else None
    run = exec_capture.capture_exec(
        _command(tools, program, d, separate), tmp_path / "run.npz", tokens=tokens, timeout_s=RUN_TIMEOUT_S
    )
    with read_dump(run) as dump:
        m = dump.manifest
    assert m.models["draft"]["architecture"] == MTP_SETTINGS[variant].arch
    assert m.models["draft"]["path"].endswith("draft.gguf" if separate else "target.gguf")
    assert m.rounds and any(r.drafts for r in m.rounds)
    assert {e.phase for e in m.evals} >= {"prefill", "inject", "draft", "verify"}
    assert {(r.role, r.name) for r in m.records} >= {("target", "h_nextn"), ("draft", "mtp_concat-6")}
    ref = _follow(d, d / ("draft.gguf" if separate else "target.gguf"), run, tmp_path)
    c = compare_dumps(ref, run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    expected = (
        "a warm-up or probe decode",
        "output no rows",
    )  # llama-server samples its prefill's last row; the reference outputs none
    unexpected = [s for s in c.skipped if not any(e in s for e in expected)]
    assert not unexpected, unexpected


@pytest.mark.parametrize("n_predict", [16, 11])
def test_a_correct_mtp_run_compares_clean_against_a_reference_of_its_tokens(tools, mtp_pairs, n_predict, tmp_path):
    """Issue 42, item 3: -n cuts the run's last verify short, and each one-token draft step's token
    history is the tokens its sequence holds, so the reference made from the run's tokens and rounds
    pairs every step (it had left them unpaired: 'a different token history')."""
    d = mtp_pairs("mtp")
    cmd = _command(tools, "llama-speculative-simple", d, False)
    cmd[cmd.index("-n") + 1] = str(n_predict)
    run = exec_capture.capture_exec(cmd, tmp_path / "run.npz", timeout_s=RUN_TIMEOUT_S)
    import featdiff_process

    featdiff_process.compares_clean_against_its_tokens(run, d / "target-hf", d / "target.gguf", tmp_path / "ref.npz")


@pytest.mark.parametrize(
    "fault, kind, tensor",
    [
        # at the head's input itself (a graph input only its norm reads, captured since issue 42)
        ("mtp-no-shift", "row_shift", "mtp_h_input"),  # token p with the hidden of p: rows one later
        ("mtp-boundary-future", "wrong_source", "mtp_h_input"),  # a batch's first row reads that batch's last
    ],
)
def test_the_mtp_driver_faults_are_named(tools, mtp_pairs, monkeypatch, fault, kind, tensor, tmp_path):
    d = mtp_pairs("mtp")
    monkeypatch.setenv("FEATDIFF_FAULT", fault)  # 0002-driver-faults.patch, read by common/speculative.cpp
    run = exec_capture.capture_exec(
        _command(tools, "llama-speculative-simple", d, False), tmp_path / "run.npz", timeout_s=RUN_TIMEOUT_S
    )
    c = compare_dumps(_follow(d, d / "target.gguf", run, tmp_path), run)
    errors = [f for f in c.findings if f.severity == "error"]
    assert errors and (errors[0].kind, errors[0].tensor) == (kind, tensor), [f.message for f in errors]
    assert errors[0].fields["where"] == "driver", errors[0].fields["where_reason"]  # the rows it paired
    first = c.pairs[c.first_divergence]
    assert first.phase in ("warmup", "prefill", "inject")  # the catch-up decode after a target batch


def _server_capture(tools, d: Path, tmp_path: Path, n_slots: int):
    """`capture --exec` of llama-server with `n_slots` slots on the pair in `d`, for two requests."""
    import featdiff_process

    command = [str(tools.program("llama-server")), "-m", str(d / "target.gguf"), *SPEC_ARGS, "-np", str(n_slots)]
    return featdiff_process.capture_server(command, tmp_path, 2, RUN_TIMEOUT_S)


def _two_requests_on_one_slot(port: int) -> None:
    """Two completions one after the other; the second's prompt starts at position 0 of the slot."""
    import json
    import urllib.request

    for prompt in ("hello world", "The quick brown fox"):
        body = json.dumps({"prompt": prompt, "n_predict": 10, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=RUN_TIMEOUT_S) as r:
            r.read()


def test_a_pending_row_kept_from_the_slots_last_request_is_named(tools, mtp_pairs, tmp_path):
    """Upstream's MTP driver keeps each sequence's pending hidden across requests (begin() does not
    reset it): the second request's first token is paired with the first request's last hidden
    where the head takes zeros. The first flow compares clean; the second is named at its first row."""
    d = mtp_pairs("mtp")
    proc, out, err, port = _server_capture(tools, d, tmp_path, n_slots=1)
    _two_requests_on_one_slot(port)
    assert proc.wait(timeout=RUN_TIMEOUT_S) == 0, err.read_text()[-3000:]
    c = compare_dumps(_follow(d, d / "target.gguf", out, tmp_path), out)
    errors = [f for f in c.findings if f.severity == "error"]
    assert errors and (errors[0].kind, errors[0].tensor, errors[0].fields["source"]) == (
        "wrong_source",
        "mtp_h_input",
        "stale_pending",
    ), [f.message for f in errors]
    assert errors[0].message.startswith("flow 1") and not any(f.message.startswith("flow 0") for f in errors)


@pytest.mark.parametrize(
    "variant, prompts",
    [
        ("mtp-glm4moe", ["hello world and more words", "The quick brown fox"]),
        # a hybrid target: llama.cpp splits a batch of both slots as split_equal with rollback tails
        ("mtp", ["hello world and more words", "hello there my old friend"]),
    ],
)
def test_two_slots_served_at_once_compare_clean_flow_by_flow(tools, mtp_pairs, variant, prompts, tmp_path):
    """Two requests at once on two slots: llama-server decodes both sequences' rows in one batch
    (its target verifies, the head's catch-up decodes and draft steps alike); each decode is split
    per sequence as llama.cpp computed it, and each request compares clean as a flow of its own."""
    import featdiff_process

    d = mtp_pairs(variant)
    proc, out, err, port = _server_capture(tools, d, tmp_path, n_slots=2)
    featdiff_process.complete_together(port, prompts, n_predict=24, timeout_s=RUN_TIMEOUT_S)
    assert proc.wait(timeout=RUN_TIMEOUT_S) == 0, err.read_text()[-3000:]
    c = featdiff_process.two_flows_compared(d / "target-hf", d / "target.gguf", out, tmp_path)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    model = ["--target", d / "target.gguf", "--model", d / "target.gguf", "--ref-target", d / "target-hf"]
    check = subprocess.run(
        [*featdiff_process.FEATDIFF, "check", *model, "--run", out], capture_output=True, text=True, timeout=600
    )
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-2000:]  # the wiring, and each flow's accept
