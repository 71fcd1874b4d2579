"""A sampled run around llama-speculative-simple (issue 45): `--temp 0.8 -s 42` on the DFlash fixture
pair. The dump records the sampler its flags set; compare against `reference --follow` of it is
clean (each sampled verify token lies in the chain's support of the reference's logits), and the
same dump read as greedy (its samplers dropped) gives the false FAIL the issue reported: a
divergence where the run chose a token that is not the reference's argmax. Real build, real models."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from test_server_clients import _featdiff

from featdiff.dump.reader import read_dump
from featdiff.dump.writer import DumpWriter
from featdiff.programs import exec as exec_capture

from test_exec import RUN_TIMEOUT_S, _command

pytestmark = pytest.mark.slow

SAMPLED = ["--temp", "0.8", "-s", "42", "-n", "24"]  # after test_exec's "--temp 0": the last flag wins


def _compared(ref, run) -> dict:
    done = _featdiff("compare", ref, run, "--json", "-")
    assert done.returncode in (0, 1), done.stderr[-3000:]
    return json.loads(done.stdout)


def test_a_sampled_program_run_compares_clean_and_reads_as_greedy_it_would_not(tools, fixture_models, tmp_path):
    models = fixture_models("clean")
    command = [*_command(tools, "llama-speculative-simple", models), *SAMPLED]
    run = exec_capture.capture_exec(command, tmp_path / "run.npz", timeout_s=RUN_TIMEOUT_S)
    with read_dump(run) as dump:
        m = dump.manifest
        (s,) = m.samplers
        assert (s.source, s.temperature, s.seed, s.top_k) == ("command_line", 0.8, 42, 40)
        greedy = DumpWriter(tmp_path / "greedy.npz")
        for r in dump.records():
            greedy.add(r, np.array(dump.array(r)))
        as_greedy = greedy.close(replace(m, records=(), samplers=()))
    ref = tmp_path / "ref.npz"
    made = _featdiff(
        "reference", "--target", models / "target.gguf", "--model", models / "draft.gguf", "--follow", run, "-o", ref
    )
    assert made.returncode == 0, made.stderr[-3000:]
    result = _compared(ref, run)
    assert result["ok"], [f["message"] for f in result["findings"] if f["severity"] == "error"]
    wrong = _compared(ref, as_greedy)
    errors = [f for f in wrong["findings"] if f["severity"] == "error"]
    assert not wrong["ok"] and errors[0]["kind"] == "divergence" and "argmax" in errors[0]["message"]
