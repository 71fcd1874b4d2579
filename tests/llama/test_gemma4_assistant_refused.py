"""Gemma 4's assistant drafter (llama.cpp's `gemma4-assistant`, issue 44) is refused by name: the
`gemma4-assistant` fixture (a transformers Gemma 4 target and a tiny Gemma4AssistantForCausalLM,
both converted by the pinned converter) is a pair the pinned llama-speculative-simple drafts with
(`-md` and `--spec-type draft-mtp`: its layers read the target's KV cache), and `lint`, `capture`,
`capture --exec` around that program and `reference` (on its GGUF and on its checkpoint) each
exit 2 with one line saying what featdiff does not model of it (kinds.mtp.UNMODELLED_HEADS)."""

from __future__ import annotations

from pathlib import Path

import pytest

from featdiff.core import names
from featdiff.core.gguf_reader import int_meta, read_gguf
from featdiff.factory.converter import DRAFT_GGUF, DRAFT_HF, TARGET_GGUF, TARGET_HF
from featdiff.factory.gemma4_assistant import ASSISTANT_LAYER_TYPES, write_gemma4_assistant_fixture
from featdiff.factory.pairs import TINY
from featdiff_process import drafted_counts, refused_in_one_line

pytestmark = pytest.mark.slow  # the pinned converter makes the pair

ARCH = names.ARCH_GEMMA4_ASSISTANT
SAID = f"an MTP head of architecture {ARCH!r}: Gemma 4's assistant drafter (gemma4-assistant.cpp"
SPEC = ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "-c", "256", "-t", "2"]
RUN = ["-p", "hello world", "-n", "16", "--temp", "0"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    return write_gemma4_assistant_fixture(tmp_path_factory.mktemp("gemma4-assistant"))


def test_the_converter_writes_an_assistant_reading_the_targets_kv(pair):
    """draft.gguf is the pinned converter's gemma4-assistant: one nextn head per layer, the target's
    width as embedding_length_out, the pre / post projections and per layer a query but no key or
    value projection."""
    d, t = read_gguf(pair / DRAFT_GGUF), read_gguf(pair / TARGET_GGUF)
    assert d.arch == ARCH and t.arch == "gemma4"
    assert int_meta(d, names.KEY_NEXTN_LAYERS.format(arch=ARCH)) == len(ASSISTANT_LAYER_TYPES)
    assert int_meta(d, f"{ARCH}.embedding_length_out") == TINY.target.n_embd == int_meta(t, "gemma4.embedding_length")
    assert {"nextn.pre_projection.weight", "nextn.post_projection.weight"} <= set(d.tensors)
    per_layer = {t.split(".", 2)[2] for t in d.tensors if t.startswith("blk.")}
    assert "attn_q.weight" in per_layer and not per_layer & {"attn_k.weight", "attn_v.weight"}


def test_llama_speculative_simple_drafts_with_it(tools, pair, tmp_path):
    """The pinned tree runs the pair: the assistant's two layers share the target's last two layers'
    KV cache (sliding 4, full 5 of the 6) and it drafts; what featdiff refuses is its own model."""
    cmd = [str(tools.program("llama-speculative-simple")), "-m", str(pair / TARGET_GGUF)]
    counts, log = drafted_counts([*cmd, "-md", str(pair / DRAFT_GGUF), *SPEC, *RUN])
    n = TINY.target.n_layer
    assert f"layer   0: sharing with layer {n - 2}" in log and f"layer   1: sharing with layer {n - 1}" in log
    assert counts.get("n_drafted", 0) > 0, log[-2000:]


def test_lint_refuses_it_by_name(pair):
    draft = pair / DRAFT_GGUF
    line = refused_in_one_line(["lint", str(draft), "--target", str(pair / TARGET_GGUF)], SAID)
    assert line.startswith(f"featdiff: error: {draft}: ") and "queries only" in line


def test_capture_refuses_it_before_llama_cpp_loads_it(pair, tmp_path):
    out = tmp_path / "run.npz"
    args = ["capture", "--target", str(pair / TARGET_GGUF), "--model", str(pair / DRAFT_GGUF), "--tokens", "7,21,3"]
    refused_in_one_line([*args, "-o", str(out)], SAID)
    assert not out.exists()


def test_capture_exec_refuses_it_before_the_program_runs(tools, pair, tmp_path):
    """Around llama-speculative-simple (which drafts with it, above): refused before it starts, no
    dump and no program log."""
    out = tmp_path / "run.npz"
    cmd = [str(tools.program("llama-speculative-simple")), "-m", str(pair / TARGET_GGUF)]
    cmd += ["-md", str(pair / DRAFT_GGUF), *SPEC, *RUN]
    refused_in_one_line(["capture", "-o", str(out), "--exec", "--", *cmd], SAID)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("model", [DRAFT_GGUF, DRAFT_HF])
def test_reference_refuses_it_by_name(pair, tmp_path, model):
    """On its GGUF, and on its checkpoint directory (config.json model_type gemma4_assistant)."""
    out = tmp_path / "ref.npz"
    args = ["reference", "--target", str(pair / TARGET_HF), "--model", str(pair / model), "--tokens", "7,21,3"]
    line = refused_in_one_line([*args, "-o", str(out)], SAID)
    assert ("model_type 'gemma4_assistant'" in line) == (model == DRAFT_HF)
    assert not out.exists()
