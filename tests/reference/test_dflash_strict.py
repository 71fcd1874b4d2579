"""Strict loading of a DFlash (DSpark, DFlash2) HF drafter (torchref/load_hf.py, issue 47): a
top-level config.json key or a `dflash_config` field neither the converter nor the reference reads
(nor featdiff.kinds.dflash.modelled's HF_IRRELEVANT_KEYS lists), an inert key at another value, and a tensor no
modelled entry reads are refused by name (exit 2); every key featdiff's own fixtures write is read."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from featdiff.core import names
from featdiff.cli import app
from featdiff.factory.converter import DSPARK_SCHEMAS, dspark_config
from featdiff.core.errors import InputError
from featdiff.factory.fixtures import VARIANTS, _dspark_hf_config, drafter_hf_config
from featdiff.factory.features import _feature_specs
from featdiff.kinds.dflash.modelled import unread_hf_keys
from featdiff.factory.dflash2 import dflash2_keys
from featdiff.factory.pairs import TINY
from featdiff.torchref.load_hf import converter_config, draft_from_hf, unread_dflash_fields

CPU, F32 = torch.device("cpu"), torch.float32


def test_every_dflash_config_field_the_fixtures_write_is_read():
    written = [fields for _, fields, _ in _feature_specs().values()]
    written.append({k.split(".", 1)[1]: v for k, v in dflash2_keys().items()})
    written.append(drafter_hf_config(TINY, {"target_layer_ids": [0, 2], "mask_token_id": 1})[names.HF_DFLASH_CONFIG])
    for fields in written:
        assert unread_dflash_fields(fields) == (), fields
    assert unread_dflash_fields({"target_layer_ids": [1], "mystery": 1}) == ("dflash_config.mystery",)


def _top_level_configs() -> list[dict]:
    """Every top-level config.json layout featdiff's DFlash fixtures write: the base (every
    DFlash/DFlash2 variant, trained ones included: fixtures.drafter_hf_config), with RoPE scaling,
    each feature fixture's fields, and each DSpark variant in each schema the converter reads."""
    base = drafter_hf_config(TINY, {"target_layer_ids": [0, 2], "mask_token_id": 1})
    out = [base, drafter_hf_config(TINY, base[names.HF_DFLASH_CONFIG], rope="yarn")]
    out += [{**base, **top} for _, _, top in _feature_specs().values()]
    for variant, w in (("dspark", {}), ("dspark-bonus", {}), ("dspark-d2t", {"d2t": np.zeros(8, np.int64)})):
        v = VARIANTS[variant]
        dspark = {**base, **_dspark_hf_config(w, v)}
        out += [
            dspark_config(dspark, s)
            for s in DSPARK_SCHEMAS
            if (s == "eagle3") == v.checkpoint_bonus_anchor or s == "nested"
        ]
    return [converter_config(c) for c in out]


def test_every_top_level_key_the_fixtures_write_is_read_or_listed():
    configs = _top_level_configs()
    assert len(configs) > 15 and any("transformer_layer_config" in c for c in configs)
    for c in configs:
        assert unread_hf_keys(c) == (), c
    odd = {**configs[0], "mystery_setting": 1, "attention_bias": True, "hidden_act": "silu"}
    assert unread_hf_keys(odd) == ("mystery_setting", "attention_bias = True")


def _odd_copy(d, tmp_path, field, top, tensor):
    odd = tmp_path / "draft-hf"
    shutil.copytree(d / "draft-hf", odd)
    assert draft_from_hf(odd, F32, CPU).target_layers  # the fixture's own checkpoint loads
    if field or top:
        c = json.loads((odd / "config.json").read_text())
        if field:
            c[names.HF_DFLASH_CONFIG][field] = 2.0
        c.update(top or {})
        (odd / "config.json").write_text(json.dumps(c))
    if tensor:
        f = odd / "model.safetensors"
        save_file({**load_file(str(f)), tensor: np.ones(4, np.float32)}, str(f))
    return odd


UNREAD = [
    ("mystery_scale", None, None, "dflash_config.mystery_scale"),
    (None, None, "mystery.weight", "mystery.weight"),
    (None, {"mystery_setting": 3}, None, "mystery_setting"),
    (None, {"attention_bias": True}, None, "attention_bias = True"),
]


@pytest.mark.parametrize(("field", "top", "tensor", "named"), UNREAD)
def test_an_unread_key_or_tensor_makes_reference_exit_2_naming_it(fixture_models, tmp_path, field, top, tensor, named):
    d = fixture_models("clean")
    odd = _odd_copy(d, tmp_path, field, top, tensor)
    with pytest.raises(InputError, match=named.replace(".", r"\.")):
        draft_from_hf(odd, F32, CPU)
    args = ["reference", "--target", str(d / "target.gguf"), "--model", str(odd), "-o", str(tmp_path / "r.npz")]
    out = CliRunner().invoke(app, [*args, "--tokens", "5,17,42", "--rounds", "1"])
    assert out.exit_code == 2 and named in out.output and "Traceback" not in out.output, out.output


@pytest.mark.parametrize("command", ["check", "probe"])
def test_check_and_probe_exit_2_naming_an_unread_top_level_key(fixture_models, tmp_path, command):
    """check (in-process: the run is captured, then the reference refuses) and probe take the HF
    drafter as --ref-model and stop in one line naming the key and the file."""
    d = fixture_models("clean")
    odd = _odd_copy(d, tmp_path, None, {"mystery_setting": 3}, None)
    args = [command, "--target", str(d / "target.gguf"), "--model", str(d / "draft.gguf"), "--ref-model", str(odd)]
    extra = ["--keep", str(tmp_path / "kept")] if command == "check" else []
    out = CliRunner().invoke(app, [*args, *extra, "--rounds", "1"])
    assert out.exit_code == 2, out.output
    assert f"{odd / 'config.json'}: mystery_setting" in out.output and "HF_IRRELEVANT_KEYS" in out.output
    assert "Traceback" not in out.output
