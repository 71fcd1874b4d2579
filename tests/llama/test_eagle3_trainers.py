"""EAGLE3 checkpoints in their trainers' layouts against the pinned build (issue 47): SpecForge's
(ids of layer outputs under eagle_config, fc_norm), Eagle3Speculator's and EAGLE's own. Each
compares clean from its HF checkpoint where llama.cpp supports it; the export faults between them
(ids not shifted for an output-reading trainer, fc_norm dropped by a converter) are named, where:
export; the pinned converter's own handling (eagle_config unread, fc_norm refused) is pinned."""

from __future__ import annotations

from pathlib import Path

import pytest

from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import int_list_meta, read_gguf
from featdiff.diff import compare_dumps
from featdiff.driver.capture import capture
from featdiff.dump.reader import read_dump
from featdiff.factory.converter import convert_checkpoint
from featdiff.factory.gguf_rewrite import rewrite_gguf
from featdiff.llama import ggml_dequant
from featdiff.torchref.kind import reference

from eagle3_real import ROUNDS, TOKENS

pytestmark = pytest.mark.slow  # the pinned converter makes the pairs (cached per machine)


def _hf_reference(d: Path, run: Path, tmp: Path) -> Path:
    return reference(
        d / "target.gguf", d / "draft-hf", tmp / "ref.npz", prompt=None, tokens=TOKENS, rounds=ROUNDS,
        dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None, run=run,
    )  # fmt: skip


def _errors(ref: Path, run: Path) -> list:
    return [f for f in compare_dumps(ref, run).findings if f.severity == "error"]


@pytest.mark.parametrize(
    ("variant", "trainer"),
    [("eagle3-specforge", "specforge"), ("eagle3-speculators", "speculators"), ("eagle3-eagle", "eagle")],
)
def test_each_trainers_checkpoint_compares_clean_from_hf(eagle3_pairs, tmp_path, variant, trainer):
    d = eagle3_pairs(variant)
    run = capture(d / "target.gguf", d / "draft.gguf", tmp_path / "run.npz", tokens=TOKENS, rounds=ROUNDS)
    ref = _hf_reference(d, run, tmp_path)
    c = compare_dumps(ref, run)
    assert c.ok and not c.skipped, [f.message for f in c.findings if f.severity == "error"]
    with read_dump(ref) as dump:
        assert dump.manifest.models["draft"]["checkpoint"]["trainer"] == trainer


def test_specforge_ids_not_shifted_are_a_layer_offset_naming_both_conventions(eagle3_pairs, tmp_path):
    d = eagle3_pairs("eagle3-specforge")  # eagle_config ids [0, 2, 4]: outputs, tapped as inputs [1, 3, 5]
    unshifted = rewrite_gguf(
        d / "draft.gguf", tmp_path / "draft-unshifted.gguf", keys={"eagle3.target_layers": [0, 2, 4]}
    )
    run = capture(d / "target.gguf", unshifted, tmp_path / "run.npz", tokens=TOKENS, rounds=ROUNDS)
    first = _errors(_hf_reference(d, run, tmp_path), run)[0]
    assert first.kind == "layer_offset", first.message
    assert first.fields["observed_layers"] == [0, 2, 4] and first.fields["expected_layers"] == [1, 3, 5]
    assert "reads layer outputs" in first.message and "llama.cpp taps layer inputs" in first.message
    assert "ids + 1" in first.message and "specforge" in first.message
    assert first.fields["where"] == "export", first.fields


def test_the_pinned_converter_reads_no_eagle_config_and_writes_its_default(eagle3_pairs, tmp_path):
    """Why eagle3-specforge's draft.gguf is fixed after conversion: conversion/llama.py reads only the
    top-level eagle_aux_hidden_state_layer_ids, so SpecForge's nested ids become [2, n // 2, n - 3]."""
    d = eagle3_pairs("eagle3-specforge")
    raw = convert_checkpoint(d / "draft-hf", tmp_path / "raw.gguf", target_dir=d / "target-hf")
    assert int_list_meta(read_gguf(raw, ggml_dequant.load), "eagle3.target_layers") == [2, 3, 3]


def test_fc_norm_is_refused_by_the_converter_and_its_drop_is_named(eagle3_pairs, tmp_path):
    d = eagle3_pairs("eagle3-specforge-fc-norm")
    with pytest.raises(InputError, match="fc_norm.0.weight"):
        convert_checkpoint(d / "draft-hf", tmp_path / "raw.gguf", target_dir=d / "target-hf")
    run = capture(d / "target.gguf", d / "draft.gguf", tmp_path / "run.npz", tokens=TOKENS, rounds=ROUNDS)
    errors = _errors(_hf_reference(d, run, tmp_path), run)
    assert errors, "a drafter without its per-slot norms compared clean"
    first = errors[0]
    assert first.kind == "wrong_source" and first.fields["candidate"] == "fc_out@fc_norm=none", first.message
    assert "fc_norm" in first.message and first.fields["where"] == "export", first.fields


def test_check_and_probe_take_layer_ids_mean_for_a_checkpoint_that_cannot_tell(eagle3_pairs, tmp_path):
    """Top-level ids [0, 2, 4] beside a SpecForge block without its own: refused (exit 2) until the
    flag says what they name; read as outputs they are the GGUF's inputs [1, 3, 5] (clean), read as
    inputs they are one layer off (layer_offset)."""
    import json
    import shutil

    from typer.testing import CliRunner

    from featdiff.cli import app

    d = eagle3_pairs("eagle3")  # draft.gguf taps the inputs of [1, 3, 5]
    amb = tmp_path / "draft-hf"
    shutil.copytree(d / "draft-hf", amb)
    config = json.loads((amb / "config.json").read_text())
    ids = {"eagle_aux_hidden_state_layer_ids": [0, 2, 4], "eagle_config": {}}
    (amb / "config.json").write_text(json.dumps({**config, **ids}))
    probe = ["probe", "--target", str(d / "target.gguf"), "--model", str(d / "draft.gguf"), "--ref-model", str(amb)]
    refused = CliRunner().invoke(app, [*probe, "--rounds", "2"])
    assert refused.exit_code == 2 and "--layer-ids-mean input|output" in refused.output, refused.output
    done = CliRunner().invoke(app, [*probe, "--rounds", "2", "--layer-ids-mean", "output"])
    assert done.exit_code == 0, done.output
    check = ["check", "--target", str(d / "target.gguf"), "--model", str(d / "draft.gguf"), "--ref-model", str(amb)]
    checked = CliRunner().invoke(app, [*check, "--rounds", "2", "--layer-ids-mean", "output"])
    assert checked.exit_code == 0, checked.output
    wrong = CliRunner().invoke(app, [*check, "--rounds", "2", "--layer-ids-mean", "input"])
    assert wrong.exit_code == 1 and "layer_offset" in wrong.output, wrong.output
