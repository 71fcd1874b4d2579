"""Consistency checks of a drafter shared by the reference's loaders (which refuse), `lint` (which
lists) and capture's preflight (which refuses the fatal ones): each returns problem sentences
without the file name; the caller prefixes it. `dspark_key_problems` is lint's alone: llama.cpp
loads such a file, so the reference does too. Pure rules on values: below every stage.
"""

from __future__ import annotations

import numpy as np

from featdiff import names

# The DSpark tensors a file may hold, and d2t (which sizes markov_w2), by GGUF name
DSPARK_FILE_TENSORS = (
    names.T_MARKOV_W1,
    names.T_MARKOV_W2,
    names.T_MARKOV_W2_SCALE,
    names.T_CONF_PROJ_W,
    names.T_CONF_PROJ_B,
    names.T_D2T,
)


def layer_id_problems(key: str, ids: list[int], n_layer: int | None) -> list[str]:
    """The drafter's target layer ids (`key` as the file spells it) against the target's
    `n_layer` (None: unknown): what lint, the preflight and the reference refuse, worded once."""
    problems = [f"{key} = {ids} has negative ids; ids are target layer indices"] if ids and min(ids) < 0 else []
    if n_layer is not None and ids and max(ids) >= n_layer:
        problems.append(
            f"{key} = {ids} but the target has {n_layer} layers; ids must be < n_layer "
            "(an id equal to n_layer aborts llama.cpp)"
        )
    return problems


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


def dspark_problems(
    shapes: dict[str, tuple[int, ...]], n_embd: int | None, n_vocab: int | None, spelled: dict[str, str] | None = None
) -> list[str]:
    """The DSpark tensors must come as llama.cpp loads them (upstream `load_arch_tensors`,
    src/models/dflash.cpp): a file with `markov_w1` is DSpark and needs `markov_w2`; without it
    any other DSpark tensor is left unused, which llama.cpp refuses.

    `shapes`: numpy shapes of the DSpark tensors and `d2t` the file holds, keyed by GGUF name;
    `spelled` maps a GGUF name to the file's own name for the messages (HF checkpoints). A size
    passed as None is not checked.
    """
    say = (spelled or {}).get
    w1, w2 = shapes.get(names.T_MARKOV_W1), shapes.get(names.T_MARKOV_W2)
    extra = [say(t, t) for t in _DSPARK_EXTRAS if t in shapes]
    if w1 is None:
        return (
            [
                f"carries {', '.join(extra)} but no {say(names.T_MARKOV_W1, names.T_MARKOV_W1)}, so llama.cpp "
                "leaves them unused and refuses the file; re-export the drafter with its whole Markov head "
                "or drop them"
            ]
            if extra
            else []
        )
    if w2 is None:
        return [
            f"carries {say(names.T_MARKOV_W1, names.T_MARKOV_W1)} but no {say(names.T_MARKOV_W2, names.T_MARKOV_W2)}; "
            "llama.cpp refuses a Markov head without it, re-export both Markov matrices"
        ]
    rank = w1[-1]
    d2t = shapes.get(names.T_D2T)
    n_vocab_draft = d2t[0] if d2t else n_vocab
    expected = {
        names.T_MARKOV_W1: (n_vocab, rank),
        names.T_MARKOV_W2: (n_vocab_draft, rank),
        names.T_MARKOV_W2_SCALE: (1,),
        names.T_CONF_PROJ_W: (1, None if n_embd is None else n_embd + rank),
        names.T_CONF_PROJ_B: (1,),
    }
    problems = [
        f"{say(t, t)} has shape {list(shapes[t])}, expected {_spelled_shape(want)} ({_WHY[t]}); "
        "re-export the DSpark heads for this drafter"
        for t, want in expected.items()
        if t in shapes and not _fits(shapes[t], want)
    ]
    if names.T_CONF_PROJ_B in shapes and names.T_CONF_PROJ_W not in shapes:
        problems.append(
            f"carries {say(names.T_CONF_PROJ_B, names.T_CONF_PROJ_B)} but no "
            f"{say(names.T_CONF_PROJ_W, names.T_CONF_PROJ_W)}, so the run has no confidence head; "
            "re-export the confidence head whole"
        )
    return problems


def dspark_key_problems(keys: dict[str, bool], present: set[str]) -> list[str]:
    """What a GGUF's DSpark keys say against its tensors: llama.cpp loads such a file and runs it
    otherwise than trained (upstream common/speculative.cpp reads the keys, the graph the tensors).

    `keys`: the DSpark keys the file sets, with their values; `present`: its tensor names.
    """
    conf = keys.get(names.KEY_HAS_CONFIDENCE_HEAD)
    if names.T_MARKOV_W1 not in present:
        problems = (
            [
                f"{' and '.join(sorted(keys))} {'are' if len(keys) > 1 else 'is'} set but {names.T_MARKOV_W1} is "
                "missing, so llama.cpp runs it as plain DFlash: the export lost its Markov head; re-export with "
                "markov_w1/markov_w2"
            ]
            if keys
            else []
        )
        if conf:
            problems.append(
                f"{names.KEY_HAS_CONFIDENCE_HEAD} = true without {names.T_MARKOV_W1}: a confidence head "
                "without the Markov head it scores is a broken export; re-export the DSpark drafter whole"
            )
        return problems
    has_proj = names.T_CONF_PROJ_W in present
    problems = []
    if names.KEY_SAMPLE_FROM_ANCHOR not in keys:
        problems.append(
            f"{names.KEY_SAMPLE_FROM_ANCHOR} is missing, so llama.cpp drafts anchor-first, wrong for a "
            "bonus-anchor checkpoint; export the trained layout"
        )
    if conf is None and not has_proj:
        problems.append(
            f"{names.KEY_HAS_CONFIDENCE_HEAD} is missing, which llama.cpp reads as true, but "
            f"{names.T_CONF_PROJ_W} is missing; export {names.KEY_HAS_CONFIDENCE_HEAD} = false"
        )
    elif conf and not has_proj:
        problems.append(
            f"{names.KEY_HAS_CONFIDENCE_HEAD} = true but {names.T_CONF_PROJ_W} is missing, so "
            "--spec-draft-p-min > 0 reads confidences the graph never computes; export the "
            "confidence head or set the key false"
        )
    elif conf is False and has_proj:
        problems.append(
            f"{names.KEY_HAS_CONFIDENCE_HEAD} = false but {names.T_CONF_PROJ_W} is present, so "
            "llama.cpp refuses --spec-draft-p-min > 0 for a drafter that has a confidence head; "
            "set the key true"
        )
    return problems


def d2t_problems(d2t: np.ndarray, n_vocab: int, head_rows: int) -> list[str]:
    """A reduced draft vocabulary `d2t` (absolute ids, `(n_vocab_draft,)`): int64, one distinct
    target id below `n_vocab` per head row (llama.cpp scatters row i of the drafter's logits to
    target token `d2t[i]`, src/models/dflash.cpp)."""
    if d2t.dtype != np.int64:
        return [f"{names.T_D2T} is stored as {d2t.dtype}, llama.cpp reads int64 (I64) ids; re-export d2t as int64"]
    problems = []
    if d2t.shape != (head_rows,):
        problems.append(
            f"{names.T_D2T} maps {d2t.size} draft rows but the drafter's head scores {head_rows}; "
            "export the reduced head (output.weight) with one row per d2t entry"
        )
    if d2t.size and not 0 <= d2t.min() <= d2t.max() < n_vocab:
        problems.append(
            f"{names.T_D2T} holds ids {d2t.min()}..{d2t.max()} outside the vocabulary of {n_vocab} "
            "tokens; d2t must hold absolute target ids (HF stores offsets: id = d2t[i] + i)"
        )
    if np.unique(d2t).size != d2t.size:
        problems.append(f"{names.T_D2T} maps two draft rows to one target id; re-export d2t")
    return problems


_DSPARK_EXTRAS = (names.T_MARKOV_W2, names.T_MARKOV_W2_SCALE, names.T_CONF_PROJ_W, names.T_CONF_PROJ_B)
_WHY = {
    names.T_MARKOV_W1: "n_vocab x rank",
    names.T_MARKOV_W2: "n_vocab_draft x rank",
    names.T_MARKOV_W2_SCALE: "one scale",
    names.T_CONF_PROJ_W: "1 x (n_embd + rank)",
    names.T_CONF_PROJ_B: "one bias",
}  # numpy order


def _fits(shape: tuple[int, ...], want: tuple[int | None, ...]) -> bool:
    return len(shape) == len(want) and all(w is None or s == w for s, w in zip(shape, want))


def _spelled_shape(want: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if w is None else str(w) for w in want) + "]"
