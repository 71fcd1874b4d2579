"""Every fixture pair `featdiff fixture --variant NAME` writes, one list: the DFlash / DSpark pairs
of featdiff.pairs (fixtures.py) and the EAGLE3 pairs the pinned converter makes (fixtures_eagle3.py)."""

from __future__ import annotations

from pathlib import Path

from featdiff import fixtures, fixtures_eagle3
from featdiff.errors import InputError


def describe() -> str:
    """One line per variant: its name and what it is."""
    eagle3 = "\n".join(f"{name:22s} {doc}" for name, doc in fixtures_eagle3.EAGLE3_VARIANTS.items())
    return fixtures.describe_variants() + "\n" + eagle3


def write(outdir: Path, variant: str, seed: int = 0) -> Path:
    """Write `variant`'s pair into `outdir`; InputError naming every variant for an unknown one."""
    if variant in fixtures_eagle3.EAGLE3_VARIANTS:
        return fixtures_eagle3.write_eagle3_fixture(outdir, variant, seed)
    if variant not in fixtures.VARIANTS:
        known = [*fixtures.VARIANTS, *fixtures_eagle3.EAGLE3_VARIANTS]
        raise InputError(f"--variant {variant!r}: no such fixture variant; choose one of {', '.join(known)}")
    return fixtures.write_fixture(outdir, variant, seed)
