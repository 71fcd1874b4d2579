"""The commands the README and examples/ show run as written: the `sh` blocks of README.md and
examples/demo.sh (what `make demo` runs), with featdiff on PATH, in a scratch directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXIT_OK, EXIT_FINDINGS = 0, 1  # 1: error findings or an accept gap, which some examples show

# What README.md promises of each command its `sh` blocks show: (a pattern the command matches,
# the exit code, a text its output holds). Every command matches exactly one promise, so a new
# example needs its promise written here.
PROMISES = (
    (r"^featdiff fixture ", EXIT_OK, ""),
    (r"^featdiff check .*ci/trained/", EXIT_OK, "PASS: the wiring compares clean"),  # the trained pair passes
    (r"^featdiff probe .*out/trained/", EXIT_OK, "agree"),  # mean len 4.00 of 4, run = ref
    (r"^featdiff probe .*out/broken/", EXIT_FINDINGS, "GAP"),  # run 1.25, ref 4.00: GAP, exit 1
    (r"^featdiff capture ", EXIT_OK, ""),
    (r"^featdiff reference ", EXIT_OK, ""),
    (r"^featdiff report ", EXIT_FINDINGS, ""),  # `featdiff report` exits 1 (error findings)
)


def _promise(command: str) -> tuple[int, str]:
    """The exit code and the output text README.md promises for `command`."""
    found = [(code, text) for pattern, code, text in PROMISES if re.search(pattern, command, flags=re.S)]
    assert len(found) == 1, f"{command!r} matches {len(found)} promises: write its promise in PROMISES"
    return found[0]


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def _sh_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, flags=re.S)


@pytest.mark.slow  # each block is a whole workflow in a shell
@pytest.mark.parametrize("index", range(len(_sh_blocks((ROOT / "README.md").read_text()))))
def test_readme_sh_block_runs(index, tmp_path):
    block = _sh_blocks((ROOT / "README.md").read_text())[index]
    commands = [c for c in re.split(r"(?<!\\)\n", block) if c.strip()]
    for command in commands:
        code, text = _promise(command)
        result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=_env(), capture_output=True, text=True)
        assert result.returncode == code, (command, result.stdout[-2000:], result.stderr[-2000:])
        assert text in result.stdout, (command, text, result.stdout[-2000:])
        for written in re.findall(r"-o (\S+)", command):
            assert (tmp_path / written).exists(), (command, written)


@pytest.mark.tools  # the demo runs the patched llama-server
def test_demo_script_runs_end_to_end(tmp_path):
    result = subprocess.run(
        ["bash", str(ROOT / "examples" / "demo.sh")],
        cwd=tmp_path,
        env={**_env(), "DEMO_OUT": str(tmp_path / "demo")},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "layer_offset" in result.stdout and "GAP" in result.stdout
    for label in ("correct", "off-by-one"):
        assert (tmp_path / "demo" / label / "report.html").stat().st_size > 10_000


def test_demo_gives_its_first_verdict_before_building_the_tools():
    """`make demo` needs only the library for its in-process parts: the Makefile's demo target
    does not build the tools first, and demo.sh compares before it asks for the tools."""
    makefile = (ROOT / "Makefile").read_text()
    (demo_rule,) = re.findall(r"^demo:(.*)$", makefile, flags=re.M)
    assert "tools" not in demo_rule.split(), demo_rule
    script = (ROOT / "examples" / "demo.sh").read_text()
    tools = script.index("python -m featdiff.llama.tools)")  # the tools build, not `--library`
    assert script.index("featdiff compare") < tools < script.index('"$BIN/llama-server"')
