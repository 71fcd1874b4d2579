"""Session-wide fixtures shared by the whole suite: tiny models per variant, and real captures
of them through the pinned llama.cpp build (each made once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from featdiff.fixtures import write_fixture

DEFAULT_TOKENS = "7,21,3,99,140,5,260,33,18,402,77,9"
DEFAULT_ROUNDS = 3


@pytest.fixture(scope="session")
def fixture_models(tmp_path_factory):
    """variant name -> directory with target.gguf, draft.gguf, target-hf/, draft-hf/."""
    made: dict[str, Path] = {}

    def get(variant: str = "clean") -> Path:
        if variant not in made:
            made[variant] = write_fixture(tmp_path_factory.mktemp(f"fx-{variant}"), variant)
        return made[variant]

    return get


@pytest.fixture(scope="session")
def captured(tmp_path_factory, fixture_models):
    """(variant, filters) -> a real capture dump of that fixture pair (made once)."""
    from featdiff.llama.capture import capture

    made: dict[tuple, Path] = {}

    def get(variant: str = "clean", filters: tuple[str, ...] | None = None,
            tokens: str = DEFAULT_TOKENS, rounds: int = DEFAULT_ROUNDS) -> Path:
        key = (variant, filters, tokens, rounds)
        if key not in made:
            d = fixture_models(variant)
            out = tmp_path_factory.mktemp(f"run-{variant}") / "run.npz"
            made[key] = capture(d / "target.gguf", d / "draft.gguf", out, tokens=tokens,
                                rounds=rounds, filters=list(filters) if filters else None)
        return made[key]

    return get
