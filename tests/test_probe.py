"""`featdiff probe`: the real spec loop and the reference drafter, side by side on the same
target tokens. Right wiring: both accept the same drafts; an off-by-one layer list: a gap,
and only in rounds where the drafts differ."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.verdict.probe import probe, render_probe

# The tiny seeded drafters are untrained: most drafts are rejected. These prompts (found by a
# search over the seed-0 fixtures) each get a draft token accepted by the clean pair.
ACCEPTING_PROMPTS = ("tokens: 232,209,318,41,446,463,10,311,497,58", "tokens: 200,365,147,318,423,401,62")
# With 2 drafts per block, prompt 2 meets a near-tie (the top two logits 3e-4 apart, within the f16
# KV cache's noise) where the run and the reference may draft either token; these two do not.
DRAFT_MAX_2_PROMPTS = (ACCEPTING_PROMPTS[0], "The quick brown fox")
ROUNDS = 8
SERVER_ARGS = ["--spec-type", "draft-dflash", "-c", "256", "-t", "1", "-td", "1"]
DRAFT_MAX = 3  # llama.cpp's default; the fixtures' block_size 4 allows 1 .. 3


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("probe") / "prompts.txt"
    path.write_text("\n".join(ACCEPTING_PROMPTS) + "\nThe quick brown fox\n")
    return path


@pytest.fixture(scope="session")
def draft_max_2_prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("probe-2") / "prompts.txt"
    path.write_text("\n".join(DRAFT_MAX_2_PROMPTS) + "\n")
    return path


@pytest.fixture(scope="session")
def probed(fixture_models, prompts_file):
    """(variant, through_server, draft_max) -> the probe of that pair against its trained HF
    checkpoint, drafting `draft_max` tokens per block (in-process: --draft-max; llama-server:
    --spec-draft-n-max)."""
    made = {}

    def get(variant: str, through_server: bool = False, draft_max: int = DRAFT_MAX, prompts: Path = prompts_file):
        key = (variant, through_server, draft_max, prompts)
        if key not in made:
            d = fixture_models(variant)
            command = None
            if through_server:
                from featdiff.llama.tools import ensure_tools

                server = ensure_tools().program("llama-server")
                command = [
                    str(server),
                    "-m",
                    str(d / "target.gguf"),
                    "-md",
                    str(d / "draft.gguf"),
                    *SERVER_ARGS,
                    "--spec-draft-n-max",
                    str(draft_max),
                ]
            made[key] = probe(
                d / "target.gguf",
                d / "draft.gguf",
                prompts=prompts,
                rounds=ROUNDS,
                ref_target=d / "target-hf",
                ref_model=d / "draft-hf",
                command=command,
                draft_max=None if through_server else draft_max,
            )
        return made[key]

    return get


@pytest.mark.parametrize("through_server", [False, True])
def test_run_and_reference_accept_alike_when_wiring_is_right(probed, through_server):
    result = probed("clean", through_server)
    rounds = [r for p in result.prompts for r in p.rounds]
    assert rounds and all(r.run_drafts == r.ref_drafts for r in rounds)
    assert [r.run_accepted for r in rounds] == [r.ref_accepted for r in rounds]
    assert result.run.accepted > 0, "no draft accepted at all: the figures would agree trivially"
    assert result.run == result.ref and not result.has_gap


@pytest.mark.parametrize("through_server", [False, True])
def test_off_by_one_layers_differ_only_where_the_drafts_differ(probed, through_server):
    result = probed("layers-plus1", through_server)
    rounds = [r for p in result.prompts for r in p.rounds]
    assert all(r.drafts_differ for r in rounds if r.run_accepted != r.ref_accepted)
    assert any(r.drafts_differ for r in rounds)
    # the gap the module promises, in-process and through llama-server alike: the clean checkpoint
    # (the reference) accepts in these rounds, the miswired run does not
    assert result.has_gap and result.run.accepted < result.ref.accepted


def test_server_probe_counts_what_the_server_reports(probed):
    for p in probed("clean", through_server=True).prompts:
        assert (p.server_draft_n, p.server_draft_n_accepted) == (p.run.drafted, p.run.accepted)


def test_report_names_the_gap(probed):
    text = render_probe(probed("layers-plus1"))
    assert "GAP" in text and "overall" in text
    assert "agree" in render_probe(probed("clean"))


@pytest.mark.parametrize("variant, code", [("clean", 0), ("layers-plus1", 1)])
def test_probe_exit_code_is_1_on_a_gap(fixture_models, prompts_file, variant, code):
    d = fixture_models(variant)
    result = CliRunner().invoke(
        app,
        [
            "probe",
            "--target",
            str(d / "target.gguf"),
            "--model",
            str(d / "draft.gguf"),
            "--ref-target",
            str(d / "target-hf"),
            "--ref-model",
            str(d / "draft-hf"),
            "--prompts",
            str(prompts_file),
            "--rounds",
            str(ROUNDS),
        ],
    )
    assert result.exit_code == code, result.output
    assert "run drafted/accepted" in result.output


def test_empty_prompts_file_exits_2(fixture_models, tmp_path):
    d, empty = fixture_models("clean"), tmp_path / "none.txt"
    empty.write_text("\n")
    result = CliRunner().invoke(
        app, ["probe", "--target", str(d / "target.gguf"), "--model", str(d / "draft.gguf"), "--prompts", str(empty)]
    )
    assert result.exit_code == 2 and "no prompts" in result.output


def test_probe_help_shows_its_flags():
    result = CliRunner().invoke(app, ["probe", "--help"])
    assert result.exit_code == 0
    for flag in ("--target", "--model", "--prompts", "--rounds", "--ref-model", "--draft-max", "--exec"):
        assert flag in result.output, flag


@pytest.mark.parametrize("through_server", [False, True])
def test_reference_drafts_blocks_as_long_as_the_runs(probed, draft_max_2_prompts_file, through_server):
    result = probed("clean", through_server, draft_max=2, prompts=draft_max_2_prompts_file)
    rounds = [r for p in result.prompts for r in p.rounds if r.run_drafts]
    assert rounds and all(len(r.run_drafts) <= 2 for r in rounds) and any(len(r.run_drafts) == 2 for r in rounds)
    assert all(r.run_drafts == r.ref_drafts for r in rounds)  # 4-row reference blocks draft others in some rounds
    assert result.run == result.ref and not result.has_gap


def test_probe_exec_refuses_draft_max(fixture_models):
    d = fixture_models("clean")
    result = CliRunner().invoke(
        app,
        [
            "probe",
            "--target",
            str(d / "target.gguf"),
            "--model",
            str(d / "draft.gguf"),
            "--draft-max",
            "2",
            "--exec",
            "--",
            "llama-server",
            "-m",
            str(d / "target.gguf"),
        ],
    )
    assert result.exit_code == 2, result.output
    assert "--draft-max 2" in result.output and "--spec-draft-n-max" in result.output


# ---------------------------------------------------------------- where each run round drafts (pure)


def _trace(prompt: tuple[int, ...], *rounds: tuple[int, int, tuple[int, ...]]):
    """A run trace of rounds (pos0, anchor as the drafter read it, target tokens)."""
    from featdiff.dump.records import Round
    from featdiff.verdict.probe import RunTrace

    made = tuple(Round(i + 1, pos0, anchor, (9, 9), 0, tokens) for i, (pos0, anchor, tokens) in enumerate(rounds))
    return RunTrace("p", prompt, made, 3)


def test_each_round_drafts_after_the_runs_own_tokens():
    from featdiff.verdict.probe import contexts

    trace = _trace((1, 2, 3), (2, 3, (7, 8)), (4, 8, (5,)))
    assert contexts(trace) == ((1, 2, 3), (1, 2, 3, 7, 8))


def test_an_anchor_the_drafter_misread_is_judged_on_the_runs_token_not_refused():
    """A masked anchor (FEATDIFF_FAULT=anchor-mask) is compare's block_token; the probe goes on."""
    from featdiff.verdict.probe import contexts

    mask = 175
    trace = _trace((1, 2, 3), (2, mask, (7,)), (3, mask, (6,)))
    assert contexts(trace) == ((1, 2, 3), (1, 2, 3, 7))


def test_a_round_past_the_known_tokens_is_left_unprobed_and_a_rewind_is_followed():
    from featdiff.verdict.probe import contexts

    trace = _trace((1, 2, 3), (5, 4, (7,)), (1, 2, (4,)), (2, 4, ()))
    assert contexts(trace) == (None, (1, 2), (1, 2, 4))
