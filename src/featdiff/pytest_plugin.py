"""featdiff's pytest plugin (entry point `pytest11: featdiff`), so a llama.cpp fork tests its
drafter wiring with one test file (examples/test_drafter_wiring.py):

    def test_drafter_is_wired(featdiff_check):
        assert_wired(featdiff_check("T.gguf", "D.gguf", ref_model="D-hf/", llama_dir="llama.cpp"))

* fixture `featdiff_check`: a callable `(target, draft, **options) -> CheckResult`, `options`
  those of `featdiff.verdict.check`; the dumps and the HTML report go to the test's `tmp_path`
  (`featdiff/` and `featdiff-report.html`) unless the options name other places.
* `assert_wired(result)`: fails the test with the check's findings, accept figures and the report
  path when the verdict is not a pass.

Loaded into every pytest run of an environment featdiff is installed in, so it imports nothing
of featdiff's until a test asks for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

KEEP_DIR = "featdiff"  # under the test's tmp_path: the run and reference dumps
REPORT_FILE = "featdiff-report.html"  # under the test's tmp_path


@pytest.fixture
def featdiff_check(tmp_path: Path) -> Callable[..., Any]:
    """`featdiff_check(target, draft, **options) -> CheckResult`: featdiff check, in this test's tmp_path."""
    return functools.partial(_check_in, tmp_path)


def _check_in(tmp_path: Path, target: str | Path, draft: str | Path, **options: Any) -> Any:
    from featdiff.verdict.run import check

    options.setdefault("keep", tmp_path / KEEP_DIR)
    options.setdefault("report", tmp_path / REPORT_FILE)
    return check(Path(target), Path(draft), **options)


def assert_wired(result: Any) -> None:
    """Fail (AssertionError) unless `result` (a CheckResult) passed; the message is the check's text."""
    __tracebackhide__ = True  # pytest shows the caller's line, not this one
    if not result.ok:
        from featdiff.verdict.render import render_text

        raise AssertionError(f"featdiff check failed: {'; '.join(result.reasons)}\n\n{render_text(result)}")
