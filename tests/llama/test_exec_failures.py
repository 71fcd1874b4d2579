"""Clear failures of the program featdiff runs around (issue 48, item 3): a drafter that does not
fit its target is refused with lint's sentence before the program starts (capture --exec and
check --exec); a program that fails or is killed is one line naming it, how it ended and the log
file holding its whole output (never its backtrace); that log, not the terminal, gets the
program's output; llama-server run without a drafter is said to be. llama-simple is the program
run: what is said here does not depend on which."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core import names
from featdiff.core.gguf_reader import read_gguf
from featdiff.dump.reader import read_dump
from featdiff.factory.gguf_rewrite import DROP, rewrite_gguf
from featdiff.programs import server
from featdiff.programs.exec import check_pair, program_log
from featdiff.verdict.lint import lint_gguf

from real_flow import DEFAULT_TOKENS

SPEC_ARGS = ["--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-c", "256", "-t", "1", "-td", "1"]
SIMPLE = "llama-simple"  # the target alone, its own arguments: `-m T.gguf -n N PROMPT`
OTHER_N_VOCAB = 256  # the crafted drafter's vocabulary; the fixture target's is pairs.N_VOCAB (512)
BACKTRACE_FRAME = "#1 "  # how gdb's frames open, which ggml_abort prints into the program's output
LOADER_LINE = "llama_model_loader"  # what every llama.cpp program prints as it loads a model


def _command(tools, program: str, target: Path, drafter: Path | None) -> list[str]:
    if program == SIMPLE:  # it takes no drafter: a -md is read by featdiff's check, never by the program
        return [
            str(tools.program(SIMPLE)),
            "-m",
            str(target),
            *(["-md", str(drafter)] if drafter else []),
            "-n",
            "4",
            "hi",
        ]
    cmd = [str(tools.program(program)), "-m", str(target), *(["-md", str(drafter)] if drafter else []), *SPEC_ARGS]
    if program == "llama-speculative-simple":
        cmd += ["-p", "The quick brown fox", "-n", "16", "--temp", "0"]
    return cmd


def _capture(out: Path, command: list[str]):
    """`featdiff capture --exec` of `command`, llama-server asked the suite's tokens."""
    tokens = ["--tokens", DEFAULT_TOKENS] if Path(command[0]).name == "llama-server" else []
    return CliRunner().invoke(app, ["capture", "--exec", "-o", str(out), *tokens, "--", *command])


@pytest.fixture(scope="module")
def other_vocabulary(fixture_models, tmp_path_factory) -> Path:
    """The fixture's drafter with tables of another vocabulary than its target's (own token_embd
    and output of OTHER_N_VOCAB rows, its mask token the last of them, no token list): a drafter
    trained for another target."""
    src = fixture_models("own-embd") / "draft.gguf"
    n_embd = read_gguf(src).tensors[names.T_TOKEN_EMBD].ne[0]
    table = np.full((OTHER_N_VOCAB, n_embd), 0.01, np.float32)  # (n_vocab, n_embd)
    keys = {k: DROP for k in (names.KEY_TOKEN_LIST, "tokenizer.ggml.scores", "tokenizer.ggml.token_type")}
    keys[names.KEY_MASK_TOKEN] = OTHER_N_VOCAB - 1
    out = tmp_path_factory.mktemp("other-vocab") / "draft.gguf"
    return rewrite_gguf(src, out, keys, {names.T_TOKEN_EMBD: table, names.T_OUTPUT: table})


@pytest.mark.parametrize("program", [SIMPLE])
def test_a_drafter_of_another_vocabulary_is_refused_with_lints_sentence_before_the_program_starts(
    program, tools, fixture_models, other_vocabulary, tmp_path
):
    target = fixture_models("clean") / "target.gguf"
    out = tmp_path / "run.npz"
    result = _capture(out, _command(tools, program, target, other_vocabulary))
    assert result.exit_code == 2, result.output
    (line,) = result.output.splitlines()
    first = lint_gguf(other_vocabulary, target)[0]  # lint's own line: "<drafter>: <problem>"
    assert line.startswith(f"featdiff: error: {first} (2 more: `featdiff lint {other_vocabulary} --target {target}`)")
    assert "the drafter's vocabulary has 256 tokens, the target's 512" in first
    assert not program_log(out).exists() and not out.exists()  # the program never started


def test_check_exec_refuses_the_same_pair_before_the_program_starts(tools, fixture_models, other_vocabulary, tmp_path):
    d = fixture_models("clean")
    command = _command(tools, SIMPLE, d / "target.gguf", other_vocabulary)
    args = ["check", "--target", str(d / "target.gguf"), "--model", str(other_vocabulary)]
    args += ["--ref-model", str(d / "draft-hf"), "--keep", str(tmp_path / "kept"), "--exec", "--", *command]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    (line,) = result.output.splitlines()
    assert "the drafter's vocabulary has 256 tokens, the target's 512" in line
    assert not list((tmp_path / "kept").glob("*.log"))


@pytest.mark.parametrize("program", [SIMPLE])
def test_a_program_that_cannot_load_its_model_is_one_line_naming_its_exit_and_log(
    program, tools, fixture_models, tmp_path
):
    out = tmp_path / "run.npz"
    missing = tmp_path / "missing.gguf"
    result = _capture(out, _command(tools, program, missing, None))
    assert result.exit_code == 2, result.output
    (line,) = result.output.splitlines()
    log = program_log(out)
    assert line.startswith(f"featdiff: error: {program}: exited with code 1 ") and f"its output is in {log}" in line
    assert str(missing) in log.read_text() and LOADER_LINE not in line and BACKTRACE_FRAME not in line


def test_a_program_killed_by_a_signal_is_named_by_it_and_keeps_what_it_decoded(tools, fixture_models, tmp_path):
    out = tmp_path / "run.npz"
    d = fixture_models("clean")
    simple = _command(tools, SIMPLE, d / "target.gguf", None)
    result = _capture(out, ["bash", "-c", f"{shlex.join(simple)}; kill -ABRT $$"])
    assert result.exit_code == 2, result.output
    (line,) = result.output.splitlines()
    assert line.startswith("featdiff: error: bash: was killed by SIGABRT under capture; its output is in ")
    assert f"{out} holds what it decoded" in line  # no dump was at -o: it goes there
    assert LOADER_LINE in program_log(out).read_text()  # the program's output went to its log, whole
    with read_dump(out) as dump:
        assert dump.manifest.evals  # the target's decodes before the kill


def test_a_clean_capture_keeps_the_programs_output_off_the_terminal(tools, fixture_models, tmp_path, capfd):
    out = tmp_path / "run.npz"
    d = fixture_models("clean")
    result = _capture(out, _command(tools, SIMPLE, d / "target.gguf", None))
    assert result.exit_code == 0, result.output
    seen = capfd.readouterr()
    assert LOADER_LINE not in seen.out + seen.err and LOADER_LINE in program_log(out).read_text()


def test_a_failure_line_quotes_the_error_and_never_a_backtrace_frame(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "llama_model_loader: loaded meta data\n"
        "/src/llama-model.cpp:99: GGML_ASSERT(il < n_layer) failed\n"
        "#0  0x00007f in __libc_start_main_impl () error\n"
        "#1  0x00008f in main ()\n"
    )
    line = server.failure_line("llama-server", -6, log, " before it was ready")
    assert line == (
        f"llama-server: was killed by SIGABRT before it was ready; its output is in {log} "
        "(it says: /src/llama-model.cpp:99: GGML_ASSERT(il < n_layer) failed)"
    )
    assert server.ended(3) == "exited with code 3" and server.ended(-11) == "was killed by SIGSEGV"
    log.write_text("all is well\n")
    assert server.failure_line("llama-simple", 1, log) == f"llama-simple: exited with code 1; its output is in {log}"


@pytest.mark.parametrize(
    "command, environ, warns",
    [
        (["llama-server", "-m", "T.gguf", "--port", "8080"], {}, True),
        (["llama-server", "-m", "T.gguf", "-md", "D.gguf"], {}, False),
        (["llama-server", "-m", "T.gguf", "--spec-draft-model=D.gguf"], {}, False),
        (["llama-server", "-m", "T.gguf"], {"LLAMA_ARG_SPEC_DRAFT_MODEL": "D.gguf"}, False),
        (["llama-server", "-m", "T.gguf", "--spec-type", "draft-mtp"], {}, False),  # the head is the target's own
        (["llama-speculative-simple", "-m", "T.gguf"], {}, False),  # it says so itself
    ],
)
def test_llama_server_without_a_drafter_is_said_to_run_without_one(command, environ, warns, caplog):
    with caplog.at_level(logging.WARNING, logger="featdiff"):
        check_pair(command, environ)  # the files are not there: nothing else is read
    said = [r.getMessage() for r in caplog.records]
    assert said == (["llama-server runs without a drafter (no -md): the capture holds the target alone, with no "
                     "draft to judge; give -md D.gguf and --spec-type to capture speculative decoding"] if warns else [])  # fmt: skip


def test_following_a_run_without_a_drafter_says_it_loaded_none(tools, fixture_models, tmp_path):
    """llama-simple decodes the target alone, as llama-server started without -md does."""
    d = fixture_models("clean")
    run = tmp_path / "run.npz"
    assert _capture(run, _command(tools, SIMPLE, d / "target.gguf", None)).exit_code == 0
    args = ["reference", "--target", str(d / "target.gguf"), "--model", str(d / "draft-hf")]
    result = CliRunner().invoke(app, [*args, "--follow", str(run), "-o", str(tmp_path / "ref.npz")])
    assert result.exit_code == 2, result.output
    assert result.output == f"featdiff: error: {run}: the run loaded no drafter (its program had no -md), so it " \
        "drafted nothing to follow or compare; capture it again with the drafter (-md D.gguf and its --spec-type)\n"  # fmt: skip


def test_check_exec_names_the_programs_log_at_the_end(tools, fixture_models, tmp_path, capfd):
    d = fixture_models("clean")
    command = _command(tools, "llama-speculative-simple", d / "target.gguf", d / "draft.gguf")
    args = ["check", "--target", str(d / "target.gguf"), "--model", str(d / "draft.gguf")]
    args += ["--ref-model", str(d / "draft-hf"), "--exec", "--", *command]
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 1), result.output
    last = result.stdout.rstrip("\n").split("\n")[-1]  # the verdict's last line (stdout; stderr has the bars)
    assert last.startswith("llama-speculative-simple's own output: ")
    log = Path(last.split(": ", 1)[1])
    said = [line for line in log.read_text().splitlines() if line.strip()]  # kept after the check's temp dir
    seen = capfd.readouterr()
    assert said and not any(line in seen.out + seen.err for line in said)  # none of it on the terminal
    log.unlink()
