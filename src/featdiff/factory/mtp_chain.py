"""Tiny MiMo-V2 targets with the chained MTP heads MiMo ships (`model.mtp.layers.{0,1,2}`), for
common/speculative.cpp's `chain_heads` (n_layer_nextn > 1, memory not shared: draft step k runs
head k, llama_set_nextn_layer_offset(ctx_dft, k), n_max capped at the head count). The checkpoint
is `mtp-mimo2`'s (factory/mtp.py: the same target and head 0 for the same seed) with heads 1 and 2
drawn as head 0 is, each from its own stream; the pinned converter writes all three (MimoV2Model's
own count, conversion/mimo.py: `mimo2.nextn_predict_layers` 3, blocks n_layer .. n_layer + 2).

`mtp-mimo2` stays one head (the single-head path of the same arch); the chain is its own variant.
Two more plant the chain's export faults by rewriting the converted GGUF (factory/gguf_rewrite.py):
`-permuted` holds the heads in reverse block order (block n_layer + k holds head 2 - k), `-same`
holds head 0 in every block. The checkpoint in `target-hf/` stays the clean one, so a reference
made from it tells the GGUF's heads from the checkpoint's (`where: export`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from featdiff.core import names
from featdiff.core.outputs import check_output_dir, replaced
from featdiff.factory import pairs
from featdiff.factory.converter import (
    CONVERTER,
    DRAFT_GGUF,
    TARGET_GGUF,
    TARGET_HF,
    TOKENIZER_MODEL,
    convert_checkpoint,
    write_spm_tokenizer,
)
from featdiff.factory.fixtures import PROMPTS_FILE
from featdiff.factory.gguf_rewrite import rewrite_gguf
from featdiff.factory.hf_families import BOOTSTRAP_OF, TOKENIZER_SPM
from featdiff.factory.hf_targets import write_hf_target
from featdiff.factory.mtp import HF_SAFETENSORS, MIMO2_MTP, VARIANT_FILE, _update_tensors, add_mtp_head, mtp_weights

N_CHAIN = 3  # MiMo-V2's heads (conversion/mimo.py MimoV2Model._n_nextn)
_HEAD_LAYER = "model.mtp.layers.{k}."  # where MiMo-V2 keeps head k
# heads 1.. drawn as head 0 is (mtp_weights), each from the seed's own stream k: [seed * CHAIN_STREAMS + k]
CHAIN_STREAMS = 1000


@dataclass(frozen=True)
class ChainVariant:
    name: str
    doc: str
    # block n_layer + k of the GGUF holds head order[k] (None: as converted)
    order: tuple[int, ...] | None = None


def permuted(clean: ChainVariant, name: str) -> ChainVariant:
    """The variant `name`: `clean`'s export fault with the GGUF's heads in reverse block order (of N_CHAIN heads)."""
    return ChainVariant(
        name,
        f"`{clean.name}` with the GGUF's heads in reverse block order (export fault: head 2 - k runs for step k)",
        order=(2, 1, 0),
    )


_CLEAN_DOC = (
    f"MiMo-V2-Flash target (as `mtp-mimo2`) with its {N_CHAIN} chained MTP heads inside target.gguf: draft step k "
    f"runs head k (common/speculative.cpp chain_heads; --spec-draft-n-max capped at {N_CHAIN})"
)
_CLEAN = ChainVariant("mtp-mimo2-chain", _CLEAN_DOC)
_VARIANTS = (
    _CLEAN,
    permuted(_CLEAN, "mtp-mimo2-chain-permuted"),
    ChainVariant(
        "mtp-mimo2-chain-same",
        "`mtp-mimo2-chain` with head 0 in every head block of the GGUF (export fault: the same head for every step)",
        order=(0, 0, 0),
    ),
)
CHAIN_SETTINGS = {v.name: v for v in _VARIANTS}
CHAIN_VARIANTS = {v.name: v.doc for v in _VARIANTS}


def write_mtp_chain_fixture(outdir: str | Path, variant: str = "mtp-mimo2-chain", seed: int = 0) -> Path:
    """Write `variant`'s fixture into `outdir` (target-hf/ with the three heads, target.gguf, VARIANT); return it."""
    v = CHAIN_SETTINGS[variant]
    out = check_output_dir(Path(outdir), (), "OUTDIR")
    hf = write_hf_target(out / TARGET_HF, MIMO2_MTP.family, seed)
    write_spm_tokenizer(hf / TOKENIZER_MODEL, pairs.TINY.n_vocab)
    add_mtp_head(hf, seed, MIMO2_MTP)
    _update_tensors(hf, later_heads(hf, seed))
    (out / PROMPTS_FILE).unlink(missing_ok=True)
    (out / DRAFT_GGUF).unlink(missing_ok=True)
    gguf = convert_checkpoint(hf, out / TARGET_GGUF, bootstrap=BOOTSTRAP_OF[TOKENIZER_SPM])  # the converter's count
    return export_chain(gguf, v, out)


def export_chain(gguf: Path, v: ChainVariant, out: Path) -> Path:
    """The converted `gguf` with `v`'s head order planted (none: as converted) and `out`'s VARIANT
    file naming `v`; return `out`."""
    if v.order is not None:
        reorder_heads(gguf, v.order)
    with replaced(out / VARIANT_FILE) as tmp:
        tmp.write_text(f"{v.name}: {v.doc} (converted by {CONVERTER})\n")
    return out


def later_heads(hf: Path, seed: int) -> dict[str, np.ndarray]:
    """Heads 1 .. N_CHAIN - 1 of the checkpoint `hf`: head 0's layout, each its own draw."""
    from safetensors.numpy import load_file

    config = json.loads((hf / names.HF_CONFIG).read_text())
    target = load_file(str(hf / HF_SAFETENSORS))
    first = _HEAD_LAYER.format(k=0)
    out: dict[str, np.ndarray] = {}
    for k in range(1, N_CHAIN):
        drawn = mtp_weights(config, target, seed * CHAIN_STREAMS + k, MIMO2_MTP)
        out |= {_HEAD_LAYER.format(k=k) + n.removeprefix(first): a for n, a in drawn.items() if n.startswith(first)}
    return out


def reorder_heads(gguf: Path, order: tuple[int, ...]) -> Path:
    """`gguf` rewritten in place with block n_layer + k holding head `order[k]`'s tensors."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    arch = str(reader.fields[names.KEY_ARCH].contents())  # mimo2, step35
    n_layer = int(reader.fields[names.KEY_BLOCK_COUNT.format(arch=arch)].contents()) - len(order)
    blocks = [names.GGUF_LAYER_PREFIX.format(il=n_layer + k) for k in range(len(order))]
    held = {t.name: np.array(t.data) for t in reader.tensors if t.name.startswith(tuple(blocks))}
    moved = {
        blocks[k] + name.removeprefix(blocks[j]): data
        for k, j in enumerate(order)
        for name, data in held.items()
        if name.startswith(blocks[j])
    }
    return rewrite_gguf(gguf, gguf, tensors=moved)
