"""Where featdiff keeps what it builds or trains once per machine: `$FEATDIFF_CACHE`, else
`~/.cache/featdiff` (the cffi binding, the preload library, the trained pairs: each in a subdirectory)."""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE = "FEATDIFF_CACHE"


def cache_root() -> Path:
    """The cache directory (not created here)."""
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "featdiff")
