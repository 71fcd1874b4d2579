"""`featdiff lint` flags each crafted broken drafter GGUF and passes the fixtures' correct ones."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFValueType
from typer.testing import CliRunner

from featdiff.core import names
from featdiff.cli import app
from featdiff.factory.pairs import TINY, VARIANTS
from featdiff.verdict.lint import lint_gguf

runner = CliRunner()
RNG = np.random.default_rng(0)

BROKEN = {
    # name: (source variant, rewrite arguments, expected text of the problem line)
    "id-out-of-range": (
        "clean",
        {"set_keys": {names.KEY_TARGET_LAYERS: ([2, 6], GGUFValueType.ARRAY)}},
        "dflash.target_layers = [2, 6] but the target has 6 layers; ids must be < n_layer",
    ),
    "fc-width": (
        "clean",
        {"replace_tensors": {names.T_FC: RNG.standard_normal((64, 192)).astype(np.float32)}},
        "fc.weight takes 192 inputs but the features are n_extract 2 x target n_embd 64 = 128 wide",
    ),
    "no-mask-token": ("clean", {"drop_keys": (names.KEY_MASK_TOKEN,)}, "tokenizer.ggml.mask_token_id is missing"),
    "log-snr-flag-only": (
        "log-snr",
        {"drop_tensors": names.LOG_SNR_TENSORS},
        "dflash.log_snr_conditioning = true but log_snr_fc1.weight",
    ),
    "log-snr-tensors-only": (
        "log-snr",
        {"drop_keys": (names.KEY_LOG_SNR,)},
        "but dflash.log_snr_conditioning is not set",
    ),
    "own-embd-vocab": (
        "own-embd",
        {"replace_tensors": {names.T_TOKEN_EMBD: RNG.standard_normal((500, 64)).astype(np.float32)}},
        "token_embd.weight ne = [64, 500], expected [n_embd, n_vocab] = [64, 512]",
    ),
    "no-block-size": ("clean", {"drop_keys": (names.KEY_BLOCK_SIZE,)}, "dflash.block_size is missing"),
    "block-size-0": (
        "clean",
        {"drop_keys": (names.KEY_BLOCK_SIZE,), "set_keys": {names.KEY_BLOCK_SIZE: (0, GGUFValueType.UINT32)}},
        "dflash.block_size = 0 leaves no row to draft",
    ),
    "block-size-past-ubatch": (
        "clean",
        {"drop_keys": (names.KEY_BLOCK_SIZE,), "set_keys": {names.KEY_BLOCK_SIZE: (100000, GGUFValueType.UINT32)}},
        "dflash.block_size = 100000 is more rows than llama.cpp's draft batch holds in one ubatch",
    ),
    "dspark-no-block-size": (
        "dspark",
        {"drop_keys": (names.KEY_BLOCK_SIZE,)},
        "dflash.block_size is missing, which llama.cpp's DSpark Markov head asserts on",
    ),
    # DSpark: the keys and tensors of the Markov and confidence heads (upstream src/models/dflash.cpp)
    "conf-key-without-proj": (
        "dspark",
        {"drop_tensors": (names.T_CONF_PROJ_W, names.T_CONF_PROJ_B)},
        "dflash.has_confidence_head = true but conf_proj.weight is missing",
    ),
    "proj-with-conf-key-false": (
        "dspark",
        {
            "drop_keys": (names.KEY_HAS_CONFIDENCE_HEAD,),
            "set_keys": {names.KEY_HAS_CONFIDENCE_HEAD: (False, GGUFValueType.BOOL)},
        },
        "dflash.has_confidence_head = false but conf_proj.weight is present",
    ),
    "no-anchor-key": (
        "dspark-bonus",
        {"drop_keys": (names.KEY_SAMPLE_FROM_ANCHOR,)},
        "dflash.sample_from_anchor is missing, so llama.cpp drafts anchor-first",
    ),
    "keys-without-markov": (
        "dspark-no-conf",
        {"drop_tensors": (names.T_MARKOV_W1, names.T_MARKOV_W2)},
        "are set but markov_w1.weight is missing, so llama.cpp runs it as plain DFlash",
    ),
    "w1-without-w2": (
        "dspark",
        {"drop_tensors": (names.T_MARKOV_W2,)},
        "carries markov_w1.weight but no markov_w2.weight",
    ),
    "reduced-head-rows": (
        "dspark-d2t",
        {"replace_tensors": {names.T_OUTPUT: np.zeros((200, TINY.draft.n_embd), np.float32)}},
        "output.weight ne = [64, 200], expected [n_embd, n_vocab_draft] = [64, 256]",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_lint_flags_broken_drafter(case, variant_dir, edit_gguf, tmp_path):
    variant, edits, expected = BROKEN[case]
    d = variant_dir(variant)
    broken = edit_gguf(d / "draft.gguf", tmp_path / "D.gguf", **edits)
    problems = lint_gguf(broken, d / "target.gguf")
    assert any(expected in p for p in problems), problems
    assert all(p.startswith(f"{broken}: ") for p in problems)
    result = runner.invoke(app, ["lint", str(broken), "--target", str(d / "target.gguf")])
    assert result.exit_code == 1
    assert expected in result.output


LINT_NAMES = {"dspark-lost-markov"}  # its GGUF alone says the Markov head is gone (tests/reference/test_dspark_io.py)


@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - LINT_NAMES))
def test_lint_passes_fixture_drafters(variant, variant_dir):
    d = variant_dir(variant)
    assert lint_gguf(d / "draft.gguf", d / "target.gguf") == []
    assert lint_gguf(d / "draft.gguf", None) == []


def test_lint_cli_prints_ok_and_exits_0(variant_dir):
    d = variant_dir("clean")
    result = runner.invoke(app, ["lint", str(d / "draft.gguf"), "--target", str(d / "target.gguf")])
    assert result.exit_code == 0
    assert result.output.strip() == f"{d / 'draft.gguf'}: ok"


def test_lint_refuses_a_target_as_drafter(variant_dir):
    d = variant_dir("clean")
    problems = lint_gguf(d / "target.gguf", None)
    assert len(problems) == 1 and "expected one of dflash, eagle3" in problems[0]


def test_lint_of_unreadable_file_exits_2(tmp_path):
    bogus = tmp_path / "D.gguf"
    bogus.write_bytes(b"GGUF but truncated")
    result = runner.invoke(app, ["lint", str(bogus)])
    assert result.exit_code == 2
    assert "D.gguf: not a readable GGUF" in result.output
