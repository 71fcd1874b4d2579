"""The EAGLE3 kind's checks of a drafter GGUF that need no model run (upstream
src/models/eagle3.cpp, common_speculative_impl_draft_eagle3): `CHECKS`, lint's table for the kind
(DrafterKind.checks)."""

from __future__ import annotations

import numpy as np

from featdiff.core import names
from featdiff.core.gguf_reader import GgufModel, has_meta, int_list_meta, int_meta, n_embd_of, n_vocab_of
from featdiff.kinds.problems import FATAL, UNMODELLED, CheckTable, layer_id_problems
from featdiff.kinds.unmodelled import unmodelled_problems


def _eagle3_layer_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    """Exactly three layer-input ids, each below the target's layer count. An id equal to it reads
    the target's nextn state (llama_set_embeddings_nextn), which llama/qwen3 targets never set and
    featdiff does not model: refused by name, never captured as zeros."""
    key = names.KEY_EAGLE3_TARGET_LAYERS
    if not has_meta(d, key):
        return [f"{key} is missing; llama.cpp refuses to load the EAGLE3 drafter without it"]
    ids = int_list_meta(d, key)
    if len(ids) != 3:
        return [f"{key} = {ids}: EAGLE3 reads exactly 3 target layers; re-convert the drafter"]
    n_layer = int_meta(t, names.KEY_BLOCK_COUNT) if t is not None and has_meta(t, names.KEY_BLOCK_COUNT) else None
    if n_layer is not None and n_layer in ids:
        return [
            f"{key} = {ids}: id {n_layer} (the target's layer count) reads the target's nextn state, which this "
            "target does not set and featdiff does not model; convert the drafter with ids below the layer count"
        ]
    return layer_id_problems(key, ids, n_layer)


def _eagle3_fc_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    fc = d.tensors.get(names.T_FC)
    if fc is None:
        return [f"{names.T_FC} is missing; llama.cpp refuses to load the EAGLE3 drafter without it"]
    n_embd_tgt = n_embd_of(t) if t is not None else None
    if n_embd_tgt is not None and fc.ne[0] != 3 * n_embd_tgt:
        return [
            f"{names.T_FC} takes {fc.ne[0]} inputs but the features are 3 x target n_embd {n_embd_tgt} = "
            f"{3 * n_embd_tgt} wide; pair the drafter with its target"
        ]
    return []


def _eagle3_d2t_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    """`d2t` as llama.cpp's graph reads it: I64 absolute target ids (the converter adds arange to
    the checkpoint's offsets), one per row of the drafter's head, each inside the target's vocabulary."""
    d2t = d.tensors.get(names.T_D2T)
    if d2t is None:
        return []
    if d2t.ggml_type != "i64":
        return [f"{names.T_D2T} is {d2t.ggml_type}; llama.cpp's EAGLE3 graph asserts I64 absolute target ids"]
    n_vocab = n_vocab_of(t) if t is not None else None
    ids = np.asarray(d.data[names.T_D2T].data).reshape(-1)  # (n_vocab_draft,): I64 read raw
    if n_vocab is not None and ids.size and (ids.min() < 0 or ids.max() >= n_vocab):
        return [
            f"{names.T_D2T} holds ids outside the target's vocabulary of {n_vocab} (min {ids.min()}, max "
            f"{ids.max()}); write absolute ids (offsets + row index), as the converter does"
        ]
    return []


CHECKS: CheckTable = (
    (_eagle3_layer_problems, FATAL),
    (_eagle3_fc_problems, FATAL),
    (_eagle3_d2t_problems, FATAL),
    (unmodelled_problems, UNMODELLED),  # featdiff.kinds.eagle3
)
