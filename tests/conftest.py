"""Session-wide fixtures shared by the whole suite: tiny models per variant, real captures of
them through the pinned llama.cpp build, and their reference dumps (each made once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from featdiff.diff.result import Comparison
from featdiff.factory.fixtures import write_fixture

from findings_schema import validate_findings, written
from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS

_UNCHECKED_TO_JSON = Comparison.to_json
TOOLS_FIXTURE = "tools"  # the fixture below: featdiff's build of the llama.cpp programs
THROUGH_SERVER = "through_server"  # a probe parameter: True runs it through the built llama-server
# fixtures whose models the pinned tree's converter makes (featdiff.factory.converter; cached per machine),
# run through the transformers reference: tests/reference/test_hf_target.py, tests/test_converter.py
CONVERTED_FIXTURES = ("qwen3moe", "qwen3moe_tied", "converted", "converted_feature")


def pytest_collection_modifyitems(config, items):
    """Mark what needs `make tools` (`tools`): every test using the `tools` fixture, directly or
    through another fixture, and every probe run `through_server`; and what converts (`slow`):
    every test on a pair of the pinned converter's (CONVERTED_FIXTURES). `make test-fast` leaves
    both out, `make test` runs them. (`browser`, `cuda` and the other `slow` tests are marked where
    they are written.)"""
    for item in items:
        callspec = getattr(item, "callspec", None)
        through_server = callspec is not None and callspec.params.get(THROUGH_SERVER) is True
        fixtures = getattr(item, "fixturenames", ())
        if TOOLS_FIXTURE in fixtures or through_server:
            item.add_marker(pytest.mark.tools)
        if any(f in fixtures for f in CONVERTED_FIXTURES):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def torch_on_one_thread():
    """The suite's own references on one torch thread. The tiny models' matrices (n_embd 64) are
    far below what intra-op threads pay for, and on two shared cores torch's second OpenMP thread
    mostly waits for a core: one in-process `check` of the tiny pair took 97 s at torch's default
    (2 threads) and 35 s at 1, back to back on the busy 2-core machine. Training pins its own count."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tools():
    """featdiff's build of the pinned llama.cpp programs (llama-server, llama-speculative-simple,
    llama-quantize, ...) and their source tree, built once per machine (`make tools`)."""
    from featdiff.llama.tools import ensure_tools

    return ensure_tools()


def _checked_to_json(self: Comparison) -> dict:
    """Comparison.to_json, each result validated against docs/findings.schema.json as written."""
    out = _UNCHECKED_TO_JSON(self)
    validate_findings(written(out))
    return out


@pytest.fixture(autouse=True)
def findings_json_follows_the_schema(monkeypatch):
    """Every findings JSON a test makes (the CLI's --json, write_json, check's JSON, a to_json
    call) is validated against the schema (tests/findings_schema.py)."""
    monkeypatch.setattr(Comparison, "to_json", _checked_to_json)


@pytest.fixture(scope="session")
def eagle3_pairs(tmp_path_factory):
    """EAGLE3 variant -> its pair made by the pinned converter (featdiff.factory.eagle3), once."""
    from featdiff.factory.eagle3 import write_eagle3_fixture

    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = write_eagle3_fixture(tmp_path_factory.mktemp(variant), variant)
        return made[variant]

    return get


@pytest.fixture(scope="session")
def mtp_pairs(tmp_path_factory):
    """MTP variant -> its Qwen3.5 target and head made by the pinned converter (featdiff.factory.mtp), once."""
    from featdiff.factory.mtp import write_mtp_fixture

    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = write_mtp_fixture(tmp_path_factory.mktemp(variant), variant)
        return made[variant]

    return get


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
    from featdiff.driver.capture import capture

    made: dict[tuple, Path] = {}

    def get(
        variant: str = "clean",
        filters: tuple[str, ...] | None = None,
        tokens: str = DEFAULT_TOKENS,
        rounds: int = DEFAULT_ROUNDS,
    ) -> Path:
        key = (variant, filters, tokens, rounds)
        if key not in made:
            d = fixture_models(variant)
            out = tmp_path_factory.mktemp(f"run-{variant}") / "run.npz"
            made[key] = capture(
                d / "target.gguf",
                d / "draft.gguf",
                out,
                tokens=tokens,
                rounds=rounds,
                filters=list(filters) if filters else None,
            )
        return made[key]

    return get


@pytest.fixture(scope="session")
def referenced(tmp_path_factory, fixture_models):
    """(variant, model=, target=, tokens=, rounds=, kv_dtype=) -> the reference dump of that
    fixture pair's files (default: the trained checkpoint draft-hf), made once per arguments."""
    from featdiff.torchref.dflash.run import reference

    made: dict[tuple, Path] = {}

    def get(
        variant: str = "clean",
        model: str = "draft-hf",
        target: str = "target.gguf",
        tokens: str = DEFAULT_TOKENS,
        rounds: int = DEFAULT_ROUNDS,
        kv_dtype: str = "f16",
    ) -> Path:
        key = (variant, model, target, tokens, rounds, kv_dtype)
        if key not in made:
            d = fixture_models(variant)
            out = tmp_path_factory.mktemp(f"ref-{variant}") / "ref.npz"
            made[key] = reference(
                d / target,
                d / model,
                out,
                prompt=None,
                tokens=tokens,
                rounds=rounds,
                dtype="float32",
                device="cpu",
                kv_dtype=kv_dtype,
                llama_dir=None,
            )
        return made[key]

    return get
