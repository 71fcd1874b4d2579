"""DSpark drafters (a Markov head, an optional confidence head, anchor-first or bonus-anchor
blocks, a reduced vocabulary) through the real llama.cpp library, in-process (`draft-dspark` in
featdiff's driver) and around llama-server (`--spec-type draft-dspark`): correct exports compare
clean with the logits the sampler read among the compared records; the export that lost its Markov
head and the one with `dflash.sample_from_anchor` flipped are named by compare."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from featdiff.factory import fixtures
from featdiff.core import names
from featdiff.diff import compare_dumps, exit_code
from featdiff.dump.reader import read_dump
from featdiff.programs import exec as exec_capture
from featdiff.driver.capture import capture
from featdiff.verdict.probe import probe
from featdiff.torchref.dflash.run import reference
from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS
from test_exec import RUN_TIMEOUT_S, TOKENS

CLEAN = ("dspark", "dspark-no-conf", "dspark-bonus", "dspark-d2t")
SERVER_ARGS = ["--spec-type", "draft-dspark", "--spec-draft-n-max", "3", "-c", "256", "-t", "1", "-td", "1"]
# the sampled logits and confidences come after the whole drafter: only float32 rounding and the
# f16 KV cache separate the two sides (measured: NMSE <= 1e-7)
MAX_NMSE = 1e-5
PROBE_ROUNDS = 4
MIN_TRAINED_ACCEPT = 2.0  # tokens per block (accepted drafts + 1); issue 11's bar for the trained DSpark


@pytest.fixture(scope="session")
def dspark_run(tmp_path_factory, fixture_models):
    """(variant, p_min) -> (in-process capture, its reference from the trained HF checkpoint)."""
    made: dict[tuple[str, float], tuple[Path, Path]] = {}

    def get(variant: str, p_min: float = 0.0) -> tuple[Path, Path]:
        if (variant, p_min) not in made:
            d, out = fixture_models(variant), tmp_path_factory.mktemp(f"dspark-{variant}")
            run = capture(
                d / "target.gguf",
                d / "draft.gguf",
                out / "run.npz",
                tokens=DEFAULT_TOKENS,
                rounds=DEFAULT_ROUNDS,
                p_min=p_min,
            )
            ref = reference(
                d / "target.gguf",
                d / "draft-hf",
                out / "ref.npz",
                prompt=None,
                tokens=DEFAULT_TOKENS,
                rounds=DEFAULT_ROUNDS,
                dtype="float32",
                device="cpu",
                kv_dtype="f16",
                llama_dir=None,
                run=run,
            )
            made[(variant, p_min)] = (run, ref)
        return made[(variant, p_min)]

    return get


def _pairs(comparison, name: str) -> list:
    return [p for p in comparison.pairs if p.name == name and p.phase == "draft"]


def _assert_clean_with_sampled_logits(comparison, conf: bool) -> None:
    assert comparison.ok, [f.message for f in comparison.findings]
    logits = _pairs(comparison, names.DRAFT_LOGITS)
    assert logits and all(p.within and p.nmse <= MAX_NMSE for p in logits), [p.nmse for p in logits]
    assert bool(_pairs(comparison, names.DSPARK_CONF)) == conf


@pytest.mark.parametrize("variant", CLEAN)
def test_dspark_drafter_in_process_compares_clean(dspark_run, variant):
    run, ref = dspark_run(variant)
    _assert_clean_with_sampled_logits(compare_dumps(ref, run), conf=variant != "dspark-no-conf")


@pytest.mark.parametrize("variant,first_row", [("dspark", 0), ("dspark-bonus", 1)])
def test_the_driver_samples_the_markov_biased_rows_of_its_layout(dspark_run, variant, first_row):
    """The block is n_draft rows anchor-first (drafts from row 0), n_draft + 1 bonus-anchor (from
    row 1); the drafts are the argmax of the biased logits, which differ from result_output."""
    run, _ = dspark_run(variant)
    with read_dump(run) as dump:
        m = dump.manifest
        for rnd in m.rounds:
            draft = next(e for e in m.evals if e.round == rnd.round and e.phase == "draft")
            assert draft.n_tokens == 3 + first_row
            rec = {r.name: dump.array(r) for r in m.records if r.eval == draft.eval}
            sampled = rec[names.DRAFT_LOGITS]  # (n_rows, n_vocab)
            assert tuple(int(t) for t in sampled[first_row:].argmax(1)) == rnd.drafts
            assert not np.allclose(sampled[first_row:], rec[names.RESULT_OUTPUT][first_row:])  # the bias is there


def test_p_min_stops_drafting_at_the_first_unconfident_row_on_both_sides(dspark_run):
    run, ref = dspark_run("dspark", p_min=0.5)
    with read_dump(run) as dump:
        m = dump.manifest
        assert m.build["p_min"] == 0.5
        short = [r for r in m.rounds if len(r.drafts) < 3]
        assert short, [r.drafts for r in m.rounds]  # the random confidence head is below 0.5 somewhere
    _assert_clean_with_sampled_logits(compare_dumps(ref, run), conf=True)


def test_an_export_that_lost_its_markov_head_is_a_missing_term(dspark_run):
    run, ref = dspark_run("dspark-lost-markov")
    comparison = compare_dumps(ref, run)
    first = next(f for f in comparison.findings if f.severity == "error")
    assert (first.kind, first.tensor, first.fields["term"]) == (
        "missing_term",
        names.DRAFT_LOGITS,
        names.DSPARK_MARKOV_BIAS,
    )
    assert "plain DFlash" in first.message and exit_code(comparison) == 1


def test_sample_from_anchor_flipped_is_a_wrong_source(dspark_run):
    run, ref = dspark_run("dspark-anchor-flipped")
    comparison = compare_dumps(ref, run)
    first = next(f for f in comparison.findings if f.severity == "error")
    assert (first.kind, first.tensor, first.fields["source"]) == ("wrong_source", names.DRAFT_LOGITS, "bonus")
    assert names.KEY_SAMPLE_FROM_ANCHOR in first.message and exit_code(comparison) == 1


@pytest.mark.parametrize("variant", ["dspark", "dspark-bonus"])
def test_dspark_drafter_around_llama_server_compares_clean(fixture_models, tools, tmp_path, variant):
    """llama-server samples the draft on the backend (top-k); the preload reads back those
    candidates' logits, and they pair with the reference's."""
    d = fixture_models(variant)
    cmd = [str(tools.program("llama-server")), "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf"), *SERVER_ARGS]
    run = exec_capture.capture_exec(cmd, tmp_path / "run.npz", tokens=TOKENS, timeout_s=RUN_TIMEOUT_S)
    with read_dump(run) as dump:
        m = dump.manifest
        tokens = ",".join(map(str, m.prompt_tokens))
        rounds = sum(1 for r in m.rounds if r.drafts)
    ref = reference(
        d / "target-hf",
        d / "draft-hf",
        tmp_path / "ref.npz",
        prompt=None,
        tokens=tokens,
        rounds=rounds,
        dtype="float32",
        device="cpu",
        kv_dtype="f16",
        llama_dir=None,
        run=run,
    )
    comparison = compare_dumps(ref, run)
    _assert_clean_with_sampled_logits(comparison, conf=False)  # the server's confidences are not read back


@pytest.mark.parametrize("through_server", [False, True])
def test_trained_dspark_accepts_at_least_two_per_block_as_the_reference_does(fixture_models, tools, through_server):
    """The trained anchor-first DSpark pair through the real spec loop (in-process draft-dspark, and
    llama-server --spec-type draft-dspark): >= 2 tokens per block, round by round the reference's figure."""
    d = fixture_models("trained-dspark")
    command = (
        [str(tools.program("llama-server")), "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf"), *SERVER_ARGS]
        if through_server
        else None
    )
    result = probe(
        d / "target.gguf",
        d / "draft.gguf",
        prompts=d / fixtures.PROMPTS_FILE,
        rounds=PROBE_ROUNDS,
        ref_model=d / "draft-hf",
        command=command,
    )
    assert result.run.mean_accepted_length >= MIN_TRAINED_ACCEPT, result.run
    assert not result.has_gap and result.run.mean_accepted_length == result.ref.mean_accepted_length, (
        result.run,
        result.ref,
    )
