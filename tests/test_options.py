"""llama.cpp run options as featdiff reads them: strictly for an in-process capture, leniently
from a program's command line; an in-process run's threads."""

from __future__ import annotations

import os

import pytest

from featdiff.core.errors import InputError
from featdiff.dump.manifest import CacheTypes
from featdiff.llama.options import (
    MAX_THREADS,
    THREADS_ENV,
    RunOptions,
    options_of_command,
    parse_run_options,
    run_threads,
)


def test_in_process_options_are_read_as_llama_cpp_spells_them():
    o = parse_run_options(["-ctk", "Q8_0", "--cache-type-v", "q8_0", "-fa", "on", "-ngl", "0", "-t", "2", "-c", "512"])
    assert o.kv["target"] == CacheTypes("q8_0", "q8_0") and o.kv["draft"] == CacheTypes()
    assert (o.flash_attn, o.n_gpu_layers, o.threads, o.n_ctx) == ("on", 0, 2, 512)
    assert parse_run_options([]) == RunOptions()
    assert parse_run_options(["-ub", "4"]).n_ubatch == 4 and parse_run_options([]).n_ubatch is None


@pytest.mark.parametrize(
    "args, says",
    [
        (["--bogus", "1"], "--bogus: not a featdiff capture option"),
        (["-ctk"], "-ctk: expects a value"),
        (["-ctk", "q3_k"], "not a KV cache type"),
        (["-fa", "yes"], "-fa yes: expected one of on, off, auto"),
        (["-t", "0"], "-t 0: expected an integer >= 1"),
        (["-ngl", "many"], "-ngl many"),
        (["-ub", "0"], "-ub 0: expected an integer >= 1"),
    ],
)
def test_bad_in_process_options_are_refused(args, says):
    with pytest.raises(InputError, match=says):
        parse_run_options(args)


def test_a_programs_options_come_from_its_last_flags_then_its_environment():
    o = options_of_command(["llama-server", "-m", "t.gguf", "-fa", "off", "--other", "x", "-ngl", "99", "-ngl", "12"],
                           {"LLAMA_ARG_CACHE_TYPE_K": "q4_0"})  # fmt: skip
    assert (o.flash_attn, o.n_gpu_layers, o.kv["target"].k) == ("off", 12, "q4_0")
    assert o.build_json()["run_options"]["n_gpu_layers"] == 12


def test_a_programs_values_featdiff_cannot_read_are_not_its_options():
    o = options_of_command(["bash", "-c", "llama-server -m t.gguf", "-ctk", "q8_0", "-t", "lots"], {})
    assert (o.n_ctx, o.threads, o.kv["target"].k) == (None, None, "q8_0")


def test_a_cache_type_the_model_cannot_take_is_one_line_and_leaves_no_spool(fixture_models, tmp_path):
    """q8_0 stores K in blocks of 32; the tiny fixture's heads are 16 wide: llama.cpp refuses the
    context, featdiff says which options it was given and leaves nothing behind."""
    from typer.testing import CliRunner

    from featdiff.cli import app

    d = fixture_models("clean")
    args = ["capture", "--target", d / "target.gguf", "--model", d / "draft.gguf", "--tokens", "1,2,3", "-o",
            tmp_path / "run.npz", "-ctk", "q8_0"]  # fmt: skip
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 2 and "K/V cache types q8_0/f16" in result.output
    assert list(tmp_path.iterdir()) == []


def test_the_default_build_is_the_projects_own(monkeypatch):
    from featdiff.llama import binding

    monkeypatch.delenv(binding.ENV_LLAMA_DIR, raising=False)
    build = binding.find_build(None)
    assert build.kind == "project" and build.root == binding.project_tree().resolve()


def test_no_build_at_all_is_one_line_naming_make_setup(monkeypatch, tmp_path):
    import importlib.util

    from featdiff.core.errors import InputError
    from featdiff.llama import binding

    monkeypatch.delenv(binding.ENV_LLAMA_DIR, raising=False)
    monkeypatch.setenv(binding.ENV_TOOLS_DIR, str(tmp_path))  # no project build there
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(InputError) as e:
        binding.find_build(None)
    assert "\n" not in str(e.value) and "make setup" in str(e.value) and str(tmp_path) in str(e.value)


def test_an_in_process_runs_threads_are_its_t_else_llama_arg_threads_else_the_cores():
    told = parse_run_options(["-t", "3"])
    assert run_threads(told, {THREADS_ENV: "1"}) == 3  # the command line wins, as in llama.cpp's programs
    assert run_threads(parse_run_options([]), {THREADS_ENV: "1"}) == 1
    assert run_threads(parse_run_options([]), {}) == min(os.cpu_count() or 1, MAX_THREADS)
    assert run_threads(parse_run_options([]), {THREADS_ENV: "0"}) == min(os.cpu_count() or 1, MAX_THREADS)
    with pytest.raises(InputError, match=f"{THREADS_ENV}=lots: expected a thread count"):
        run_threads(parse_run_options([]), {THREADS_ENV: "lots"})


def test_a_programs_threads_from_its_environment_are_recorded():
    assert options_of_command(["llama-server", "-m", "t.gguf"], {THREADS_ENV: "1"}).threads == 1
    assert options_of_command(["llama-server", "-t", "2"], {THREADS_ENV: "1"}).threads == 2
    assert options_of_command(["llama-server"], {THREADS_ENV: "lots"}).threads is None  # the program's to judge
