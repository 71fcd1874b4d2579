"""Every write out of room (issue 34): under a file-size limit (`ulimit -f`) from 1 KiB up to just
below what a command writes, capture (its spool, its dump), reference, compare --json, report and
check exit 2 with one error line naming the file, leave no partial file, spool or lock, and keep
the file already at the output byte for byte. The runs are real (the tiny fixture pair, the
pinned build) and so is the limit: RLIMIT_FSIZE, set in the child, where featdiff ignores
SIGXFSZ so a write fails with EFBIG. A full disk (ENOSPC) or a quota (EDQUOT) is mocked where
it cannot be had without mounting a filesystem."""

from __future__ import annotations

import errno
import functools
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from featdiff.core.errors import NoRoomError
from featdiff.core.outputs import lock_path, output_lock

from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS

KIB = 1024
RUN_S = 120
MAIN = "import sys; from featdiff.cli import main; sys.argv[0] = 'featdiff'; main()"  # the console script
ERROR = "featdiff: error: "
OLD = b"the user's file, kept byte for byte\n"  # what an output held before the run
STEP_SUMMARY_LIMIT = 16 << 20  # bytes: above every file check writes on the fixture pair (a dump: < 1 MiB)


def _limits(size: int) -> list[int]:
    """File-size limits from 1 KiB up to one byte below `size`, what the command writes whole: a
    capture's spool index, its spool data, its dump (the end of the zip) each fail at one."""
    return sorted({n for n in (KIB, size // 2, size - 1) if 0 < n < size})


def _featdiff(args: list[str], cwd: Path, limit: int, **env: str) -> subprocess.CompletedProcess:
    """`featdiff ARGS` in `cwd` with files limited to `limit` bytes and its temp dir in `cwd/tmp`."""
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    (cwd / "tmp").mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-c", MAIN, *map(str, args)],
        cwd=cwd,
        env={**os.environ, "TMPDIR": str(cwd / "tmp"), **env},
        preexec_fn=functools.partial(resource.setrlimit, resource.RLIMIT_FSIZE, (limit, hard)),
        capture_output=True,
        text=True,
        timeout=RUN_S,
    )


def _files(d: Path) -> dict[str, bytes]:
    """Every file under `d`, by relative path, with its bytes."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _assert_out_of_room(done: subprocess.CompletedProcess, named: str) -> None:
    """Exit 2, one error line naming `named` and what to free; no traceback, no internal error;
    any other line is featdiff's own progress (`featdiff: reference: ...`)."""
    lines = done.stderr.splitlines()
    errors = [line for line in lines if line.startswith(ERROR)]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(errors) == 1 and named in errors[0] and "ulimit -f" in errors[0], done.stderr
    assert all(line.startswith("featdiff: ") for line in lines), done.stderr
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr


def _assert_nothing_lost(work: Path, before: dict[str, bytes], limit: int, done: subprocess.CompletedProcess) -> None:
    after = _files(work)
    assert after.keys() == before.keys(), f"limit {limit}: {sorted(after.keys() ^ before.keys())}; {done.stderr}"
    assert all(after[k] == before[k] for k in before), f"limit {limit}: an existing file changed"


@pytest.fixture(scope="module")
def models(fixture_models) -> Path:
    return fixture_models("clean")


def test_capture_out_of_room_at_any_size_is_exit_2_and_keeps_the_old_dump(tmp_path, models, captured):
    """Below the spool's size the spool's write fails (in the C shim, its errno kept), above it
    the dump's: each is one line naming the output; the spool goes too."""
    args = ["capture", "--target", models / "target.gguf", "--model", models / "draft.gguf", "-o", "run.npz",
            "--tokens", DEFAULT_TOKENS, "--rounds", DEFAULT_ROUNDS]  # fmt: skip
    _sweep(tmp_path, captured(), "run.npz", args)  # over the session's capture of the same pair and tokens


def test_reference_out_of_room_at_any_size_is_exit_2_and_keeps_the_old_dump(tmp_path, models, referenced):
    args = ["reference", "--target", models / "target.gguf", "--model", models / "draft-hf", "-o", "ref.npz",
            "--tokens", DEFAULT_TOKENS, "--rounds", DEFAULT_ROUNDS]  # fmt: skip
    _sweep(tmp_path, referenced(), "ref.npz", args)


def _sweep(tmp_path: Path, existing: Path, name: str, args: list) -> None:
    """`args` writing `name`, where a copy of `existing` already is, under each file-size limit:
    exit 2 naming it, every file as it was."""
    old = tmp_path / name
    shutil.copy(existing, old)
    before = _files(tmp_path)
    for limit in _limits(old.stat().st_size):
        done = _featdiff(args, tmp_path, limit)
        _assert_out_of_room(done, f"{name}: could not be written")
        _assert_nothing_lost(tmp_path, before, limit, done)


@pytest.mark.parametrize(
    ("command", "output"), [(["compare", "--json"], "f.json"), (["report", "-o"], "r.html")], ids=["compare", "report"]
)
def test_compare_json_and_report_out_of_room_keep_the_old_file(tmp_path, captured, referenced, command, output):
    dumps = [referenced(), captured()]
    done = _featdiff([command[0], *dumps, command[1], output], tmp_path, resource.RLIM_INFINITY)
    assert done.returncode == 0, done.stderr
    size = (tmp_path / output).stat().st_size
    (tmp_path / output).write_bytes(OLD)
    before = _files(tmp_path)
    for limit in _limits(size):
        done = _featdiff([command[0], *dumps, command[1], output], tmp_path, limit)
        _assert_out_of_room(done, f"{output}: could not be written")
        _assert_nothing_lost(tmp_path, before, limit, done)


def test_check_out_of_room_at_any_size_is_exit_2_and_keeps_its_old_outputs(tmp_path, models, captured):
    """check writes a capture (1 KiB: its spool fails) and a reference (in its temp dir, or --keep)
    before its JSON, report and summary: a limit below either dump stops it there, and nothing the
    user had changes. `--run` judges the session's capture, so the reference is the dump to fill."""
    pair = ["--target", models / "target.gguf", "--model", models / "draft.gguf"]
    outputs = ["--json", "c.json", "--report", "c.html", "--summary-md", "s.md"]
    done = _featdiff(
        ["check", *pair, "--run", captured(), *outputs, "--keep", "keep"], tmp_path, resource.RLIM_INFINITY
    )
    assert done.returncode == 0, done.stderr
    size = (tmp_path / "keep" / "ref.npz").stat().st_size
    shutil.rmtree(tmp_path / "keep")
    before = _files(tmp_path)
    for limit, judged in ((KIB, []), (size // 2, ["--run", captured()]), (size - 1, ["--run", captured()])):
        done = _featdiff(["check", *pair, *judged, *outputs], tmp_path, limit)
        _assert_out_of_room(done, ".npz: could not be written")
        _assert_nothing_lost(tmp_path, before, limit, done)


def test_check_appending_to_a_full_step_summary_takes_its_lines_back(tmp_path, models, captured):
    """$GITHUB_STEP_SUMMARY is appended to, never replaced: an append out of room is cut back."""
    step = tmp_path / "step.md"
    step.write_bytes(OLD)
    os.truncate(step, STEP_SUMMARY_LIMIT - 16)  # sparse: the earlier steps' summaries, near the limit
    args = ["check", "--target", models / "target.gguf", "--model", models / "draft.gguf", "--run", captured()]
    done = _featdiff(args, tmp_path, STEP_SUMMARY_LIMIT, GITHUB_STEP_SUMMARY=str(step))
    _assert_out_of_room(done, "step.md: could not be written")
    assert step.stat().st_size == STEP_SUMMARY_LIMIT - 16 and step.read_bytes().startswith(OLD)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["step.md", "tmp"]


def test_a_cold_cache_without_room_to_compile_is_exit_2_naming_it(tmp_path, models):
    """The binding is compiled on first use into the cache; the compiler's failures do not say
    why, so the room is checked first, and nothing is left in the cache."""
    args = ["capture", "--target", models / "target.gguf", "--model", models / "draft.gguf", "-o", "run.npz"]
    done = _featdiff([*args, "--tokens", "1,2,3"], tmp_path, 20 * KIB, FEATDIFF_CACHE=str(tmp_path / "cache"))
    _assert_out_of_room(done, str(tmp_path / "cache"))
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []
    assert not (tmp_path / "run.npz").exists() and not list((tmp_path / "tmp").iterdir())


def test_a_bug_whose_crash_report_finds_no_room_is_still_one_line(tmp_path):
    """A bug is exit 3 with its traceback in a file; where that file has no room the line says
    so, and no partial report or terminal traceback is left (the bug is planted: none is known)."""
    plant = "import featdiff.diff; featdiff.diff.compare_dumps = lambda *a, **k: 1 / 0; "
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    (tmp_path / "tmp").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", plant + MAIN, "compare", "ref.npz", "run.npz"],
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
        preexec_fn=functools.partial(resource.setrlimit, resource.RLIMIT_FSIZE, (KIB, hard)),
        capture_output=True,
        text=True,
        timeout=RUN_S,
    )
    assert done.returncode == 3, done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and "ZeroDivisionError" in line and "no crash report" in line and "ulimit -f" in line
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_lock_file_without_room_for_its_pid_is_no_room_and_removed(tmp_path, monkeypatch, code):
    """A full disk or a quota at the lock's pid (mocked: `os.write` fails as the disk would)."""
    output = tmp_path / "run.npz"

    def full(fd: int, data: bytes) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("featdiff.core.outputs.os.write", full)
    with pytest.raises(NoRoomError, match="run.npz.lock: could not be written"), output_lock(output):
        pass
    monkeypatch.undo()
    assert not lock_path(output).exists() and list(tmp_path.iterdir()) == []
