"""`reference --follow`: the reference replays a run's own decisions (prompt, drafts, accepted
prefixes), so a run whose drafts differ from the reference's (a Q4_0 target) still pairs every
eval, where a reference deciding for itself leaves rows out."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from featdiff.diff import compare_dumps
from featdiff.dump.reader import read_dump
from featdiff.core.errors import InputError
from featdiff.driver.capture import capture
from quantize import quantize_gguf
from real_flow import DEFAULT_TOKENS, reference_of

ROUNDS = 4
NOT_THE_SAME_HISTORY = {"token_history", "position", "missing_eval"}  # skips a replayed flow cannot have


@pytest.fixture(scope="module")
def q4_run(variant_dir, tmp_path_factory) -> tuple[Path, Path]:
    """The clean pair's drafter run on a Q4_0 target: its greedy path leaves the f32 reference's."""
    d, work = variant_dir("clean"), tmp_path_factory.mktemp("follow")
    target = quantize_gguf(d / "target.gguf", work / "target-q4_0.gguf", GGMLQuantizationType.Q4_0)
    return d, capture(target, d / "draft.gguf", work / "run.npz", tokens=DEFAULT_TOKENS, rounds=ROUNDS)


def _reference(d: Path, out: Path, **kw) -> Path:
    return reference_of(d / "target.gguf", d / "draft-hf", out, **kw)


def _flow(path: Path) -> list[tuple]:
    with read_dump(path) as dump:
        return [(e.role, e.phase, e.round, e.positions, e.token_ids) for e in dump.manifest.evals]


def test_following_the_run_pairs_every_eval(q4_run, tmp_path):
    d, run = q4_run
    own = _reference(
        d, tmp_path / "own.npz", prompt=None, tokens=DEFAULT_TOKENS, rounds=ROUNDS
    )  # not --run: it follows
    assert _flow(own) != _flow(run)  # the premise: left to itself, the reference decodes other tokens
    skipped = {s.reason for s in compare_dumps(own, run).coverage.skips}
    assert skipped & NOT_THE_SAME_HISTORY, skipped

    followed = _reference(d, tmp_path / "followed.npz", prompt=None, tokens=None, rounds=0, follow=run)
    assert _flow(followed) == _flow(run)
    comparison = compare_dumps(followed, run)
    assert not {s.reason for s in comparison.coverage.skips} & NOT_THE_SAME_HISTORY
    assert comparison.coverage.rows > compare_dumps(own, run).coverage.rows  # rows left out before now compare
    with read_dump(followed) as dump:
        assert dump.manifest.build["follow"] == str(run)


def test_follow_replaces_the_options_that_would_decide_otherwise(q4_run, tmp_path):
    d, run = q4_run
    with pytest.raises(InputError, match="drop --tokens"):
        _reference(d, tmp_path / "x.npz", prompt=None, tokens="1,2,3", rounds=2, follow=run)


def test_a_dump_without_rounds_cannot_be_followed(q4_run, tmp_path):
    d, run = q4_run
    no_rounds = _reference(d, tmp_path / "prefill.npz", prompt=None, tokens=DEFAULT_TOKENS, rounds=0)
    with pytest.raises(
        InputError, match=r"no speculative round to follow .* --tokens \S+ --rounds 1 in place of --follow"
    ):
        _reference(d, tmp_path / "x.npz", prompt=None, tokens=None, rounds=2, follow=no_rounds)


def test_the_cli_follows_a_run(q4_run, tmp_path):
    from typer.testing import CliRunner

    from featdiff.cli import app

    d, run = q4_run
    out = tmp_path / "cli.npz"
    args = ["reference", "--target", str(d / "target.gguf"), "--model", str(d / "draft-hf"), "--follow", str(run)]
    result = CliRunner().invoke(app, [*args, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert _flow(out) == _flow(run)
    refused = CliRunner().invoke(app, [*args, "--tokens", "1,2", "-o", str(tmp_path / "x.npz")])
    assert refused.exit_code == 2 and "drop --tokens" in refused.output
