"""Strict loading of a DFlash (DSpark, DFlash2) HF drafter (torchref/load_hf.py, issue 47): a
`dflash_config` field neither the converter nor the reference reads, and a tensor no modelled entry
reads, are refused by name (exit 2); every field featdiff's own fixtures write is read."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from featdiff import names
from featdiff.cli import app
from featdiff.errors import InputError
from featdiff.fixtures import _feature_specs, drafter_hf_config
from featdiff.fixtures_dflash2 import dflash2_keys
from featdiff.pairs import TINY
from featdiff.torchref.load_hf import draft_from_hf, unread_dflash_fields

CPU, F32 = torch.device("cpu"), torch.float32


def test_every_dflash_config_field_the_fixtures_write_is_read():
    written = [fields for _, fields, _ in _feature_specs().values()]
    written.append({k.split(".", 1)[1]: v for k, v in dflash2_keys().items()})
    written.append(drafter_hf_config(TINY, {"target_layer_ids": [0, 2], "mask_token_id": 1})[names.HF_DFLASH_CONFIG])
    for fields in written:
        assert unread_dflash_fields(fields) == (), fields
    assert unread_dflash_fields({"target_layer_ids": [1], "mystery": 1}) == ("dflash_config.mystery",)


@pytest.mark.parametrize(
    ("field", "tensor", "named"),
    [("mystery_scale", None, "dflash_config.mystery_scale"), (None, "mystery.weight", "mystery.weight")],
)
def test_an_unread_field_or_tensor_makes_reference_exit_2_naming_it(fixture_models, tmp_path, field, tensor, named):
    d = fixture_models("clean")
    odd = tmp_path / "draft-hf"
    shutil.copytree(d / "draft-hf", odd)
    assert draft_from_hf(odd, F32, CPU).target_layers  # the fixture's own checkpoint loads
    if field:
        c = json.loads((odd / "config.json").read_text())
        c[names.HF_DFLASH_CONFIG][field] = 2.0
        (odd / "config.json").write_text(json.dumps(c))
    if tensor:
        f = odd / "model.safetensors"
        save_file({**load_file(str(f)), tensor: np.ones(4, np.float32)}, str(f))
    with pytest.raises(InputError, match=named.replace(".", r"\.")):
        draft_from_hf(odd, F32, CPU)
    args = ["reference", "--target", str(d / "target.gguf"), "--model", str(odd), "-o", str(tmp_path / "r.npz")]
    out = CliRunner().invoke(app, [*args, "--tokens", "5,17,42", "--rounds", "1"])
    assert out.exit_code == 2 and named in out.output and "Traceback" not in out.output, out.output
