"""A graph input read through a view, a reshape, a transpose or any other op is recorded under its
own name, as one read by a matrix multiplication is (issue 42 item 4). Patch
0010-inputs-through-views.patch makes the pinned graphs read their inputs so under
`FEATDIFF_FAULT=features-through-view` (not a fault: the values are the same): the DFlash family's
inject graph reads `inp_target_features` through a 2-D view, EAGLE3's encoder reads `inp_embd`
through a transpose. Each run must give the same records, with the same values, as the plain graph:
in-process, around `llama-speculative-simple`, and on the Vulkan device (where the device's
consumer reads the scheduler's copy of the input)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from test_device import device_capture

from families import FAULT_VAR
from featdiff.core import names
from featdiff.diff import compare_dumps
from featdiff.driver.capture import capture
from featdiff.dump.reader import read_dump
from featdiff.programs import exec as exec_capture
from featdiff.torchref.kind import reference

from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS

THROUGH_VIEW = "features-through-view"  # patches/llama.cpp/0010-inputs-through-views.patch
RUN_TIMEOUT_S = 120

pytestmark = pytest.mark.slow  # the pinned converter makes the EAGLE3 pair (cached per machine)


def _records(path: Path, name: str) -> tuple[list[tuple], list[np.ndarray]]:
    """Every record of the dump (eval, role, phase, name, occurrence, shape), and the arrays of `name`."""
    with read_dump(path) as dump:
        keys = sorted((r.eval, r.role, r.phase, r.name, r.occurrence, r.shape) for r in dump.manifest.records)
        arrays = [dump.array(r) for r in dump.manifest.records if r.name == name]
    return keys, arrays


def _assert_same(plain: Path, viewed: Path, name: str) -> None:
    keys, arrays = _records(plain, name)
    keys_v, arrays_v = _records(viewed, name)
    assert arrays, f"the plain run recorded no {name}"
    assert keys_v == keys, sorted(set(keys) ^ set(keys_v))
    assert all(np.array_equal(a, b) for a, b in zip(arrays, arrays_v, strict=True))


def test_in_process_the_features_read_through_a_view_are_recorded(fixture_models, tmp_path, monkeypatch):
    d = fixture_models("clean")

    def run(out: Path) -> Path:
        return capture(d / "target.gguf", d / "draft.gguf", out, tokens=DEFAULT_TOKENS, rounds=DEFAULT_ROUNDS)

    plain = run(tmp_path / "plain.npz")
    monkeypatch.setenv(FAULT_VAR, THROUGH_VIEW)  # read by the graph as it is built (0010)
    viewed = run(tmp_path / "viewed.npz")
    _assert_same(plain, viewed, names.INP_TARGET_FEATURES)


def test_around_a_program_eagle3s_input_read_through_a_transpose_is_recorded(
    tools, eagle3_pairs, tmp_path, monkeypatch
):
    d = eagle3_pairs("eagle3")
    cmd = [str(tools.program("llama-speculative-simple")), "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf")]
    cmd += ["--spec-type", "draft-eagle3", "--spec-draft-n-max", "3", "--spec-draft-p-min", "0", "-c", "256"]
    cmd += ["-t", "1", "-td", "1", "-p", "The quick brown fox", "-n", "16", "--temp", "0"]
    plain = exec_capture.capture_exec(cmd, tmp_path / "plain.npz", timeout_s=RUN_TIMEOUT_S)
    monkeypatch.setenv(FAULT_VAR, THROUGH_VIEW)
    viewed = exec_capture.capture_exec(cmd, tmp_path / "viewed.npz", timeout_s=RUN_TIMEOUT_S)
    monkeypatch.delenv(FAULT_VAR)
    _assert_same(plain, viewed, names.ENC_INP_EMBD)
    ref = reference(
        d / "target.gguf", d / "draft.gguf", tmp_path / "ref.npz", prompt=None, tokens=None, rounds=0,
        dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None, follow=viewed,
    )  # fmt: skip
    comparison = compare_dumps(ref, viewed)
    assert comparison.ok, [f.message for f in comparison.findings if f.severity == "error"]


def test_on_the_device_the_copy_of_an_input_read_through_a_view_is_recorded(vulkan, fixture_models, tmp_path):
    d = fixture_models("clean")
    placement = ("-ngl", "99", "-ngld", "99")  # the drafter's consumer of the input on the device
    plain = device_capture(vulkan, d, tmp_path / "plain.npz", *placement)
    env = {**os.environ, **vulkan.backend.env, FAULT_VAR: THROUGH_VIEW}
    viewed = device_capture(vulkan, d, tmp_path / "viewed.npz", *placement, env=env)
    _assert_same(plain, viewed, names.INP_TARGET_FEATURES)
