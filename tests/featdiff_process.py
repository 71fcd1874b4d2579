"""featdiff run as its console script runs it (cli.main, with its signal handlers), in a process
of its own: for the tests that capture around a llama-server and talk to it while it runs; and
the check of a planted fault the check fault tests share (check_names_fault); `featdiff check`
processes run at once (checks_at_once)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

FEATDIFF = [sys.executable, "-c", "import sys; from featdiff.cli import main; sys.argv[0] = 'featdiff'; main()"]
LISTENING = "send your requests now"  # featdiff's line once the server answers /health
CHECK_WAIT_S = 600  # one check of a trained pair: about 100 s on two loaded cores


def start(args: list, stderr: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """featdiff with `args`, its stderr to the file `stderr`."""
    with open(stderr, "w") as err:
        return subprocess.Popen([*FEATDIFF, *map(str, args)], stdout=subprocess.DEVNULL, stderr=err, env=env)


def checks_at_once(args: list, envs: list[dict[str, str]], tmp: Path) -> list[subprocess.CompletedProcess[str]]:
    """`featdiff check ARGS` under each of `envs`, the processes run at once (each on a core of
    its own where the machine has them free; each writes to its own temporary directory): their
    exit codes and outputs, in the order of `envs`. None is left running when this returns."""
    command = [*FEATDIFF, "check", *map(str, args)]
    outs = [(tmp / f"check{i}.out", tmp / f"check{i}.err") for i in range(len(envs))]
    procs = []
    try:
        for env, (out, err) in zip(envs, outs, strict=True):
            with open(out, "w") as stdout, open(err, "w") as stderr:
                procs.append(subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env))
        codes = [p.wait(timeout=CHECK_WAIT_S) for p in procs]
    finally:  # a timeout or an error here leaves no check running
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [
        subprocess.CompletedProcess(command, code, out.read_text(), err.read_text())
        for code, (out, err) in zip(codes, outs, strict=True)
    ]


def wait_listening(proc: subprocess.Popen, stderr: Path, wait_s: float) -> None:
    """Until featdiff says the server listens; the test fails if it ends or `wait_s` pass first."""
    deadline = time.monotonic() + wait_s
    while LISTENING not in stderr.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"featdiff never said it listens (rc {proc.poll()}): {stderr.read_text()[-2000:]}")
        time.sleep(0.05)


def capture_server(
    command: list, tmp_path: Path, n_requests: int, wait_s: float, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, Path, Path, int]:
    """`featdiff capture --exec` of the llama-server `command` (without --port) until it served
    `n_requests`, listening: (the featdiff process, its -o, its stderr file, the server's port).
    `env`: the process's whole environment (default: this one's)."""
    from featdiff.programs.server import free_port

    out, err, port = tmp_path / "run.npz", tmp_path / "stderr", free_port()
    proc = start(["capture", "--exec", "-o", out, "--requests", n_requests, "--", *command, "--port", port], err, env)
    wait_listening(proc, err, wait_s)
    return proc, out, err, port


def complete_together(port: int, prompts: list[str], n_predict: int, timeout_s: float) -> list[str]:
    """The `prompts` completed at once (greedy) by one llama-server /completion whose prompt is
    their list: the server queues a task per prompt in one go, so its free slots start them in the
    same update and serve them together, however busy the machine (two requests sent at once from
    two threads were served one after the other when one thread started late). Their texts, in order."""
    import json
    import urllib.request

    body = json.dumps({"prompt": prompts, "n_predict": n_predict, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=timeout_s) as r:
        answer = json.loads(r.read())
    results = answer if isinstance(answer, list) else [answer]
    assert len(results) == len(prompts), answer
    return [r["content"] for r in sorted(results, key=lambda r: r.get("index", 0))]


def two_flows_compared(target: Path, model: Path, run: Path, tmp_path: Path):
    """compare of a capture of two requests served at once on two slots against the reference
    that follows it (`target`, `model` as `featdiff reference` takes them), once the dump is
    checked to hold them as two flows that ran together, every decode split (no flow note); no
    record left out but the expected warm-up and prefill-output ones."""
    from featdiff.diff import compare_dumps
    from featdiff.dump.reader import read_dump
    from featdiff.torchref.kind import reference

    with read_dump(run) as dump:
        m = dump.manifest
    assert sorted(f.seq_id for f in m.flows) == [0, 1] and served_together(m.evals)
    assert not m.flow_notes, m.flow_notes  # every decode split as llama.cpp computed it
    ref = reference(
        target, model, tmp_path / "ref.npz", prompt=None, tokens=None, rounds=0, dtype="float32", device="cpu",
        kv_dtype="f16", llama_dir=None, follow=run,
    )  # fmt: skip
    c = compare_dumps(ref, run)
    expected = (
        "a warm-up or probe decode",
        "output no rows",
    )  # llama-server samples its prefill's last row; the reference outputs none
    assert not [s for s in c.skipped if not any(e in s for e in expected)], c.skipped  # nothing judged rests on a skip
    return c


def served_together(evals) -> bool:
    """Whether a dump's flows ran at once: an eval of one flow between two of another."""
    seen: list[int] = []
    for e in evals:
        if not seen or seen[-1] != e.flow:
            seen.append(e.flow)
    return len(seen) > len(set(seen))


def compares_clean_against_its_tokens(run: Path, target: Path, model: Path, out: Path) -> None:
    """Compare the run dump `run` with `reference --tokens T --rounds N` of its own prompt and
    drafted rounds, as DFlash's docs make it (not --follow: the reference drafts and accepts on its
    own), and fail the test on any error or on a step left unpaired by its token history (issue
    42, item 3: a token history is the tokens the sequence holds)."""
    from featdiff.diff import compare_dumps
    from featdiff.dump.reader import read_dump
    from featdiff.torchref.kind import reference

    with read_dump(run) as dump:
        m = dump.manifest
    tokens, rounds = ",".join(map(str, m.prompt_tokens)), sum(1 for r in m.rounds if r.drafts)
    ref = reference(
        target, model, out, prompt=None, tokens=tokens, rounds=rounds,
        dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None,
    )  # fmt: skip
    c = compare_dumps(ref, run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    assert not [f for f in c.findings if f.kind == "unpaired" and f.fields.get("reason") == "token_history"]


FAULT_VAR = "FEATDIFF_FAULT"  # the variable that plants a fault of patches/llama.cpp (docs/faults.md)
EXIT_FAIL = 1


def check_names_fault(args: list, fault: str | None, out: Path, finding: str) -> list[dict]:
    """`featdiff check ARGS` (through typer's CliRunner) with FEATDIFF_FAULT=`fault` planted, its
    dumps kept in out/dumps and its verdict in out/check.json; the test fails unless it exits 1
    with an error finding of kind `finding` and keeps its dumps (the run's, the --run it judged).
    Its error findings' JSON. `fault` None: none planted (a `--run` capture carries its own)."""
    import json

    from typer.testing import CliRunner

    from featdiff.cli import app

    args = [str(a) for a in args]
    out.mkdir(parents=True, exist_ok=True)
    kept = ["--keep", str(out / "dumps"), "--json", str(out / "check.json")]
    env = {FAULT_VAR: fault, "GITHUB_STEP_SUMMARY": None}
    result = CliRunner().invoke(app, ["check", *kept, *args], env=env)
    assert result.exit_code == EXIT_FAIL, (result.exit_code, result.output[-3000:])
    findings = json.loads((out / "check.json").read_text())["comparison"]["findings"]
    errors = [f for f in findings if f["severity"] == "error"]
    assert finding in [f["kind"] for f in errors], [(f["kind"], f["tensor"], f.get("where")) for f in errors]
    run = Path(args[args.index("--run") + 1]) if "--run" in args else out / "dumps" / "run.npz"
    assert run.is_file() and (out / "dumps" / "ref.npz").is_file()
    return errors


def check_passes(args: list, out: Path) -> dict:
    """`featdiff check ARGS` (through typer's CliRunner), nothing planted, its verdict in
    out/check.json; the test fails unless it exits 0 with no error finding and the accept probe
    paired at least the blocks an accept comparison needs. The verdict's JSON."""
    import json

    from typer.testing import CliRunner

    from featdiff.cli import app
    from featdiff.verdict.result import MIN_BLOCKS

    out.mkdir(parents=True, exist_ok=True)
    result = CliRunner().invoke(
        app,
        ["check", "--json", str(out / "check.json"), *map(str, args)],
        env={FAULT_VAR: None, "GITHUB_STEP_SUMMARY": None},
    )
    assert result.exit_code == 0, (result.exit_code, result.output[-3000:])
    verdict = json.loads((out / "check.json").read_text())
    assert verdict["verdict"] == "pass" and not verdict["reasons"], verdict["reasons"]
    assert verdict["accept"]["blocks"] >= MIN_BLOCKS, verdict["accept"]
    return verdict


def refused_in_one_line(args: list[str], said: str) -> str:
    """`featdiff ARGS` (through typer's CliRunner) exits 2 with exactly one error line, which says
    `said`, and no traceback: that line."""
    from typer.testing import CliRunner

    from featdiff.cli import app

    result = CliRunner().invoke(app, args)
    errors = [line for line in result.output.splitlines() if line.startswith("featdiff: error:")]
    assert result.exit_code == 2 and len(errors) == 1 and said in errors[0], result.output
    assert "Traceback" not in result.output
    return errors[0]


# llama.cpp's common/log.cpp writes from a worker thread and leaks its logger on purpose (its
# common_log_main), so a program that exits on a loaded machine can lose its last lines: the
# summary llama-speculative-simple prints at the end. Measured with two busy loops on the two
# cores: 8 of 40 runs of the gemma4-assistant pair, 19 of 40 of trained-mtp's head lost it.
SUMMARY_TRIES = 8
SUMMARY_PAUSE_S = 1.0  # between tries: the load that starved the log's thread may pass
FAVOURED_NICENESS = -10  # where allowed (root): 4 of 40 runs of trained-mtp lost it, against 19
SUMMARY_TIMEOUT_S = 120  # one run of a tiny pair takes ~0.1 s


def drafted_counts(argv: list) -> tuple[dict[str, int], str]:
    """llama-speculative-simple run as `argv`, exiting 0, until its summary's n_drafted / n_accept
    lines are read (at most SUMMARY_TRIES runs, for the lost tail above): those counts, {} when no
    run wrote them, and the last run's log."""
    for attempt in range(SUMMARY_TRIES):
        if attempt:
            time.sleep(SUMMARY_PAUSE_S)
        done = subprocess.run(
            [str(a) for a in argv],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=SUMMARY_TIMEOUT_S,
            preexec_fn=_favoured,
        )
        log = done.stdout + done.stderr
        assert done.returncode == 0, log[-3000:]
        counts = {k: int(v) for k, v in re.findall(r"(n_drafted|n_accept)\s*=\s*(\d+)", log)}
        if "n_drafted" in counts:
            return counts, log
    return {}, log


def _favoured() -> None:
    """In the child before it runs the program: a higher priority where the user may set one, so
    the log's thread is not starved by the suite's background builds; as it was elsewhere."""
    try:
        os.nice(FAVOURED_NICENESS)
    except OSError:
        pass
