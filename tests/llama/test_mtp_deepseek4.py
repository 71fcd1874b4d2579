"""DeepSeek-V4's MTP head (issue 44, llama.cpp's deepseek4) on the `mtp-deepseek4` fixture, which the
pinned converter makes from a checkpoint in DeepSeek's own layout (factory/mtp_deepseek4.py): the
head alone in draft.gguf as the checkpoint holds it, llama-speculative-simple drafting with it, and
featdiff (lint, reference, capture) refusing it by name in one line (kinds.mtp.UNMODELLED_HEADS): what its graph computes is
not modelled, so no comparison of it is made."""

from __future__ import annotations

import re

import numpy as np
import pytest
from mtp_head_runs import SPEC_ARGS, assert_refused

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import array_from_tensor, int_meta, read_gguf_weights
from featdiff.factory.converter import DRAFT_GGUF, TARGET_GGUF, TARGET_HF
from featdiff.factory.mtp_deepseek4 import (
    EXPERT_SCALE_EXP,
    HC_MULT,
    N_LAYER,
    deepseek4_weights,
    write_deepseek4_fixture,
)
from featdiff.factory.pairs import TINY
from featdiff.llama import ggml_dequant
from featdiff.programs import exec as exec_capture
from featdiff_process import drafted_counts, refused_in_one_line

pytestmark = pytest.mark.slow  # the pinned converter makes the pair (cached per machine)

ARCH = names.ARCH_DEEPSEEK4
IL = N_LAYER  # the head's block in draft.gguf
SAID = f"an MTP head of architecture {ARCH!r}: DeepSeek-V4's head (deepseek4.cpp graph_mtp) is not modelled"
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)  # MXFP4's codes
Q8_0_STEP = 1 / 127  # Q8_0's rounding: half a step of each 32-value block's max / 127


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_deepseek4_fixture(tmp_path_factory.mktemp("mtp-deepseek4"))


def test_the_head_is_alone_in_draft_gguf_with_the_checkpoints_values(pair):
    """draft.gguf (`--mtp`) holds block n_layer: eh_proj is [e_proj | h_proj] (Q8_0), the experts the
    checkpoint's MXFP4 codes exactly, the sinks as they are; target.gguf holds no head."""
    g = read_gguf_weights(pair / DRAFT_GGUF, None, ggml_dequant.load)
    t = read_gguf_weights(pair / TARGET_GGUF, None, ggml_dequant.load)
    assert g.arch == t.arch == ARCH and int_meta(g, names.KEY_NEXTN_LAYERS) == 1
    assert int_meta(g, names.KEY_BLOCK_COUNT) == N_LAYER + 1 and int_meta(t, names.KEY_NEXTN_LAYERS, 0) == 0
    assert int_meta(g, "{arch}.embedding_length_out") == HC_MULT * TINY.target.n_embd  # the hidden handed over
    assert not any(n.startswith(f"blk.{IL}.") for n in t.tensors)
    w = deepseek4_weights(0)
    eh = array_from_tensor(g, names.T_NEXTN.format(il=IL, name=names.NEXTN_EH_PROJ))
    want = np.concatenate([w["mtp.0.e_proj.weight"], w["mtp.0.h_proj.weight"]], axis=1)
    assert eh.shape == want.shape and np.abs(eh - want).max() <= Q8_0_STEP * np.abs(want).max()
    packed = w["mtp.0.ffn.experts.1.w3.weight"]
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    up = array_from_tensor(g, f"blk.{IL}.ffn_up_exps.weight")
    np.testing.assert_array_equal(up[1], E2M1[codes] * 2.0**EXPERT_SCALE_EXP)
    np.testing.assert_array_equal(array_from_tensor(g, f"blk.{IL}.attn_sinks.weight"), w["mtp.0.attn.attn_sink"])


def test_llama_speculative_simple_drafts_with_the_head(tools, pair):
    """The pinned build runs the head: `--spec-type draft-mtp -md draft.gguf` drafts (n_drafted > 0)."""
    program = tools.program("llama-speculative-simple")
    cmd = [str(program), "-m", str(pair / TARGET_GGUF), "-md", str(pair / DRAFT_GGUF), *SPEC_ARGS]
    counts, log = drafted_counts([*cmd, "-p", "hello world", "-n", "16", "--temp", "0"])
    assert counts.get("n_drafted", 0) > 0, log[-2000:]


def test_lint_reference_and_capture_refuse_the_converted_head_by_name(tools, pair, tmp_path):
    """One line, exit 2, no dump: lint of the pair, the reference of draft.gguf and of the checkpoint,
    and `capture --exec` of llama-speculative-simple drafting with it (before the program starts)."""
    refused_in_one_line(["lint", str(pair / DRAFT_GGUF), "--target", str(pair / TARGET_GGUF)], SAID)
    assert_refused(pair, pair / DRAFT_GGUF, SAID, tmp_path)
    assert_refused(pair, pair / TARGET_HF, f"model_type 'deepseek_v4': {SAID}", tmp_path)
    program = str(tools.program("llama-speculative-simple"))
    cmd = [program, "-m", str(pair / TARGET_GGUF), "-md", str(pair / DRAFT_GGUF), *SPEC_ARGS, "-p", "hi", "-n", "4"]
    with pytest.raises(InputError, match=re.escape(f"{pair / DRAFT_GGUF}: {SAID}")):
        exec_capture.capture_exec(cmd, tmp_path / "run.npz")
    assert not (tmp_path / "run.npz").exists()
