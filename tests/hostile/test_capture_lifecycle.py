"""A capture's life under faults (issue 12): two runs to one output, a spool left by a dead run,
a program that fails or outlives featdiff, SIGINT / SIGTERM / SIGKILL of featdiff, a broken spool,
a filter that catches nothing. Every case runs the real build and real programs on the tiny
fixture models; none may lose or overwrite the user's data, and none may be silent."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core.filters import capture_filters
from featdiff.core.names import ROLES
from featdiff.driver.capture import capture
from featdiff.dump.reader import read_dump
from featdiff.dump.records import record_key
from featdiff.llama import spool, spool_index
from featdiff.programs import exec as exec_capture
from featdiff.programs.preload import preload
from featdiff.programs.recover import pack_spool
from featdiff.programs.server import free_port

from real_flow import DEFAULT_TOKENS

# one thread each: ggml's spinning thread pool crawls when the machine's 2 cores are shared
SPEC_ARGS = ["--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-c", "256", "-t", "1", "-td", "1"]
FLOW_PHASES = {"prefill", "inject", "draft", "verify"}
RUN_TIMEOUT_S = 120
WAIT_S = 60  # the most a test waits for a child to reach the state it needs
GONE_WITHIN_S = 10  # SIGKILL of featdiff: its program must be gone by then
# featdiff as its console script runs it: cli.main, with its signal handlers
FEATDIFF = [sys.executable, "-c", "import sys; from featdiff.cli import main; sys.argv[0] = 'featdiff'; main()"]


@pytest.fixture(scope="module")
def models(fixture_models) -> Path:
    return fixture_models("clean")


def _spec_command(tools, d: Path) -> list[str]:
    """llama-speculative-simple on the fixture pair: a whole DFlash flow in about a second."""
    return [str(tools.program("llama-speculative-simple")), "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf"),
            *SPEC_ARGS, "-p", "The quick brown fox", "-n", "16", "--temp", "0"]  # fmt: skip


def _server_command(tools, d: Path) -> list[str]:
    return [str(tools.program("llama-server")), "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf"), *SPEC_ARGS]


def _wrapped(command: list[str], then: str) -> list[str]:
    """`command` run by a bash wrapper (its output dropped), which then runs `then`."""
    return ["bash", "-c", f"{shlex.join(command)} >/dev/null 2>&1; {then}"]


@pytest.fixture(scope="module")
def exec_spool(tools, models, tmp_path_factory) -> Path:
    """The spool a `capture --exec` of llama-speculative-simple leaves when featdiff dies before
    packing it: the program run under the preload alone."""
    prefix = tmp_path_factory.mktemp("exec-spool") / "dead.npz.spool"
    env = preload(prefix).environ()
    done = subprocess.run(_spec_command(tools, models), env=env, capture_output=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return prefix


@pytest.fixture(scope="module")
def exec_spool_packed(exec_spool, tmp_path_factory) -> spool.Packed:
    """`exec_spool` packed as it is: the baseline of the broken-spool tests."""
    copy = _copy_spool(exec_spool, tmp_path_factory.mktemp("baseline") / "run.npz.spool")
    return pack_spool(copy, copy.parent / "run.npz")


def _copy_spool(prefix: Path, to: Path) -> Path:
    """Every file of the spool at `prefix`, copied to the spool prefix `to`."""
    for path in spool.spool_paths(prefix):
        shutil.copyfile(path, to.with_name(to.name + path.name[len(prefix.name) :]))
    return to


def _featdiff(args: list[str]) -> subprocess.Popen:
    """featdiff in a child process, its stderr kept."""
    return subprocess.Popen([*FEATDIFF, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_until(ready, proc: subprocess.Popen, what: str) -> None:
    """Poll `ready()` until true; fail naming `what` if `proc` ends first or WAIT_S pass."""
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"featdiff ended (rc {proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} after {WAIT_S} s")
        time.sleep(0.05)


def _messages(stderr: str) -> list[str]:
    """featdiff's own lines (not the program's, not a progress bar's)."""
    return [line for line in stderr.splitlines() if line.startswith("featdiff: ")]


def _live_pids(marker: bytes) -> list[int]:
    """Pids of the live (not zombie) processes whose environment holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes():
                stat = (entry / "stat").read_text()
                if stat[stat.rindex(")") + 2] != "Z":
                    found.append(int(entry.name))
        except OSError:  # it ended while we looked, or is not ours to read
            continue
    return found


def _spool_marker(output: Path) -> bytes:
    """What the environment of every process `capture --exec -o output` starts holds."""
    return f"FEATDIFF_SPOOL={spool.prefix_for(output)}\0".encode()


def _real_phases(path: Path) -> set[str]:
    with read_dump(path) as dump:
        return {e.phase for e in dump.manifest.evals}


# ---------------------------------------------------------------- one output, one writer


def test_a_second_capture_to_the_same_output_is_refused_while_the_first_writes(tools, models, tmp_path):
    out, ready, go = tmp_path / "run.npz", tmp_path / "ready", tmp_path / "go"
    waits = f"touch {ready}; while [ ! -e {go} ]; do sleep 0.05; done"
    first = _featdiff(["capture", "--exec", "-o", out, "--", *_wrapped(_spec_command(tools, models), waits)])
    _wait_until(ready.exists, first, "the first capture's program finished decoding")
    second = CliRunner().invoke(app, ["capture", "--target", str(models / "target.gguf"), "--model",
                                      str(models / "draft.gguf"), "--tokens", DEFAULT_TOKENS, "-o", str(out)])  # fmt: skip
    packing = CliRunner().invoke(app, ["pack", str(spool.prefix_for(out)), "-o", str(tmp_path / "other.npz")])
    go.touch()
    _, err = first.communicate(timeout=RUN_TIMEOUT_S)
    held = f"another featdiff run is writing {out} (pid {first.pid}); wait for it or choose another -o"
    for refused in (second, packing):
        assert refused.exit_code == 2 and held in refused.output, refused.output
    assert first.returncode == 0, err[-2000:]
    assert FLOW_PHASES <= _real_phases(out)  # the first run's dump, whole
    assert not (tmp_path / "other.npz").exists()
    assert list(tmp_path.glob("run.npz.*")) == [exec_capture.program_log(out)]  # no spool, no lock: the program's log


# ---------------------------------------------------------------- a spool left by a dead run


@pytest.mark.parametrize("kind", ["in-process", "exec"])
def test_a_rerun_moves_a_dead_runs_spool_aside_and_it_still_packs(kind, tools, models, exec_spool, tmp_path, caplog):
    out = tmp_path / "run.npz"
    left = _copy_spool(exec_spool, spool.prefix_for(out))
    before = {p.name[len(left.name) :]: p.read_bytes() for p in spool.spool_paths(left)}
    with caplog.at_level("WARNING", logger="featdiff"):
        if kind == "exec":
            exec_capture.capture_exec(_spec_command(tools, models), out, timeout_s=RUN_TIMEOUT_S)
        else:
            capture(models / "target.gguf", models / "draft.gguf", out, tokens=DEFAULT_TOKENS, rounds=1)
    (aside,) = {p.name[: -len(".index")] for p in tmp_path.glob("run.npz.spool-*.index")}
    moved = tmp_path / aside
    assert {p.name[len(aside) :]: p.read_bytes() for p in spool.spool_paths(moved)} == before  # every file, intact
    assert f"moved it to {moved}.*" in caplog.text and f"`featdiff pack {moved} -o " in caplog.text
    assert "matched no tensor" not in caplog.text  # the default filters never warn
    assert FLOW_PHASES <= _real_phases(out) and not spool.spool_paths(spool.prefix_for(out))
    result = CliRunner().invoke(app, ["pack", str(moved), "-o", str(tmp_path / "recovered.npz")])
    assert result.exit_code == 0, result.output
    assert FLOW_PHASES <= _real_phases(tmp_path / "recovered.npz")


# ---------------------------------------------------------------- a failed run keeps the user's dump


def test_a_failing_program_leaves_the_dump_at_o_as_it_was(tools, models, exec_spool_packed, tmp_path):
    out = Path(shutil.copy(exec_spool_packed.path, tmp_path / "run.npz"))
    good = out.read_bytes()
    command = _wrapped(_spec_command(tools, models), "exit 3")
    result = CliRunner().invoke(app, ["capture", "--exec", "-o", str(out), "--", *command])
    assert result.exit_code == 2, result.output
    failed = tmp_path / "run.failed.npz"
    assert "exited with code 3" in result.output and f"{failed} holds what it decoded" in result.output
    assert out.read_bytes() == good
    assert FLOW_PHASES <= _real_phases(failed)


# ---------------------------------------------------------------- pack: either kind, every complete record


def test_pack_of_an_exec_spool_gives_its_evals_their_phases(exec_spool, tmp_path):
    copy = _copy_spool(exec_spool, tmp_path / "run.npz.spool")
    result = CliRunner().invoke(app, ["pack", str(copy), "-o", str(tmp_path / "run.npz")])
    assert result.exit_code == 0, result.output
    with read_dump(tmp_path / "run.npz") as dump:
        m = dump.manifest
        assert FLOW_PHASES <= {e.phase for e in m.evals} and m.rounds and m.prompt_tokens
        assert FLOW_PHASES <= {r.phase for r in m.records}
    assert f"packed {len(m.records)} complete records into {tmp_path / 'run.npz'}" in result.output


def test_pack_keeps_every_complete_record_after_a_short_one_and_counts_the_dropped(
    exec_spool, exec_spool_packed, tmp_path
):
    copy = _copy_spool(exec_spool, tmp_path / "run.npz.spool")
    index, data = spool.spool_files(copy)
    lines = index.read_bytes().splitlines(keepends=True)
    records = [i for i, line in enumerate(lines) if json.loads(line)["kind"] == spool_index.RECORD]
    middle, other = records[len(records) // 2], records[len(records) // 3]
    short, missized = json.loads(lines[middle]), json.loads(lines[other])
    short["offset"] = data.stat().st_size  # its bytes are past the end of the data file
    missized["nbytes"] += 4  # its byte count is not its shape's
    lines[middle], lines[other] = (json.dumps(e).encode() + b"\n" for e in (short, missized))
    index.write_bytes(b"".join(lines) + b'{"kind": "record", "eval": ')  # and a torn last line
    result = CliRunner().invoke(app, ["pack", str(copy), "-o", str(tmp_path / "run.npz")])
    assert result.exit_code == 0, result.output
    kept = exec_spool_packed.kept - 2
    assert f"packed {kept} complete records" in result.output
    assert (
        "warning: dropped 3 (1: byte count does not match the shape, 1: data file ends early, 1: torn index line)"
        in result.output
    )
    with read_dump(exec_spool_packed.path) as whole, read_dump(tmp_path / "run.npz") as packed:
        lost = {r.key for r in whole.manifest.records} - {r.key for r in packed.manifest.records}
        assert len(packed.manifest.records) == kept
    assert lost == {
        record_key(int(e["eval"]), ROLES[int(e["role"])], e["name"], int(e["occurrence"])) for e in (short, missized)
    }


def _preload_spool(prefix: Path, lines: list[dict], data: bytes = b"") -> Path:
    """A preload spool written by hand: its index lines and data bytes."""
    index, data_path = spool.spool_files(prefix)
    index.write_text("".join(json.dumps(line) + "\n" for line in lines))
    data_path.write_bytes(data)
    return prefix


# the lines native/featdiff_preload.c writes for a program that decoded two tokens on one context
PRELOAD_LINES = [
    {"kind": "exec_start", "pid": 1, "library": "libllama.so"},
    {"kind": "exec_context", "ctx": 0, "ok": True, "role": 0, "model": 1, "arch": "qwen3", "n_ubatch": 512,
     "n_seq_max": 1, "kv_unified": False},
    {"kind": "exec_eval", "eval": 0, "ctx": 0, "call": "decode", "n_tokens": 2, "token_ids": [5, 6],
     "positions": [0, 1], "seq_ids": [0, 0], "outputs": [1, 1]},
    {"kind": "exec_done", "eval": 0, "rc": 0, "ms": 1.0},
]  # fmt: skip
RECORD_LINE = {"kind": "record", "eval": 0, "ubatch": 0, "role": 0, "occurrence": 0, "name": "result_output",
               "op": "MUL_MAT", "ggml_type": "f32", "n_dims": 2, "ne": [4, 2, 1, 1], "nb": [4, 16, 32, 32],
               "srcs": [], "dtype": "float32", "offset": 0, "nbytes": 32, "is_leaf": False}  # fmt: skip


@pytest.mark.parametrize(
    "line",
    [
        {k: v for k, v in PRELOAD_LINES[2].items() if k != "positions"},
        {**PRELOAD_LINES[2], "seq_ids": "0,0"},
        {**PRELOAD_LINES[1], "role": 7},
    ],
    ids=["a-field-missing", "a-field-of-another-type", "no-such-role"],
)
def test_a_preload_line_without_its_fields_exits_2_naming_the_index(line, tmp_path):
    lines = [line if e["kind"] == line["kind"] else e for e in PRELOAD_LINES]
    prefix = _preload_spool(tmp_path / "run.npz.spool", lines)
    result = CliRunner().invoke(app, ["pack", str(prefix), "-o", str(tmp_path / "run.npz")])
    assert result.exit_code == 2, result.output
    assert f"{spool.spool_files(prefix)[0]}: an {line['kind']} line of the preload" in result.output
    assert not (tmp_path / "run.npz").exists()


def test_a_record_line_with_a_field_of_another_type_is_dropped_and_counted(tmp_path):
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)  # (n_tokens, n_vocab)
    bad = {**RECORD_LINE, "occurrence": 1, "nbytes": "32"}
    prefix = _preload_spool(tmp_path / "run.npz.spool", [*PRELOAD_LINES, RECORD_LINE, bad], rows.tobytes())
    result = CliRunner().invoke(app, ["pack", str(prefix), "-o", str(tmp_path / "run.npz")])
    assert result.exit_code == 0, result.output
    assert "packed 1 complete records" in result.output and "1: unreadable index line" in result.output
    with read_dump(tmp_path / "run.npz") as dump:
        (record,) = dump.manifest.records
        assert (record.phase, record.shape) == ("prefill", (2, 4))
        np.testing.assert_array_equal(dump.array(record), rows)


# ---------------------------------------------------------------- signals


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("wrapper", [False, True], ids=["direct", "under-a-wrapper-script"])
def test_sigkill_of_featdiff_takes_the_program_with_it(wrapper, tools, models, tmp_path):
    out = tmp_path / "run.npz"
    server = [*_server_command(tools, models), "--port", str(free_port())]
    command = ["bash", "-c", f"{shlex.join(server)}; true"] if wrapper else server
    proc = _featdiff(["capture", "--exec", "-o", out, "--tokens", DEFAULT_TOKENS, "--", *command])
    marker = _spool_marker(out)

    def server_up() -> bool:
        return any(b"llama-server" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _live_pids(marker))

    _wait_until(server_up, proc, "llama-server started")
    proc.kill()
    proc.wait()  # not its stderr: an orphan would hold that pipe open
    deadline = time.monotonic() + GONE_WITHIN_S
    while _live_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    orphans = _live_pids(marker)
    for pid in orphans:  # this test's own processes: never leave them running
        os.kill(pid, signal.SIGKILL)
    assert orphans == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_exec_capture_stops_the_program_and_packs_what_it_decoded(signum, tools, models, tmp_path):
    out, ready = tmp_path / "run.npz", tmp_path / "ready"
    command = _wrapped(_spec_command(tools, models), f"touch {ready}; exec sleep 600")
    proc = _featdiff(["capture", "--exec", "-o", out, "--", *command])
    _wait_until(ready.exists, proc, "the program finished decoding")
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err[-2000:]
    (line,) = _messages(err)
    assert line.startswith(f"featdiff: interrupted by {name}; stopped the program; packed ") and str(out) in line
    assert FLOW_PHASES <= _real_phases(out)
    assert _live_pids(_spool_marker(out)) == []
    assert list(tmp_path.glob("run.npz.*")) == [exec_capture.program_log(out)]  # no spool left: the program's log


def test_sigterm_of_an_in_process_capture_packs_what_it_decoded_beside_the_users_dump(
    models, exec_spool_packed, tmp_path
):
    out, failed = tmp_path / "run.npz", tmp_path / "run.failed.npz"
    good = Path(shutil.copy(exec_spool_packed.path, out)).read_bytes()
    index = spool.spool_files(spool.prefix_for(out))[0]
    proc = _featdiff(["capture", "--target", models / "target.gguf", "--model", models / "draft.gguf",
                      "--tokens", DEFAULT_TOKENS, "--rounds", "900", "--filter", "*", "-o", out])  # fmt: skip
    _wait_until(lambda: index.exists() and index.stat().st_size > 100_000, proc, "a spool of 100 kB")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 143, err[-2000:]
    (line,) = _messages(err)
    assert line.startswith("featdiff: interrupted by SIGTERM; packed ") and line.endswith(f"records into {failed}")
    assert out.read_bytes() == good
    with read_dump(failed) as dump:
        assert f"packed {len(dump.manifest.records)} complete" in line and len(dump.manifest.records) > 100
        assert {"prefill", "draft", "verify"} <= {e.phase for e in dump.manifest.evals}
    assert not list(tmp_path.glob("run.npz.*"))


# ---------------------------------------------------------------- filters that catch nothing


def test_a_filter_that_matches_nothing_is_named_in_a_warning(models, tmp_path, caplog):
    out = tmp_path / "run.npz"
    with caplog.at_level("WARNING", logger="featdiff"):
        capture(models / "target.gguf", models / "draft.gguf", out, tokens=DEFAULT_TOKENS, rounds=1,
                filters=["l_out-99", "draft:Qcur-*"])  # fmt: skip
    assert "--filter 'l_out-99' matched no tensor of the target or the draft in this capture" in caplog.text
    assert "Qcur" not in caplog.text
    with read_dump(out) as dump:
        assert {r.name for r in dump.manifest.records} >= {"Qcur-0"}


def test_unmatched_globs_are_judged_over_the_roles_each_was_given_for():
    filters = capture_filters(["l_out-9", "draft:nope", "Qcur-*", "!Qcur-1"])
    names = frozenset({("target", "Qcur-0"), ("target", "l_out-1")})
    got = spool.unmatched_globs(filters, names)
    assert got == (("l_out-9", ("target", "draft")), ("nope", ("draft",)))
