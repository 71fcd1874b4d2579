"""featdiff in environments its own runs never shape: a prompt given on the program's command
line, a llama.cpp build configured out of tree, a pip install outside the checkout, a full disk
or a file-size limit, dumps holding NaN/Inf (issue 22, part 5)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core.errors import InputError
from featdiff.core.outputs import existing_file
from featdiff.llama import binding
from featdiff.programs.exec import command_files

sys.path.insert(0, str(Path(__file__).parents[1] / "compare"))

import synth  # noqa: E402

# a prompt as users pass one with -p: longer than a file name may be (NAME_MAX 255 on Linux)
LONG_PROMPT = "You are a careful assistant. Summarise the following report in three sentences. " * 8
FSIZE_LIMIT = 4096  # bytes: below every output these tests write, above the lock file's pid
RUN_S = 120
MAIN = "from featdiff.cli import main; main()"  # `python -c MAIN ARGS`: the console entry point


# --- a prompt on the program's command line ---------------------------------------------------


def test_a_long_prompt_or_text_with_a_nul_is_no_input_file(tmp_path):
    model = tmp_path / "T.gguf"
    model.write_bytes(b"GGUF")
    assert len(LONG_PROMPT) > os.pathconf("/", "PC_NAME_MAX")
    assert existing_file(LONG_PROMPT) is None and existing_file("a\0b") is None and existing_file("") is None
    assert existing_file(str(tmp_path)) is None  # a directory is no input file
    command = ["llama-speculative-simple", "-m", str(model), "-p", LONG_PROMPT, f"--prompt={LONG_PROMPT}", "-n", "16"]
    assert command_files(command) == (model,)


def test_capture_exec_with_a_long_prompt_argument_is_not_an_internal_error(tmp_path, monkeypatch):
    """Before: every argument after `--` was stat-ed as a possible input, and a prompt of a few
    hundred characters raised ENAMETOOLONG (exit 3). `true` loads no libllama: exit 2 saying so."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["capture", "--exec", "-o", "run.npz", "--", "true", "-p", LONG_PROMPT])
    assert result.exit_code == 2, result.output
    assert "internal error" not in result.output and "File name too long" not in result.output
    assert "never loaded the preload library" in result.output
    assert not (tmp_path / "run.npz").exists()


# --- a build configured out of tree -----------------------------------------------------------


def _out_of_tree_build(where: Path) -> Path:
    """A CMake build directory `where` of the project's pinned tree, as `cmake -S src -B where`
    leaves one: its CMakeCache.txt naming the source, its libraries (linked to the real ones)."""
    real = binding.find_build(None)
    bin_dir = where / "bin"
    bin_dir.mkdir(parents=True)
    for lib in real.libllama.parent.glob("lib*.so*"):
        (bin_dir / lib.name).symlink_to(lib)
    (where / binding.CMAKE_CACHE).write_text(
        "# This is the CMakeCache file.\n"
        "//Value Computed by CMake\n"
        f"llama.cpp_SOURCE_DIR:STATIC={real.root}\n"
        f"CMAKE_HOME_DIRECTORY:INTERNAL={real.root}\n"
    )
    return where


def test_an_out_of_tree_build_directory_is_a_llama_dir(tmp_path):
    source = binding.find_build(None).root
    where = _out_of_tree_build(tmp_path / "elsewhere")
    assert binding.source_of(where) == source
    build = binding.find_build(where)
    assert build.include_dirs[0] == source / "include" and build.libllama == where.resolve() / "bin" / binding.LIBLLAMA
    assert binding.build_dir_of(where / "bin" / binding.LIBLLAMA) == where


def test_a_cache_naming_no_llama_source_is_no_build(tmp_path):
    (tmp_path / binding.CMAKE_CACHE).write_text(f"CMAKE_HOME_DIRECTORY:INTERNAL={tmp_path}\n")
    assert binding.source_of(tmp_path) is None
    with pytest.raises(InputError, match="CMake build directory"):
        binding.find_build(tmp_path)


def test_the_program_of_an_out_of_tree_build_is_captured_against_its_source(tmp_path, monkeypatch):
    """A program linked to a libllama in `cmake -B elsewhere`: with no default build to match it
    (a pip install without llama-cpp-python), its build is found from the CMakeCache.txt above it."""
    from featdiff.programs.preload import build_of_program

    source = binding.find_build(None).root
    where = _out_of_tree_build(tmp_path / "elsewhere")
    program = tmp_path / "llama-own"
    main = "int llama_max_devices(void); int main(void) { return (int)llama_max_devices() < 0; }\n"
    subprocess.run(
        ["cc", "-x", "c", "-", "-o", str(program), f"-L{where / 'bin'}", "-lllama", f"-Wl,-rpath,{where / 'bin'}"],
        input=main,
        text=True,
        check=True,
    )
    monkeypatch.delenv(binding.ENV_LLAMA_DIR, raising=False)
    monkeypatch.setenv(binding.ENV_TOOLS_DIR, str(tmp_path / "no-project-build"))
    assert build_of_program(program) == where
    assert binding.find_build(where).include_dirs == (source / "include", source / "ggml" / "include")


# --- the "no build" message of a pip install --------------------------------------------------


def test_no_build_in_the_checkout_says_make_setup():
    message = binding.no_build_message(binding.REPO_ROOT)
    assert "make setup" in message and "--llama-dir" in message and "\n" not in message


def test_no_build_outside_a_checkout_says_pip_install(tmp_path, monkeypatch):
    import importlib.util

    site = tmp_path / "site-packages"  # an installed featdiff: no Makefile above the package
    site.mkdir()
    monkeypatch.delenv(binding.ENV_LLAMA_DIR, raising=False)
    monkeypatch.setenv(binding.ENV_TOOLS_DIR, str(tmp_path / "no-project-build"))
    monkeypatch.setattr(binding, "REPO_ROOT", site)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(InputError) as e:
        binding.find_build(None)
    message = str(e.value)
    assert f"pip install {binding.PINNED_WHEEL}" in message and "--llama-dir" in message
    assert "make setup" not in message and "\n" not in message


# --- a full disk or a file-size limit ---------------------------------------------------------


def _featdiff_under_fsize_limit(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`featdiff ARGS` in a process whose files may grow to FSIZE_LIMIT bytes (`ulimit -f`)."""
    script = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_FSIZE, ({FSIZE_LIMIT}, resource.RLIM_INFINITY))
    """)
    return subprocess.run(
        [sys.executable, "-c", script + MAIN, *args], cwd=cwd, capture_output=True, text=True, timeout=RUN_S
    )


def _one_error_line(done: subprocess.CompletedProcess, output: str) -> None:
    lines = [line for line in done.stderr.splitlines() if line.startswith("featdiff: error:")]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and output in lines[0] and "ulimit -f" in lines[0], done.stderr
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr


def test_a_file_size_limit_on_a_fixture_is_exit_2_naming_the_file(tmp_path):
    done = _featdiff_under_fsize_limit(["fixture", "models"], tmp_path)
    _one_error_line(done, "models/target.gguf")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == []  # no partial, no lock left


def test_a_file_size_limit_on_compare_json_keeps_the_old_file(tmp_path):
    ref, run = synth.write(tmp_path / "ref.npz"), synth.write(tmp_path / "run.npz", side="run", noise=1e-7)
    (tmp_path / "f.json").write_text("the user's old findings\n")
    done = _featdiff_under_fsize_limit(["compare", str(ref), str(run), "--json", "f.json"], tmp_path)
    _one_error_line(done, "f.json")
    assert (tmp_path / "f.json").read_text() == "the user's old findings\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json", "ref.npz", "run.npz"]


def test_a_dump_writer_out_of_room_removes_its_partial_file(tmp_path):
    dump = tmp_path / "run.npz"
    dump.write_text("the user's old dump\n")
    script = textwrap.dedent(f"""
        import resource, signal, numpy as np
        from featdiff.dump.writer import DumpWriter, record_from_array
        from featdiff.core.errors import InputError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as featdiff's main sets it
        resource.setrlimit(resource.RLIMIT_FSIZE, ({FSIZE_LIMIT}, resource.RLIM_INFINITY))
        writer = DumpWriter("{dump}")
        try:
            writer.add(*record_from_array("k", "target", "prefill", 0, "x", 0, np.ones((64, 64), np.float32)))
        except InputError as e:
            print(e)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=RUN_S)
    assert done.stdout.startswith(f"{dump}: could not be written (File too large)"), done.stdout + done.stderr
    assert dump.read_text() == "the user's old dump\n" and [p.name for p in tmp_path.iterdir()] == ["run.npz"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_a_write_out_of_room_no_writer_named_is_exit_2_naming_its_file(monkeypatch, tmp_path, code):
    """An OSError out of room raised past the writers (a cache, a spool) is the user's, not a bug:
    main says so in one line, naming the file the system named. (Mocked: a full disk on demand.)"""
    import featdiff.diff

    def full(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(tmp_path / "cache.bin"))

    monkeypatch.setattr(featdiff.diff, "compare_dumps", full)
    for name in ("ref.npz", "run.npz"):
        (tmp_path / name).write_bytes(b"")
    result = CliRunner().invoke(app, ["compare", str(tmp_path / "ref.npz"), str(tmp_path / "run.npz")])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and line.startswith(f"featdiff: error: {tmp_path / 'cache.bin'}: could not be written")


# --- NaN/Inf dumps --------------------------------------------------------------------------------


def _poisoned(value: float, rows: tuple[int, ...]) -> synth.Mutation:
    def mutate(ev, name, a):
        a = np.array(a, dtype=np.float32, copy=True)
        view = a.reshape(a.shape[0], -1)  # (R, D)
        for r in rows:
            view[r % view.shape[0], :3] = value
        return a

    return mutate


@pytest.mark.parametrize(
    ("value", "rows"), [(np.nan, (0,)), (np.inf, (1, -1)), (-np.inf, (0,)), (np.inf, tuple(range(64)))]
)
def test_compare_of_nan_or_inf_dumps_prints_no_numpy_warning(tmp_path, value, rows):
    ref = synth.write(tmp_path / "ref.npz")
    run = synth.write(tmp_path / "run.npz", side="run", mutate=_poisoned(value, rows), noise=1e-7)
    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", MAIN, "compare", ref, run, "--json", tmp_path / "f.json"],
        capture_output=True,
        text=True,
        timeout=RUN_S,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "RuntimeWarning" not in done.stderr, done.stderr
    assert '"nonfinite"' in (tmp_path / "f.json").read_text()
