"""EAGLE3 checkpoints as their trainers write them (torchref/eagle3/hf.py, modelled_eagle3.TRAINERS):
which trainer wrote a checkpoint and what its layer ids mean (SpecForge: layer outputs, so the
reference taps ids + 1; Eagle3Speculator, EAGLE, ids where the converter reads them: inputs), the
refusal where it cannot be told and `--layer-ids-mean`, SpecForge's per-slot fc_norm, and strict
loading: a tensor or config key the reference does not read is refused by name (exit 2)."""

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
from featdiff.torchref.eagle3.graph import encode, encode_candidates
from featdiff.torchref.eagle3.hf import eagle3_from_hf
from featdiff.torchref.load import load_target
from featdiff.torchref.numerics import linear, rms_norm

CPU, F32 = torch.device("cpu"), torch.float32
TOKENS = "5,17,42,7"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    from featdiff.factory.eagle3 import write_eagle3_fixture

    return write_eagle3_fixture(tmp_path_factory.mktemp("eagle3-ckpt"), "eagle3")


@pytest.fixture(scope="module")
def target(pair):
    return load_target(pair / "target.gguf", F32, CPU)


def rewritten(pair: Path, out: Path, config=None, add: dict | None = None, rename: dict | None = None) -> Path:
    """A copy of the pair's draft-hf/ with `config(dict) -> dict` applied, tensors `add`ed and renamed."""
    shutil.copytree(pair / "draft-hf", out)
    c = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config(c) if config else c))
    w = load_file(str(out / "model.safetensors"))
    w = {(rename or {}).get(k, k): v for k, v in w.items()}
    save_file({**w, **(add or {})}, str(out / "model.safetensors"))
    return out


def nested(c: dict, ids=(0, 2, 4), **more) -> dict:
    """SpecForge's config: the ids under eagle_config (layer outputs)."""
    c.pop("eagle_aux_hidden_state_layer_ids", None)
    return {**c, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids)}, **more}


def test_specforge_nested_ids_name_layer_outputs_and_the_reference_taps_the_next_input(pair, target, tmp_path):
    d = eagle3_from_hf(rewritten(pair, tmp_path / "sf", nested), target, F32, CPU)
    assert d.target_layers == (1, 3, 5)  # outputs of 0, 2, 4 = inputs of 1, 3, 5
    assert d.checkpoint == {
        "trainer": "specforge",
        "layer_ids": [0, 2, 4],
        "layer_ids_mean": "output",
        "told_by": "checkpoint",
    }


def test_speculators_layout_ids_name_layer_inputs(pair, target, tmp_path):
    rename = {
        k: "layers.0." + k[len("midlayer.") :]
        for k in load_file(str(pair / "draft-hf" / "model.safetensors"))
        if k.startswith("midlayer.")
    }
    d = eagle3_from_hf(rewritten(pair, tmp_path / "sp", rename=rename), target, F32, CPU)
    assert d.target_layers == (1, 3, 5) and d.checkpoint["trainer"] == "speculators"
    assert d.checkpoint["layer_ids_mean"] == "input"


def test_no_ids_stated_is_every_trainers_default(pair, target, tmp_path):
    def drop(c):
        c.pop("eagle_aux_hidden_state_layer_ids")
        return c

    d = eagle3_from_hf(rewritten(pair, tmp_path / "ea", drop), target, F32, CPU)
    assert d.target_layers == (2, 3, 3) and d.checkpoint["told_by"] == "default"  # [2, n // 2, n - 3] of 6 layers
    assert d.checkpoint["trainer"] == "eagle"


def test_ids_beside_a_specforge_block_without_them_are_refused_unless_stated(pair, target, tmp_path):
    d = rewritten(pair, tmp_path / "amb", lambda c: {**c, "eagle_config": {}})
    with pytest.raises(InputError, match=r"cannot be told; pass --layer-ids-mean input\|output") as e:
        eagle3_from_hf(d, target, F32, CPU)
    assert str(d / "config.json") in str(e.value)
    assert eagle3_from_hf(d, target, F32, CPU, layer_ids_mean="output").target_layers == (2, 4, 6)
    stated = eagle3_from_hf(d, target, F32, CPU, layer_ids_mean="input")
    assert stated.target_layers == (1, 3, 5) and stated.checkpoint["told_by"] == "flag"
    with pytest.raises(InputError, match="--layer-ids-mean 'middle'"):
        eagle3_from_hf(d, target, F32, CPU, layer_ids_mean="middle")


@pytest.mark.parametrize(
    ("config", "add", "named"),
    [
        (
            None,
            {"midlayer.self_attn.q_norm.weight": np.ones(16, np.float32)},
            "tensor midlayer.self_attn.q_norm.weight",
        ),
        (None, {"mystery.weight": np.ones(4, np.float32)}, "tensor mystery.weight"),
        (lambda c: {**c, "mystery_key": 1}, None, "config.json mystery_key"),
        (
            lambda c: (
                nested(c, mystery=2) | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4], "mystery": 2}}
            ),
            None,
            "config.json eagle_config.mystery",
        ),
        (lambda c: {**c, "hidden_act": "gelu"}, None, "config.json hidden_act = 'gelu'"),
    ],
)
def test_what_the_reference_does_not_read_is_refused_by_name(pair, target, tmp_path, config, add, named):
    d = rewritten(pair, tmp_path / "odd", config, add)
    with pytest.raises(InputError, match="does not read") as e:
        eagle3_from_hf(d, target, F32, CPU)
    assert named in str(e.value) and str(d) in str(e.value)


def test_an_unknown_tensor_makes_reference_exit_2_in_one_line(pair, tmp_path):
    d = rewritten(pair, tmp_path / "odd", add={"mystery.weight": np.ones(4, np.float32)})
    out = CliRunner().invoke(
        app,
        [
            "reference",
            "--target",
            str(pair / "target.gguf"),
            "--model",
            str(d),
            "-o",
            str(tmp_path / "r.npz"),
            "--tokens",
            TOKENS,
        ],
    )
    assert out.exit_code == 2, out.output
    assert "mystery.weight" in out.output and "Traceback" not in out.output
    assert not (tmp_path / "r.npz").exists()


def _slot_norms(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"fc_norm.{k}.weight": (1 + 0.3 * rng.standard_normal(n)).astype(np.float32) for k in range(3)}


def test_specforge_fc_norm_is_one_rms_norm_per_slot(pair, target, tmp_path):
    n = target.hparams.n_embd
    norms = _slot_norms(n, 0)
    d = eagle3_from_hf(rewritten(pair, tmp_path / "fcn", lambda c: nested(c, fc_norm=True), norms), target, F32, CPU)
    assert d.fc_norm is not None
    x = torch.randn(4, 3 * n, generator=torch.Generator().manual_seed(1))  # (n_tokens, 3 * n_embd_tgt)
    g, _ = encode(d, x)
    slots = [
        rms_norm(x[:, k * n : (k + 1) * n], torch.from_numpy(norms[f"fc_norm.{k}.weight"]), d.hparams.rms_eps)
        for k in range(3)
    ]
    torch.testing.assert_close(g, linear(torch.cat(slots, dim=1), d.fc))
    whole = linear(rms_norm(x, torch.ones(3 * n), d.hparams.rms_eps), d.fc)  # one norm over the whole vector
    assert (g - whole).abs().max() > 1e-3
    dropped = {c.name: c.array for c in encode_candidates(d, x)}["fc_out@fc_norm=none"]
    torch.testing.assert_close(dropped, linear(x, d.fc))


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        (lambda c: nested(c, fc_norm=True), False, "fc_norm.0.weight' is missing"),
        (nested, True, "fc_norm is not true"),
        (lambda c: nested(c, fc_norm=True) | {"norm_before_fc": True}, True, "sets both norm_before_fc"),
    ],
)
def test_fc_norm_flag_and_tensors_must_agree(pair, target, tmp_path, config, tensors, message):
    norms = _slot_norms(target.hparams.n_embd, 0) if tensors else None
    with pytest.raises(InputError, match=message):
        eagle3_from_hf(rewritten(pair, tmp_path / "fcn", config, norms), target, F32, CPU)


def _reference(pair: Path, model: Path, out: Path, *flags: str):
    args = [
        "reference",
        "--target",
        str(pair / "target.gguf"),
        "--model",
        str(model),
        "-o",
        str(out),
        "--tokens",
        TOKENS,
    ]
    return CliRunner().invoke(app, [*args, "--rounds", "1", *flags])


def test_layer_ids_mean_states_what_the_checkpoint_cannot_tell(pair, tmp_path):
    from featdiff.dump.reader import read_dump

    d = rewritten(pair, tmp_path / "amb", lambda c: {**c, "eagle_config": {}})
    refused = _reference(pair, d, tmp_path / "r.npz")
    assert refused.exit_code == 2 and "--layer-ids-mean input|output" in refused.output, refused.output
    done = _reference(pair, d, tmp_path / "r.npz", "--layer-ids-mean", "input")
    assert done.exit_code == 0, done.output
    with read_dump(tmp_path / "r.npz") as dump:
        entry = dump.manifest.models["draft"]
    assert entry["target_layers"] == [1, 3, 5]
    listed = CliRunner().invoke(app, ["inspect", str(tmp_path / "r.npz")])
    assert "draft checkpoint: trainer stated, layer ids [1, 3, 5] name layer inputs (told by the flag)" in listed.output
    assert entry["checkpoint"] == {
        "trainer": "stated",
        "layer_ids": [1, 3, 5],
        "layer_ids_mean": "input",
        "told_by": "flag",
    }


def test_layer_ids_mean_on_a_gguf_is_refused(pair, tmp_path):
    out = _reference(pair, pair / "draft.gguf", tmp_path / "r.npz", "--layer-ids-mean", "output")
    assert out.exit_code == 2 and "GGUF ids always name layer inputs" in out.output, out.output


def test_inspect_names_a_checkpoints_trainer_and_what_its_ids_mean(pair, tmp_path):
    d = rewritten(pair, tmp_path / "sf", nested, add={"mystery.weight": np.ones(4, np.float32)})
    out = CliRunner().invoke(app, ["inspect", str(d)])
    assert out.exit_code == 0, out.output
    assert "trainer: specforge" in out.output and "naming layer outputs" in out.output
    assert "the GGUF must carry [1, 3, 5]" in out.output and "(refused): mystery.weight" in out.output


def test_draft_vocab_size_must_be_the_heads_rows(pair, target, tmp_path):
    d = rewritten(pair, tmp_path / "dv", lambda c: {**c, "draft_vocab_size": c["draft_vocab_size"] + 1})
    with pytest.raises(InputError, match="rows but config.json draft_vocab_size"):
        eagle3_from_hf(d, target, F32, CPU)
