"""The reference reads every weight type the build reads: a build's own ggml dequantizes what
gguf-py cannot (Q1_0), equals gguf-py where both can, and a reference of a Q1_0 target made by
the tools build's `llama-quantize` compares clean against the real library's run of it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.diff import compare_dumps
from featdiff.dump.reader import read_dump
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import array_from_tensor, read_gguf_weights
from featdiff.llama import ggml_dequant
from featdiff.llama.binding import ENV_LLAMA_DIR
from featdiff.driver.capture import capture
from featdiff.core.gguf_reader import GGUF_PY
from quantize import quantize_gguf
from real_flow import DEFAULT_TOKENS, reference_of

Q1_0 = GGMLQuantizationType.Q1_0
QK1_0, Q1_0_BYTES = GGML_QUANT_SIZES[Q1_0]  # 128 weights in 18 bytes: an f16 scale, one sign bit each
Q1_0_WEIGHT = "blk.0.ffn_down.weight"  # (n_embd, n_ff) = (64, 128): the fixture's one width Q1_0 splits
ROUNDS = 4
RUN_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def ggml():
    """The default build's ggml: the project's build of the pinned tree, the library this test
    process captures with."""
    return ggml_dequant.load(None)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0])
def test_ggml_dequantizes_exactly_as_gguf_py(ggml, qtype):
    x = np.random.default_rng(14).standard_normal((16, 256)).astype(np.float32)
    raw = quantize(x, qtype)
    ours = ggml.dequantize(raw, int(qtype), x.shape)
    assert ours.dtype == np.float32 and ours.shape == x.shape
    np.testing.assert_array_equal(ours, dequantize(raw, qtype))
    assert not np.array_equal(ours, x)  # the premise: quantization changed the values


def test_a_wrong_byte_count_is_refused(ggml):
    raw = quantize(np.ones((2, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="expected 136"):
        ggml.dequantize(raw.reshape(-1)[:-1], int(GGMLQuantizationType.Q8_0), (2, 64))
    with pytest.raises(ValueError, match="blocks of 32"):
        ggml.n_bytes(int(GGMLQuantizationType.Q8_0), (2, 48))


def test_ggml_knows_the_types_it_converts(ggml):
    assert ggml.knows(int(Q1_0)) and ggml.type_name(int(Q1_0)) == "q1_0"
    assert ggml.knows(int(GGMLQuantizationType.F32))
    assert not ggml.knows(4)  # Q4_2: removed, its row of the table is empty
    assert not ggml.knows(int(GGMLQuantizationType.I64))  # integers are read as stored, not converted
    assert not ggml.knows(-1) and not ggml.knows(10_000)  # outside the table: never handed to ggml
    assert ggml.library.name.startswith(ggml_dequant.LIBGGML_BASE)


def _q1_0(x: np.ndarray, _: GGMLQuantizationType) -> np.ndarray:
    """Q1_0 as ggml-quants.c stores it: per 128 weights the mean |x| as f16, then one bit per
    weight, set for a positive one, least significant bit first. gguf-py has no Q1_0."""
    blocks = x.reshape(-1, QK1_0)  # (n_blocks, 128)
    d = np.abs(blocks).mean(axis=1, keepdims=True).astype(np.float16)  # (n_blocks, 1)
    bits = np.packbits(blocks > 0, axis=1, bitorder="little")  # (n_blocks, 16)
    raw = np.concatenate([d.view(np.uint8), bits], axis=1)  # (n_blocks, 18)
    return raw.reshape(x.shape[0], -1)  # (rows, row bytes)


def _q1_0_values(x: np.ndarray) -> np.ndarray:
    """What a Q1_0 block decodes to, in numpy: +d where the weight was positive, else -d."""
    blocks = x.reshape(-1, QK1_0)  # (n_blocks, 128)
    d = np.abs(blocks).mean(axis=1, keepdims=True).astype(np.float16).astype(np.float32)
    return np.where(blocks > 0, d, -d).reshape(x.shape)


@pytest.fixture(scope="module")
def q1_0_target(variant_dir, tmp_path_factory) -> Path:
    """The clean target with its ffn_down weights in Q1_0, written by the test's own quantizer."""
    work = tmp_path_factory.mktemp("q1_0")
    return quantize_gguf(variant_dir("clean") / "target.gguf", work / "target-q1_0.gguf", Q1_0, _q1_0)


def test_a_type_gguf_py_cannot_read_falls_back_to_the_default_build(ggml, q1_0_target, variant_dir):
    g = read_gguf_weights(q1_0_target, None, ggml_dequant.load)
    assert g.tensors[Q1_0_WEIGHT].ggml_type == "q1_0"
    assert g.dequantized_by == str(ggml.library)
    f32 = array_from_tensor(
        read_gguf_weights(variant_dir("clean") / "target.gguf", None, ggml_dequant.load), Q1_0_WEIGHT
    )
    np.testing.assert_array_equal(array_from_tensor(g, Q1_0_WEIGHT), _q1_0_values(f32))


def test_a_gguf_gguf_py_reads_is_dequantized_by_gguf_py(variant_dir):
    assert read_gguf_weights(variant_dir("clean") / "target.gguf", None, ggml_dequant.load).dequantized_by == GGUF_PY


def test_without_a_build_a_type_gguf_py_cannot_read_names_tensor_type_and_fix(q1_0_target, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_LLAMA_DIR, str(tmp_path))  # the default build: a directory with none
    with pytest.raises(InputError) as e:
        read_gguf_weights(q1_0_target, None, ggml_dequant.load)
    message = str(e.value)
    assert "\n" not in message and str(q1_0_target) in message
    assert "'blk.0.ffn_down.weight' is q1_0" in message and "pass --llama-dir" in message


# End to end through the tools build's llama-quantize (`make tools`).


@pytest.fixture(scope="module")
def quantized(tools, variant_dir, tmp_path_factory) -> tuple[Path, Path]:
    """The clean pair's target quantized by llama-quantize: Q8_0, with ffn_down in Q1_0 (the other
    matrices are 64 wide, Q1_0 blocks 128, and llama-quantize has no fallback type for Q1_0)."""
    d, work = variant_dir("clean"), tmp_path_factory.mktemp("llama-quantize")
    out = work / "target-q1_0.gguf"
    cmd = [str(tools.program("llama-quantize")), "--tensor-type", "ffn_down=q1_0", str(d / "target.gguf"), str(out)]
    done = subprocess.run([*cmd, "Q8_0"], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return d, out


@pytest.fixture(scope="module")
def q1_0_run(quantized, tmp_path_factory) -> Path:
    """The drafter's run on that target, captured in-process through the default build."""
    d, target = quantized
    out = tmp_path_factory.mktemp("q1_0-run") / "run.npz"
    return capture(target, d / "draft.gguf", out, tokens=DEFAULT_TOKENS, rounds=ROUNDS)


def test_a_llama_quantize_q1_0_target_compares_clean(ggml, quantized, q1_0_run, tmp_path):
    d, target = quantized
    with read_dump(q1_0_run) as dump:
        assert dump.manifest.model("target").weight_types == ("q1_0", "q8_0")
    ref = reference_of(target, d / "draft-hf", tmp_path / "ref.npz", follow=q1_0_run)
    comparison = compare_dumps(ref, q1_0_run)
    assert comparison.ok and comparison.pairs, [f.message for f in comparison.findings]
    # the same file on both sides (sha256): judged by the same-file bound, not the weights' own
    assert comparison.types["quant_types"] == [] and comparison.types["same_file_types"] == ["q1_0", "q8_0"]
    with read_dump(ref) as dump:
        assert dump.manifest.model("target").dequantized_by == str(ggml.library)
        assert dump.manifest.model("draft").dequantized_by is None  # a HF checkpoint: nothing to dequantize
    # the weights matter: the f32 target's reference, on the same flow, is not the run
    f32 = reference_of(d / "target.gguf", d / "draft-hf", tmp_path / "f32.npz", follow=q1_0_run)
    assert not compare_dumps(f32, q1_0_run).ok


def _featdiff(*args: str) -> subprocess.CompletedProcess:
    """The CLI in its own process, as a user runs it: one process binds one build's ggml."""
    cmd = [sys.executable, "-c", "from featdiff.cli import main; main()", *args]
    env = {k: v for k, v in os.environ.items() if k != ENV_LLAMA_DIR}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)


def test_a_named_build_dequantizes_every_quantized_weight(tools, quantized, tmp_path):
    d, target = quantized
    llama_dir = str(tools.source)
    model = ["--target", str(target), "--model", str(d / "draft.gguf"), "--llama-dir", llama_dir]
    run = tmp_path / "run.npz"
    captured = _featdiff("capture", *model, "--tokens", DEFAULT_TOKENS, "--rounds", str(ROUNDS), "-o", str(run))
    assert captured.returncode == 0, captured.stderr[-2000:]
    ref = tmp_path / "ref.npz"
    referenced = _featdiff("reference", *model, "--follow", str(run), "-o", str(ref))
    assert referenced.returncode == 0, referenced.stderr[-2000:]
    comparison = compare_dumps(ref, run)
    assert comparison.ok and comparison.pairs, [f.message for f in comparison.findings]
    with read_dump(ref) as dump:
        for role in ("target", "draft"):  # the drafter GGUF too: the named build reads every file
            library = Path(dump.manifest.model(role).dequantized_by)
            assert library.is_relative_to(tools.source) and library.name.startswith(ggml_dequant.LIBGGML_BASE)


@pytest.mark.slow  # builds the older llama.cpp (tests/conftest.py's legacy) when no test built it before
def test_another_build_than_the_process_bound_is_refused(ggml, legacy):
    with pytest.raises(InputError, match="already uses another build's ggml"):
        ggml_dequant.load(legacy.source)


def test_the_cli_without_a_build_is_one_line_naming_the_fix(quantized, q1_0_run, tmp_path, monkeypatch):
    d, target = quantized
    monkeypatch.setenv(ENV_LLAMA_DIR, str(tmp_path))  # no build at hand: gguf-py alone
    args = ["reference", "--target", str(target), "--model", str(d / "draft-hf"), "--follow", str(q1_0_run)]
    result = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "ref.npz")])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and str(target) in line and "is q1_0" in line and "--llama-dir" in line


def test_a_type_newer_than_gguf_py_is_read_through_the_builds_ggml(ggml, tools, variant_dir, tmp_path):
    """Q2_0 (ggml type 42): gguf-py's reader refuses the file outright; featdiff teaches it the
    build's types, so capture describes the model, and the reference reads the same file."""
    d = variant_dir("clean")
    target = tmp_path / "target-q2_0.gguf"
    done = subprocess.run([str(tools.program("llama-quantize")), str(d / "target.gguf"), str(target), "Q2_0"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Q2_0" not in GGMLQuantizationType.__members__  # the premise: gguf-py's enum lacks it
    run = capture(target, d / "draft.gguf", tmp_path / "run.npz", tokens=DEFAULT_TOKENS, rounds=ROUNDS)
    with read_dump(run) as dump:
        assert "q2_0" in dump.manifest.model("target").weight_types
    ref = reference_of(target, d / "draft-hf", tmp_path / "ref.npz", follow=run)
    comparison = compare_dumps(ref, run)
    assert comparison.ok and comparison.coverage.pairs > 0, [f.message for f in comparison.findings]
    assert "q2_0" in comparison.types["same_file_types"]
    with read_dump(ref) as dump:
        assert dump.manifest.model("target").dequantized_by == str(ggml.library)
