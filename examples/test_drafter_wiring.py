"""The drafter wiring test of a llama.cpp fork: copy this file into the fork's tests, point it at
the fork's drafter fixture, and `pytest` fails when the drafter is wired wrong or accepts less
than the trained reference does (featdiff's pytest plugin; `pip install featdiff` registers it).

    FEATDIFF_TARGET=T.gguf FEATDIFF_DRAFT=D.gguf FEATDIFF_REF_MODEL=D-hf \\
    FEATDIFF_LLAMA_DIR=. FEATDIFF_SERVER=build/bin/llama-server pytest test_drafter_wiring.py

* FEATDIFF_TARGET, FEATDIFF_DRAFT: the GGUF pair the fork's build loads (required; the tests
  skip without them).
* FEATDIFF_REF_MODEL: the trained checkpoint (Hugging Face directory, DFlash layout) the export
  was made from; without it the reference runs the same GGUF and only the build is tested.
* FEATDIFF_PROMPTS: one prompt per line (`tokens: 1,2,3` for ids); default: featdiff's own.
* FEATDIFF_LLAMA_DIR: the fork's checkout with its shared build in DIR/build (in-process run).
* FEATDIFF_SERVER: the fork's llama-server; its test skips without it.
* FEATDIFF_MIN_ACCEPT: the least accept rate (accepted / drafted) the run must reach.

Each test keeps its dumps and the HTML report in its pytest tmp_path; a failure prints the
findings, the accept figures and the report's path.
"""

from __future__ import annotations

import os

import pytest

from featdiff.pytest_plugin import assert_wired

TARGET = os.environ.get("FEATDIFF_TARGET")
DRAFT = os.environ.get("FEATDIFF_DRAFT")
REF_MODEL = os.environ.get("FEATDIFF_REF_MODEL")
PROMPTS = os.environ.get("FEATDIFF_PROMPTS")
LLAMA_DIR = os.environ.get("FEATDIFF_LLAMA_DIR")
SERVER = os.environ.get("FEATDIFF_SERVER")
MIN_ACCEPT = float(os.environ["FEATDIFF_MIN_ACCEPT"]) if os.environ.get("FEATDIFF_MIN_ACCEPT") else None
ROUNDS = 3  # per prompt: enough blocks for the accept margin, few enough for a quick test
SERVER_ARGS = ["--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-c", "256", "-t", "2", "-td", "2"]

pytestmark = pytest.mark.skipif(
    not (TARGET and DRAFT), reason="set FEATDIFF_TARGET and FEATDIFF_DRAFT to the drafter fixture"
)


def test_drafter_is_wired_in_process(featdiff_check):
    result = featdiff_check(
        TARGET, DRAFT, ref_model=REF_MODEL, prompts=PROMPTS, rounds=ROUNDS, llama_dir=LLAMA_DIR, min_accept=MIN_ACCEPT
    )
    assert_wired(result)


@pytest.mark.skipif(not SERVER, reason="set FEATDIFF_SERVER to the fork's llama-server")
def test_drafter_is_wired_in_llama_server(featdiff_check):
    command = [SERVER, "-m", TARGET, "-md", DRAFT, *SERVER_ARGS]
    result = featdiff_check(
        TARGET, DRAFT, ref_model=REF_MODEL, prompts=PROMPTS, command=command, llama_dir=LLAMA_DIR, min_accept=MIN_ACCEPT
    )
    assert_wired(result)
