"""Where featdiff keeps what it builds or trains once per machine: `$FEATDIFF_CACHE`, else
`~/.cache/featdiff` (the cffi binding, the preload library, the trained pairs: each in a
subdirectory), and the lock a process holds while it makes one entry."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV_CACHE = "FEATDIFF_CACHE"
ENTRY_LOCK_SUFFIX = ".making.lock"  # beside an entry: held while a process makes it


def cache_root() -> Path:
    """The cache directory (not created here)."""
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "featdiff")


@contextmanager
def making(entry: Path) -> Iterator[None]:
    """Hold the exclusive lock of the cache entry `entry` for the block, waiting for a process
    that holds it: a second process making the same entry (another session, the test suite's
    background warm-up) waits, then finds it made. The caller checks again inside the block.
    The lock file stays: removing it could hand two waiters two different locks."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{entry}{ENTRY_LOCK_SUFFIX}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
