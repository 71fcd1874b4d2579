"""featdiff: find which tensor a llama.cpp drafter port gets wrong, and why.

Pipeline: capture (llama/) and reference/ write dumps (dump.py); compare/ reads two dumps and
names the first divergence; report/ draws it; check.py runs them all for one CI verdict.

The Python API, one call per stage, the same functions the command line calls:

    featdiff.capture(target, model, output, ...) -> Path        the run dump (llama/capture.py)
    featdiff.reference(target, model, output, ...) -> Path      the reference dump (reference/run.py)
    featdiff.compare(ref, run, name_map=None) -> Comparison     findings (compare/)
    featdiff.report(ref, run, output, ...) -> Path              the HTML page (report/)
    featdiff.check(target, model, ...) -> CheckResult           all of them and the accept probe (check.py)

Everything is imported on first use, so `import featdiff` loads neither torch nor llama.cpp.
`compare`, `reference`, `report` and `check` are also the names of featdiff's subpackages, and
Python binds an imported submodule to the package attribute of its name (over any function of
that name); so those four submodules are made callable instead: `featdiff.compare(...)` calls the
stage whether or not `featdiff.compare` was imported, and `from featdiff.compare import ...` works.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

from featdiff.version import VERSION as __version__  # noqa: F401 - the public spelling of the version

# submodule -> the function of this module that calling it runs
_CALLABLE_SUBMODULES = {"compare": "_compare", "reference": "_reference", "report": "_report", "check": "_check"}


def capture(
    target: Path | None, model: Path | None, output: Path, *, command: list[str] | None = None, **options: Any
) -> Path:
    """Capture a run dump from a real llama.cpp build; return its path.

    In-process: `options` are `featdiff.llama.capture.capture`'s (`prompt` or `tokens`, `rounds`,
    `filters`, `llama_dir`, `draft_max`, `p_min`). With `command` (a llama.cpp program's argv, as
    after `capture --exec --`): `filters`, `llama_dir`, `prompt` / `tokens` (llama-server's request).
    """
    from featdiff.llama import capture as capture_mod

    if command is not None:
        return capture_mod.capture_exec(
            list(command), Path(output), options.pop("filters", None), options.pop("llama_dir", None), **options
        )
    return capture_mod.capture(target, model, Path(output), **options)


def _reference(
    target: Path,
    model: Path,
    output: Path,
    *,
    prompt: str | None = None,
    tokens: str | None = None,
    rounds: int = 2,
    dtype: str = "float32",
    device: str = "cpu",
    kv_dtype: str = "f16",
    llama_dir: Path | None = None,
    block: int | None = None,
    run: Path | None = None,
    p_min: float | None = None,
) -> Path:
    """Compute the reference dump in PyTorch (`featdiff reference`'s defaults); return its path."""
    from featdiff.reference.run import reference

    return reference(
        Path(target),
        Path(model),
        Path(output),
        prompt=prompt,
        tokens=tokens,
        rounds=rounds,
        dtype=dtype,
        device=device,
        kv_dtype=kv_dtype,
        llama_dir=llama_dir,
        block=block,
        run=run,
        p_min=p_min,
    )


def _compare(ref: Path, run: Path, name_map: Path | None = None):
    """Compare two dumps; return the `Comparison` (findings, metrics, coverage)."""
    from featdiff.compare.comparison import compare_dumps

    return compare_dumps(Path(ref), Path(run), name_map)


def _report(
    ref: Path, run: Path, output: Path, *, comparison=None, png_dir: Path | None = None, name_map: Path | None = None
) -> Path:
    """Write the HTML triage report of two dumps (compared first unless `comparison` is given)."""
    from featdiff.report.writer import write_report

    comparison = comparison if comparison is not None else _compare(ref, run, name_map)
    return write_report(Path(ref), Path(run), Path(output), comparison=comparison, png_dir=png_dir, name_map=name_map)


def _check(target: Path, model: Path, **options: Any):
    """Capture, reference, compare and probe accept; return the `CheckResult` (featdiff.check.check)."""
    from featdiff.check import check

    return check(Path(target), Path(model), **options)


class _CallableSubmodule(types.ModuleType):
    """A featdiff submodule that, called, runs its stage's function of this package."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        function = _CALLABLE_SUBMODULES[self.__name__.rpartition(".")[2]]
        return getattr(sys.modules[__name__], function)(*args, **kwargs)


class _Package(types.ModuleType):
    """This package: its stage submodules become callable as the import system binds them here."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CALLABLE_SUBMODULES and type(value) is types.ModuleType:
            value.__class__ = _CallableSubmodule
        super().__setattr__(name, value)


def __getattr__(name: str) -> Any:
    """`featdiff.compare` and the like before their submodule is imported: import it (made callable)."""
    if name in _CALLABLE_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


sys.modules[__name__].__class__ = _Package
