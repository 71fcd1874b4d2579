"""Capture around upstream programs on a device backend of ggml (tests/llama/conftest.py
`device`: Vulkan on Mesa's llvmpipe, 25 or later, `make vulkan`; CUDA in `make test-cuda`):
llama-speculative-simple and llama-server run against featdiff's device build of libllama and ggml
(`featdiff.llama.extra_builds.ensure_device`, `device_program_env`: the tools build's programs, whose code
has no backend-specific line, with the device build's libraries), under the preload, as a user
runs them on a GPU build. Each
placement, the whole pair on the device, part of the target, the target or the drafter alone,
records what the same program records with every layer on the CPU and compares clean against the
reference; a fault planted in the driver and the fault only a device run can have are named.

The preload is compiled against the build whose libllama the program loads (`preload.
build_of_program`, through `ldd`: the device build's); this process loads no libllama for it, so
the captures run here, not in processes of their own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from families import FAULT_VAR
from featdiff.diff import compare_dumps
from featdiff.dump.reader import read_dump
from featdiff.llama.extra_builds import device_program_env
from featdiff.llama.tools import ToolBuild
from featdiff.programs import exec as exec_capture

from devices import PLACEMENTS, RUN_TIMEOUT_S, Device
from real_flow import reference_of
from test_exec import SPEC_ARGS, TOKENS

pytestmark = pytest.mark.slow  # builds the device llama.cpp: not part of `make test-fast`
PROMPT = "The quick brown fox"
PROGRAMS = ("llama-speculative-simple", "llama-server")


def _on(device: Device, monkeypatch) -> None:
    """The programs started inside load the device build's libraries and see the device (llvmpipe:
    ggml skips a CPU-type device unless named)."""
    for name, value in device_program_env(device.build, device.backend, os.environ).items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)


@pytest.fixture
def on_device_env(device, monkeypatch) -> Device:
    _on(device, monkeypatch)
    return device


@pytest.fixture
def on_vulkan_env(vulkan, monkeypatch) -> Device:
    _on(vulkan, monkeypatch)
    return vulkan


def _capture(tools: ToolBuild, program: str, d: Path, out: Path, placement: str) -> Path:
    """`capture --exec` around `program` on the pair in `d`, layers placed as PLACEMENTS[placement]
    says; llama-server is asked the tests' one greedy completion."""
    cmd = [str(tools.program(program)), "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf"), *SPEC_ARGS,
           *PLACEMENTS[placement]]  # fmt: skip
    if program == "llama-server":
        return exec_capture.capture_exec(cmd, out, tokens=TOKENS, timeout_s=RUN_TIMEOUT_S)
    return exec_capture.capture_exec([*cmd, "-p", PROMPT, "-n", "16", "--temp", "0"], out, timeout_s=RUN_TIMEOUT_S)


@pytest.fixture(scope="session")
def on_device(tools, fixture_models, tmp_path_factory):
    """(device, program, placement) -> a dump captured around it on the clean pair (made once;
    called inside a test, where on_device_env has set the environment)."""
    made: dict[tuple[str, str, str], Path] = {}

    def get(device: Device, program: str, placement: str) -> Path:
        key = (device.backend.name, program, placement)
        if key not in made:
            out = tmp_path_factory.mktemp("-".join(key)) / "run.npz"
            made[key] = _capture(tools, program, fixture_models("clean"), out, placement)
        return made[key]

    return get


def _record_set(dump_path: Path) -> list[tuple]:
    with read_dump(dump_path) as dump:
        return sorted((r.eval, r.role, r.phase, r.name, r.occurrence, r.shape) for r in dump.manifest.records)


def _compare(fixture_models, run: Path, tmp_path: Path):
    d = fixture_models("clean")
    return compare_dumps(reference_of(d / "target.gguf", d / "draft-hf", tmp_path / "ref.npz", follow=run), run)


# placement -> whether the target's and the drafter's layers computed on the device (None: not said)
LAYERS_ON_DEVICE = {"device": (True, True), "partial": (True, None), "target-on-device": (True, False),
                    "draft-on-device": (False, True)}  # fmt: skip
CASES = [(p, placement) for p in PROGRAMS for placement in PLACEMENTS if placement != "cpu"]


@pytest.mark.parametrize("program, placement", CASES)
def test_every_placement_records_what_the_cpu_run_records_and_compares_clean(
    program, placement, on_device_env, on_device, fixture_models, tmp_path
):
    device = on_device_env
    run = on_device(device, program, placement)
    assert _record_set(run) == _record_set(on_device(device, program, "cpu"))
    comparison = _compare(fixture_models, run, tmp_path)
    assert comparison.ok, [f.message for f in comparison.findings]
    cov = comparison.coverage
    assert cov.pairs > 0 and not cov.unexpected, cov.skipped_phrase()
    assert comparison.types["devices"] == [device.name]  # judged with the device's bound (diff/tolerance.py)
    # where each model's layers computed (partial: the target's last layers; the drafter's output
    # layer only, whose residual the scheduler may place either side)
    with read_dump(run) as dump:
        layers = {(r.role, r.backend) for r in dump.manifest.records if r.name.startswith("l_out-")}
    target_there, draft_there = LAYERS_ON_DEVICE[placement]
    assert (("target", device.name) in layers) == target_there
    assert draft_there is None or (("draft", device.name) in layers) == draft_there


# a fault planted in the driver (patches/llama.cpp/0002-driver-faults.patch) named on the device
# run as on the CPU (tests/llama/test_driver_faults.py): the block's anchor replaced by the mask token
@pytest.mark.parametrize("program", PROGRAMS)
def test_a_driver_fault_is_named_on_the_device(
    program, tools, on_device_env, on_device, fixture_models, monkeypatch, tmp_path
):
    monkeypatch.setenv(FAULT_VAR, "anchor-mask")
    run = _capture(tools, program, fixture_models("clean"), tmp_path / "run.npz", "device")
    # the reference on the user's prompt: the unplanted run's tokens and rounds (a faulty run's
    # rounds cannot be followed)
    with read_dump(on_device(on_device_env, program, "device")) as dump:
        tokens = ",".join(map(str, dump.manifest.prompt_tokens))
        rounds = sum(1 for r in dump.manifest.rounds if r.drafts)
    d = fixture_models("clean")
    ref = reference_of(d / "target.gguf", d / "draft-hf", tmp_path / "ref.npz", tokens=tokens, rounds=rounds)
    errors = [f for f in compare_dumps(ref, run).findings if f.severity == "error"]
    assert [(f.kind, f.fields.get("round")) for f in errors][:1] == [("block_token", 1)], [f.message for f in errors]


# the device-only fault (patches/llama.cpp/0006-vulkan-device-fault.patch, tests/llama/test_device.py):
# each upload of the features carries the previous upload's rows; with the drafter on the CPU
# nothing is uploaded, and the same program compares clean. Vulkan's alone (ggml-vulkan.cpp)
@pytest.mark.parametrize("placement, is_caught", [("device", True), ("target-on-device", False)])
def test_features_the_device_got_from_the_batch_before_are_named_stale_around_the_program(
    placement, is_caught, tools, on_vulkan_env, fixture_models, monkeypatch, tmp_path
):
    monkeypatch.setenv(FAULT_VAR, "device-features-stale")
    run = _capture(tools, "llama-speculative-simple", fixture_models("clean"), tmp_path / "run.npz", placement)
    comparison = _compare(fixture_models, run, tmp_path)
    errors = [f for f in comparison.findings if f.severity == "error"]
    if not is_caught:
        assert comparison.ok, [f.message for f in errors]
        return
    assert [(f.kind, f.tensor) for f in errors][:1] == [("stale", "inp_target_features")], [f.message for f in errors]


def test_check_names_the_device_only_fault_around_the_program(tools, on_vulkan_env, fixture_models, tmp_path):
    """`featdiff check --exec` (issue 48) on the device-only fault, the pair on the device: exit 1
    naming the stale features as compare does above, never 2 or 3, its dumps kept."""
    from featdiff_process import check_names_fault

    d = fixture_models("clean")
    cmd = [tools.program("llama-speculative-simple"), "-m", d / "target.gguf", "-md", d / "draft.gguf", *SPEC_ARGS,
           *PLACEMENTS["device"], "-p", PROMPT, "-n", "16", "--temp", "0"]  # fmt: skip
    args = ["--target", d / "target.gguf", "--model", d / "draft.gguf", "--ref-model", d / "draft-hf", "--exec", "--"]
    errors = check_names_fault([*args, *cmd], "device-features-stale", tmp_path, "stale")
    assert (errors[0]["kind"], errors[0]["tensor"]) == ("stale", "inp_target_features"), errors
