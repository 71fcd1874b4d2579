"""The fixtures through llama.cpp's own converter: the pinned `convert_hf_to_gguf.py` turns the HF
checkpoints into GGUFs that load and run in llama.cpp, compare clean against the reference built
from the HF directory and from the converted GGUF, and agree with featdiff's own writer up to the
named conventions below."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

import featdiff
from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.diff import exit_code
from featdiff.dump.reader import read_dump
from featdiff.factory import pairs
from featdiff.factory.converter import (
    DRAFT_GGUF,
    DRAFT_HF,
    DSPARK_SCHEMAS,
    TARGET_GGUF,
    TARGET_HF,
    TOKENIZER_MODEL,
    UNCONVERTIBLE_FEATURES,
    WRITER_PREFIX,
    conversion_key,
    convert_checkpoint,
    dspark_config,
    unconvertible_reason,
    write_converted_feature_fixture,
    write_converted_fixture,
    write_spm_tokenizer,
)
from featdiff.factory.features import feature_names, write_feature_fixture
from featdiff.factory.fixtures import VOCAB_SPM, write_fixture
from featdiff.programs.exec import capture_exec
from featdiff.torchref.load_hf import converter_config

from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS

# The correct variants: the converter's GGUFs of their checkpoints run and compare clean
CONVERTED = ("clean", "own-embd", "llama", "dspark-no-conf", "dspark-bonus", "dspark-d2t", "yarn")
# Keys featdiff's writer and the converter write differently, each a convention of featdiff's writer:
# special-token ids (featdiff's HF config.json states no bos/eos ids, so the converter writes none),
# the pre-tokenizer name, the mask id in the target too, and rope.dimension_count where it equals
# the head size (llama.cpp's default); the llama converter adds llama.vocab_size.
_SPECIAL_IDS = {
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.pre",
}
WRITER_CONVENTIONS = {
    "qwen3": _SPECIAL_IDS | {names.KEY_MASK_TOKEN, "qwen3.rope.dimension_count"},
    "llama": _SPECIAL_IDS | {names.KEY_MASK_TOKEN, "llama.vocab_size"},
    names.ARCH_DFLASH: _SPECIAL_IDS | {"dflash.rope.dimension_count"},
}
FLOW = {"tokens": DEFAULT_TOKENS, "rounds": DEFAULT_ROUNDS}
PROVENANCE = "general."  # name, size label, file type: what made the file, not what it computes


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(variant, dspark_schema) -> a fixture directory whose GGUFs the pinned converter wrote."""
    made: dict[tuple[str, str], Path] = {}

    def get(variant: str = "clean", schema: str = "nested") -> Path:
        if (variant, schema) not in made:
            out = tmp_path_factory.mktemp(f"conv-{variant}-{schema}")
            made[variant, schema] = write_converted_fixture(out, variant, dspark_schema=schema)
        return made[variant, schema]

    return get


@pytest.fixture(scope="module")
def converted_run(tmp_path_factory, converted):
    """(variant, dspark_schema) -> the in-process capture of its converted pair (made once)."""
    made: dict[tuple[str, str], Path] = {}

    def get(variant: str, schema: str = "nested") -> Path:
        if (variant, schema) not in made:
            d = converted(variant, schema)
            out = tmp_path_factory.mktemp(f"conv-run-{variant}-{schema}") / "run.npz"
            made[variant, schema] = featdiff.capture(d / "target.gguf", d / "draft.gguf", out, **FLOW)
        return made[variant, schema]

    return get


def _contents(path: Path) -> tuple[dict, dict]:
    """A GGUF's keys (less provenance) and tensors: name -> value, name -> (ggml type, array)."""
    reader = GGUFReader(str(path))
    keys = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith(("GGUF.", PROVENANCE))}
    tensors = {t.name: (t.tensor_type.name, np.array(t.data)) for t in reader.tensors}
    return keys, tensors


def _differences(ours: Path, theirs: Path) -> set[str]:
    """The key and tensor names whose presence, value, type, shape or bytes differ."""
    (ka, ta), (kb, tb) = _contents(ours), _contents(theirs)
    keys = {k for k in ka.keys() | kb.keys() if k not in ka or k not in kb or ka[k] != kb[k]}
    same = {n for n in ta.keys() & tb.keys() if ta[n][0] == tb[n][0] and np.array_equal(ta[n][1], tb[n][1])}
    return keys | ((ta.keys() | tb.keys()) - same)


@pytest.mark.slow
@pytest.mark.parametrize("variant", CONVERTED)
def test_converter_and_featdiff_writer_differ_only_by_named_conventions(converted, tmp_path, variant):
    ours = write_fixture(tmp_path / "ours", variant, vocab=VOCAB_SPM)
    theirs = converted(variant)
    arch = pairs.VARIANTS[variant].target_arch
    assert _differences(ours / "target.gguf", theirs / "target.gguf") == WRITER_CONVENTIONS[arch]
    assert _differences(ours / "draft.gguf", theirs / "draft.gguf") == WRITER_CONVENTIONS[names.ARCH_DFLASH]
    keys, _ = _contents(theirs / "draft.gguf")
    assert keys[names.KEY_TARGET_LAYERS] == [i + 1 for i in pairs.HF_TARGET_LAYER_IDS]  # the converter's +1
    assert keys[names.KEY_MASK_TOKEN] == pairs.MASK_TOKEN_ID


@pytest.mark.slow
@pytest.mark.parametrize("model", ["draft-hf", "draft.gguf"])
@pytest.mark.parametrize("variant", CONVERTED)
def test_converted_pair_runs_and_compares_clean(converted, converted_run, tmp_path, variant, model):
    d = converted(variant)
    ref = featdiff.reference(d / "target.gguf", d / model, tmp_path / "ref.npz", **FLOW)
    c = featdiff.compare(ref, converted_run(variant))
    assert exit_code(c) == 0 and c.ok, [(f.kind, f.tensor, f.message) for f in c.findings if f.severity == "error"]
    assert c.coverage.skips == () and c.coverage.run_only == 0 and len(c.pairs) > 40


# DSpark variants laid out as each flat schema implies (converter.dspark_config)
SCHEMA_CASES = [("dspark-no-conf", "lineage"), ("dspark-bonus", "eagle3"), ("dspark-d2t", "lineage")]


@pytest.mark.slow
@pytest.mark.parametrize("variant, schema", SCHEMA_CASES)
def test_dspark_schemas_convert_to_the_nested_schemas_gguf(converted, variant, schema):
    assert schema in DSPARK_SCHEMAS
    assert _differences(converted(variant) / "draft.gguf", converted(variant, schema) / "draft.gguf") == set()


@pytest.mark.slow
@pytest.mark.parametrize("variant, schema", SCHEMA_CASES)
def test_dspark_schema_directory_compares_clean_against_its_converted_gguf(
    converted, converted_run, tmp_path, variant, schema
):
    """The reference reads a flat or EAGLE3-style checkpoint directory as the converter does: it
    compares clean against llama.cpp running the GGUF the converter made of that directory."""
    d = converted(variant, schema)
    ref = featdiff.reference(d / "target.gguf", d / DRAFT_HF, tmp_path / "ref.npz", **FLOW)
    c = featdiff.compare(ref, converted_run(variant, schema))
    assert exit_code(c) == 0 and c.ok, [(f.kind, f.tensor, f.message) for f in c.findings if f.severity == "error"]
    assert c.coverage.skips == () and c.coverage.run_only == 0 and len(c.pairs) > 40


@pytest.mark.parametrize("variant, schema", [*SCHEMA_CASES, ("dspark", "nested")])
def test_dspark_schemas_read_as_the_nested_config(tmp_path, variant, schema):
    """What the converter reads of each schema (DSparkModel.__init__) is the nested config's: the
    same layer ids (EAGLE3's are GGUF ids, hf + 1), mask id, anchor layout and stack sizes."""
    nested = json.loads((write_fixture(tmp_path, variant) / DRAFT_HF / names.HF_CONFIG).read_text())
    read = converter_config(dspark_config(nested, schema))
    assert read[names.HF_DFLASH_CONFIG] == {
        k: nested[names.HF_DFLASH_CONFIG][k] for k in (names.HF_TARGET_LAYER_IDS, names.HF_MASK_TOKEN_ID)
    } | ({} if schema != "nested" else nested[names.HF_DFLASH_CONFIG])
    assert read[names.HF_SAMPLE_FROM_ANCHOR] == nested[names.HF_SAMPLE_FROM_ANCHOR]
    assert {k: read[k] for k in nested if k != names.HF_DFLASH_CONFIG} == {
        k: v for k, v in nested.items() if k != names.HF_DFLASH_CONFIG
    }


@pytest.mark.slow
def test_converter_permutes_an_interleaved_rope_checkpoint_into_the_clean_gguf(tmp_path):
    """`rope_is_neox_style: false` (fixtures' `interleaved-rope`: the clean drafter's q/k rows
    interleaved): the pinned converter's permutation gives back the clean GGUF's tensors, the one
    the reference applies reading the directory (tests/reference/test_modelled.py)."""
    d = write_feature_fixture(tmp_path / "fx", "interleaved-rope")
    n_vocab = json.loads((d / TARGET_HF / names.HF_CONFIG).read_text())["vocab_size"]
    write_spm_tokenizer(d / TARGET_HF / TOKENIZER_MODEL, n_vocab)
    out = convert_checkpoint(d / DRAFT_HF, tmp_path / "draft.gguf", target_dir=d / TARGET_HF)
    (_, ours), (_, theirs) = _contents(d / "draft.gguf"), _contents(out)
    permuted = [n for n in ours if n.endswith(("attn_q.weight", "attn_k.weight", "q_norm.weight", "k_norm.weight"))]
    assert len(permuted) == 4 * pairs.TINY.draft.n_layer
    assert {n for n in ours if n not in theirs or not np.array_equal(ours[n][1], theirs[n][1])} == set()


@pytest.mark.slow
def test_converter_drops_a_qwen3_drafters_llama3_rope_scaling(converted, converted_run, tmp_path):
    """A converter fault the pinned tree has: DFlashModel (a Qwen3Model) writes no rope_freqs for a
    drafter whose config.json says rope_scaling llama3, so llama.cpp ropes the drafter unscaled; the
    reference from the checkpoint names the first record the drafter's RoPE touches."""
    d = converted("llama3-rope")
    assert names.T_ROPE_FREQS in _contents(d / "target.gguf")[1]
    assert names.T_ROPE_FREQS not in _contents(d / "draft.gguf")[1]
    ref = featdiff.reference(d / "target.gguf", d / "draft-hf", tmp_path / "ref.npz", **FLOW)
    c = featdiff.compare(ref, converted_run("llama3-rope"))
    first = [f for f in c.findings if f.severity == "error"][0]
    assert exit_code(c) == 1 and first.tensor == "Kcur_injected-0"
    assert (first.kind, first.fields.get("detail")) == ("divergence", "rope")  # detect_divergence_in_rope


@pytest.mark.slow
def test_converter_refuses_a_log_snr_checkpoint(tmp_path):
    d = write_fixture(tmp_path / "fx", "log-snr", vocab=VOCAB_SPM)
    with pytest.raises(InputError, match="Can not map tensor 'model.log_snr_fc"):
        convert_checkpoint(d / "draft-hf", tmp_path / "draft.gguf", target_dir=d / "target-hf")


@pytest.mark.parametrize(
    "variant, why", [("layers-plus1", "gguf_layer_delta"), ("log-snr", "log_snr"), ("dspark", "markov_w2.scale")]
)
def test_unconvertible_variants_are_refused_by_name(tmp_path, variant, why):
    assert why in (unconvertible_reason(variant) or "")
    with pytest.raises(InputError, match=why):
        write_converted_fixture(tmp_path / "out", variant)


def test_conversion_key_follows_the_inputs_and_the_converter(tmp_path):
    tree = tmp_path / "tree"
    for rel in ("convert_hf_to_gguf.py", "conversion/qwen.py", "gguf-py/gguf/constants.py"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text("# v1\n")
    d = write_fixture(tmp_path / "fx", "clean")
    key = conversion_key(d / "draft-hf", d / "target-hf", tree)
    assert key == conversion_key(d / "draft-hf", d / "target-hf", tree)
    assert key != conversion_key(d / "draft-hf", None, tree)
    (tree / "conversion" / "qwen.py").write_text("# v2\n")
    changed_converter = conversion_key(d / "draft-hf", d / "target-hf", tree)
    (d / "target-hf" / "tokenizer.model").write_bytes(b"x")
    assert len({key, changed_converter, conversion_key(d / "draft-hf", d / "target-hf", tree)}) == 3


# llama-server as tests/llama/test_exec.py runs it: DFlash drafts of 3, a small context, 1 thread
SERVER_ARGS = ["--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-c", "256", "-t", "1", "-td", "1"]
SERVER_TIMEOUT_S = 120


@pytest.mark.slow
@pytest.mark.parametrize("variant", CONVERTED)
def test_converted_pair_around_llama_server_compares_clean(converted, tools, tmp_path, variant):
    """Every converted kind through llama-server's own loop (a DSpark drafter as
    `--spec-type draft-dspark`)."""
    args = [a if a != "draft-dflash" or not variant.startswith("dspark") else "draft-dspark" for a in SERVER_ARGS]
    _assert_server_run_compares_clean(converted(variant), tools, tmp_path, args)


def _assert_server_run_compares_clean(d: Path, tools, tmp_path: Path, args: list[str]) -> None:
    """`d`'s converted pair around llama-server (`args`) against the reference of its HF
    directories, with the run's block length: no error, nothing skipped."""
    server = [str(tools.program("llama-server")), "-m", str(d / TARGET_GGUF), "-md", str(d / DRAFT_GGUF)]
    run = capture_exec([*server, *args], tmp_path / "run.npz", tokens=DEFAULT_TOKENS, timeout_s=SERVER_TIMEOUT_S)
    with read_dump(run) as dump:
        drafted = sum(1 for r in dump.manifest.rounds if r.drafts)  # the reference drafts every round
        tokens = ",".join(map(str, dump.manifest.prompt_tokens))
    # the run's block length (an anchor-first DSpark block is n-max rows, not n-max + 1)
    ref = featdiff.reference(d / TARGET_HF, d / DRAFT_HF, tmp_path / "ref.npz", tokens=tokens, rounds=drafted, run=run)
    c = featdiff.compare(ref, run)
    assert exit_code(c) == 0 and c.ok, [(f.kind, f.tensor, f.message) for f in c.findings if f.severity == "error"]
    assert drafted >= 1 and len(c.pairs) > 40 and c.coverage.pairs_skipped == 0


# Each modelled converter key, tensor and file (fixtures.write_feature_fixture) as the converter
# writes it (tests/reference/test_modelled.py captures and compares them in-process)
CONVERTED_FEATURES = tuple(f for f in feature_names() if f not in UNCONVERTIBLE_FEATURES)
# feature -> what the converter writes besides featdiff's writer: an M-RoPE target's own sections
# (qwen3's loader never reads them; the drafter's are the feature)
FEATURE_CONVENTIONS = {"mrope-sections": {"qwen3.rope.dimension_sections"}}


@pytest.fixture(scope="module")
def converted_feature(tmp_path_factory):
    """feature -> a fixture directory whose GGUFs the pinned converter wrote (featdiff's beside them)."""
    made: dict[str, Path] = {}

    def get(feature: str) -> Path:
        if feature not in made:
            made[feature] = write_converted_feature_fixture(tmp_path_factory.mktemp(f"convf-{feature}"), feature)
        return made[feature]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("feature", CONVERTED_FEATURES)
def test_converted_feature_gguf_is_featdiffs_writers(converted_feature, feature):
    """The converter writes each feature's keys and tensors as featdiff's writer does, so every
    finding on the writer's fixtures (tests/reference/test_modelled.py) holds for the converter's."""
    d = converted_feature(feature)
    for role, arch in ((TARGET_GGUF, "qwen3"), (DRAFT_GGUF, names.ARCH_DFLASH)):
        found = _differences(d / f"{WRITER_PREFIX}{role}", d / role)
        assert found - WRITER_CONVENTIONS[arch] - FEATURE_CONVENTIONS.get(feature, set()) == set(), role


@pytest.mark.slow
@pytest.mark.parametrize("feature", CONVERTED_FEATURES)
def test_converted_feature_around_llama_server_compares_clean(converted_feature, tools, tmp_path, feature):
    """Each feature's converted pair through llama-server's own loop, against the HF directories."""
    _assert_server_run_compares_clean(converted_feature(feature), tools, tmp_path, SERVER_ARGS)


@pytest.mark.slow
def test_a_dspark_drafter_run_as_plain_dflash_is_named(converted, tools, tmp_path):
    """The converter's correct anchor-first DSpark pair through llama-server with
    `--spec-type draft-dflash`: the block's records agree, and its drafts are read from the row after
    the anchor. compare names the reading (wrong_source at draft_logits, asking for draft-dspark)."""
    d = converted("dspark-no-conf")
    server = [str(tools.program("llama-server")), "-m", str(d / TARGET_GGUF), "-md", str(d / DRAFT_GGUF)]
    run = capture_exec([*server, *SERVER_ARGS], tmp_path / "run.npz", tokens=DEFAULT_TOKENS, timeout_s=SERVER_TIMEOUT_S)
    ref = featdiff.reference(d / TARGET_HF, d / DRAFT_HF, tmp_path / "ref.npz", follow=run)
    c = featdiff.compare(ref, run)
    errors = [f for f in c.findings if f.severity == "error"]
    assert [(f.kind, f.tensor, f.fields["source"]) for f in errors] == [
        ("wrong_source", names.DRAFT_LOGITS, "rows from 1")
    ]
    assert "--spec-type draft-dspark" in errors[0].message and exit_code(c) == 1
