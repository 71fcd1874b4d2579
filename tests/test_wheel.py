"""A wheel of featdiff captures: built from the checkout, installed into a fresh virtual env
outside it, it compiles its C sources (package data) against the build it is pointed at (the
project's build of the pinned llama.cpp, as a user's own) and captures the fixture pair, with no
checkout on its path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from featdiff.dump.reader import read_dump
from featdiff.llama.binding import find_build

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600
pytestmark = pytest.mark.slow  # builds and installs a wheel: not part of `make test-fast`


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The `featdiff` console script of a fresh env holding only the wheel; its other
    dependencies come from this env's site-packages (a `.pth` line: no network, no rebuild)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"  # a copy: setuptools writes build/ and egg-info into the tree it builds
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(work / "dist")], check=True, timeout=TIMEOUT_S, cwd=work)  # fmt: skip
    (wheel,) = (work / "dist").glob("featdiff-*.whl")
    env = work / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=TIMEOUT_S)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "--no-deps",
                    "-q", str(wheel)], check=True, timeout=TIMEOUT_S)  # fmt: skip
    site = Path(subprocess.check_output([env / "bin" / "python", "-c", "import site; print(site.getsitepackages()[0])"],
                                        text=True).strip())  # fmt: skip
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # numpy, torch, ...
    return env / "bin" / "featdiff"


def test_the_installed_wheel_holds_its_c_sources_and_captures(installed, fixture_models, tmp_path):
    python = installed.with_name("python")
    where = subprocess.check_output([python, "-c", "import featdiff.llama.binding as b; print(b.NATIVE_DIR)"],
                                    text=True, cwd=tmp_path).strip()  # fmt: skip
    assert not Path(where).is_relative_to(REPO) and (Path(where) / "featdiff_shim.c").is_file(), where
    d = fixture_models("clean")
    env = {**os.environ, "FEATDIFF_CACHE": str(tmp_path / "cache")}  # compile the binding from the wheel's sources
    out = tmp_path / "run.npz"
    build = find_build(None)  # outside a checkout, a user names their build
    done = subprocess.run([installed, "capture", "--llama-dir", build.root, "--target", d / "target.gguf",
                           "--model", d / "draft.gguf", "--tokens", "1,2,3,4", "--rounds", "1", "-o", out],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    with read_dump(out) as dump:
        assert any(r.name == "inp_target_features" for r in dump.manifest.records)
        assert dump.manifest.build["library"] == str(build.libllama)
    assert any((tmp_path / "cache" / "binding").iterdir())
