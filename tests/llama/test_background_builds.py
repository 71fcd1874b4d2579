"""The test-only builds started in the background (tests/conftest.py, `python -m
featdiff.llama.extra_builds`): the test that needs one waits for it under its build lock
instead of building it twice, one that failed fails its test again naming the build's log, and
one killed part-way leaves no stamp that a later run trusts. Each runs a real CMake and Ninja
build of a tiny stand-in tree in the older release's place (its targets only write their files)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from featdiff.core.errors import InputError
from featdiff.llama.binding import ENV_TOOLS_DIR
from featdiff.llama.extra_builds import LEGACY_SDIST, LEGACY_TARGETS, ensure_release
from featdiff.llama.tools import STAMP

RELEASE = f"release-{LEGACY_SDIST.split('==')[1]}"  # ensure_release's default root, beside the tools dir
WAIT_S = 120

# each target appends a line to builds.txt (so a test counts the builds) and writes bin/<target>
STAND_IN = """cmake_minimum_required(VERSION 3.14)
project(stand_in NONE)
foreach(t {targets})
  add_custom_target(${{t}} ALL
    COMMAND ${{CMAKE_COMMAND}} -E sleep {sleep}
    COMMAND ${{CMAKE_COMMAND}} -E make_directory bin
    COMMAND ${{CMAKE_COMMAND}} -E echo_append "${{t}} " >> {count}
    COMMAND ${{CMAKE_COMMAND}} -E touch bin/${{t}})
endforeach()
"""


def _stand_in(tmp_path: Path, *, sleep: float = 0, body: str | None = None) -> Path:
    """A release root (tmp_path/RELEASE) whose source tree is the stand-in; returns the root."""
    root = tmp_path / RELEASE
    (root / "src" / "include").mkdir(parents=True)
    (root / "src" / "include" / "llama.h").write_text("/* stand-in */\n")
    count = tmp_path / "builds.txt"
    text = body or STAND_IN.format(targets=" ".join(LEGACY_TARGETS), sleep=sleep, count=count)
    (root / "src" / "CMakeLists.txt").write_text(text)
    return root


def _background(tmp_path: Path) -> subprocess.Popen:
    """`extra_builds release` as tests/conftest.py starts it, with the tools dir in tmp_path."""
    env = {**os.environ, ENV_TOOLS_DIR: str(tmp_path / "llama.cpp")}
    cmd = [sys.executable, "-m", "featdiff.llama.extra_builds", "release"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _builds(tmp_path: Path) -> int:
    """How many times the stand-in's targets were built (each build writes every target once)."""
    words = (tmp_path / "builds.txt").read_text().split() if (tmp_path / "builds.txt").exists() else []
    return len(words) // len(LEGACY_TARGETS)


def test_the_test_that_needs_a_build_waits_for_the_background_one_and_builds_nothing(tmp_path):
    root = _stand_in(tmp_path, sleep=2)
    proc = _background(tmp_path)
    _wait_for(root / "src" / "build" / "featdiff-build.log")  # written under the build lock
    build = ensure_release(root=root)  # what the `legacy` fixture does, meanwhile
    assert proc.wait(timeout=WAIT_S) == 0, proc.stdout.read() if proc.stdout else ""
    assert _builds(tmp_path) == 1
    assert (root / STAMP).is_file() and build.bin_dir == root / "src" / "build" / "bin"
    assert all(build.program(t).is_file() for t in LEGACY_TARGETS if t.startswith("llama-"))


def test_a_build_that_failed_in_the_background_fails_its_test_naming_the_build_log(tmp_path):
    root = _stand_in(tmp_path, body='cmake_minimum_required(VERSION 3.14)\nmessage(FATAL_ERROR "no such tree")\n')
    proc = _background(tmp_path)
    out, _ = proc.communicate(timeout=WAIT_S)
    log = root / "src" / "build" / "featdiff-build.log"
    assert proc.returncode == 1 and str(log) in out, out
    assert not (root / STAMP).exists()
    with pytest.raises(InputError, match=f"see {log}$"):
        ensure_release(root=root)  # the fixture builds again, and fails naming the log
    assert "no such tree" in log.read_text()


def test_a_build_killed_part_way_leaves_no_stamp_and_the_next_run_builds_again(tmp_path):
    root = _stand_in(tmp_path, sleep=30)
    (root / STAMP).write_text('{"want": {}, "seconds": 1}')  # an earlier build's, of other options
    proc = _background(tmp_path)
    _wait_for(root / "src" / "build" / "build.ninja")  # configured, building
    os.killpg(proc.pid, signal.SIGTERM)  # as tests/conftest.py stops a session's unfinished builds
    proc.wait(timeout=WAIT_S)
    assert not (root / STAMP).exists() and _builds(tmp_path) == 0
    (root / "src" / "CMakeLists.txt").write_text(
        STAND_IN.format(targets=" ".join(LEGACY_TARGETS), sleep=0, count=tmp_path / "builds.txt")
    )
    ensure_release(root=root)
    assert _builds(tmp_path) == 1 and (root / STAMP).is_file()


def test_the_tests_that_need_a_test_build_run_last_in_the_order_they_are_built():
    tests = Path(__file__).parent
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           str(tests / "test_backend_dl.py"), str(tests / "test_legacy_api.py"), str(tests / "test_tools.py")]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # -v would print a tree, not ids
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT_S, cwd=tests.parent.parent, env=env)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert done.returncode == 0 and ids, done.stdout[-2000:]
    files = [i.split("::")[0].rsplit("/", 1)[-1] for i in ids]
    firsts = [files.index(f) for f in ("test_tools.py", "test_legacy_api.py", "test_backend_dl.py")]
    assert firsts == sorted(firsts), files  # release's tests before the backend-loaded one's (BUILD_ORDER)
    assert files[-1] == "test_backend_dl.py" and files[: files.count("test_tools.py")] == [
        "test_tools.py"
    ] * files.count("test_tools.py")


def test_a_module_with_a_test_that_needs_a_build_runs_last_whole():
    """`make test`'s workers (pytest-xdist, --dist loadscope) take a module at a time in the
    suite's order: a module whose Vulkan case waits on the background build goes to the end
    with its CPU cases, not split in two."""
    tests = Path(__file__).parent
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           str(tests / "test_device.py"), str(tests / "test_tools.py")]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT_S, cwd=tests.parent.parent, env=env)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert done.returncode == 0 and ids, done.stdout[-2000:]
    device = [i for i in ids if i.split("::")[0].endswith("test_device.py")]
    assert any("vulkan" in i for i in device) and any("vulkan" not in i for i in device), device
    assert ids[-len(device) :] == device, ids
