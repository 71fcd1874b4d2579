"""The DFlash family's checks of a drafter GGUF that need no model run (DFlash, DFlash2 and DSpark
share the `dflash` graph): `CHECKS`, lint's table for the kind (DrafterKind.checks), and the
log-SNR head's terms, which the reference's loaders check too."""

from __future__ import annotations

import logging

import numpy as np

from featdiff.core import names
from featdiff.core.blocks import DEFAULT_BLOCK_SIZE, block_size_problem
from featdiff.core.gguf_reader import (
    GgufModel,
    array_len,
    has_meta,
    int_list_meta,
    int_meta,
    meta,
    n_embd_of,
    n_vocab_of,
)
from featdiff.kinds.dflash.dspark import DSPARK_FILE_TENSORS, dspark_key_problems, dspark_problems, gguf_first_draft_row
from featdiff.kinds.problems import ADVISORY, FATAL, UNMODELLED, CheckTable, d2t_problems, layer_id_problems
from featdiff.kinds.unmodelled import unmodelled_problems

log = logging.getLogger(__name__)


def log_snr_problems(
    flag_key: str, flag: bool, min_log_snr: float | None, max_log_snr: float | None, present: set[str]
) -> list[str]:
    """The log-SNR flag, its range and its four tensors must come together.

    `present` is the set of tensor names the file holds; the tensor names are the same in GGUF
    and HF checkpoints (`log_snr_fc1.weight`, ...).
    """
    have = [t for t in names.LOG_SNR_TENSORS if t in present]
    missing = [t for t in names.LOG_SNR_TENSORS if t not in present]
    if not flag:
        if have:
            return [
                f"carries {', '.join(have)} but {flag_key} is not set, so a run ignores the "
                f"conditioning; set {flag_key} (with the log-SNR range) or drop the tensors"
            ]
        return []
    problems = []
    if missing:
        problems.append(
            f"{flag_key} = true but {', '.join(missing)} are missing; re-export the "
            f"drafter with its log-SNR MLP or clear the flag"
        )
    if min_log_snr is None or max_log_snr is None:
        problems.append(
            f"{flag_key} = true but the log-SNR range (min/max) is missing; "
            "re-export with the trained min_log_snr and max_log_snr"
        )
    elif not min_log_snr < max_log_snr:
        problems.append(f"log-SNR range min {min_log_snr} >= max {max_log_snr}; expected min < max")
    return problems


def _target_layer_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    if not has_meta(d, names.KEY_TARGET_LAYERS):
        return [f"{names.KEY_TARGET_LAYERS} is missing; llama.cpp refuses to load the drafter without it"]
    ids = int_list_meta(d, names.KEY_TARGET_LAYERS)
    if not ids:
        return [f"{names.KEY_TARGET_LAYERS} is empty; expected the trained layer ids + 1"]
    n_layer = int_meta(t, names.KEY_BLOCK_COUNT) if t is not None and has_meta(t, names.KEY_BLOCK_COUNT) else None
    return layer_id_problems(names.KEY_TARGET_LAYERS, ids, n_layer)


def _fc_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    fc = d.tensors.get(names.T_FC)
    if fc is None:
        return [f"{names.T_FC} is missing; llama.cpp refuses to load the drafter without it"]
    if not has_meta(d, names.KEY_TARGET_LAYERS):
        return []
    n_extract = len(int_list_meta(d, names.KEY_TARGET_LAYERS))
    n_embd = n_embd_of(d)
    problems = []
    if n_embd is not None and list(fc.ne) != [n_extract * n_embd, n_embd]:
        problems.append(
            f"{names.T_FC} ne = {list(fc.ne)} but llama.cpp loads it as [n_extract * n_embd, n_embd] "
            f"= [{n_extract * n_embd}, {n_embd}]; re-export fc for {n_extract} target layers"
        )
    n_embd_tgt = n_embd_of(t) if t is not None else None
    if n_embd_tgt is not None and fc.ne[0] != n_extract * n_embd_tgt:
        problems.append(
            f"{names.T_FC} takes {fc.ne[0]} inputs but the features are n_extract {n_extract} x target "
            f"n_embd {n_embd_tgt} = {n_extract * n_embd_tgt} wide; pair the drafter with its target"
        )
    return problems


def _block_size_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    """A block size llama.cpp cannot draft with; absent from a DSpark drafter, its Markov head
    aborts llama.cpp (src/models/dflash.cpp: GGML_ASSERT "DSpark draft requires 'dflash.block_size'")."""
    if not has_meta(d, names.KEY_BLOCK_SIZE):
        return (
            [
                f"{names.KEY_BLOCK_SIZE} is missing, which llama.cpp's DSpark Markov head asserts on; export the "
                "trained block size"
            ]
            if names.T_MARKOV_W1 in d.tensors
            else []
        )
    problem = block_size_problem(int_meta(d, names.KEY_BLOCK_SIZE), gguf_first_draft_row(d))
    return [problem] if problem is not None else []


def _unstated_block_size(d: GgufModel, t: GgufModel | None) -> list[str]:
    """A DFlash drafter without `dflash.block_size`: llama.cpp falls back to its default."""
    if has_meta(d, names.KEY_BLOCK_SIZE) or names.T_MARKOV_W1 in d.tensors:
        return []
    return [
        f"{names.KEY_BLOCK_SIZE} is missing; llama.cpp falls back to {DEFAULT_BLOCK_SIZE}, which may not be the "
        "trained block size; export the trained value"
    ]


def _mask_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    if not has_meta(d, names.KEY_MASK_TOKEN):
        return [
            f"{names.KEY_MASK_TOKEN} is missing; the run reads the mask token from the drafter's vocabulary "
            "and cannot build the noise block; set it to the trained mask token id"
        ]
    mask = int_meta(d, names.KEY_MASK_TOKEN)
    problems = []
    for who, g in (("the drafter", d), ("the target", t)):
        n_vocab = n_vocab_of(g) if g is not None else None
        if n_vocab is not None and not 0 <= mask < n_vocab:
            problems.append(
                f"{names.KEY_MASK_TOKEN} = {mask} is outside {who}'s vocabulary of {n_vocab} tokens; "
                "set the trained mask token id"
            )
    return problems


def _log_snr_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    flag = bool(meta(d, names.KEY_LOG_SNR, False))
    lo, hi = meta(d, names.KEY_MIN_LOG_SNR, None), meta(d, names.KEY_MAX_LOG_SNR, None)
    problems = log_snr_problems(names.KEY_LOG_SNR, flag, lo, hi, set(d.tensors))
    n_embd = n_embd_of(d)
    expected = {
        names.T_LOG_SNR_FC1_W: [names.LOG_SNR_N_FREQ, n_embd],
        names.T_LOG_SNR_FC1_B: [n_embd],
        names.T_LOG_SNR_FC2_W: [n_embd, n_embd],
        names.T_LOG_SNR_FC2_B: [n_embd],
    }
    for name, ne in expected.items():
        if name in d.tensors and n_embd is not None and list(d.tensors[name].ne) != ne:
            problems.append(f"{name} ne = {list(d.tensors[name].ne)}, expected {ne}; re-export the log-SNR MLP")
    return problems


def _table_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    """The drafter's own token_embd / output must be [n_embd, n_vocab] for the target's vocabulary."""
    n_embd = n_embd_of(d)
    n_vocab_tgt = n_vocab_of(t) if t is not None else None
    n_vocab = n_vocab_tgt if n_vocab_tgt is not None else array_len(d, names.KEY_TOKEN_LIST)
    whose = "the target's" if n_vocab_tgt is not None else "the drafter's"
    d2t = d.tensors.get(names.T_D2T)
    problems = []
    if t is not None and n_vocab_tgt is not None and n_vocab_of(d) not in (None, n_vocab_tgt):
        problems.append(
            f"the drafter's vocabulary has {n_vocab_of(d)} tokens, the target's {n_vocab_tgt}; "
            "DFlash drafts in the target's vocabulary, pair the drafter with its target"
        )
    for name in (names.T_TOKEN_EMBD, names.T_OUTPUT):
        tensor = d.tensors.get(name)
        if name == names.T_OUTPUT and d2t is not None:  # a reduced head: one row per d2t entry
            if tensor is not None and list(tensor.ne) != [n_embd, d2t.ne[0]]:
                problems.append(
                    f"{name} ne = {list(tensor.ne)}, expected [n_embd, n_vocab_draft] = [{n_embd}, "
                    f"{d2t.ne[0]}] for the d2t's reduced vocabulary; re-export the reduced head"
                )
        elif tensor is not None and n_vocab is not None and list(tensor.ne) != [n_embd, n_vocab]:
            problems.append(
                f"{name} ne = {list(tensor.ne)}, expected [n_embd, n_vocab] = [{n_embd}, {n_vocab}] for "
                f"{whose} vocabulary; re-export the drafter's own table or drop it to borrow the target's"
            )
    return problems


def _dspark_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    """DSpark's tensors as llama.cpp loads them, and d2t."""
    shapes = {
        name: tuple(reversed(d.tensors[name].ne)) for name in DSPARK_FILE_TENSORS if name in d.tensors
    }  # numpy order
    problems = dspark_problems(shapes, n_embd_of(d), n_vocab_of(d))
    n_vocab = (n_vocab_of(t) if t is not None else None) or n_vocab_of(d)
    if names.T_D2T in d.tensors and n_vocab is not None:
        head = d.tensors.get(names.T_OUTPUT, d.tensors.get(names.T_TOKEN_EMBD))
        head_rows = head.ne[1] if head is not None else n_vocab  # no own head: the run borrows the target's
        ids = np.asarray(d.data[names.T_D2T].data).reshape(-1)  # (n_vocab_draft,): I64 read raw
        problems += d2t_problems(ids, n_vocab, head_rows)
    return problems


def _dspark_key_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    """DSpark's dflash.* keys against its tensors."""
    keys = {
        k: bool(meta(d, k)) for k in (names.KEY_SAMPLE_FROM_ANCHOR, names.KEY_HAS_CONFIDENCE_HEAD) if has_meta(d, k)
    }
    return dspark_key_problems(keys, set(d.tensors))


# Each check of a DFlash-family drafter and the severity of its problems, in lint's order: written
# once, so lint lists them all and preflight refuses the fatal ones (kinds/preflight.py).
CHECKS: CheckTable = (
    (_target_layer_problems, FATAL),  # no ids: refused; an id >= n_layer: GGML_ASSERT
    (_fc_problems, FATAL),  # a wrong width: refused at load
    (_block_size_problems, FATAL),  # no row to draft, or a block past one ubatch: GGML_ASSERT
    (_unstated_block_size, ADVISORY),
    (_mask_problems, FATAL),  # no mask token: every draft block holds token -1
    (_log_snr_problems, FATAL),  # the log-SNR keys and tensors llama.cpp requires together
    (_table_problems, FATAL),  # a table of the wrong shape: refused at load
    (_dspark_problems, FATAL),  # the DSpark tensors and d2t: refused at load, or out-of-range rows
    (_dspark_key_problems, ADVISORY),  # keys llama.cpp reads otherwise than the checkpoint was trained
    (
        unmodelled_problems,
        UNMODELLED,
    ),  # llama.cpp runs them; the reference refuses them (featdiff.kinds.dflash.modelled)
)
