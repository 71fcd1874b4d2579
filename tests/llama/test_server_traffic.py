"""The user's own traffic (issue 22, part 3): `capture --exec -- llama-server` without --prompt /
--tokens keeps the user's --port, records the requests a client outside featdiff sends, and ends
after `--requests N` or at Ctrl-C (the normal end: exit 0, the dump at -o). Real build, real
fixture models, requests sent over HTTP as any client would."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import NamedTuple

import pytest
from typer.testing import CliRunner

import featdiff_process
from featdiff.cli import app
from featdiff.dump.reader import read_dump
from featdiff.programs.server import free_port

# one slot: the request after the shared prefix finds it cached; one thread each (2 shared cores)
SERVER_ARGS = ["--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-c", "256", "-np", "1", "-t", "1", "-td", "1"]
WAIT_S = 60  # the most a test waits for the server to come up, or featdiff to end
N_PREDICT = 8
SHARED_PREFIX = list(range(100, 140))  # 40 tokens both prefix requests start with
REQUESTS = ([7, 21, 3, 99, 42, 5], [*SHARED_PREFIX, 11, 12], [*SHARED_PREFIX, 13, 14, 15])


@pytest.fixture(scope="module")
def server_command(tools, fixture_models) -> list[str]:
    d = fixture_models("clean")
    program = str(tools.program("llama-server"))
    return [program, "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf"), *SERVER_ARGS]


def _featdiff(args: list, stderr: Path) -> subprocess.Popen:
    return featdiff_process.start(args, stderr)


def _wait_listening(proc: subprocess.Popen, stderr: Path) -> None:
    featdiff_process.wait_listening(proc, stderr, WAIT_S)


def _complete(port: int, prompt: list, n_predict: int = N_PREDICT):
    """One greedy /completion, as a client outside featdiff sends it, with the server's prompt cache."""
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "cache_prompt": True}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=WAIT_S) as r:
        return json.loads(r.read())


class Traffic(NamedTuple):
    """One capture of the three REQUESTS sent one after the other: its dump, the port, what
    featdiff said on stderr, and the server's answers."""

    run: Path
    port: int
    said: str
    answers: list[dict]


@pytest.fixture(scope="module")
def three_requests(server_command, tmp_path_factory) -> Traffic:
    """The three requests' capture, once: the tests below assert different things about it."""
    tmp = tmp_path_factory.mktemp("three-requests")
    out, err, port = tmp / "run.npz", tmp / "stderr", free_port()
    proc = _featdiff(["capture", "--exec", "-o", out, "--requests", 3, "--", *server_command, "--port", port], err)
    _wait_listening(proc, err)
    said = err.read_text()
    answers = [_complete(port, prompt) for prompt in REQUESTS]
    assert proc.wait(timeout=WAIT_S) == 0, err.read_text()[-2000:]
    return Traffic(out, port, said, answers)


def test_three_requests_of_the_users_client_are_captured_with_the_cached_prefix_followed(three_requests):
    out, port, answers = three_requests.run, three_requests.port, three_requests.answers
    assert f"capturing llama-server at http://127.0.0.1:{port} until Ctrl-C or 3 requests" in three_requests.said
    third = answers[2]["timings"]
    assert third["cache_n"] == len(SHARED_PREFIX)  # the server reused the prefix the second request left
    with read_dump(out) as dump:
        m = dump.manifest
        prefills = [e for e in m.evals if e.role == "target" and e.phase == "prefill"]
        target = [e for e in m.evals if e.role == "target" and e.phase != "warmup"]
    assert m.build["server_traffic"] == {
        "ended_by": "requests",
        "exit_code": 0,
        "n_requests": 3,
        "url": f"http://127.0.0.1:{port}",
    }
    # each request's prefill: from where its cached prefix ends, its uncached prompt tokens
    assert [(e.positions[0], e.n_tokens) for e in prefills] == [
        (a["timings"]["cache_n"], a["timings"]["prompt_n"]) for a in answers
    ]
    assert prefills[2].positions[0] > 0 and list(prefills[2].token_ids) == REQUESTS[2][len(SHARED_PREFIX) :]
    # every token each request generated came out of a captured target decode (prefill or verify)
    assert len(target) >= len(REQUESTS) and {"prefill", "verify"} == {e.phase for e in target}
    assert sum(a["timings"]["predicted_n"] for a in answers) == len(REQUESTS) * N_PREDICT
    assert [p.name for p in out.parent.glob("run.npz.*")] == ["run.npz.log"]  # the server's own log, nothing else
    assert not (out.parent / "run.failed.npz").exists()


def test_sigint_ends_a_capture_of_the_users_traffic_with_exit_0_and_the_dump_at_o(server_command, tmp_path):
    out, err, port = tmp_path / "run.npz", tmp_path / "stderr", free_port()
    proc = _featdiff(["capture", "--exec", "-o", out, "--", *server_command, "--port", port], err)
    _wait_listening(proc, err)
    assert f"at http://127.0.0.1:{port} until Ctrl-C; " in err.read_text()
    answer = _complete(port, REQUESTS[0])
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=WAIT_S) == 0, err.read_text()[-2000:]
    assert "interrupted" not in err.read_text()
    with read_dump(out) as dump:
        m = dump.manifest
    assert m.build["server_traffic"]["ended_by"] == "SIGINT" and m.build["server_traffic"]["n_requests"] == 1
    (prefill,) = [e for e in m.evals if e.role == "target" and e.phase == "prefill"]
    assert list(prefill.token_ids) == REQUESTS[0] and answer["timings"]["predicted_n"] == N_PREDICT
    assert {"inject", "draft", "verify"} <= {e.phase for e in m.evals}
    assert [p.name for p in tmp_path.glob("run.npz.*")] == ["run.npz.log"]  # the server's own log, nothing else
    assert not (tmp_path / "run.failed.npz").exists()


@pytest.mark.parametrize(
    ("options", "extra", "said"),
    [
        (["--exec", "--requests", "2", "--prompt", "hi"], [], "featdiff sends one itself"),
        (["--requests", "2"], [], "give it with --exec -- llama-server"),
        (["--exec", "--requests", "2"], ["-lv", "1"], "'stop processing: n_tokens' log lines, which --log-verbosity 1"),
        (["--exec", "--requests", "2"], ["--log-disable"], "which --log-disable keeps out of its output"),
        (["--exec"], ["--host", "/tmp/featdiff-test.sock"], "not a UNIX socket"),
        (["--exec"], ["--port", "0"], "--port 0: featdiff needs the port your client will use"),
    ],
    ids=["with-prompt", "in-process", "quiet-log", "log-disabled", "unix-socket", "port-0"],
)
def test_a_traffic_capture_that_cannot_work_exits_2_before_starting_anything(
    server_command, tmp_path, options, extra, said
):
    out = tmp_path / "r.npz"
    args = ["capture", "-o", str(out), *options, "--", *server_command, *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and said in result.output, result.output
    assert list(tmp_path.iterdir()) == []


def test_requests_around_another_program_exits_2(tools, tmp_path):
    cmd = [str(tools.program("llama-simple")), "-m", str(tmp_path / "T.gguf")]
    result = CliRunner().invoke(
        app, ["capture", "--exec", "-o", str(tmp_path / "r.npz"), "--requests", "1", "--", *cmd]
    )
    assert result.exit_code == 2 and "llama-simple is not llama-server" in result.output, result.output


# ---------------------------------------------------------------- each request compared (issue 22, parts 2 and 3)


def _captured_traffic(server_command, tmp_path, requests, extra=(), concurrent=False, env=None) -> Path:
    """The dump of `requests` sent by a client to a server under passive capture."""
    import os

    out, err, port = tmp_path / "run.npz", tmp_path / "stderr", free_port()
    args = ["capture", "--exec", "-o", out, "--requests", len(requests), "--", *server_command, *extra, "--port", port]
    before = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        proc = _featdiff(args, err)
    finally:
        for k, v in before.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    _wait_listening(proc, err)
    if concurrent:  # one call of several prompts: the server starts a slot for each at once
        _complete(port, list(requests), CONCURRENT_PREDICT)
    else:
        for prompt in requests:
            _complete(port, prompt)
    assert proc.wait(timeout=WAIT_S) == 0, err.read_text()[-2000:]
    return out


def _compared(models: Path, run: Path, tmp_path: Path):
    from featdiff.diff import compare_dumps

    from real_flow import reference_of

    ref = reference_of(models / "target.gguf", models / "draft-hf", tmp_path / "ref.npz", follow=run)
    return compare_dumps(ref, run)


def _errors(c) -> list[str]:
    return [f"{f.kind} at {f.tensor}: {f.message}" for f in c.findings if f.severity == "error"]


def test_three_client_requests_compare_clean_request_by_request(three_requests, fixture_models, tmp_path):
    """Each request is a flow (the third starting past the prefix the server kept cached); the
    reference replays each (`--follow`) and compare pairs every request's rows, nothing skipped."""
    run = three_requests.run
    with read_dump(run) as dump:
        m = dump.manifest
        assert m.flow_ids() == (0, 1, 2)
        assert [f.n_cached for f in m.flows] == [0, 0, len(SHARED_PREFIX)]
        assert m.flows[2].prompt_tokens[: len(SHARED_PREFIX) + 3] == (*SHARED_PREFIX, 13, 14, 15)
    c = _compared(fixture_models("clean"), run, tmp_path)
    assert c.ok, _errors(c)
    assert c.coverage.pairs_skipped == 0 and c.coverage.rows_skipped == 0, c.coverage.skipped_phrase()
    assert {p.eval for p in c.pairs} and c.coverage.pairs > 3 * 10
    # the CI verdict on that capture: each request's wiring and its accept against the reference's
    d = fixture_models("clean")
    args = ["check", "--target", d / "target.gguf", "--model", d / "draft.gguf", "--ref-model", d / "draft-hf",
            "--run", run, "--json", tmp_path / "check.json"]  # fmt: skip
    result = CliRunner().invoke(app, [str(a) for a in args])
    verdict = json.loads((tmp_path / "check.json").read_text())
    assert result.exit_code == 0 and verdict["verdict"] == "pass", result.output
    assert verdict["mode"] == "capture" and len(verdict["probe"]["prompts"]) == 3


TWO_SLOTS = ["-np", "2"]
CONCURRENT = ([7, 21, 3, 99, 42, 5, 60, 61], [300, 301, 302, 303, 304, 305, 306, 307])
CONCURRENT_PREDICT = 16


def _interleaved(m) -> bool:
    """The two flows decoded side by side: each has an eval between two of the other's."""
    order = [e.flow for e in m.evals if e.phase != "warmup"]
    first, last = (
        {f: order.index(f) for f in set(order)},
        {f: len(order) - 1 - order[::-1].index(f) for f in set(order)},
    )
    return all(any(first[f] < i < last[f] for i, g in enumerate(order) if g != f) for f in set(order))


def test_two_concurrent_requests_on_two_slots_compare_clean_per_sequence(server_command, fixture_models, tmp_path):
    run = _captured_traffic(server_command, tmp_path, CONCURRENT, TWO_SLOTS, concurrent=True)
    with read_dump(run) as dump:
        m = dump.manifest
        assert len(m.flow_ids()) == 2 and {f.seq_id for f in m.flows} == {0, 1}
        assert _interleaved(m)  # the slots' rounds, split out of the batches both slots shared
    c = _compared(fixture_models("clean"), run, tmp_path)
    assert c.ok, _errors(c)
    assert c.coverage.pairs_skipped == 0 and c.coverage.rows_skipped == 0, c.coverage.skipped_phrase()


def test_one_slot_fed_the_other_slots_features_is_named_at_that_sequence(server_command, fixture_models, tmp_path):
    """0002-driver-faults.patch `seq-swap`: sequence 1 reads sequence 0's feature rows when a batch
    holds as many of them; compare names it in sequence 1's flow, and sequence 0's flow is clean."""
    run = _captured_traffic(
        server_command, tmp_path, CONCURRENT, TWO_SLOTS, concurrent=True, env={"FEATDIFF_FAULT": "seq-swap"}
    )
    with read_dump(run) as dump:
        assert _interleaved(dump.manifest)
    c = _compared(fixture_models("clean"), run, tmp_path)
    errors = [f for f in c.findings if f.severity == "error"]
    assert errors, "the swapped features went unnoticed"
    assert {f.fields.get("seq_id") for f in errors} == {1}, _errors(c)
    assert errors[0].tensor == "inp_target_features" and "sequence 1" in errors[0].message
    # check of that capture (issue 48: check --exec sends one request at a time, so two sequences
    # at once are the user's traffic it judges with --run) names it there too
    d = fixture_models("clean")
    args = ["--target", d / "target.gguf", "--model", d / "draft.gguf", "--ref-model", d / "draft-hf", "--run", run]
    named = featdiff_process.check_names_fault(args, None, tmp_path / "check", errors[0].kind)
    assert (named[0]["tensor"], named[0].get("seq_id")) == ("inp_target_features", 1), named
