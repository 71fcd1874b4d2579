"""Progress on long work, on stderr: a bar over a flow's rounds (capture, reference) and over a
model's layers as its weights load (reference). Short work shows none, so tests and quick runs
print nothing but their result."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

MIN_STEPS = 8  # fewer steps than this: no bar


@contextmanager
def steps(total: int, what: str) -> Iterator[Callable[[], None] | None]:
    """A callback to call once per step of `total` (`what`: "rounds", "layers"), or None when the
    work is short; the bar is closed when the block ends, so a message after it starts a line."""
    if total < MIN_STEPS:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=what, unit=what.rstrip("s"), leave=False)
    try:
        yield lambda: bar.update(1)
    finally:
        bar.close()
