"""The memory check before a transformers-backed target loads (featdiff.torchref.memory): the
parameter count read from the safetensors headers, and `featdiff reference` exiting 2 with the
figures, before loading, where the machine has less memory available than the model takes."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core.errors import InputError
from featdiff.factory.fixtures import write_fixture
from featdiff.factory.hf_families import FAMILIES
from featdiff.factory.hf_targets import write_hf_target
from featdiff.torchref import memory


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A Qwen3-MoE target's HF directory beside the fixtures' drafter (no conversion needed)."""
    out = write_fixture(tmp_path_factory.mktemp("mem"), "clean")
    write_hf_target(out / "target-hf", FAMILIES["qwen3moe"], seed=0)
    return out


def test_parameters_are_counted_from_the_headers(moe_dir):
    path = moe_dir / "target-hf"
    counted = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as st:
            counted += sum(st.get_tensor(k).numel() for k in st.keys())
    assert memory.checkpoint_parameters(path) == counted > 0


def test_the_check_names_both_figures_and_passes_when_memory_suffices(moe_dir):
    path = moe_dir / "target-hf"
    need = memory.loaded_bytes(memory.checkpoint_parameters(path), torch.float32)
    memory.check_fits(path, torch.float32, need)  # exactly enough
    memory.check_fits(path, torch.float32, None)  # a system that does not say: not checked
    with pytest.raises(InputError, match=r"GiB, and this machine has [0-9.]+ GiB available; run it where"):
        memory.check_fits(path, torch.float32, need - 1)
    assert memory.loaded_bytes(10**9, torch.float64) > memory.loaded_bytes(10**9, torch.float32)


def test_reference_exits_2_before_loading_a_target_that_does_not_fit(moe_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 20)  # a machine with 1 MiB left
    from featdiff.torchref import hf_target

    monkeypatch.setattr(hf_target, "available_bytes", memory.available_bytes)
    out = tmp_path / "ref.npz"
    result = CliRunner().invoke(
        app,
        ["reference", "--target", str(moe_dir / "target-hf"), "--model", str(moe_dir / "draft-hf"), "-o", str(out),
         "--tokens", "1,2,3,4"],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "through transformers" in result.output and "GiB available" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()


def test_a_truncated_weights_file_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(InputError, match="model.safetensors: not a readable safetensors file"):
        memory.checkpoint_parameters(tmp_path)


def test_this_machine_reports_its_available_memory():
    """Linux says MemAvailable: the check is live on the machines CI runs on."""
    available = memory.available_bytes()
    assert available is not None and available > 0
