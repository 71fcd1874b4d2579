"""A tiny seeded DFlash2 drafter: the clean pair (featdiff.factory.fixtures) with DFlash2's local convs
and candidate selector added, as the pinned converter writes them (conversion/qwen.py
DFlashModel for `DFlash2DraftModel`: the four `dflash.*` keys, `blk.<il>.{attn,ffn}_conv_*` and
the `selector_*` codebooks), in `draft.gguf` and in `draft-hf/` (config.json's `dflash_config`
fields and `model-dflash2.safetensors` under the HF names the converter maps).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from featdiff.core import names
from featdiff.core.outputs import replaced
from featdiff.factory.fixtures import VOCAB_TEST, write_fixture
from featdiff.factory.gguf_rewrite import rewrite_gguf
from featdiff.factory.pairs import BLOCK_SIZE, TINY
from featdiff.torchref.dflash import dflash2 as d2

KERNEL_SIZE = 3  # taps: more than one, fewer than BLOCK_SIZE rows, so the left padding shows
GROUP_SIZE = 16  # n_embd 64 / 16 = 4 groups of dynamic taps
SELECTOR_RANK = 8
SELECTOR_TOP_K = 4  # top_k (top_k + 1) = 20 <= n_embd, as llama.cpp requires
BASE_TAP0, BASE_SPREAD, PROJ_SPREAD = 1.0, 0.3, 0.05  # tap 0 near identity: the conv moves rows, not wipes them
SELECTOR_GAIN = 3.0  # the pairwise score outweighs the logits' spread, so the walk parts from the per-row argmax
HF_WEIGHTS = "model-dflash2.safetensors"  # a second part: the converter reads every model*.safetensors
HF_ARCH = "DFlash2DraftModel"


def dflash2_keys() -> dict[str, int]:
    """The converter's DFlash2 keys, GGUF name -> value (config.json `dflash_config.<leaf>`)."""
    return {
        d2.KEY_CONV_KERNEL_SIZE: KERNEL_SIZE,
        d2.KEY_CONV_GROUP_SIZE: GROUP_SIZE,
        d2.KEY_SELECTOR_RANK: SELECTOR_RANK,
        d2.KEY_SELECTOR_TOP_K: SELECTOR_TOP_K,
    }


def dflash2_weights(rng: np.random.Generator, n_layer: int, n_embd: int, n_vocab: int) -> dict[str, np.ndarray]:
    """Random DFlash2 tensors under their GGUF names, numpy order (= HF orientation)."""
    n_groups = n_embd // GROUP_SIZE
    w: dict[str, np.ndarray] = {}
    for il in range(n_layer):
        for part in ("attn", "ffn"):
            base = BASE_SPREAD * rng.standard_normal((2, KERNEL_SIZE, n_embd))  # (side, tap, n_embd)
            base[:, 0, :] += BASE_TAP0
            w[f"blk.{il}.{part}_conv_base"] = base.astype(np.float32)
            proj = PROJ_SPREAD * rng.standard_normal((2 * KERNEL_SIZE * n_groups, n_embd))  # (2 kernel groups, n_embd)
            w[f"blk.{il}.{part}_conv_proj.weight"] = proj.astype(np.float32)
    w[d2.T_SELECTOR_PREV] = (SELECTOR_GAIN * rng.standard_normal((n_vocab, SELECTOR_RANK))).astype(np.float32)
    w[d2.T_SELECTOR_NEXT] = (SELECTOR_GAIN * rng.standard_normal((n_vocab, SELECTOR_RANK))).astype(np.float32)
    w[d2.T_SELECTOR_HIDDEN] = (rng.standard_normal((SELECTOR_RANK, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
    return w


def write_dflash2_fixture(outdir: str | Path, seed: int = 0, vocab: str = VOCAB_TEST) -> Path:
    """The clean pair in `outdir` with a DFlash2 drafter in `draft.gguf` and `draft-hf/`; return `outdir`."""
    out = write_fixture(outdir, "clean", seed, vocab=vocab)
    s = TINY.draft
    w = dflash2_weights(np.random.default_rng([seed, 2]), s.n_layer, s.n_embd, TINY.n_vocab)
    rewrite_gguf(out / "draft.gguf", out / "draft.gguf", dict(dflash2_keys()), w)
    hf = out / "draft-hf"
    config = json.loads((hf / names.HF_CONFIG).read_text())
    config["architectures"] = [HF_ARCH]
    config[names.HF_DFLASH_CONFIG].update({k.split(".", 1)[1]: v for k, v in dflash2_keys().items()})
    with replaced(hf / names.HF_CONFIG) as tmp:
        tmp.write_text(json.dumps(config, indent=1))
    with replaced(hf / HF_WEIGHTS) as tmp:
        save_file({d2.hf_name(k, names.HF_LAYER_PREFIX): a for k, a in w.items()}, str(tmp))
    with replaced(out / "VARIANT") as tmp:
        tmp.write_text(f"clean + DFlash2 (block_size {BLOCK_SIZE}, top_k {SELECTOR_TOP_K}, kernel {KERNEL_SIZE})\n")
    return out
