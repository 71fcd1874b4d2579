"""The Python API cannot drift from the command line: every option of a stage command is a
parameter of its featdiff.api function with the command's default (issue 25)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import typer.main
from typer.core import TyperCommand, TyperGroup

from featdiff import api
from featdiff.cli import app

STAGES = ("capture", "reference", "compare", "report", "check")
CLI_SPELLINGS = {"exec_": "command"}  # `--exec -- PROGRAM ...` is `command=[PROGRAM, ...]`: None, no program
CLI_ONLY = {
    ("compare", "verbose"),  # prints the per-record table; the API returns the Comparison itself
    ("reference", "verbose"),  # per-round detail on stderr: the CLI's logging; an API caller sets its own
    ("check", "verbose"),
}
API_ONLY = {
    ("capture", "options"),  # llama.cpp's run options, on the command line after featdiff's (-ctk, -fa, ...)
    ("report", "comparison"),  # a Comparison already made; the command compares first
}


def _drift(stage: str, command: TyperCommand, function: Callable) -> list[str]:
    """How `function`'s parameters differ from `command`'s options, one line each (none: in step)."""
    params = inspect.signature(function).parameters
    drift = []
    for option in command.params:
        if (stage, option.name) in CLI_ONLY:
            continue
        name = CLI_SPELLINGS.get(option.name, option.name)
        if name not in params:
            drift.append(f"{stage}: {option.opts[0]} has no parameter {name}")
            continue
        default = params[name].default
        if option.required or default is inspect.Parameter.empty:
            # what a call names (its files) is positional, with no default; the command may still
            # take None for it (capture's --target and --model, around a program)
            positional = params[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
            if default is not inspect.Parameter.empty or not positional or option.default is not None:
                drift.append(f"{stage}: {option.opts[0]} required, {name} = {default!r}")
        elif option.name in CLI_SPELLINGS:
            if (option.default, default) != (False, None):
                drift.append(f"{stage}: {option.opts[0]} defaults to {option.default!r}, {name} to {default!r}")
        elif default != option.default or type(default) is not type(option.default):
            drift.append(f"{stage}: {option.opts[0]} defaults to {option.default!r}, {name} to {default!r}")
    cli_names = {CLI_SPELLINGS.get(p.name, p.name) for p in command.params}
    drift += [f"{stage}: {n} is not an option of the command" for n in params if n not in cli_names and (stage, n) not in API_ONLY]  # fmt: skip
    return drift


@pytest.fixture(scope="module")
def commands() -> dict[str, TyperCommand]:
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    return {name: group.commands[name] for name in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_every_cli_option_is_an_api_parameter_with_the_same_default(commands, stage):
    assert _drift(stage, commands[stage], getattr(api, stage)) == []


def test_a_default_or_an_option_that_drifted_is_found(commands):
    def reference(target, model, output, *, dtype="float16", **rest):  # no --follow, another --dtype
        raise AssertionError

    def compare(ref, run, name_map=None, *, json_out=None, report=None, extra=0):
        raise AssertionError

    drift = _drift("reference", commands["reference"], reference)
    assert "reference: --dtype defaults to 'float32', dtype to 'float16'" in drift
    assert "reference: --follow has no parameter follow" in drift
    assert _drift("compare", commands["compare"], compare) == ["compare: extra is not an option of the command"]


def test_featdiffs_stage_names_are_the_api_functions():
    """`featdiff.compare(...)` and the others are featdiff.api's functions, plain ones (no module
    rewriting), and stay so after every stage package is imported."""
    import featdiff.diff.comparison  # noqa: F401 - each stage package, imported under its own name
    import featdiff.html.writer  # noqa: F401
    import featdiff.torchref.dflash.run  # noqa: F401

    pass
    import featdiff.verdict.result  # noqa: F401

    for stage in STAGES:
        assert getattr(featdiff, stage) is getattr(api, stage), stage
    assert type(featdiff).__name__ == "module" and type(featdiff.diff).__name__ == "module"
