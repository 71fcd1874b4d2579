"""DeepSeek-V4's MTP head (llama.cpp's `deepseek4`, deepseek4.cpp graph_mtp) is refused whole, by
name: `lint`, `reference` and capture's preflight on a deepseek4 pair, and `reference` on its
checkpoint directory, each exit 2 with one line saying what featdiff does not model of it
(kinds.mtp.UNMODELLED_HEADS). The pair is written with gguf-py as the pinned converter lays out a
tiny one (conversion/deepseek.py DeepseekV4Model: the trunk's target.gguf, and the head alone in
an `mtp-*.gguf` from `--mtp`, which keeps the model's tables and the hyper-connection head)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from featdiff_process import refused_in_one_line
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.kinds.preflight import preflight

ARCH = names.ARCH_DEEPSEEK4
N_EMBD, N_VOCAB, HC = 64, 128, 4
SAID = f"an MTP head of architecture {ARCH!r}: DeepSeek-V4's head (deepseek4.cpp graph_mtp) is not modelled"
RNG = np.random.default_rng(0)


def _gguf(path: Path, n_trunk: int, heads: int) -> Path:
    """A deepseek4 GGUF of `n_trunk` trunk blocks and `heads` head blocks (blk.<n_trunk + i>), only
    the head's blocks written when it has one (as `--mtp` writes them)."""
    from gguf import GGUFWriter

    wr = GGUFWriter(str(path), ARCH)
    key = lambda k: k.format(arch=ARCH)  # noqa: E731
    wr.add_uint32(key(names.KEY_BLOCK_COUNT), n_trunk + heads)
    wr.add_uint32(key(names.KEY_EMBEDDING_LENGTH), N_EMBD)
    wr.add_uint32(key("{arch}.embedding_length_out"), N_EMBD * HC)
    wr.add_uint32(key("{arch}.hyper_connection.count"), HC)
    wr.add_array(key("{arch}.attention.compress_ratios"), [0] * (n_trunk + heads))
    if heads:
        wr.add_uint32(key(names.KEY_NEXTN_LAYERS), heads)
    f32 = lambda *shape: RNG.standard_normal(shape).astype(np.float32)  # noqa: E731
    for name, t in (
        (names.T_TOKEN_EMBD, f32(N_VOCAB, N_EMBD)),
        (names.T_OUTPUT_NORM, np.ones(N_EMBD, np.float32)),
        (names.T_OUTPUT, f32(N_VOCAB, N_EMBD)),
        ("output_hc_fn.weight", f32(HC, N_EMBD * HC)),
        ("output_hc_base.weight", f32(HC)),
        ("output_hc_scale.weight", f32(1)),
    ):
        wr.add_tensor(name, t)
    for b in range(n_trunk, n_trunk + heads) if heads else range(n_trunk):
        wr.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(N_EMBD, np.float32))
        wr.add_tensor(f"blk.{b}.hc_attn_fn.weight", f32((2 + HC) * HC, N_EMBD * HC))
        wr.add_tensor(f"blk.{b}.attn_sinks.weight", f32(4))
        if b >= n_trunk:
            wr.add_tensor(names.T_NEXTN.format(il=b, name=names.NEXTN_EH_PROJ), f32(N_EMBD, 2 * N_EMBD))
            for norm in ("enorm", "hnorm", "shared_head_norm"):
                wr.add_tensor(names.T_NEXTN.format(il=b, name=norm), np.ones(N_EMBD, np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target.gguf, mtp-tiny.gguf): a one-block trunk and its head at block 1."""
    d = tmp_path_factory.mktemp("deepseek4")
    return _gguf(d / "target.gguf", 1, 0), _gguf(d / "mtp-tiny.gguf", 1, 1)


def test_lint_refuses_the_head_by_name(pair):
    """lint of the head against its target: exit 2, one line naming the file and what is not modelled."""
    target, head = pair
    line = refused_in_one_line(["lint", str(head), "--target", str(target)], SAID)
    assert line.startswith(f"featdiff: error: {head}: ") and "hyper-connections" in line and "Sinkhorn" in line


def test_reference_refuses_the_head_by_name_and_writes_no_dump(pair, tmp_path):
    target, head = pair
    out = tmp_path / "ref.npz"
    args = ["reference", "--target", str(target), "--model", str(head), "--tokens", "7,21,3", "-o", str(out)]
    assert f"{head}: " in refused_in_one_line(args, SAID)
    assert not out.exists()


def test_capture_preflight_refuses_the_head_by_name(pair):
    """Capture's preflight (before llama.cpp loads the pair) says the same line."""
    target, head = pair
    with pytest.raises(InputError, match="DeepSeek-V4's head") as e:
        preflight(head, target)
    assert str(e.value).startswith(f"{head}: an MTP head of architecture 'deepseek4'")


def test_the_checkpoint_directory_is_refused_by_name(pair, tmp_path):
    """A DeepSeek-V4 checkpoint declaring its head (config.json num_nextn_predict_layers) as --model."""
    target, _ = pair
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    config = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "num_nextn_predict_layers": 1}
    (ckpt / "config.json").write_text(json.dumps(config))
    args = ["reference", "--target", str(target), "--model", str(ckpt), "--tokens", "7,21,3"]
    refused_in_one_line([*args, "-o", str(tmp_path / "ref.npz")], f"model_type 'deepseek_v4': {SAID}")


def test_the_trunk_without_a_head_is_not_refused_as_a_head(pair):
    """The refusal is the head's: the trunk alone is no drafter, and lint says that instead."""
    target, _ = pair
    result = CliRunner().invoke(app, ["lint", str(target)])
    assert result.exit_code != 0 and "expected one of" in result.output, result.output
    assert "an MTP head of architecture" not in result.output
