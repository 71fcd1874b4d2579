"""The MTP kind's checks of a head GGUF that need no model run (upstream src/models/*.cpp graph_mtp,
common_speculative_impl_draft_mtp): `CHECKS`, lint's table for the kind (DrafterKind.checks)."""

from __future__ import annotations

from featdiff.core import names
from featdiff.core.gguf_reader import GgufModel, int_meta, n_embd_of
from featdiff.kinds.mtp import mtp_head_block
from featdiff.kinds.problems import FATAL, CheckTable


def _mtp_head_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    """One trained head, declared and present: a GGUF converted with `--no-mtp` (or a plain
    target) run with `--spec-type draft-mtp` has none, and llama.cpp aborts on its MTP graph."""
    key = names.KEY_NEXTN_LAYERS.format(arch=d.arch)
    n_heads = int_meta(d, names.KEY_NEXTN_LAYERS, 0)
    if n_heads == 0:
        return [
            f"{key} is missing or 0: this GGUF carries no MTP head (converted with --no-mtp?); "
            "re-convert the checkpoint without --no-mtp, or with --mtp for a separate head GGUF"
        ]
    if d.arch == names.ARCH_GEMMA4_ASSISTANT:
        return _assistant_problems(d, t)
    il = mtp_head_block(d)  # more than one: chained heads, head k at block il + k (common/speculative.cpp chain_heads)
    if il is None:
        return [f"{names.KEY_BLOCK_COUNT.format(arch=d.arch)} is missing: re-convert the checkpoint"]
    needs = [names.T_NEXTN.format(il=il + k, name=names.NEXTN_EH_PROJ) for k in range(n_heads)]
    missing = [n for n in needs if n not in d.tensors]
    if missing:
        return [
            f"{missing[0]} is missing; {key} = {n_heads} declares heads at blocks {il}..{il + n_heads - 1}: re-convert "
            "without --no-mtp"
        ]
    n_embd_tgt = n_embd_of(t) if t is not None else None
    if n_embd_tgt is not None and n_embd_tgt != n_embd_of(d):
        return [f"the head is {n_embd_of(d)} wide, the target {n_embd_tgt}: pair the MTP GGUF with its own target"]
    return []


def _assistant_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    """Gemma 4's assistant (gemma4-assistant.cpp): its pre / post projections, handed and handing
    back the target's width (`embedding_length_out`), for a Gemma 4 target."""
    missing = [n for n in ("nextn.pre_projection.weight", "nextn.post_projection.weight") if n not in d.tensors]
    if missing:
        return [f"{missing[0]} is missing: re-convert the assistant (conversion/gemma.py Gemma4AssistantModel)"]
    if t is None:
        return []
    if t.arch != "gemma4":
        return [f"Gemma 4's assistant drafts for a gemma4 target; the target is {t.arch!r}"]
    out = int_meta(d, f"{d.arch}.embedding_length_out", 0)
    if out != n_embd_of(t):
        return [f"the assistant hands back {out} wide rows (embedding_length_out), the target is {n_embd_of(t)} wide"]
    return []


CHECKS: CheckTable = ((_mtp_head_problems, FATAL),)
