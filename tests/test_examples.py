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
EXIT_FINDINGS = 1  # compare/report/probe: error findings or an accept gap, which the examples show


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def _sh_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("index", range(len(_sh_blocks((ROOT / "README.md").read_text()))))
def test_readme_sh_block_runs(index, tmp_path):
    block = _sh_blocks((ROOT / "README.md").read_text())[index]
    commands = [c for c in re.split(r"(?<!\\)\n", block) if c.strip()]
    for command in commands:
        result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=_env(), capture_output=True, text=True)
        assert result.returncode in (0, EXIT_FINDINGS), (command, result.stderr[-2000:])
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
