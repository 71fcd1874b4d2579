"""The command line keeps the contract's commands and flags, and the repository its rules."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from featdiff.cli import app

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = {
    "fixture": ["--variant"],
    "capture": ["--target", "--model", "--prompt", "--tokens", "--rounds", "--filter", "--llama-dir", "--exec", "-o"],
    "reference": ["--target", "--model", "--prompt", "--tokens", "--rounds", "-o"],
    "compare": ["--json", "--report"],
    "report": ["-o"],
    "inspect": [],
    "lint": ["--target"],
    "probe": ["--target", "--model", "--prompts", "--exec"],
    "pack": ["-o"],
}


@pytest.mark.parametrize("command, flags", CONTRACT.items())
def test_help_shows_the_contract_flags(command, flags):
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    for flag in flags:
        assert flag in result.output, (command, flag)


@pytest.mark.parametrize(
    "command, flags", [("reference", ["--block", "--run"]), ("capture", ["--draft-max"]), ("probe", ["--draft-max"])]
)
def test_help_shows_the_block_length_flags(command, flags):
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    for flag in flags:
        assert flag in result.output, (command, flag)


def test_capture_exec_refuses_draft_max_naming_the_programs_flag(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "capture",
            "--exec",
            "--draft-max",
            "2",
            "-o",
            str(tmp_path / "r.npz"),
            "--",
            "llama-speculative-simple",
            "-m",
            "T.gguf",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "--draft-max 2" in result.output and "--spec-draft-n-max" in result.output
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value", ["0", "-1"])
def test_capture_refuses_a_draft_max_below_1(fixture_models, tmp_path, value):
    d = fixture_models("clean")
    result = CliRunner().invoke(
        app,
        [
            "capture",
            "--target",
            str(d / "target.gguf"),
            "--model",
            str(d / "draft.gguf"),
            "--tokens",
            "1,2,3",
            "--draft-max",
            value,
            "-o",
            str(tmp_path / "r.npz"),
        ],
    )
    assert result.exit_code == 2, result.output
    assert f"--draft-max {value}: expected >= 1" in result.output
    assert not list(tmp_path.iterdir())


def test_unknown_fixture_variant_exits_2_naming_the_choices(tmp_path):
    result = CliRunner().invoke(app, ["fixture", str(tmp_path), "--variant", "nope"])
    assert result.exit_code == 2
    assert "no such fixture variant" in result.output and "layers-plus1" in result.output


def test_fixture_list_names_every_variant():
    from featdiff.factory.pairs import VARIANTS

    result = CliRunner().invoke(app, ["fixture", "--list"])
    assert result.exit_code == 0
    assert all(v in result.output for v in VARIANTS)


def _with_an_extra_tensor(src: Path, dst: Path) -> Path:
    """`src` plus one tensor no architecture reads: llama.cpp refuses it ("wrong number of tensors")."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(src))
    arch = "general.architecture"
    writer = GGUFWriter(str(dst), str(reader.fields[arch].contents()))
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != arch:
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data))
    writer.add_tensor("blk.0.unknown.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_capture_of_a_model_llama_cpp_refuses_exits_2_naming_it(fixture_models, tmp_path):
    d = fixture_models("clean")
    out = tmp_path / "out"
    out.mkdir()
    draft = _with_an_extra_tensor(d / "draft.gguf", tmp_path / "draft-extra.gguf")
    result = CliRunner().invoke(
        app,
        [
            "capture",
            "--target",
            str(d / "target.gguf"),
            "--model",
            str(draft),
            "--tokens",
            "1,2,3",
            "-o",
            str(out / "r.npz"),
        ],
    )
    assert result.exit_code == 2, result.output
    assert str(draft) in result.output and "llama.cpp refused" in result.output
    assert not list(out.iterdir())  # no spool or partial dump left behind


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--tokens", "1,x"], "expected comma-separated integers"),
        (["--tokens", "5"], "needs >= 2 token ids"),
        (["--tokens", "1,99999"], "out of range"),
        ([], "exactly one of --prompt"),
    ],
)
def test_bad_prompts_exit_2(fixture_models, tmp_path, args, expected):
    d = fixture_models("clean")
    result = CliRunner().invoke(
        app,
        [
            "capture",
            "--target",
            str(d / "target.gguf"),
            "--model",
            str(d / "draft.gguf"),
            *args,
            "-o",
            str(tmp_path / "r.npz"),
        ],
    )
    assert result.exit_code == 2 and expected in result.output


def test_bad_llama_dir_exits_2(fixture_models, tmp_path):
    d = fixture_models("clean")
    result = CliRunner().invoke(
        app,
        [
            "capture",
            "--target",
            str(d / "target.gguf"),
            "--model",
            str(d / "draft.gguf"),
            "--tokens",
            "1,2",
            "--llama-dir",
            str(tmp_path),
            "-o",
            str(tmp_path / "r.npz"),
        ],
    )
    assert result.exit_code == 2 and "no include/llama.h" in result.output


SCANNED_FOR_CTYPES = ("src", "tests", "bench", "examples")  # every directory of code the project ships or runs


def test_the_binding_is_cffi_only():
    """No code file names the other FFI (read here file by file, so it holds outside a checkout)."""
    forbidden = re.compile(r"\b" + "c" + "types" + r"\b")  # spelled apart so this file does not match itself
    files = [
        p
        for d in SCANNED_FOR_CTYPES
        for p in (ROOT / d).rglob("*")
        if p.is_file() and p.suffix not in (".md", ".pyc", ".so") and "__pycache__" not in p.parts
    ]
    assert ROOT / "src" / "featdiff" / "llama" / "binding.py" in files  # the scan reads the binding itself
    hits = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (a compiled module, a figure)
        hits += [f"{path}:{n}" for n, line in enumerate(text.splitlines(), 1) if forbidden.search(line)]
    assert hits == []


def test_inspect_lists_a_captures_evals_and_records(captured):
    result = CliRunner().invoke(app, ["inspect", str(captured("clean"))])
    assert result.exit_code == 0, result.output
    for text in (
        "llama.cpp dump",
        "target prefill",
        "draft  inject",
        "draft  draft",
        "target verify",
        "inp_target_features",
        "Kcur_injected-0",
        "round 1: pos0",
    ):
        assert text in result.output, text


def test_inspect_shows_a_drafters_dflash_metadata(fixture_models):
    d = fixture_models("layers-plus1")
    result = CliRunner().invoke(app, ["inspect", str(d / "draft.gguf")])
    assert result.exit_code == 0
    assert "dflash.target_layers = [3, 5]" in result.output and "block_size = 4" in result.output
    assert "borrows the target" in result.output


def test_a_bug_of_featdiffs_exits_3_with_one_line_and_the_traceback_in_a_file(monkeypatch, tmp_path):
    import featdiff.diff

    def broken(*args, **kwargs):
        raise RuntimeError("planted bug")

    monkeypatch.setattr(featdiff.diff, "compare_dumps", broken)
    for name in ("ref.npz", "run.npz"):
        (tmp_path / name).write_bytes(b"")
    result = CliRunner().invoke(app, ["compare", str(tmp_path / "ref.npz"), str(tmp_path / "run.npz")])
    assert result.exit_code == 3, result.output
    line = result.output.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("featdiff: internal error") and "RuntimeError: planted bug" in line
    report = Path(line.rsplit("the traceback is in ", 1)[1])
    assert "planted bug" in report.read_text() and "Traceback" in report.read_text()
    report.unlink()


def test_usage_errors_keep_the_frameworks_exit_code():
    assert CliRunner().invoke(app, ["compare"]).exit_code == 2
    assert CliRunner().invoke(app, ["no-such-command"]).exit_code == 2


@pytest.mark.parametrize("args", [["reference", "--help"], ["fixture", "--list"]])
def test_a_reader_that_goes_away_ends_featdiff_quietly(args):
    """`featdiff ... | head`: the pipe closes before featdiff writes; no traceback, no crash file,
    no 'internal error' (click's own handler or featdiff's, exit 1 or 128 + SIGPIPE)."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("featdiff")), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader leaves before the interpreter has even started
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (1, 141) and "internal error" not in err and "Traceback" not in err, err
