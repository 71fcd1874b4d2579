"""Synthetic dump pairs (synthetic_dumps.py) for the report tests, written once per session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from featdiff.compare.result import Comparison
from synthetic_dumps import compare_by_hand, planted_findings, write_pair


@dataclass(frozen=True)
class Pair:
    """A ref/run dump pair and the Comparison of the two."""

    ref: Path
    run: Path
    comparison: Comparison


def _pair(factory: pytest.TempPathFactory, variant: str) -> Pair:
    ref, run = write_pair(factory.mktemp(variant), variant)
    return Pair(ref, run, compare_by_hand(ref, run, planted_findings(variant)))


@pytest.fixture(scope="session")
def clean_pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return _pair(tmp_path_factory, "clean")


@pytest.fixture(scope="session")
def plus1_pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """Every slot of inp_target_features taken from layer L+1 instead of L."""
    return _pair(tmp_path_factory, "layers-plus1")


@pytest.fixture(scope="session")
def shift_pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """The noise block of the first draft eval shifted by one row."""
    return _pair(tmp_path_factory, "row-shift")


# --- real dumps: the fixture models captured through llama.cpp and computed by the reference ---

@pytest.fixture(scope="session")
def real_pair(captured, referenced):
    """`real_pair(variant)`: a real capture, a real reference and compare's Comparison of them."""
    from featdiff.compare import compare_dumps

    made: dict[str, Pair] = {}

    def get(variant: str) -> Pair:
        if variant not in made:
            run, ref = captured(variant), referenced(variant)
            made[variant] = Pair(ref, run, compare_dumps(ref, run))
        return made[variant]

    return get
