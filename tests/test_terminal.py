"""A quiet terminal (issue 48, item 4): `featdiff --version`, one hint line for a program's
command line that forgot --exec, counts and phases that read as English, the reference's
per-round detail only with -v (the findings table's width: tests/compare/test_render.py)."""

from __future__ import annotations

import logging

import pytest
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core.phases import phrase
from featdiff.core.words import plural
from featdiff.version import VERSION

# A prompt on which the off-by-one drafter's drafts part from the reference's in round 1
PARTING_TOKENS, PARTING_ROUNDS = "7,21,3,99,140,5,260,33", 4


def test_version_prints_the_package_version_and_exits_0():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"featdiff {VERSION}\n"


@pytest.mark.parametrize(
    "args",
    [
        ["--", "llama-server", "-m", "T.gguf", "-md", "D.gguf"],  # `--exec` left out before `--`
        ["llama-server", "-m", "T.gguf"],  # and without `--`: typer hands over the words
        ["-m", "T.gguf", "-md", "D.gguf"],  # a llama.cpp flag in-process capture does not take
    ],
)
def test_capture_of_a_programs_command_line_without_exec_says_did_you_mean_exec(args, tmp_path):
    result = CliRunner().invoke(app, ["capture", "-o", str(tmp_path / "run.npz"), *args])
    assert result.exit_code == 2, result.output
    (line,) = result.output.splitlines()  # one line: no list of 25 run options
    assert f"featdiff: error: {args[1] if args[0] == '--' else args[0]}: " in line and "did you mean --exec?" in line
    assert "-ctkd" not in line and not (tmp_path / "run.npz").exists()


@pytest.mark.parametrize("command", ["check", "probe"])
def test_check_and_probe_of_a_programs_command_line_without_exec_say_did_you_mean_exec(command, tmp_path):
    t, d = tmp_path / "T.gguf", tmp_path / "D.gguf"
    t.write_bytes(b""), d.write_bytes(b"")  # --target and --model must exist; nothing reads them
    args = [command, "--target", str(t), "--model", str(d), "--", "llama-server", "-m", str(t), "-md", str(d)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    (line,) = result.output.splitlines()
    assert line.startswith("featdiff: error: llama-server: ") and "did you mean --exec?" in line
    assert f"featdiff {command} ... --exec -- llama-server -m" in line


def test_counts_are_singular_for_one():
    assert [plural(n, "row") for n in (0, 1, 2)] == ["0 rows", "1 row", "2 rows"]
    assert plural(1, "error finding") == "1 error finding" and plural(3, "index", "indices") == "3 indices"


def test_phases_read_as_whose_eval_it_is():
    assert phrase("draft", "draft") == "drafter's draft" and phrase("target", "verify") == "target's verify"
    assert phrase("draft", "inject") == "drafter's inject" and phrase("target", "warmup") == "target's warm-up"


def test_reference_tells_each_rounds_parting_only_with_verbose(captured, fixture_models, tmp_path, caplog):
    """The off-by-one drafter drafts otherwise than the reference from round 1: a parting per
    round, which compare judges; on the terminal only when asked (-v)."""
    d = fixture_models("layers-plus1")
    run = captured("layers-plus1", tokens=PARTING_TOKENS, rounds=PARTING_ROUNDS)
    said = {}
    for flags in ([], ["-v"]):
        args = ["reference", "--target", str(d / "target.gguf"), "--model", str(d / "draft-hf")]
        args += ["-o", str(tmp_path / f"ref{len(flags)}.npz"), "--follow", str(run), *flags]
        with caplog.at_level(logging.DEBUG, logger="featdiff"):
            caplog.clear()
            result = CliRunner().invoke(app, args)
            said[bool(flags)] = [r.getMessage() for r in caplog.records if "would draft" in r.getMessage()]
        assert result.exit_code == 0, result.output
        assert any(r.getMessage().startswith("reference: ") for r in caplog.records)  # the stage's one line stays
    assert not said[False] and said[True][0].startswith("round 1: the reference would draft ")
