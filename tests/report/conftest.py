"""Synthetic dump pairs (synthetic_dumps.py) for the report tests, written once per session."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from featdiff.compare.result import Comparison

from synthetic_dumps import compare_by_hand, planted_findings, write_pair


@dataclass(frozen=True)
class Pair:
    """A ref/run dump pair, the Comparison the report renders, and compare's own of the two.

    The synthetic dumps draw well but break the flow's token conventions (compare adds a
    `block_token`), so the page tests render findings and metrics measured by hand with compare's
    figure data (`layer_match`, `row_shift` of `compared`); the real pairs render `compared` itself.
    """

    ref: Path
    run: Path
    comparison: Comparison
    compared: Comparison


def _pair(factory: pytest.TempPathFactory, variant: str) -> Pair:
    from featdiff.compare import compare_dumps

    ref, run = write_pair(factory.mktemp(variant), variant)
    compared = compare_dumps(ref, run)
    by_hand = compare_by_hand(ref, run, planted_findings(variant))
    return Pair(ref, run, replace(by_hand, layer_match=compared.layer_match, row_shift=compared.row_shift), compared)


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
            compared = compare_dumps(ref, run)
            made[variant] = Pair(ref, run, compared, compared)
        return made[variant]

    return get
