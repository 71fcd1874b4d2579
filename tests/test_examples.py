"""The commands README.md and the guides show run as written: the `sh` blocks of README.md and
docs/guide-*.md (those with `--exec` on featdiff's build of the llama.cpp programs), and
examples/demo.sh (what `make demo` runs), with featdiff on PATH, in a scratch directory. README's
other blocks name the test that runs their commands; every relative link of README.md and docs/
resolves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXIT_OK, EXIT_FINDINGS = 0, 1  # 1: error findings or an accept gap, which some examples show
RUN_DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("guide-*.md")))

# What the docs promise of each command their `sh` blocks show: (a pattern the command matches,
# the exit code, a text its output holds). Every command matches exactly one promise, so a new
# example needs its promise written here.
PROMISES = (
    (r"^featdiff fixture ", EXIT_OK, ""),
    (r"^featdiff check .*ci/trained/", EXIT_OK, "PASS: the wiring compares clean"),  # the trained pair passes
    (r"^featdiff check .*--run (my|srv)/", EXIT_OK, "PASS"),  # README: the trained pair's capture passes
    (r"^featdiff probe .*out/trained/", EXIT_OK, "agree"),  # mean len 4.00 of 4, run = ref
    (r"^featdiff probe .*out/broken/", EXIT_FINDINGS, "GAP"),  # run 1.25, ref 4.00: GAP, exit 1
    (r"^featdiff capture ", EXIT_OK, ""),
    (r"^featdiff reference ", EXIT_OK, ""),
    (r"^featdiff compare my/", EXIT_OK, ""),  # README's five commands: the trained pair compares clean
    (r"^featdiff report my/", EXIT_OK, ""),
    (r"^featdiff report triage/", EXIT_FINDINGS, ""),  # the worked triage: exits 1 (error findings)
)

# README's blocks that are not `sh` (set-up, install): each command line's start, and the test
# file (with a text it holds) that runs it; the block of the pipeline holds no command.
RUN_ELSEWHERE = {
    "make setup": ("Makefile", "test: setup"),  # every make target sets up first; .ci/run runs make test
    "make tools": ("Makefile", "test: setup lint browser vulkan tools"),
    "make demo": ("tests/test_examples.py", "def test_demo_script_runs_end_to_end"),
    "make test": (".ci/run", "make test"),
    "pip install torch": ("examples/ci/featdiff-check.yml", "torch==2.13.0 --index-url"),
    "pip wheel": ("tests/test_wheel.py", '"pip", "wheel"'),
    "cmake -B build": ("src/featdiff/llama/tools.py", "BUILD_SHARED_LIBS=ON"),
    "featdiff capture --llama-dir": ("tests/test_wheel.py", '"capture", "--llama-dir"'),
}
COMMAND_WORDS = ("make", "pip", "cmake", "featdiff")


def _promise(command: str) -> tuple[int, str]:
    """The exit code and the output text the docs promise for `command`."""
    found = [(code, text) for pattern, code, text in PROMISES if re.search(pattern, command, flags=re.S)]
    assert len(found) == 1, f"{command!r} matches {len(found)} promises: write its promise in PROMISES"
    return found[0]


def _env(bin_dir: Path | None = None) -> dict[str, str]:
    dirs = [str(Path(sys.executable).parent)] + ([str(bin_dir)] if bin_dir else [])
    return {**os.environ, "PATH": os.pathsep.join([*dirs, os.environ["PATH"]])}


def _sh_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, flags=re.S)


def _run_blocks(needs_tools: bool) -> list:
    """(doc, index) of each `sh` block of RUN_DOCS, those that run a program (`--exec`) or not."""
    return [
        pytest.param(doc, i, id=f"{doc}-{i}")
        for doc in RUN_DOCS
        for i, block in enumerate(_sh_blocks((ROOT / doc).read_text()))
        if ("--exec" in block) == needs_tools
    ]


def _run_block(doc: str, index: int, cwd: Path, env: dict[str, str]) -> None:
    block = _sh_blocks((ROOT / doc).read_text())[index]
    commands = [c for c in re.split(r"(?<!\\)\n", block) if c.strip()]
    for command in commands:
        code, text = _promise(command)
        result = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True)
        assert result.returncode == code, (command, result.stdout[-2000:], result.stderr[-2000:])
        assert text in result.stdout, (command, text, result.stdout[-2000:])
        for written in re.findall(r"-o (\S+)", command):
            assert (cwd / written).exists(), (command, written)


@pytest.mark.slow  # each block is a whole workflow in a shell
@pytest.mark.parametrize(("doc", "index"), _run_blocks(needs_tools=False))
def test_doc_sh_block_runs(doc, index, tmp_path):
    _run_block(doc, index, tmp_path, _env())


@pytest.mark.slow
@pytest.mark.parametrize(("doc", "index"), _run_blocks(needs_tools=True))
def test_doc_sh_block_around_a_program_runs(doc, index, tools, tmp_path):
    """A block that runs llama-speculative-simple or llama-server: featdiff's build of them on PATH."""
    _run_block(doc, index, tmp_path, _env(tools.bin_dir))


def test_readme_shows_blocks_that_run():
    """README runs its examples: the five commands and llama-server in `sh` blocks here, the
    set-up's commands in the tests RUN_ELSEWHERE names."""
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and len(_sh_blocks(readme)) >= 2
    others = re.findall(r"```\n(.*?)```", readme, flags=re.S)  # the blocks that are not `sh`
    lines = [line.split("#")[0].strip() for block in others for line in block.splitlines()]
    commands = [line for line in lines if line.split(" ")[0] in COMMAND_WORDS]
    assert commands, "README shows no set-up command"
    for command in commands:
        where = [RUN_ELSEWHERE[start] for start in RUN_ELSEWHERE if command.startswith(start)]
        assert len(where) == 1, f"README's {command!r}: name the test that runs it in RUN_ELSEWHERE"
        path, text = where[0]
        assert text in (ROOT / path).read_text(), (command, path, text)


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_resolve(doc):
    """Every relative link (and image) of README.md and docs/*.md names a file that exists."""
    text = re.sub(r"```.*?```", "", (ROOT / doc).read_text(), flags=re.S)  # links in code are not links
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)]
    local = [t for t in targets if t and not re.match(r"[a-z]+:", t)]
    missing = [t for t in local if not ((ROOT / doc).parent / t).exists()]
    assert not missing, f"{doc}: links to missing files {missing}"


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
