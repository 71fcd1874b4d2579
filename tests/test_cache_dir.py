"""featdiff.core.cache_dir.making: a process making a cache entry holds its lock, and a second
process asking for the same entry waits for it and then finds the entry made (the test suite's
background warm-up and a fixture asking meanwhile; two sessions on one machine)."""

from __future__ import annotations

import subprocess
import sys

from featdiff.core.cache_dir import making

MAKER = """
import sys, time
from pathlib import Path
from featdiff.core.cache_dir import making
entry = Path(sys.argv[1])
with making(entry):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    entry.write_text("made")
"""
HOLD_S = 1.0  # how long the maker holds the lock before it writes the entry


def test_a_second_maker_waits_for_the_first_and_finds_the_entry_made(tmp_path):
    entry = tmp_path / "cache" / "trained" / "seed0-key"
    maker = subprocess.Popen([sys.executable, "-c", MAKER, str(entry), str(HOLD_S)], stdout=subprocess.PIPE, text=True)
    assert maker.stdout is not None and maker.stdout.readline().strip() == "held"
    with making(entry):  # blocks until the maker has written the entry (HOLD_S after "held") and let go
        assert entry.read_text() == "made"
    assert maker.wait(timeout=60) == 0


def test_the_lock_is_free_again_after_the_block(tmp_path):
    entry = tmp_path / "entry"
    with making(entry):
        pass
    done = subprocess.run([sys.executable, "-c", MAKER, str(entry), "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "held", done.stderr
    assert entry.read_text() == "made"
