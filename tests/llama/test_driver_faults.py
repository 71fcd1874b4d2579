"""Wiring faults planted in the real llama.cpp driver (patches/llama.cpp/0002-driver-faults.patch,
chosen at run time by FEATDIFF_FAULT), captured around llama-speculative-simple and llama-server:
compare names each with its finding kind and fields and exits 1; the unplanted build compares
clean. The reference is fed the user's prompt (the clean run's tokens of the same `-p` text),
never a prompt read back from the faulty run."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest

from featdiff import fixtures
from featdiff.compare import compare_dumps, exit_code
from featdiff.dump import read_dump
from featdiff.errors import InputError
from featdiff.llama import exec as exec_capture
from test_exec import RUN_TIMEOUT_S, TOKENS, _command, tools  # noqa: F401  (tools: a session fixture)

FAULT_VAR = "FEATDIFF_FAULT"
VARIANT = "clean"
MASK = fixtures.MASK_TOKEN_ID
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
def planted(tmp_path_factory, fixture_models, tools):  # noqa: F811
    """(program, fault or None) -> a dump captured around that program of the patched build."""
    made: dict[tuple[str, str | None], Path] = {}

    def get(program: str, fault: str | None) -> Path:
        if (program, fault) not in made:
            out = tmp_path_factory.mktemp(f"fault-{program}-{fault or 'none'}") / "run.npz"
            tokens = TOKENS if program == "llama-server" else None
            with _fault(fault):
                try:
                    made[(program, fault)] = exec_capture.capture_exec(
                        _command(tools, program, fixture_models(VARIANT)), out, tokens=tokens, timeout_s=RUN_TIMEOUT_S)
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
    comparison = compare_dumps(user_reference(program), planted(program, fault))
    return comparison, {f.kind: f.to_json() for f in reversed(comparison.findings)}


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
    assert (f["row"], f["expected"], f["observed"], f["round"]) == (0, anchor, MASK, 1)
    assert exit_code(comparison) == 1


def test_a_stale_anchor_is_a_block_token(planted, user_reference):
    program = "llama-speculative-simple"
    comparison, found = _findings(planted, user_reference, program, "anchor-stale")
    anchor, before = _first_round_anchor(planted, program)
    f = found["block_token"]
    assert (f["row"], f["expected"], f["observed"], f["round"]) == (0, anchor, before, 1)
    assert exit_code(comparison) == 1


@pytest.mark.parametrize("program, fault, phase", [
    ("llama-speculative-simple", "draft-pos", "draft"),
    ("llama-speculative-simple", "inject-pos", "inject"),
    ("llama-server", "inject-pos", "inject"),
])
def test_positions_off_by_one_are_a_position_offset_of_that_phase(planted, user_reference, program, fault, phase):
    comparison, found = _findings(planted, user_reference, program, fault)
    f = found["position_offset"]
    assert (f["offset"], f["phase"]) == (1, phase)
    assert exit_code(comparison) == 1


def test_n_past_drifting_after_an_accept_is_a_position_offset_of_the_next_verify(planted, user_reference):
    comparison, found = _findings(planted, user_reference, "llama-speculative-simple", "npast-drift")
    f = found["position_offset"]
    assert (f["offset"], f["phase"], f["round"]) == (1, "verify", 2)
    assert exit_code(comparison) == 1


def test_features_staged_layer_major_are_a_layout_transpose(planted, user_reference):
    comparison, found = _findings(planted, user_reference, "llama-speculative-simple", "layer-major")
    assert found["layout_transpose"]["tensor"] == "inp_target_features"
    assert exit_code(comparison) == 1


def test_slots_reversed_in_the_driver_are_a_slot_permutation(planted, user_reference):
    comparison, found = _findings(planted, user_reference, "llama-speculative-simple", "slots-reversed")
    assert found["slot_permutation"]["permutation"] == [1, 0]
    assert exit_code(comparison) == 1


def test_layer_ids_shifted_in_the_driver_are_a_layer_offset(planted, user_reference):
    comparison, found = _findings(planted, user_reference, "llama-speculative-simple", "layers-plus1")
    f = found["layer_offset"]
    assert (f["slot"], f["expected_layer"], f["observed_layer"], f["delta"]) == (0, 2, 3, 1)
    assert exit_code(comparison) == 1


def test_features_never_injected_are_not_conditioned(planted, user_reference):
    comparison, found = _findings(planted, user_reference, "llama-speculative-simple", "no-inject")
    assert found["not_conditioned"]["detail"] == "no inject eval"
    assert exit_code(comparison) == 1


def test_rows_injected_twice_are_duplicate_rows(planted, user_reference):
    comparison, found = _findings(planted, user_reference, "llama-speculative-simple", "inject-twice")
    prefill = _prefill_positions(planted)
    assert found["duplicate_rows"]["rows"][:len(prefill)] == prefill
    assert exit_code(comparison) == 1


@pytest.mark.parametrize("program", ["llama-speculative-simple", "llama-server"])
def test_rejected_rows_left_in_the_draft_cache_are_stale(planted, user_reference, program):
    comparison, found = _findings(planted, user_reference, program, "keep-rejected")
    f = found["stale"]
    with read_dump(planted(program, "keep-rejected")) as dump:
        first = next(r for r in dump.manifest.rounds if r.accepted < len(r.drafts))
    left = list(range(first.pos0 + first.accepted + 1, first.pos0 + len(first.drafts) + 1))
    assert f["rows"][:len(left)] == left
    assert exit_code(comparison) == 1


def _prefill_positions(planted) -> list[int]:
    with read_dump(planted("llama-speculative-simple", None)) as dump:
        prefill = next(e for e in dump.manifest.evals if e.phase == "prefill")
    return list(prefill.positions)
