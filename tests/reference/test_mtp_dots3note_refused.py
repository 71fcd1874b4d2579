"""dots3-note's MTP head (llama.cpp's `dots3note`) is refused by name: the pinned tree loads no MTP
graph for it (dots3note.cpp loads the nextn block's tensors with TENSOR_SKIP and its
build_arch_graph has no graph_mtp, so an MTP context gets the trunk's graph over a KV cache of the
nextn block alone). `lint`, `reference`, capture's preflight and `capture --exec` of a program run
with `--spec-type draft-mtp` on a dots3note GGUF declaring a head each exit 2 with one line saying
so (kinds.mtp.UNMODELLED_HEADS). The file is written with gguf-py as conversion/dots3.py lays out a
converted one with its MTP block: the trunk's blocks, then blk.<n_layer> with the nextn tensors,
`nextn_predict_layers` 1 and a block count that includes it."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from featdiff_process import refused_in_one_line
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.kinds.preflight import preflight

ARCH = names.ARCH_DOTS3NOTE
N_EMBD, N_VOCAB, N_TRUNK = 64, 128, 2
SAID = "an MTP head of architecture 'dots3note': the pinned llama.cpp loads no MTP graph for dots3note: "
RNG = np.random.default_rng(0)


def _gguf(path: Path, heads: int) -> Path:
    """A dots3note GGUF of N_TRUNK trunk blocks and `heads` nextn blocks after them."""
    from gguf import GGUFWriter

    wr = GGUFWriter(str(path), ARCH)
    key = lambda k: k.format(arch=ARCH)  # noqa: E731
    wr.add_uint32(key(names.KEY_BLOCK_COUNT), N_TRUNK + heads)
    wr.add_uint32(key(names.KEY_EMBEDDING_LENGTH), N_EMBD)
    if heads:
        wr.add_uint32(key(names.KEY_NEXTN_LAYERS), heads)
    f32 = lambda *shape: RNG.standard_normal(shape).astype(np.float32)  # noqa: E731
    wr.add_tensor(names.T_TOKEN_EMBD, f32(N_VOCAB, N_EMBD))
    wr.add_tensor(names.T_OUTPUT_NORM, np.ones(N_EMBD, np.float32))
    for b in range(N_TRUNK + heads):
        wr.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(N_EMBD, np.float32))
        if b >= N_TRUNK:
            wr.add_tensor(names.T_NEXTN.format(il=b, name=names.NEXTN_EH_PROJ), f32(N_EMBD, 2 * N_EMBD))
            for norm in ("enorm", "hnorm", "shared_head_norm"):
                wr.add_tensor(names.T_NEXTN.format(il=b, name=norm), np.ones(N_EMBD, np.float32))
            wr.add_tensor(names.T_NEXTN.format(il=b, name="embed_tokens"), f32(N_VOCAB, N_EMBD))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    """(with-head.gguf, trunk.gguf): the model with its MTP block, and converted with --no-mtp."""
    d = tmp_path_factory.mktemp("dots3note")
    return _gguf(d / "with-head.gguf", 1), _gguf(d / "trunk.gguf", 0)


def test_lint_refuses_the_head_by_name(files):
    """lint of the file as its own head (target and model alike, as an MTP pair is given)."""
    model, _ = files
    line = refused_in_one_line(["lint", str(model), "--target", str(model)], SAID)
    assert line.startswith(f"featdiff: error: {model}: ") and "TENSOR_SKIP" in line and "graph_mtp" in line


def test_reference_refuses_the_head_by_name_and_writes_no_dump(files, tmp_path):
    model, _ = files
    out = tmp_path / "ref.npz"
    args = ["reference", "--target", str(model), "--model", str(model), "--tokens", "7,21,3", "-o", str(out)]
    assert f"{model}: " in refused_in_one_line(args, SAID)
    assert not out.exists()


def test_capture_refuses_the_head_before_llama_cpp_loads_it(files, tmp_path):
    """Capture in-process: its preflight says the same line (the CLI, and preflight itself)."""
    model, _ = files
    out = tmp_path / "run.npz"
    args = ["capture", "--target", str(model), "--model", str(model), "--tokens", "7,21,3", "-o", str(out)]
    refused_in_one_line(args, SAID)
    assert not out.exists()
    with pytest.raises(InputError) as e:
        preflight(model, model)
    assert str(e.value).startswith(f"{model}: {SAID}")


def test_capture_exec_refuses_a_program_drafting_with_the_head(files, tmp_path):
    """`capture --exec` of a program asked to draft with the file's own head (`--spec-type draft-mtp`,
    no -md) is refused before the program starts (any program stands in: it never runs), with no
    dump and no program log."""
    model, _ = files
    out = tmp_path / "run.npz"
    program = shutil.which("true")
    assert program is not None
    cmd = [program, "-m", str(model), "--spec-type", "draft-mtp", "-p", "hello", "-n", "4"]
    refused_in_one_line(["capture", "-o", str(out), "--exec", "--", *cmd], SAID)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_the_trunk_without_a_head_is_not_refused_as_a_head(files):
    """The refusal is the head's: the file converted without its block is no drafter, and lint says that."""
    _, trunk = files
    result = CliRunner().invoke(app, ["lint", str(trunk)])
    assert result.exit_code != 0 and "expected one of" in result.output, result.output
    assert SAID not in result.output
