"""Capture on a device backend: the pinned tree built with a GPU backend of ggml (tests/llama/
conftest.py `device`: Vulkan on Mesa's llvmpipe, a Vulkan device that computes on the CPU, in
`make test`; CUDA in `make test-cuda` where a GPU is present). With layers offloaded, ggml's
scheduler hands each device consumer of a graph input a copy of it (`Vulkan0#inp_target_features#0`);
the capture records the input under its own name from that copy, so every placement, CPU, partial,
whole, and target and drafter apart, gives the CPU build's records and compares clean against the
reference.

Each capture runs in a process of its own: this one has the pinned CPU libllama loaded, and the
builds' libraries share their sonames.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from families import FAULT_VAR
from featdiff.cli import app
from featdiff.core.names import BACKEND_HOST, MTP_H_INPUT
from featdiff.diff import compare_dumps
from featdiff.dump.reader import read_dump
from featdiff.factory.fixtures import PROMPTS_FILE
from featdiff.llama.extra_builds import VULKAN, VULKAN_UNFUSED, device_program_env
from featdiff.torchref.kind import reference

from devices import PLACEMENTS, RUN_TIMEOUT_S, Device
from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS, reference_of

pytestmark = pytest.mark.slow  # builds the device llama.cpp: not part of `make test-fast`


def device_capture(
    device: Device,
    d: Path,
    out: Path,
    *options: str,
    filters: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    model: str = "draft.gguf",
) -> Path:
    """`featdiff capture` of the fixture pair in `d` (its drafter `model`) on the device build (in
    `env`, default this process's with the device's settings)."""
    flags = [f for g in filters for f in ("--filter", g)]
    done = subprocess.run([sys.executable, "-c", "from featdiff.cli import main; main()", "capture", "--llama-dir",
                           str(device.build.root), "--target", str(d / "target.gguf"), "--model", str(d / model),
                           "--tokens", DEFAULT_TOKENS, "--rounds", str(DEFAULT_ROUNDS), *flags, "-o", str(out), *options],
                          capture_output=True, text=True, errors="replace", timeout=RUN_TIMEOUT_S,
                          env=env or {**os.environ, **device.backend.env})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _record_set(dump_path: Path) -> list[tuple]:
    with read_dump(dump_path) as dump:
        return sorted((r.eval, r.role, r.phase, r.name, r.occurrence, r.shape) for r in dump.manifest.records)


def _backends(dump_path: Path) -> dict[tuple[str, str], set[str | None]]:
    """(role, name) -> the backends its records came from."""
    found: dict[tuple[str, str], set[str | None]] = {}
    with read_dump(dump_path) as dump:
        for r in dump.manifest.records:
            found.setdefault((r.role, r.name), set()).add(r.backend)
    return found


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_every_placement_records_the_cpu_builds_tensors_and_compares_clean(
    placement, device, fixture_models, captured, tmp_path
):
    d = fixture_models("clean")
    run = device_capture(device, d, tmp_path / "run.npz", *PLACEMENTS[placement])
    assert _record_set(run) == _record_set(captured("clean"))
    ref = reference_of(d / "target.gguf", d / "draft-hf", tmp_path / "ref.npz", follow=run)
    comparison = compare_dumps(ref, run)
    assert comparison.ok, [f.message for f in comparison.findings]
    cov = comparison.coverage
    assert cov.pairs > 0 and not cov.unexpected and cov.run_only == 0, comparison.coverage.skipped_phrase()
    # judged with the device's bound wherever a record came from it (diff/tolerance.py REL_device.name)
    assert comparison.types["devices"] == ([] if placement == "cpu" else [device.name])


def test_records_say_which_backend_they_came_from(device, fixture_models, tmp_path):
    d = fixture_models("clean")
    on_device = _backends(device_capture(device, d, tmp_path / "device.npz", *PLACEMENTS["device"]))
    # the drafter's feature input is read from the scheduler's copy on the device, and its layers
    # computed there; the tapped target layer inputs too; the token lookup stays on the CPU
    # (llama.cpp keeps the input layer's weights in host memory)
    assert on_device[("draft", "inp_target_features")] == {device.name}
    assert on_device[("draft", "l_out-0")] == {device.name}
    assert on_device[("target", "l_out-1")] == {device.name}
    assert on_device[("draft", "draft_logits")] == {None}  # read back through the API: no buffer
    on_cpu = _backends(device_capture(device, d, tmp_path / "cpu.npz", *PLACEMENTS["cpu"]))
    assert {b for (role, name), found in on_cpu.items() if name != "draft_logits" for b in found} == {BACKEND_HOST}


@pytest.fixture(scope="session")
def every_node_on_cpu(device, fixture_models, tmp_path_factory) -> Path:
    """The clean pair captured on the device build's CPU with every named tensor kept."""
    out = tmp_path_factory.mktemp(f"{device.backend.name}-cpu") / "run.npz"
    return device_capture(device, fixture_models("clean"), out, *PLACEMENTS["cpu"], filters=("*",))


# every named tensor, not only the wiring: a node copied between backends (a layer's output at the
# boundary of a partial offload, `Vulkan0#l_out-2#0`) is recorded once, as the node; an input
# under its own name; no source is listed under a copy's name
@pytest.mark.parametrize("placement", ["device", "partial", "target-on-device"])
def test_every_tensor_is_recorded_once_under_its_own_name_wherever_it_ran(
    placement, device, fixture_models, every_node_on_cpu, tmp_path
):
    d = fixture_models("clean")
    run = device_capture(device, d, tmp_path / "run.npz", *PLACEMENTS[placement], filters=("*",))
    assert _record_set(run) == _record_set(every_node_on_cpu)
    with read_dump(run) as dump:
        records = dump.manifest.records
        names = {r.name for r in records}
        assert {"inp_target_features", "inp_pos", "inp_tokens"} <= names, sorted(names)
        assert not [r.name for r in records if "#" in r.name or any("#" in src for src in r.srcs)]
        assert device.name in {r.backend for r in records}


def test_the_manifest_says_where_each_model_computed(device, fixture_models, tmp_path):
    d = fixture_models("clean")
    run = device_capture(device, d, tmp_path / "run.npz", *PLACEMENTS["target-on-device"])
    with read_dump(run) as dump:
        placement = dump.manifest.build["placement"]
    devices = {dev["name"]: dev for dev in placement["devices"]}
    assert devices[device.name]["description"], json.dumps(placement)
    if device.backend is VULKAN:  # the suite's: Mesa's software device
        assert "llvmpipe" in devices[device.name]["description"], json.dumps(placement)
    assert placement["target"] == {"n_gpu_layers": 99, "devices": [device.name]}
    assert placement["draft"] == {"n_gpu_layers": 0, "devices": []}
    shown = CliRunner().invoke(app, ["inspect", str(run)])
    assert shown.exit_code == 0, shown.output
    assert f"target placement: -ngl 99 -> {device.name}; records: " in shown.output
    assert "draft placement: -ngl 0 -> CPU; records: " in shown.output
    assert "inp_target_features" in shown.output and f" {device.name}\n" in shown.output


# the other drafters' graphs on the device: the log-SNR feature input (`dspark_log_snr_feat`,
# patch 0001) read through its copy, and DSpark's (anchor-first and bonus-anchor) with the rows
# read back through the API (`draft_logits`, `dspark_conf`)
@pytest.mark.parametrize("variant", ["log-snr", "dspark", "dspark-bonus"])
def test_other_drafters_inputs_on_the_device_compare_clean(variant, device, fixture_models, tmp_path):
    d = fixture_models(variant)
    on_cpu = device_capture(device, d, tmp_path / "cpu.npz", *PLACEMENTS["cpu"], filters=("*",))
    run = device_capture(device, d, tmp_path / "run.npz", *PLACEMENTS["device"], filters=("*",))
    assert _record_set(run) == _record_set(on_cpu)
    assert not any("#" in name for _, name in _backends(run))
    ref = reference_of(d / "target.gguf", d / "draft-hf", tmp_path / "ref.npz", follow=run)
    comparison = compare_dumps(ref, run)
    assert comparison.ok, [f.message for f in comparison.findings]
    assert not comparison.coverage.unexpected, comparison.coverage.skipped_phrase()


# ggml-vulkan's fused kernels, on as users run it (the suite turns them off on llvmpipe for the time
# llvmpipe takes to compile them, featdiff.llama.extra_builds.SOFTWARE_VULKAN_ENV): fusing runs unobserved
# nodes as one kernel; every observed tensor still ends a graph split, so the records are the same
# and compare clean
def test_a_run_with_fused_kernels_records_the_same_and_compares_clean(vulkan, fixture_models, captured, tmp_path):
    d = fixture_models("clean")
    env = {k: v for k, v in {**os.environ, **vulkan.backend.env}.items() if k != VULKAN_UNFUSED}
    run = device_capture(vulkan, d, tmp_path / "run.npz", *PLACEMENTS["device"], env=env)
    assert _record_set(run) == _record_set(captured("clean"))
    ref = reference_of(d / "target.gguf", d / "draft-hf", tmp_path / "ref.npz", follow=run)
    comparison = compare_dumps(ref, run)
    assert comparison.ok, [f.message for f in comparison.findings]
    assert not comparison.coverage.unexpected and comparison.types["devices"] == [vulkan.name]


# a device-only fault (patches/llama.cpp/0006-vulkan-device-fault.patch): each upload of the
# features to the device carries the previous upload's rows. The capture reads the input from the
# device's copy, what the drafter computed on, so compare names the stale rows; with the drafter
# on the CPU nothing is uploaded, and the same run compares clean. Vulkan's alone: the fault is
# planted in ggml-vulkan.cpp (CUDA's upload path carries none)
@pytest.mark.parametrize("draft_layers, is_caught", [("99", True), ("0", False)])
def test_features_the_device_got_from_the_batch_before_are_named_stale(
    draft_layers, is_caught, vulkan, fixture_models, monkeypatch, tmp_path
):
    monkeypatch.setenv(FAULT_VAR, "device-features-stale")
    d = fixture_models("clean")
    run = device_capture(vulkan, d, tmp_path / "run.npz", "-ngl", "99", "-ngld", draft_layers)
    ref = reference_of(d / "target.gguf", d / "draft-hf", tmp_path / "ref.npz", follow=run)
    comparison = compare_dumps(ref, run)
    errors = [f for f in comparison.findings if f.severity == "error"]
    if not is_caught:
        assert comparison.ok, [f.message for f in errors]
        return
    assert [(f.kind, f.tensor) for f in errors][:1] == [("stale", "inp_target_features")], [f.message for f in errors]
    with read_dump(run) as dump:
        injects = [e.eval for e in dump.manifest.evals if e.phase == "inject"]
    assert errors[0].fields["source_eval"] == injects[0]  # the second inject got the first's rows


# `featdiff check` on the device build: the trained pair with llama.cpp's default placement (every
# layer on the device, n_gpu_layers -1), in-process and around llama-server on the device (the
# tools build's program on the device build's libraries, tools.device_program_env): the wiring
# compares clean and the accept rate holds, as on the CPU (tests/test_check.py)
@pytest.mark.parametrize("mode", ["in-process", "llama-server"])
def test_check_passes_the_trained_pair_on_the_device(mode, device, tools, fixture_models, tmp_path):
    d = fixture_models("trained")  # the trained pair and its held-out prompts (tests/test_check.py)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join((d / PROMPTS_FILE).read_text().splitlines()[:2]) + "\n")
    args = ["check", "--target", str(d / "target.gguf"), "--model", str(d / "draft.gguf"), "--ref-model",
            str(d / "draft-hf"), "--prompts", str(prompts), "--rounds", "2", "--json", str(tmp_path / "check.json")]  # fmt: skip
    env = {**os.environ, **device.backend.env}
    if mode == "in-process":
        args += ["--llama-dir", str(device.build.root)]
    else:
        server = [str(tools.program("llama-server")), "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf"),
                  "--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-c", "256", "-t", "1", "-td", "1",
                  "-ngl", "99", "-ngld", "99"]  # fmt: skip
        args += ["--exec", "--", *server]
        env = device_program_env(device.build, device.backend, os.environ)
    done = subprocess.run([sys.executable, "-c", "from featdiff.cli import main; main()", *args], capture_output=True,
                          text=True, errors="replace", timeout=RUN_TIMEOUT_S, env=env)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    verdict = json.loads((tmp_path / "check.json").read_text())
    assert verdict["verdict"] == "pass" and verdict["accept"]["matches"], json.dumps(verdict)[:2000]
    assert verdict["comparison"]["types"]["devices"] == [device.name]  # the run computed on the device


def test_an_input_only_a_norm_reads_is_recorded_on_the_device_as_on_the_cpu(device, mtp_pairs, tmp_path):
    """An MTP head's `mtp_h_input`, which only the head's hnorm reads (issue 42: read before the norm
    runs, since ggml-alloc may compute RMS_NORM in its source's memory), is recorded on the device
    from the scheduler's copy as on the CPU: every named tensor the same, its records from the
    device's memory, and the run compares clean against the reference. (The head inside the
    target's GGUF runs where the target's layers do: -ngl, not -ngld.)"""
    d = mtp_pairs("mtp")
    cpu, run = (
        device_capture(device, d, tmp_path / f"{p}.npz", *PLACEMENTS[p], filters=("*",), model="target.gguf")
        for p in ("cpu", "device")
    )
    assert _record_set(run) == _record_set(cpu)
    assert _backends(cpu)[("draft", MTP_H_INPUT)] == {BACKEND_HOST}
    assert _backends(run)[("draft", MTP_H_INPUT)] == {device.name}
    ref = reference(
        d / "target-hf", d / "target.gguf", tmp_path / "ref.npz", prompt=None, tokens=DEFAULT_TOKENS,
        rounds=DEFAULT_ROUNDS, dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None, run=run,
    )  # fmt: skip
    c = compare_dumps(ref, run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    assert {p.phase for p in c.pairs if p.name == MTP_H_INPUT} == {"inject", "draft"}
