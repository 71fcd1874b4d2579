"""DSpark drafters in and out: the fixtures write them, the loaders read GGUF and HF to the same
record (d2t as absolute ids both ways), refuse what llama.cpp refuses or misruns, lint lists the
keys that disagree with the tensors, and the manifest's `dspark` entry says what the heads are."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from featdiff.core import names
from featdiff.cli import app
from featdiff.core.errors import InputError
from featdiff.factory.pairs import MARKOV_RANK, TINY
from featdiff.dump.manifest_fields import ModelInfo
from featdiff.verdict.lint import lint_gguf
from featdiff.torchref.load import load_draft
from featdiff.torchref.weights import models_entry

CPU = torch.device("cpu")
N_EMBD = TINY.draft.n_embd
DSPARK_VARIANTS = {  # variant: (sample_from_anchor, has confidence head, has markov_w2.scale, n_vocab_draft)
    "dspark": (True, True, True, TINY.n_vocab),
    "dspark-no-conf": (True, False, False, TINY.n_vocab),
    "dspark-bonus": (False, True, False, TINY.n_vocab),
    "dspark-d2t": (True, True, False, TINY.n_vocab // 2),
}


def _load(path):
    return load_draft(path, torch.float32, CPU)


def _same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("variant", sorted(DSPARK_VARIANTS))
def test_gguf_and_hf_load_to_the_same_dspark_record(variant, variant_dir):
    anchor_first, conf, scale, n_vocab_draft = DSPARK_VARIANTS[variant]
    g, h = _load(variant_dir(variant) / "draft.gguf"), _load(variant_dir(variant) / "draft-hf")
    for field in ("markov_w1", "markov_w2", "markov_w2_scale", "conf_w", "conf_b"):
        assert _same(getattr(g.dspark, field), getattr(h.dspark, field)), field
    assert g.dspark.sample_from_anchor == h.dspark.sample_from_anchor == anchor_first
    assert g.dspark.has_confidence_head == conf and (g.dspark.markov_w2_scale is not None) == scale
    assert g.dspark.markov_w2.shape == (n_vocab_draft, MARKOV_RANK) and g.dspark.rank == MARKOV_RANK
    assert g.causal is h.causal is False
    assert _same(g.d2t, h.d2t) and _same(g.output, h.output)


def test_d2t_is_absolute_from_gguf_and_from_hf_offsets(variant_dir):
    d = variant_dir("dspark-d2t")
    offsets = load_file(str(d / "draft-hf" / "model.safetensors"))[names.HF_D2T]  # (n_vocab_draft,)
    stored = next(t for t in GGUFReader(str(d / "draft.gguf")).tensors if t.name == names.T_D2T)
    ids = offsets + np.arange(offsets.size)
    assert not np.array_equal(offsets, ids)  # the fixture's offsets are not all 0
    for draft in (_load(d / "draft.gguf"), _load(d / "draft-hf")):
        assert draft.d2t.dtype == torch.int64 and np.array_equal(draft.d2t.numpy(), ids)
        assert draft.output.shape == (TINY.n_vocab // 2, N_EMBD) and draft.token_embd is None
    assert stored.tensor_type.name == "I64" and np.array_equal(stored.data, ids)


def test_fault_exports_load_as_the_run_sees_them(variant_dir):
    lost, flipped = variant_dir("dspark-lost-markov"), variant_dir("dspark-anchor-flipped")
    assert _load(lost / "draft.gguf").dspark is None  # llama.cpp runs it as plain DFlash
    assert _load(lost / "draft-hf").dspark is not None
    assert _load(flipped / "draft.gguf").dspark.sample_from_anchor is False
    assert _load(flipped / "draft-hf").dspark.sample_from_anchor is True


REFUSED = {
    # name: (variant, rewrite arguments, expected text)
    "w1-without-w2": (
        "dspark",
        {"drop_tensors": (names.T_MARKOV_W2,)},
        "carries markov_w1.weight but no markov_w2.weight; llama.cpp refuses",
    ),
    "w2-without-w1": (
        "dspark-no-conf",
        {"drop_tensors": (names.T_MARKOV_W1,)},
        "carries markov_w2.weight but no markov_w1.weight, so llama.cpp leaves them unused",
    ),
    "conf-without-markov": (
        "dspark",
        {"drop_tensors": (names.T_MARKOV_W1, names.T_MARKOV_W2, names.T_MARKOV_W2_SCALE)},
        "carries conf_proj.weight, conf_proj.bias but no markov_w1.weight",
    ),
    "conf-width": (
        "dspark",
        {"replace_tensors": {names.T_CONF_PROJ_W: np.zeros((1, N_EMBD), np.float32)}},
        f"conf_proj.weight has shape [1, {N_EMBD}], expected [1, {N_EMBD + MARKOV_RANK}]",
    ),
    "d2t-int32": (
        "dspark-d2t",
        {"replace_tensors": {names.T_D2T: np.arange(TINY.n_vocab // 2, dtype=np.int32)}},
        "d2t is stored as int32, llama.cpp reads int64",
    ),
    "d2t-out-of-range": (
        "dspark-d2t",
        {"replace_tensors": {names.T_D2T: np.arange(TINY.n_vocab // 2) + TINY.n_vocab}},
        "d2t holds ids 512..767 outside the vocabulary of 512 tokens",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_loader_refuses_broken_dspark_gguf(case, variant_dir, edit_gguf, tmp_path):
    variant, edits, expected = REFUSED[case]
    broken = edit_gguf(variant_dir(variant) / "draft.gguf", tmp_path / "D.gguf", **edits)
    with pytest.raises(InputError, match=r"D\.gguf: .*" + re.escape(expected)):
        _load(broken)


def _hf_copy(variant_dir, tmp_path, variant="dspark", drop=(), config=None):
    """A copy of a fixture's draft-hf with tensors dropped and config.json keys set."""
    hf = shutil.copytree(variant_dir(variant) / "draft-hf", tmp_path / "draft-hf")
    tensors = load_file(str(hf / "model.safetensors"))
    save_file({k: a for k, a in tensors.items() if k not in drop}, str(hf / "model.safetensors"))
    cfg = json.loads((hf / names.HF_CONFIG).read_text())
    (hf / names.HF_CONFIG).write_text(json.dumps({**cfg, **(config or {})}))
    return hf


def test_hf_markov_head_without_w2_is_refused_in_hf_names(variant_dir, tmp_path):
    hf = _hf_copy(variant_dir, tmp_path, drop=(names.HF_MARKOV_W2,))
    with pytest.raises(InputError, match="carries markov_head.markov_w1.weight but no markov_head.markov_w2.weight"):
        _load(hf)


def test_hf_markov_head_of_another_type_is_refused(variant_dir, tmp_path):
    hf = _hf_copy(variant_dir, tmp_path, config={"markov_head_type": "mlp"})
    with pytest.raises(InputError, match="markov_head_type = 'mlp'.*'vanilla' only"):
        _load(hf)


def test_hf_reduced_vocabulary_without_d2t_is_refused(variant_dir, tmp_path):
    hf = _hf_copy(variant_dir, tmp_path, "dspark-d2t", drop=(names.HF_D2T,))
    with pytest.raises(InputError, match="draft_vocab_size = 256 < vocab_size 512 but there is no d2t"):
        _load(hf)


def test_causal_key_and_config_load_as_causal(variant_dir, edit_gguf, tmp_path):
    gguf = edit_gguf(
        variant_dir("dspark") / "draft.gguf",
        tmp_path / "D.gguf",
        set_keys={names.KEY_CAUSAL: (True, GGUFValueType.BOOL)},
    )
    hf = _hf_copy(variant_dir, tmp_path, config={names.HF_IS_CAUSAL: True})
    assert _load(gguf).causal is _load(hf).causal is True
    assert models_entry(_load(gguf))["dspark"]["causal"] is True


@pytest.mark.parametrize("variant", [*sorted(DSPARK_VARIANTS), "dspark-anchor-flipped"])
def test_lint_passes_dspark_fixture_drafters(variant, variant_dir):
    d = variant_dir(variant)
    assert lint_gguf(d / "draft.gguf", d / "target.gguf") == []


def test_lint_says_the_export_lost_its_markov_head(variant_dir):
    d = variant_dir("dspark-lost-markov")
    problems = lint_gguf(d / "draft.gguf", d / "target.gguf")
    assert len(problems) == 2, problems
    assert "llama.cpp runs it as plain DFlash: the export lost its Markov head" in problems[0]
    assert "dflash.has_confidence_head = true without markov_w1.weight" in problems[1]
    result = CliRunner().invoke(app, ["lint", str(d / "draft.gguf")])
    assert result.exit_code == 1 and "lost its Markov head" in result.output


def test_fixture_command_writes_a_dspark_pair(tmp_path):
    out = tmp_path / "fx"
    result = CliRunner().invoke(app, ["fixture", str(out), "--variant", "dspark"])
    assert result.exit_code == 0, result.output
    for f in (
        "target.gguf",
        "draft.gguf",
        "VARIANT",
        "target-hf/config.json",
        "target-hf/model.safetensors",
        "draft-hf/config.json",
        "draft-hf/model.safetensors",
    ):
        assert (out / f).is_file(), f
    reader = GGUFReader(str(out / "draft.gguf"))
    assert {t.name for t in reader.tensors} >= {
        names.T_MARKOV_W1,
        names.T_MARKOV_W2,
        names.T_MARKOV_W2_SCALE,
        names.T_CONF_PROJ_W,
        names.T_CONF_PROJ_B,
    }
    assert reader.fields[names.KEY_SAMPLE_FROM_ANCHOR].contents() is True
    assert reader.fields[names.KEY_HAS_CONFIDENCE_HEAD].contents() is True
    config = json.loads((out / "draft-hf" / names.HF_CONFIG).read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config[names.HF_SAMPLE_FROM_ANCHOR] is True


@pytest.mark.parametrize("variant", sorted(DSPARK_VARIANTS))
def test_models_entry_carries_the_same_dspark_dict_from_gguf_and_hf(variant, variant_dir):
    anchor_first, conf, _, n_vocab_draft = DSPARK_VARIANTS[variant]
    expected = {
        "markov": True,
        "rank": MARKOV_RANK,
        "confidence_head": conf,
        "sample_from_anchor": anchor_first,
        "causal": False,
        "n_vocab_draft": n_vocab_draft,
    }
    d = variant_dir(variant)
    assert models_entry(_load(d / "draft.gguf"))["dspark"] == expected
    assert models_entry(_load(d / "draft-hf"))["dspark"] == expected


def test_models_entry_of_a_dflash_drafter_has_no_dspark(variant_dir):
    assert models_entry(_load(variant_dir("clean") / "draft.gguf"))["dspark"] is None
    assert models_entry(_load(variant_dir("dspark-lost-markov") / "draft.gguf"))["dspark"] is None


def test_old_manifest_entry_without_dspark_still_parses(variant_dir):
    entry = models_entry(_load(variant_dir("dspark") / "draft.gguf"))
    assert ModelInfo.from_json(entry).to_json() == entry
    old = {k: v for k, v in entry.items() if k != "dspark"}
    info = ModelInfo.from_json(old)
    assert info.dspark is None and info.target_layers == (2, 4)
