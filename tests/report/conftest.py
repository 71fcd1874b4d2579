"""Synthetic dump pairs for the report tests, written once per session: the DFlash-shaped flow of
tests/synth.py (docs/flow.md) with one planted wiring bug, and compare's own Comparison
of each pair, which the page renders: the findings are the ones compare makes, never written by hand."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from featdiff.diff.result import Comparison

import synth

SYNTH_NOISE = 1e-7  # run noise below every tolerance (tests/compare/conftest.py): only the planted bug diverges
SHIFTED_ROUND = 1  # the row-shift pair shifts the features injected in this round
SHIFTED = "inp_target_features"  # its rows differ (a draft block's mask rows are alike: no shift to tell)


def _shift_injected_rows(ev, name: str, a: np.ndarray) -> np.ndarray:
    """The run's row i of one round's injected features holds the reference's row i + 1."""
    return np.roll(a, -1, axis=0) if name == SHIFTED and ev.phase == "inject" and ev.round == SHIFTED_ROUND else a


# variant -> how its run side is written (the reference side is always synth's correct one)
RUNS = {
    "clean": {},
    "layers-plus1": {"spec": synth.Spec(target_layers=tuple(L + 1 for L in synth.Spec().target_layers))},
    "row-shift": {"mutate": _shift_injected_rows},
}


@dataclass(frozen=True)
class Pair:
    """A ref/run dump pair and compare's Comparison of the two (what the report renders)."""

    ref: Path
    run: Path
    comparison: Comparison


def _pair(factory: pytest.TempPathFactory, variant: str) -> Pair:
    from featdiff.diff import compare_dumps

    d = factory.mktemp(variant)
    ref = synth.write(d / "ref.npz")
    run = synth.write(d / "run.npz", side="run", noise=SYNTH_NOISE, **RUNS[variant])
    return Pair(ref, run, compare_dumps(ref, run))


@pytest.fixture(scope="session")
def clean_pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return _pair(tmp_path_factory, "clean")


@pytest.fixture(scope="session")
def plus1_pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """Every slot of inp_target_features taken from layer L+1 instead of L."""
    return _pair(tmp_path_factory, "layers-plus1")


@pytest.fixture(scope="session")
def shift_pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """The features injected after round 1's verify shifted by one row."""
    return _pair(tmp_path_factory, "row-shift")


# --- real dumps: the fixture models captured through llama.cpp and computed by the reference ---


@pytest.fixture(scope="session")
def real_pair(captured, referenced):
    """`real_pair(variant)`: a real capture, a real reference and compare's Comparison of them."""
    from featdiff.diff import compare_dumps

    made: dict[str, Pair] = {}

    def get(variant: str) -> Pair:
        if variant not in made:
            run, ref = captured(variant), referenced(variant)
            made[variant] = Pair(ref, run, compare_dumps(ref, run))
        return made[variant]

    return get
