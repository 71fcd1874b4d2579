"""No output path loses what the user had: an output naming an input (or inside an input model
directory), an existing directory, or a path in a missing directory exits 2 with one line naming
it, and the input stays byte for byte; an output that is no input is replaced whole, never left
half-written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core.errors import InputError
from featdiff.core.outputs import failed_output, lock_path, output_lock, partial_path, replaced


def _refused(args: list[str], *kept: Path) -> str:
    """Run the CLI, assert exit 2 with one error line and every `kept` file unchanged; return the line."""
    before = {p: p.read_bytes() for p in kept}
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("featdiff: error:")]
    assert len(errors) == 1, result.output
    assert all(p.read_bytes() == b for p, b in before.items())
    return errors[0]


@pytest.fixture
def models(fixture_models, tmp_path) -> Path:
    """A private copy of the clean fixture pair, so a failed refusal cannot spoil the session's."""
    return Path(shutil.copytree(fixture_models("clean"), tmp_path / "models"))


@pytest.fixture
def dumps(captured, referenced, tmp_path) -> tuple[Path, Path]:
    """Private copies of a real reference dump and a real capture of the clean pair."""
    return (
        Path(shutil.copy(referenced("clean"), tmp_path / "ref.npz")),
        Path(shutil.copy(captured("clean"), tmp_path / "run.npz")),
    )


@pytest.fixture
def spool(tmp_path) -> Path:
    """The spool prefix of a capture that died after its header."""
    prefix = tmp_path / "run.npz.spool"
    Path(f"{prefix}.index").write_text(json.dumps({"kind": "header", "prompt_tokens": [1, 2]}) + "\n")
    Path(f"{prefix}.data").write_bytes(b"")
    return prefix


# --- an output that is an input -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["draft.gguf", "target.gguf"])
def test_capture_refuses_to_write_over_its_models(models, name):
    t, m = models / "target.gguf", models / "draft.gguf"
    line = _refused(
        ["capture", "--target", str(t), "--model", str(m), "--tokens", "1,2,3", "-o", str(models / name)], t, m
    )
    assert str(models / name) in line and "must not be an input of this command" in line and "choose another -o" in line
    assert not list(models.glob("*.spool*")) and not list(models.glob("*.partial"))


def test_capture_refuses_a_symlink_to_its_model(models, tmp_path):
    link = tmp_path / "link.gguf"
    link.symlink_to(models / "draft.gguf")
    line = _refused(
        [
            "capture",
            "--target",
            str(models / "target.gguf"),
            "--model",
            str(models / "draft.gguf"),
            "--tokens",
            "1,2,3",
            "-o",
            str(link),
        ],
        models / "draft.gguf",
    )
    assert str(link) in line and str(models / "draft.gguf") in line


@pytest.mark.parametrize("spelling", ["-m {}", "--model={}"])
def test_capture_exec_refuses_a_model_of_the_command_line(models, spelling):
    t = models / "target.gguf"
    flag, _, value = spelling.format(t).partition(" ")
    command = ["true", *([flag, value] if value else [flag]), "-md", str(models / "draft.gguf")]
    line = _refused(["capture", "--exec", "-o", str(t), "--", *command], t)
    assert str(t) in line and "must not be an input of this command" in line


@pytest.mark.parametrize(
    "model, output",
    [
        ("draft.gguf", "target.gguf"),
        ("draft.gguf", "draft.gguf"),
        ("draft-hf", "draft-hf"),
        ("draft-hf", "draft-hf/ref.npz"),
        ("draft-hf", "draft-hf/model.safetensors"),
    ],
)
def test_reference_refuses_its_models_and_their_directories(models, model, output):
    kept = [models / "target.gguf", models / "draft.gguf", models / "draft-hf" / "model.safetensors"]
    line = _refused(
        [
            "reference",
            "--target",
            str(models / "target.gguf"),
            "--model",
            str(models / model),
            "--tokens",
            "1,2,3",
            "-o",
            str(models / output),
        ],
        *kept,
    )
    assert str(models / output) in line and "choose another -o" in line
    if model == "draft-hf":
        assert "inside" in line and str(models / "draft-hf") in line
    assert not list(models.rglob("*.partial"))


def test_reference_refuses_to_write_over_its_run(models, tmp_path):
    run = tmp_path / "run.npz"
    run.write_bytes(b"the user's capture")
    line = _refused(
        [
            "reference",
            "--target",
            str(models / "target.gguf"),
            "--model",
            str(models / "draft.gguf"),
            "--tokens",
            "1,2,3",
            "--run",
            str(run),
            "-o",
            str(run),
        ],
        run,
    )
    assert str(run) in line


@pytest.mark.parametrize("flag, side", [("--json", 1), ("--report", 0), ("--json", 0)])
def test_compare_refuses_to_write_over_a_dump(dumps, flag, side):
    line = _refused(["compare", str(dumps[0]), str(dumps[1]), flag, str(dumps[side])], *dumps)
    assert str(dumps[side]) in line and f"choose another {flag}" in line


def test_report_refuses_to_write_over_a_dump(dumps):
    line = _refused(["report", str(dumps[0]), str(dumps[1]), "-o", str(dumps[1])], *dumps)
    assert str(dumps[1]) in line and "choose another -o" in line


def test_report_refuses_a_png_dir_that_is_a_dump(dumps, tmp_path):
    line = _refused(
        ["report", str(dumps[0]), str(dumps[1]), "-o", str(tmp_path / "r.html"), "--png-dir", str(dumps[0])], *dumps
    )
    assert str(dumps[0]) in line and "--png-dir" in line
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("suffix", [".data", ".index"])
def test_pack_refuses_to_write_over_its_spool(spool, suffix):
    files = [Path(f"{spool}.index"), Path(f"{spool}.data")]
    line = _refused(["pack", str(spool), "-o", f"{spool}{suffix}"], *files)
    assert f"{spool}{suffix}" in line and "must not be an input of this command" in line


# --- an output that cannot be a file here -------------------------------------------------------


def test_fixture_refuses_an_outdir_that_is_a_file(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("the user's notes")
    line = _refused(["fixture", str(f)], f)
    assert str(f) in line and "expected a directory" in line


def test_an_output_that_is_a_directory_is_refused(spool, tmp_path):
    (tmp_path / "out").mkdir()
    line = _refused(["pack", str(spool), "-o", str(tmp_path / "out")])
    assert str(tmp_path / "out") in line and "existing directory" in line


def test_a_file_output_in_a_missing_directory_is_refused_naming_it(spool, dumps, tmp_path):
    missing = tmp_path / "no-such-dir"
    for command in (
        ["pack", str(spool), "-o", str(missing / "out.npz")],
        ["compare", str(dumps[0]), str(dumps[1]), "--json", str(missing / "out.json")],
    ):
        line = _refused(command)
        assert f"{missing / 'out'}" in line and f"the directory {missing}, which does not exist" in line
    assert not missing.exists()


def test_a_directory_output_is_made_with_its_parents_unless_one_is_a_file(tmp_path):
    result = CliRunner().invoke(app, ["fixture", str(tmp_path / "new" / "fx")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "new" / "fx" / "draft.gguf").is_file()
    f = tmp_path / "notes.txt"
    f.write_text("the user's notes")
    line = _refused(["fixture", str(f / "fx")], f)
    assert f"needs {f} to be a directory, but it is a file" in line


def test_capture_in_a_missing_directory_is_refused_before_it_runs(models, tmp_path):
    out = tmp_path / "no-such-dir" / "run.npz"
    line = _refused(
        [
            "capture",
            "--target",
            str(models / "target.gguf"),
            "--model",
            str(models / "draft.gguf"),
            "--tokens",
            "1,2,3",
            "-o",
            str(out),
        ]
    )
    assert f"{out.parent}, which does not exist" in line


# --- what may be written is written whole ------------------------------------------------------


def test_compare_and_report_write_new_outputs_and_replace_old_ones_whole(dumps, tmp_path):
    old = tmp_path / "findings.json"
    old.write_text("the last run's findings")
    result = CliRunner().invoke(
        app, ["compare", str(dumps[0]), str(dumps[1]), "--json", str(old), "--report", str(tmp_path / "new.html")]
    )
    assert result.exit_code == 0, result.output
    assert "findings" in json.loads(old.read_text())
    assert (tmp_path / "new.html").read_text().startswith("<!doctype html>")
    result = CliRunner().invoke(
        app,
        ["report", str(dumps[0]), str(dumps[1]), "-o", str(tmp_path / "r.html"), "--png-dir", str(tmp_path / "png")],
    )
    assert result.exit_code == 0, result.output
    assert list((tmp_path / "png").glob("*.png"))  # a clean pair has no row-shift figure
    assert not list(tmp_path.rglob("*.partial"))


def test_pack_writes_to_a_new_path(spool, tmp_path):
    result = CliRunner().invoke(app, ["pack", str(spool), "-o", str(tmp_path / "packed.npz")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "packed.npz").is_file()


def test_fixture_writes_into_a_new_directory_and_rewrites_its_own(tmp_path):
    out = tmp_path / "fx"
    for _ in range(2):
        result = CliRunner().invoke(app, ["fixture", str(out)])
        assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == {"target.gguf", "draft.gguf", "target-hf", "draft-hf", "VARIANT"}
    assert not list(out.rglob("*.partial"))


def test_a_failed_write_leaves_the_old_file_as_it_was(tmp_path):
    old = tmp_path / "report.html"
    old.write_text("the user's report")
    with pytest.raises(OSError):
        with replaced(old) as tmp:
            tmp.write_text("half a rep")
            raise OSError("disk full")
    assert old.read_text() == "the user's report" and not partial_path(old).exists()


# --- one writer per output; a failed run writes beside the user's dump ---------------------------


def _held_elsewhere(path: Path):
    """A child process holding `path`'s output lock until killed; returned once it holds it."""
    import subprocess
    import sys

    code = (
        "import sys, time; from featdiff.core.outputs import output_lock\n"
        f"with output_lock(__import__('pathlib').Path({str(path)!r})):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_an_output_lock_refuses_a_second_writer_naming_the_first(tmp_path):
    out = tmp_path / "run.npz"
    proc = _held_elsewhere(out)
    try:
        with pytest.raises(InputError) as refused:
            with output_lock(out):
                pass
        assert str(refused.value) == (
            f"{out}: another featdiff run is writing {out} (pid {proc.pid}); wait for it or choose another -o"
        )
        assert lock_path(out).read_text() == f"{proc.pid}\n"  # the refused run leaves the holder's lock alone
    finally:
        proc.kill()
        proc.wait()


def test_the_lock_is_reentrant_within_one_run(tmp_path):
    """A capture holds its output's lock and writes the dump under it: one process, one writer."""
    out = tmp_path / "run.npz"
    with output_lock(out) as lock:
        assert lock == lock_path(out) and lock.read_text() == f"{os.getpid()}\n"
        with output_lock(out):
            assert lock.exists()
        assert lock.exists()  # the inner block leaves the outer's lock held
    assert not lock.exists()


def test_a_lock_file_left_by_a_killed_run_does_not_block(tmp_path):
    out = tmp_path / "run.npz"
    lock_path(out).write_text("99999\n")  # its flock went with its process
    with output_lock(out):
        assert lock_path(out).read_text() == f"{os.getpid()}\n"
    assert not lock_path(out).exists()


def test_a_failed_run_writes_beside_an_existing_dump_never_over_it(tmp_path):
    out = tmp_path / "run.npz"
    assert failed_output(out) == out
    out.write_bytes(b"the user's dump")
    assert failed_output(out) == tmp_path / "run.failed.npz"
    (tmp_path / "run.failed.npz").write_bytes(b"an earlier failure's")
    assert failed_output(out) == tmp_path / "run.failed-2.npz"


def test_every_writer_refuses_an_output_another_run_is_writing(fixture_models, tmp_path):
    """replaced() (JSON, HTML, PNGs, fixtures) and the reference take the output's lock, so a
    second run refuses instead of writing the same temporary file."""
    out = tmp_path / "ref.npz"
    out.write_bytes(b"the user's dump")
    proc = _held_elsewhere(out)
    try:
        with pytest.raises(InputError, match="another featdiff run is writing"):
            with replaced(out) as tmp:
                tmp.write_text("not written")
        d = fixture_models("clean")
        args = ["reference", "--target", d / "target.gguf", "--model", d / "draft.gguf", "--tokens", "1,2,3"]
        result = CliRunner().invoke(app, [*map(str, args), "-o", str(out)])
        assert result.exit_code == 2 and "another featdiff run is writing" in result.output
    finally:
        proc.kill()
        proc.wait()
    assert out.read_bytes() == b"the user's dump" and not partial_path(out).exists()
    with replaced(out) as tmp:  # free again
        tmp.write_text("written")
    assert out.read_text() == "written"
