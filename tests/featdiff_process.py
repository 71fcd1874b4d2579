"""featdiff run as its console script runs it (cli.main, with its signal handlers), in a process
of its own: for the tests that capture around a llama-server and talk to it while it runs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

FEATDIFF = [sys.executable, "-c", "import sys; from featdiff.cli import main; sys.argv[0] = 'featdiff'; main()"]
LISTENING = "send your requests now"  # featdiff's line once the server answers /health


def start(args: list, stderr: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """featdiff with `args`, its stderr to the file `stderr`."""
    with open(stderr, "w") as err:
        return subprocess.Popen([*FEATDIFF, *map(str, args)], stdout=subprocess.DEVNULL, stderr=err, env=env)


def wait_listening(proc: subprocess.Popen, stderr: Path, wait_s: float) -> None:
    """Until featdiff says the server listens; the test fails if it ends or `wait_s` pass first."""
    deadline = time.monotonic() + wait_s
    while LISTENING not in stderr.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"featdiff never said it listens (rc {proc.poll()}): {stderr.read_text()[-2000:]}")
        time.sleep(0.05)
