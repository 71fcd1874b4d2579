"""The table of what the reference models (featdiff.kinds.dflash.modelled) against the real llama.cpp build:
each modelled converter key, on a correct drafter the pinned converter wrote, compares clean from
the GGUF and from the HF directory; an unmodelled one makes `reference` exit 2 naming it, and lint
lists it. Conversions are cached per machine: the module is `slow`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from featdiff.kinds import registry
from featdiff.kinds.dflash import modelled
from featdiff.cli import app
from featdiff.diff.comparison import compare_dumps
from featdiff.factory.converter import UNCONVERTIBLE_FEATURES, write_converted_feature_fixture
from featdiff.factory.features import write_feature_fixture
from featdiff.dump.model_info import model_info
from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS, reference_of

pytestmark = pytest.mark.slow
DOC = Path(__file__).resolve().parents[2] / "docs" / "modelled.md"
MODELLED = (
    "embedding-scale",
    "value-scale",
    "logit-scale",
    "fc-scale",
    "sliding-window",
    "attn-sinks",
    "interleaved-rope",
    "causal",
    "partial-rotary",
    "mrope-sections",
    "mask-embedding",
)
REFUSED = {"q-scale": "blk.*.attn_q.scale"}  # as the GGUF names it
REFUSED_HF = {"q-scale": "layers.0.self_attn.q_proj.weight_scale_2"}  # as the HF directory does


@pytest.fixture(scope="module")
def feature_dir(tmp_path_factory):
    """feature -> its fixture directory, whose GGUFs the pinned converter wrote from the HF
    directories (featdiff's writer for the features the converter cannot write)."""
    made: dict[str, Path] = {}

    def get(feature: str) -> Path:
        if feature not in made:
            write = write_feature_fixture if feature in UNCONVERTIBLE_FEATURES else write_converted_feature_fixture
            made[feature] = write(tmp_path_factory.mktemp(f"feat-{feature}"), feature)
        return made[feature]

    return get


@pytest.fixture(scope="module")
def run_of(feature_dir, tmp_path_factory):
    from featdiff.driver.capture import capture

    made: dict[str, Path] = {}

    def get(feature: str) -> Path:
        if feature not in made:
            d = feature_dir(feature)
            out = tmp_path_factory.mktemp(f"run-{feature}") / "run.npz"
            made[feature] = capture(
                d / "target.gguf", d / "draft.gguf", out, tokens=DEFAULT_TOKENS, rounds=DEFAULT_ROUNDS
            )
        return made[feature]

    return get


def _errors(ref: Path, run: Path) -> list[str]:
    return [f"{f.kind} at {f.tensor}: {f.message}" for f in compare_dumps(ref, run).findings if f.severity == "error"]


def test_docs_modelled_md_is_rendered_from_the_table():
    assert DOC.read_text() == registry.render_markdown(), "regenerate: featdiff.kinds.registry.render_markdown()"


@pytest.mark.parametrize("feature", MODELLED)
@pytest.mark.parametrize("model", ["draft.gguf", "draft-hf"])
def test_modelled_key_compares_clean_against_llama_cpp(feature_dir, run_of, tmp_path, feature, model):
    d = feature_dir(feature)
    ref = reference_of(d / "target.gguf", d / model, tmp_path / "ref.npz", tokens=DEFAULT_TOKENS, rounds=DEFAULT_ROUNDS)
    assert _errors(ref, run_of(feature)) == []


# Every modelled feature but the logits-only keys (the plain reference's) and the M-RoPE sections,
# whose degenerate form computes as no sections by design
@pytest.mark.parametrize(
    "feature",
    ["embedding-scale", "value-scale", "fc-scale", "sliding-window", "attn-sinks", "causal", "partial-rotary",
     "mask-embedding"],
)  # fmt: skip
def test_a_reference_without_the_key_is_blamed_on_the_run(feature_dir, run_of, tmp_path, feature):
    """The keys (and fc.scale, the sinks) change what llama.cpp computes: a reference of the same weights
    without them gets error findings against the run, so the clean comparisons above are not vacuous."""
    plain = write_feature_fixture(tmp_path / "fx", "logit-scale")  # same weights; logits-only keys
    ref = reference_of(
        plain / "target.gguf", plain / "draft.gguf", tmp_path / "ref.npz", tokens=DEFAULT_TOKENS, rounds=DEFAULT_ROUNDS
    )
    assert _errors(ref, run_of(feature))


def _with_config(src: Path, dst: Path, **fields: object) -> Path:
    """A copy of the HF directory `src` at `dst` with config.json's `fields` set (None: removed)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return dst


def test_an_interleaved_checkpoint_read_as_neox_is_blamed_on_the_run(feature_dir, run_of, tmp_path):
    """The same interleaved-RoPE directory with `rope_is_neox_style` dropped: q/k rows left in
    interleaved order give error findings, so the clean comparison above rests on the permutation."""
    d = feature_dir("interleaved-rope")
    plain = _with_config(d / "draft-hf", tmp_path / "draft-hf", **{modelled.HF_ROPE_IS_NEOX: None})
    ref = reference_of(d / "target.gguf", plain, tmp_path / "ref.npz", tokens=DEFAULT_TOKENS, rounds=DEFAULT_ROUNDS)
    assert _errors(ref, run_of("interleaved-rope"))


def test_an_interleaved_checkpoint_with_partial_rotary_is_refused_by_name(feature_dir, tmp_path):
    d = feature_dir("interleaved-rope")
    partial = _with_config(d / "draft-hf", tmp_path / "draft-hf", partial_rotary_factor=0.5)
    result = CliRunner().invoke(
        app,
        ["reference", "--target", str(d / "target.gguf"), "--model", str(partial), "-o", str(tmp_path / "r.npz"),
         "--tokens", DEFAULT_TOKENS],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"{modelled.HF_ROPE_IS_NEOX} = false with partial rotary" in result.output


@pytest.mark.parametrize("feature", list(REFUSED))
@pytest.mark.parametrize("model", ["draft.gguf", "draft-hf"])
def test_unmodelled_key_makes_reference_exit_2_naming_it(feature_dir, tmp_path, feature, model):
    d = feature_dir(feature)
    result = CliRunner().invoke(
        app,
        ["reference", "--target", str(d / "target.gguf"), "--model", str(d / model), "-o", str(tmp_path / "r.npz"),
         "--tokens", DEFAULT_TOKENS],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert (REFUSED if model == "draft.gguf" else REFUSED_HF)[feature] in result.output
    assert "featdiff models dflash.embedding_scale" in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("feature", list(REFUSED))
def test_lint_lists_the_unmodelled_key_and_capture_records_it(feature_dir, feature):
    d = feature_dir(feature)
    result = CliRunner().invoke(app, ["lint", str(d / "draft.gguf")])
    assert result.exit_code == 1
    assert any(REFUSED[feature] in line and "not modelled" in line for line in result.output.splitlines())
    info = model_info(d / "draft.gguf", with_hash=False)
    assert REFUSED[feature] in info.unmodelled
    assert type(info).from_json(info.to_json()).unmodelled == info.unmodelled


def test_unknown_dflash_key_and_tensor_are_refused_and_inert_values_are_not():
    found = modelled.unmodelled_in(
        {"dflash.some_future_key": 1, "dflash.attention.scale": 0.0, "dflash.hidden_activation": "silu"},
        ["blk.0.attn_q.scale", "blk.1.attn_q.scale", "fc.weight", "fc.scale", "blk.0.attn_sinks.weight"],
    )
    assert found == ("dflash.some_future_key", "blk.*.attn_q.scale")


def test_hf_fields_map_to_the_converters_keys():
    config = {
        "dflash_config": {"use_swa": True, "swa_window_size": 8, "input_embedding_scale": 2.0},
        "num_hidden_layers": 2,
    }
    found = modelled.unmodelled_in_hf(
        config,
        ["fc.weight", "fc.weight_scale_2", "layers.0.self_attn.sinks", "layers.0.self_attn.q_proj.weight_scale_2"],
        ["mask_embedding.pt"],
    )
    assert found == ("layers.0.self_attn.q_proj.weight_scale_2",)  # mask_embedding.pt: modelled
    keys = modelled.converter_keys(config)
    assert keys[modelled.KEY_EMBEDDING_SCALE] == 2.0
    assert (keys[modelled.KEY_SLIDING_WINDOW], keys[modelled.KEY_SLIDING_WINDOW_PATTERN]) == (8, [True, True])


def test_sections_other_than_the_degenerate_ones_are_refused_by_name(feature_dir, tmp_path):
    """M-RoPE sections that give rows a second position section (a vision target's drafter) are not
    what the reference computes: `reference` exits 2 naming the key."""
    from featdiff.factory.gguf_rewrite import rewrite_gguf

    d = feature_dir("mrope-sections")
    real_mrope = rewrite_gguf(d / "draft.gguf", tmp_path / "draft.gguf", {modelled.KEY_ROPE_SECTIONS: [4, 2, 2, 0]}, {})
    result = CliRunner().invoke(
        app,
        ["reference", "--target", str(d / "target.gguf"), "--model", str(real_mrope), "-o", str(tmp_path / "r.npz"),
         "--tokens", DEFAULT_TOKENS],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert modelled.KEY_ROPE_SECTIONS in result.output
    assert modelled.sections_modelled(modelled.degenerate_sections(16)) and not modelled.sections_modelled([4, 2, 2, 0])


def test_a_mask_row_of_another_token_is_refused_as_the_converter_refuses_it(feature_dir, tmp_path):
    import torch

    d = feature_dir("mask-embedding")
    draft = tmp_path / "draft-hf"
    shutil.copytree(d / "draft-hf", draft)
    saved = torch.load(draft / modelled.MASK_EMBEDDING_FILE, weights_only=True)
    torch.save({**saved, "mask_token_id": saved["mask_token_id"] + 1}, draft / modelled.MASK_EMBEDDING_FILE)
    result = CliRunner().invoke(
        app,
        ["reference", "--target", str(d / "target-hf"), "--model", str(draft), "-o", str(tmp_path / "r.npz"),
         "--tokens", DEFAULT_TOKENS],
    )  # fmt: skip
    assert result.exit_code == 2 and modelled.MASK_EMBEDDING_FILE in result.output, result.output
