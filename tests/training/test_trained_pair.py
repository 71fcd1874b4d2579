"""The trained fixture pair through the real llama.cpp spec loop (in-process driver and
llama-server), measured by `featdiff probe` on held-out prompts: the drafter accepts, the
reference agrees with the run, and each planted fault costs accept rate and is named by compare."""

from __future__ import annotations

from pathlib import Path

import pytest

from featdiff.factory import fixtures
from featdiff.diff import compare_dumps, exit_code
from featdiff.verdict.probe import probe, read_prompts


ROUNDS = 6
MIN_MEAN_ACCEPTED_LENGTH = 2.0  # issue 7: at least 2 tokens per verify step, blocks of 4, greedy
COLLAPSE = 0.5  # a broken export accepts fewer than this share of the drafts the reference accepts
COMPARE_ROUNDS = 3
SERVER_ARGS = ["--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-c", "256", "-t", "1", "-td", "1"]


@pytest.fixture(scope="session")
def probed(fixture_models):
    """(variant, through_server) -> the probe of that GGUF pair on its held-out prompts, against
    the trained HF checkpoint."""
    made = {}

    def get(variant: str, through_server: bool = False):
        if (variant, through_server) not in made:
            d = fixture_models(variant)
            command = _server_command(d) if through_server else None
            made[(variant, through_server)] = probe(
                d / "target.gguf",
                d / "draft.gguf",
                prompts=d / fixtures.PROMPTS_FILE,
                rounds=ROUNDS,
                ref_model=d / "draft-hf",
                command=command,
            )
        return made[(variant, through_server)]

    return get


def _server_command(d: Path) -> list[str]:
    from featdiff.llama.tools import ensure_tools

    server = ensure_tools().program("llama-server")
    return [str(server), "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf"), *SERVER_ARGS]


@pytest.fixture(scope="session")
def compared(fixture_models, captured, referenced):
    """variant -> compare of a real capture against the reference of the trained checkpoint."""

    def get(variant: str):
        d = fixture_models(variant)
        tokens = ",".join(map(str, read_prompts(d / fixtures.PROMPTS_FILE)[0].tokens))
        ref = referenced(variant, tokens=tokens, rounds=COMPARE_ROUNDS)
        return compare_dumps(ref, captured(variant, tokens=tokens, rounds=COMPARE_ROUNDS), None)

    return get


def _errors(comparison) -> list:
    return [f for f in comparison.findings if f.severity == "error"]


@pytest.mark.parametrize("through_server", [False, True])
def test_trained_drafter_accepts_at_least_two_tokens_per_block_on_held_out_prompts(probed, through_server):
    result = probed("trained", through_server)
    assert result.run.mean_accepted_length >= MIN_MEAN_ACCEPTED_LENGTH, result.run
    assert result.ref.mean_accepted_length >= MIN_MEAN_ACCEPTED_LENGTH, result.ref


@pytest.mark.parametrize("through_server", [False, True])
def test_reference_drafts_what_the_run_drafts(probed, through_server):
    result = probed("trained", through_server)
    rounds = [r for p in result.prompts for r in p.rounds]
    assert rounds and all(r.run_drafts == r.ref_drafts for r in rounds)
    assert result.run == result.ref and not result.has_gap


def test_trained_capture_compares_clean(compared):
    c = compared("trained")
    assert exit_code(c) == 0 and not _errors(c)


@pytest.mark.parametrize("through_server", [False, True])
def test_layers_without_the_plus_one_collapse_accept(probed, through_server):
    result = probed("trained-layers-minus1", through_server)
    assert result.ref.mean_accepted_length >= MIN_MEAN_ACCEPTED_LENGTH
    assert result.run.accepted < COLLAPSE * result.ref.accepted, (result.run, result.ref)
    assert result.has_gap


def test_layers_without_the_plus_one_are_a_layer_offset(compared):
    (f,) = _errors(compared("trained-layers-minus1"))
    assert (f.kind, f.tensor) == ("layer_offset", "inp_target_features")
    assert (f.fields["expected_layer"], f.fields["observed_layer"], f.fields["delta"]) == (2, 1, -1)


@pytest.mark.parametrize("through_server", [False, True])
def test_log_snr_drafter_without_its_conditioning_accepts_less(probed, through_server):
    result = probed("trained-no-log-snr", through_server)
    assert result.run.accepted < result.ref.accepted, (result.run, result.ref)
    assert result.has_gap


def test_log_snr_drafter_without_its_conditioning_is_a_missing_term(compared):
    (f,) = _errors(compared("trained-no-log-snr"))
    assert (f.kind, f.tensor, f.fields["term"]) == ("missing_term", "l_out-0", "dspark_log_snr_fc2")
    assert f.fields["expected_in"] == "dspark_draft_embd_snr"
