"""Dumps for the compare tests: synthetic pairs (tests/synth.py, the suite's one synthetic-dump
writer: no model needed) and real ones (the fixture models captured through llama.cpp and
computed by the reference, each made once)."""

from __future__ import annotations

from pathlib import Path

import pytest

import synth

# The trained checkpoint behind each fault variant (the reference reads draft-hf, always correct):
# the layer and slot faults share clean's checkpoint, so they share its reference.
CHECKPOINT_OF = {
    "clean": "clean",
    "layers-plus1": "clean",
    "layers-minus1": "clean",
    "slots-swapped": "clean",
    "no-log-snr": "no-log-snr",
    "borrowed-embd": "borrowed-embd",
}
SYNTH_NOISE = 1e-7  # below every tolerance: only planted faults diverge


@pytest.fixture(scope="session")
def synth_ref(tmp_path_factory) -> Path:
    """The synthetic reference dump (default Spec)."""
    return synth.write(tmp_path_factory.mktemp("synth") / "ref.npz")


@pytest.fixture
def synth_run(tmp_path):
    """`synth_run(**kwargs)`: a synthetic run dump written with synth.write(side="run")."""
    count = iter(range(1000))

    def make(**kwargs) -> Path:
        kwargs.setdefault("noise", SYNTH_NOISE)
        return synth.write(tmp_path / f"run{next(count)}.npz", side="run", **kwargs)

    return make


@pytest.fixture(scope="session")
def checkpoint_ref(referenced):
    """`checkpoint_ref(variant)`: the reference dump of that variant's trained checkpoint."""
    return lambda variant: referenced(CHECKPOINT_OF[variant])
