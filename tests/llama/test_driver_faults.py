"""Wiring faults planted in the real llama.cpp driver (patches/llama.cpp/0002-driver-faults.patch,
chosen at run time by FEATDIFF_FAULT), captured around llama-speculative-simple and llama-server:
compare names each with its finding kind and fields and exits 1; the unplanted build compares
clean. The reference is fed the user's prompt (the clean run's tokens of the same `-p` text),
never a prompt read back from the faulty run."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path

import pytest

from featdiff.core.errors import InputError
from featdiff.diff import compare_dumps, exit_code
from featdiff.dump.reader import read_dump
from featdiff.factory import pairs
from featdiff.programs import exec as exec_capture

from findings_schema import validate_findings, written
from test_exec import RUN_TIMEOUT_S, TOKENS, _command

FAULT_VAR = "FEATDIFF_FAULT"
VARIANT = "clean"
MASK = pairs.MASK_TOKEN_ID
# faults after which llama.cpp refuses a decode the program cannot go on without (a batch that
# repeats positions; llama-server's inject at a position the cache does not continue)
FAILS_THE_PROGRAM = ("inject-twice", "inject-pos")


@contextmanager
def _fault(name: str | None):
    """FEATDIFF_FAULT set to `name` (unset for None) for the programs started inside."""
    before = os.environ.pop(FAULT_VAR, None)
    if name:
        os.environ[FAULT_VAR] = name
    try:
        yield
    finally:
        os.environ.pop(FAULT_VAR, None)
        if before is not None:
            os.environ[FAULT_VAR] = before


@pytest.fixture(scope="session")
def planted(tmp_path_factory, fixture_models, tools):
    """(program, fault or None) -> a dump captured around that program of the patched build."""
    made: dict[tuple[str, str | None], Path] = {}

    def get(program: str, fault: str | None) -> Path:
        if (program, fault) not in made:
            out = tmp_path_factory.mktemp(f"fault-{program}-{fault or 'none'}") / "run.npz"
            tokens = TOKENS if program == "llama-server" else None
            with _fault(fault):
                try:
                    made[(program, fault)] = exec_capture.capture_exec(
                        _command(tools, program, fixture_models(VARIANT)), out, tokens=tokens, timeout_s=RUN_TIMEOUT_S
                    )
                except InputError as e:  # llama.cpp refused a batch and the program failed: the dump is the evidence
                    assert fault in FAILS_THE_PROGRAM and "holds what it decoded" in str(e) and out.is_file(), e
                    made[(program, fault)] = out
        return made[(program, fault)]

    return get


@pytest.fixture(scope="session")
def user_reference(planted, referenced):
    """program -> the reference on the user's prompt and the unplanted run's number of rounds."""

    def get(program: str) -> Path:
        with read_dump(planted(program, None)) as dump:
            m = dump.manifest
            tokens = ",".join(map(str, m.prompt_tokens))
            rounds = sum(1 for r in m.rounds if r.drafts)
        return referenced(VARIANT, target="target-hf", tokens=tokens, rounds=rounds)

    return get


def _findings(planted, user_reference, program: str, fault: str | None):
    """The comparison, and its findings by kind (the first of each kind)."""
    comparison = compare_dumps(user_reference(program), planted(program, fault))
    validate_findings(written(comparison.to_json()))  # the findings JSON of each fault follows the schema
    return comparison, {f.kind: f.to_json() for f in reversed(comparison.findings)}


def _first_error(comparison) -> str:
    return next(f.kind for f in comparison.findings if f.severity == "error")


def _first_round_anchor(planted, program: str) -> tuple[int, int]:
    """The anchor of round 1 and the token before it, from the unplanted run."""
    with read_dump(planted(program, None)) as dump:
        prompt = dump.manifest.prompt_tokens
    return prompt[-1], prompt[-2]


@pytest.mark.parametrize("program", ["llama-speculative-simple", "llama-server"])
def test_the_unplanted_build_compares_clean_with_nothing_skipped(planted, user_reference, program):
    comparison, _ = _findings(planted, user_reference, program, None)
    assert comparison.ok, [f.message for f in comparison.findings]
    assert comparison.coverage.pairs_skipped == 0 and comparison.coverage.rows_skipped == 0


@pytest.mark.parametrize("program", ["llama-speculative-simple", "llama-server"])
def test_a_draft_block_without_its_anchor_is_a_block_token(planted, user_reference, program):
    comparison, found = _findings(planted, user_reference, program, "anchor-mask")
    anchor, _ = _first_round_anchor(planted, program)
    f = found["block_token"]
    assert _first_error(comparison) == "block_token"
    assert (f["row"], f["expected"], f["observed"], f["round"]) == (0, anchor, MASK, 1)
    assert exit_code(comparison) == 1


def test_a_stale_anchor_is_a_block_token(planted, user_reference):
    program = "llama-speculative-simple"
    comparison, found = _findings(planted, user_reference, program, "anchor-stale")
    anchor, before = _first_round_anchor(planted, program)
    f = found["block_token"]
    assert (f["row"], f["expected"], f["observed"], f["round"]) == (0, anchor, before, 1)
    assert exit_code(comparison) == 1


# fault -> (program, finding kind, the fields it must carry); each fault is planted alone
NAMED = {
    "draft-pos": ("llama-speculative-simple", "position_offset", {"offset": 1, "phase": "draft", "round": 1}),
    "inject-pos": ("llama-speculative-simple", "position_offset", {"offset": 1, "phase": "inject", "round": 0}),
    "inject-pos@server": ("llama-server", "position_offset", {"offset": 1, "phase": "inject", "round": 0}),
    # n_past one too far after round 1's accept: round 2's verify (and its draft block) sit one late
    "npast-drift": ("llama-speculative-simple", "position_offset", {"offset": 1, "phase": "verify", "round": 2}),
    "layer-major": ("llama-speculative-simple", "layout_transpose", {"tensor": "inp_target_features"}),
    "slots-reversed": ("llama-speculative-simple", "slot_permutation", {"permutation": [1, 0]}),
    "layers-plus1": (
        "llama-speculative-simple",
        "layer_offset",
        {"slot": 0, "expected_layer": 2, "observed_layer": 3, "delta": 1},
    ),
    "no-inject": ("llama-speculative-simple", "not_conditioned", {"detail": "no inject eval"}),
}


@pytest.mark.parametrize("case", NAMED)
def test_each_planted_fault_is_named_with_its_fields(planted, user_reference, case):
    program, kind, fields = NAMED[case]
    comparison, found = _findings(planted, user_reference, program, case.split("@")[0])
    assert _first_error(comparison) == kind, [f.message for f in comparison.findings]  # the cause comes first
    assert {k: found[kind][k] for k in fields} == fields
    assert found[kind]["where"] == "driver", found[kind]["where_reason"]  # 0002 plants them in the driver
    assert exit_code(comparison) == 1


def test_rows_injected_twice_are_duplicate_rows(planted, user_reference):
    comparison, found = _findings(planted, user_reference, "llama-speculative-simple", "inject-twice")
    prefill = _prefill_positions(planted)
    assert _first_error(comparison) == "duplicate_rows"
    assert found["duplicate_rows"]["rows"][: len(prefill)] == prefill
    assert exit_code(comparison) == 1


@pytest.mark.parametrize("program", ["llama-speculative-simple", "llama-server"])
def test_rejected_rows_left_in_the_draft_cache_are_stale(planted, user_reference, program):
    comparison, found = _findings(planted, user_reference, program, "keep-rejected")
    f = found["stale"]
    assert _first_error(comparison) == "stale"
    with read_dump(planted(program, "keep-rejected")) as dump:
        first = next(r for r in dump.manifest.rounds if r.accepted < len(r.drafts))
    left = list(range(first.pos0 + first.accepted + 1, first.pos0 + len(first.drafts) + 1))
    assert f["rows"][: len(left)] == left
    assert exit_code(comparison) == 1


def _prefill_positions(planted) -> list[int]:
    with read_dump(planted("llama-speculative-simple", None)) as dump:
        prefill = next(e for e in dump.manifest.evals if e.phase == "prefill")
    return list(prefill.positions)


def test_inspect_shows_refused_decodes_the_cache_removals_and_the_flow_notes(planted):
    from typer.testing import CliRunner

    from featdiff.cli import app

    result = CliRunner().invoke(app, ["inspect", str(planted("llama-speculative-simple", "draft-pos"))])
    assert result.exit_code == 0, result.output
    assert "draft   round 1  4 tokens at 4..7  REFUSED by llama.cpp (rc -1)" in result.output
    assert "KV-cache removals recorded (memory_ops)" in result.output
    assert re.search(
        r"flow note: eval \d+ \(drafter's draft, round 1, positions 4\.\.7\) failed with rc -1", result.output
    )
