"""Strict loading of an MTP head's HF checkpoint (torchref/mtp/hf.py, issue 47): every tensor under
the head's namespace and every config key naming mtp or nextn is read, or listed as irrelevant with
its reason; anything else is refused by name (exit 2), never silently left out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core.errors import InputError
from featdiff.torchref.mtp.hf import mtp_from_hf

pytestmark = pytest.mark.slow  # the pinned converter makes the pairs (cached per machine)

F32, CPU = torch.float32, torch.device("cpu")
# variant -> a tensor name under its head's namespace that no field reads
ODD_TENSOR = {
    "mtp": "mtp.mystery.weight",
    "mtp-qwen35moe": "mtp.layers.0.mlp.mystery.weight",
    "mtp-glm4moe": "model.layers.6.mystery.weight",
    "mtp-mimo2": "model.mtp.layers.0.mystery.weight",
    "mtp-qwen3next": "mtp.layers.0.mlp.mystery.weight",
    "mtp-deepseek2": "model.layers.6.self_attn.mystery.weight",
    "mtp-deepseek32": "model.layers.6.self_attn.indexer.mystery.weight",
    "mtp-glm-dsa": "model.layers.6.mlp.mystery.weight",
}


def _copy(src: Path, out: Path, key: dict | None = None, tensor: str | None = None) -> Path:
    shutil.copytree(src / "target-hf", out)
    if key:
        c = json.loads((out / "config.json").read_text())
        text = c.get("text_config", c)
        text.update(key)
        (out / "config.json").write_text(json.dumps(c))
    if tensor:
        f = next(out.glob("*.safetensors"))
        save_file({**load_file(str(f)), tensor: np.ones(4, np.float32)}, str(f))
    return out


@pytest.mark.parametrize("variant", list(ODD_TENSOR))
def test_each_family_checkpoint_loads_and_an_unread_tensor_or_key_is_refused(mtp_pairs, tmp_path, variant):
    d = mtp_pairs(variant)
    assert mtp_from_hf(d / "target-hf", F32, CPU).il >= 1  # the fixture's own checkpoint: everything read
    odd = _copy(d, tmp_path / "t", tensor=ODD_TENSOR[variant])
    with pytest.raises(InputError, match=f"tensor {ODD_TENSOR[variant]}, which featdiff's MTP reference does not read"):
        mtp_from_hf(odd, F32, CPU)
    keyed = _copy(d, tmp_path / "k", key={"mtp_mystery_setting": 3})
    with pytest.raises(InputError, match="config.json mtp_mystery_setting"):
        mtp_from_hf(keyed, F32, CPU)


def test_an_inert_key_at_another_value_is_refused(mtp_pairs, tmp_path):
    d = _copy(mtp_pairs("mtp"), tmp_path / "k", key={"mtp_use_dedicated_embeddings": True})
    with pytest.raises(InputError, match="mtp_use_dedicated_embeddings = True"):
        mtp_from_hf(d, F32, CPU)
    same = _copy(mtp_pairs("mtp"), tmp_path / "k0", key={"mtp_use_dedicated_embeddings": False})
    assert mtp_from_hf(same, F32, CPU).il == 6


def test_reference_exits_2_naming_the_unread_tensor(mtp_pairs, tmp_path):
    d = mtp_pairs("mtp")
    odd = _copy(d, tmp_path / "t", tensor="mtp.mystery.weight")
    args = ["reference", "--target", str(d / "target-hf"), "--model", str(odd), "-o", str(tmp_path / "r.npz")]
    out = CliRunner().invoke(app, [*args, "--tokens", "5,17,42", "--rounds", "1"])
    assert out.exit_code == 2 and "mtp.mystery.weight" in out.output, out.output
    assert "Traceback" not in out.output and not (tmp_path / "r.npz").exists()


def test_a_gguf_head_block_tensor_the_reference_does_not_read_is_refused(mtp_pairs, tmp_path):
    from featdiff.factory.gguf_rewrite import rewrite_gguf
    from featdiff.torchref.mtp.head import mtp_from_gguf

    d = mtp_pairs("mtp")
    odd = rewrite_gguf(
        d / "target.gguf", tmp_path / "odd.gguf", tensors={"blk.6.mystery.weight": np.ones(4, np.float32)}
    )
    with pytest.raises(InputError, match=r"carries blk\.6\.mystery\.weight in the MTP block"):
        mtp_from_gguf(odd, F32, CPU)


@pytest.mark.parametrize("variant", [*ODD_TENSOR, "mtp-separate"])
def test_lint_finds_nothing_unread_in_each_family_head(mtp_pairs, variant):
    d = mtp_pairs(variant)
    head = d / ("draft.gguf" if variant == "mtp-separate" else "target.gguf")
    out = CliRunner().invoke(app, ["lint", str(head), "--target", str(d / "target.gguf")])
    assert out.exit_code == 0 and out.output.strip() == f"{head}: ok", out.output


def test_lint_lists_a_head_tensor_and_a_nextn_key_the_reference_does_not_read(mtp_pairs, tmp_path):
    """lint names, for the GGUF side, what mtp_from_gguf refuses (the head's block tensors and the
    arch's nextn/mtp keys it does not read), one line each, exit 1; the reference refuses the key too."""
    from featdiff.factory.gguf_rewrite import rewrite_gguf
    from featdiff.torchref.mtp.head import mtp_from_gguf

    d = mtp_pairs("mtp")
    odd = rewrite_gguf(
        d / "target.gguf",
        tmp_path / "odd.gguf",
        keys={"qwen35.nextn_mystery_scale": 2.0},
        tensors={"blk.6.mystery.weight": np.ones(4, np.float32)},
    )
    out = CliRunner().invoke(app, ["lint", str(odd)])
    lines = out.output.strip().splitlines()
    assert out.exit_code == 1 and len(lines) == 2, out.output
    for line, name in zip(lines, ("blk.6.mystery.weight", "qwen35.nextn_mystery_scale"), strict=True):
        assert line.startswith(f"{odd}: {name} is in the MTP head (block 6)") and "does not read" in line
    keyed = rewrite_gguf(d / "target.gguf", tmp_path / "keyed.gguf", keys={"qwen35.nextn_mystery_scale": 2.0})
    with pytest.raises(InputError, match=r"carries qwen35\.nextn_mystery_scale in the MTP block"):
        mtp_from_gguf(keyed, F32, CPU)
