"""`featdiff lint`: check a DFlash (or DSpark) drafter GGUF's metadata and tensors, alone or
against its target GGUF, without running anything. One line per problem, each naming the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from featdiff import names
from featdiff.errors import InputError
from featdiff.blocks import DEFAULT_BLOCK_SIZE, MIN_BLOCK_ROWS
from featdiff.reference.checks import (DSPARK_FILE_TENSORS, d2t_problems, dspark_key_problems, dspark_problems,
                                       log_snr_problems)
from featdiff.reference.gguf_io import GgufModel, array_len, has_meta, meta, read_gguf


def lint_gguf(model: Path, target: Path | None) -> list[str]:
    """Problems of the drafter GGUF `model` (and its fit to `target`), one line each; [] when clean."""
    d = read_gguf(Path(model))
    t = read_gguf(Path(target)) if target is not None else None
    if d.arch != names.ARCH_DFLASH:
        return [f"{model}: {names.KEY_ARCH} = {d.arch!r}, expected {names.ARCH_DFLASH!r}; "
                "lint checks DFlash drafter GGUFs (pass the target with --target)"]
    problems = [*_target_layer_problems(d, t), *_fc_problems(d, t), *_block_size_problems(d),
                *_mask_problems(d, t), *_log_snr_problems(d), *_table_problems(d, t), *_dspark_problems(d, t)]
    return [f"{model}: {p}" for p in problems]


def preflight(model: Path, target: Path) -> None:
    """Refuse, before llama.cpp sees them, a pair it would abort on or misrun from the first decode:
    lint's checks of the target layer ids, fc's width and the mask token (InputError, the first
    problem, one line)."""
    d, t = read_gguf(Path(model)), read_gguf(Path(target))
    if d.arch != names.ARCH_DFLASH:
        raise InputError(f"{model}: {names.KEY_ARCH} = {d.arch!r}, expected {names.ARCH_DFLASH!r}; pass the drafter "
                         "as --model and the target as --target")
    problems = [*_target_layer_problems(d, t), *_fc_problems(d, t), *_mask_problems(d, t)]
    if problems:
        more = f" ({len(problems) - 1} more: `featdiff lint {model} --target {target}`)" if len(problems) > 1 else ""
        raise InputError(f"{model}: {problems[0]}{more}")


def _n_embd(g: GgufModel) -> int | None:
    return int(meta(g, names.KEY_EMBEDDING_LENGTH)) if has_meta(g, names.KEY_EMBEDDING_LENGTH) else None


def _n_vocab(g: GgufModel) -> int | None:
    """The vocabulary size llama.cpp uses: the token list, else the embedding table's rows."""
    n = array_len(g, names.KEY_TOKEN_LIST)
    if n is None and names.T_TOKEN_EMBD in g.tensors:
        n = g.tensors[names.T_TOKEN_EMBD].ne[1]
    return n


def _target_layer_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    if not has_meta(d, names.KEY_TARGET_LAYERS):
        return [f"{names.KEY_TARGET_LAYERS} is missing; llama.cpp refuses to load the drafter without it"]
    ids = [int(i) for i in meta(d, names.KEY_TARGET_LAYERS)]
    if not ids:
        return [f"{names.KEY_TARGET_LAYERS} is empty; expected the trained layer ids + 1"]
    problems = [f"{names.KEY_TARGET_LAYERS} = {ids} has negative ids; ids are target layer indices"] if min(ids) < 0 else []
    if t is not None and has_meta(t, names.KEY_BLOCK_COUNT):
        n_layer = int(meta(t, names.KEY_BLOCK_COUNT))
        if max(ids) >= n_layer:
            problems.append(f"{names.KEY_TARGET_LAYERS} = {ids} but the target has {n_layer} layers; "
                            "ids must be < n_layer (an id equal to n_layer aborts llama.cpp)")
    return problems


def _fc_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    fc = d.tensors.get(names.T_FC)
    if fc is None:
        return [f"{names.T_FC} is missing; llama.cpp refuses to load the drafter without it"]
    if not has_meta(d, names.KEY_TARGET_LAYERS):
        return []
    n_extract = len(meta(d, names.KEY_TARGET_LAYERS))
    n_embd = _n_embd(d)
    problems = []
    if n_embd is not None and list(fc.ne) != [n_extract * n_embd, n_embd]:
        problems.append(f"{names.T_FC} ne = {list(fc.ne)} but llama.cpp loads it as [n_extract * n_embd, n_embd] "
                        f"= [{n_extract * n_embd}, {n_embd}]; re-export fc for {n_extract} target layers")
    n_embd_tgt = _n_embd(t) if t is not None else None
    if n_embd_tgt is not None and fc.ne[0] != n_extract * n_embd_tgt:
        problems.append(f"{names.T_FC} takes {fc.ne[0]} inputs but the features are n_extract {n_extract} x target "
                        f"n_embd {n_embd_tgt} = {n_extract * n_embd_tgt} wide; pair the drafter with its target")
    return problems


def _block_size_problems(d: GgufModel) -> list[str]:
    if not has_meta(d, names.KEY_BLOCK_SIZE):
        return [f"{names.KEY_BLOCK_SIZE} is missing; llama.cpp falls back to {DEFAULT_BLOCK_SIZE}, which may not be the trained "
                "block size; export the trained value"]
    block_size = int(meta(d, names.KEY_BLOCK_SIZE))
    if block_size < MIN_BLOCK_ROWS:
        return [f"{names.KEY_BLOCK_SIZE} = {block_size} leaves no slot to draft; expected >= {MIN_BLOCK_ROWS}"]
    return []


def _mask_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    if not has_meta(d, names.KEY_MASK_TOKEN):
        return [f"{names.KEY_MASK_TOKEN} is missing; the run reads the mask token from the drafter's vocabulary "
                "and cannot build the noise block; set it to the trained mask token id"]
    mask = int(meta(d, names.KEY_MASK_TOKEN))
    problems = []
    for who, g in (("the drafter", d), ("the target", t)):
        n_vocab = _n_vocab(g) if g is not None else None
        if n_vocab is not None and not 0 <= mask < n_vocab:
            problems.append(f"{names.KEY_MASK_TOKEN} = {mask} is outside {who}'s vocabulary of {n_vocab} tokens; "
                            "set the trained mask token id")
    return problems


def _log_snr_problems(d: GgufModel) -> list[str]:
    flag = bool(meta(d, names.KEY_LOG_SNR, False))
    lo, hi = meta(d, names.KEY_MIN_LOG_SNR, None), meta(d, names.KEY_MAX_LOG_SNR, None)
    problems = log_snr_problems(names.KEY_LOG_SNR, flag, lo, hi, set(d.tensors))
    n_embd = _n_embd(d)
    expected = {names.T_LOG_SNR_FC1_W: [names.LOG_SNR_N_FREQ, n_embd], names.T_LOG_SNR_FC1_B: [n_embd],
                names.T_LOG_SNR_FC2_W: [n_embd, n_embd], names.T_LOG_SNR_FC2_B: [n_embd]}
    for name, ne in expected.items():
        if name in d.tensors and n_embd is not None and list(d.tensors[name].ne) != ne:
            problems.append(f"{name} ne = {list(d.tensors[name].ne)}, expected {ne}; re-export the log-SNR MLP")
    return problems


def _table_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    """The drafter's own token_embd / output must be [n_embd, n_vocab] for the target's vocabulary."""
    n_embd = _n_embd(d)
    n_vocab_tgt = _n_vocab(t) if t is not None else None
    n_vocab = n_vocab_tgt if n_vocab_tgt is not None else array_len(d, names.KEY_TOKEN_LIST)
    whose = "the target's" if n_vocab_tgt is not None else "the drafter's"
    d2t = d.tensors.get(names.T_D2T)
    problems = []
    if t is not None and n_vocab_tgt is not None and _n_vocab(d) not in (None, n_vocab_tgt):
        problems.append(f"the drafter's vocabulary has {_n_vocab(d)} tokens, the target's {n_vocab_tgt}; "
                        "DFlash drafts in the target's vocabulary, pair the drafter with its target")
    for name in (names.T_TOKEN_EMBD, names.T_OUTPUT):
        tensor = d.tensors.get(name)
        if name == names.T_OUTPUT and d2t is not None:  # a reduced head: one row per d2t entry
            if tensor is not None and list(tensor.ne) != [n_embd, d2t.ne[0]]:
                problems.append(f"{name} ne = {list(tensor.ne)}, expected [n_embd, n_vocab_draft] = [{n_embd}, "
                                f"{d2t.ne[0]}] for the d2t's reduced vocabulary; re-export the reduced head")
        elif tensor is not None and n_vocab is not None and list(tensor.ne) != [n_embd, n_vocab]:
            problems.append(f"{name} ne = {list(tensor.ne)}, expected [n_embd, n_vocab] = [{n_embd}, {n_vocab}] for "
                            f"{whose} vocabulary; re-export the drafter's own table or drop it to borrow the target's")
    return problems


def _dspark_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    """DSpark's tensors as llama.cpp loads them, its dflash.* keys against them, and d2t."""
    shapes = {name: tuple(reversed(d.tensors[name].ne)) for name in DSPARK_FILE_TENSORS if name in d.tensors}  # numpy order
    keys = {k: bool(meta(d, k)) for k in (names.KEY_SAMPLE_FROM_ANCHOR, names.KEY_HAS_CONFIDENCE_HEAD) if has_meta(d, k)}
    problems = [*dspark_problems(shapes, _n_embd(d), _n_vocab(d)), *dspark_key_problems(keys, set(d.tensors))]
    n_vocab = (_n_vocab(t) if t is not None else None) or _n_vocab(d)
    if names.T_D2T in d.tensors and n_vocab is not None:
        head = d.tensors.get(names.T_OUTPUT, d.tensors.get(names.T_TOKEN_EMBD))
        head_rows = head.ne[1] if head is not None else n_vocab  # no own head: the run borrows the target's
        ids = np.asarray(d.data[names.T_D2T].data).reshape(-1)  # (n_vocab_draft,): I64 read raw
        problems += d2t_problems(ids, n_vocab, head_rows)
    return problems
