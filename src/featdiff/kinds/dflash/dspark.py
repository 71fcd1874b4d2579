"""DSpark's checks of a drafter GGUF that need no model run: its heads' tensors, shapes and keys."""

from __future__ import annotations

from featdiff.core import names
from featdiff.core.blocks import first_draft_row
from featdiff.core.gguf_reader import GgufModel, meta

# The DSpark tensors a file may hold, and d2t (which sizes markov_w2), by GGUF name
DSPARK_FILE_TENSORS = (
    names.T_MARKOV_W1,
    names.T_MARKOV_W2,
    names.T_MARKOV_W2_SCALE,
    names.T_CONF_PROJ_W,
    names.T_CONF_PROJ_B,
    names.T_D2T,
)
# the heads' tensors besides markov_w1, and what each is
_EXTRAS = (names.T_MARKOV_W2, names.T_MARKOV_W2_SCALE, names.T_CONF_PROJ_W, names.T_CONF_PROJ_B)
_WHY = {
    names.T_MARKOV_W1: "n_vocab x rank",
    names.T_MARKOV_W2: "n_vocab_draft x rank",
    names.T_MARKOV_W2_SCALE: "one scale",
    names.T_CONF_PROJ_W: "1 x (n_embd + rank)",
    names.T_CONF_PROJ_B: "one bias",
}  # numpy order


def gguf_first_draft_row(d: GgufModel) -> int:
    """The block row llama.cpp reads a `dflash` drafter GGUF's first draft from (featdiff.core.blocks):
    the heads the file carries choose it, whatever kind of the graph it is told as (a DSpark Markov
    head with `dflash.sample_from_anchor`, absent = true, drafts from the anchor's row)."""
    return first_draft_row(names.T_MARKOV_W1 in d.tensors, bool(meta(d, names.KEY_SAMPLE_FROM_ANCHOR, True)))


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
    extra = [say(t, t) for t in _EXTRAS if t in shapes]
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


def _fits(shape: tuple[int, ...], want: tuple[int | None, ...]) -> bool:
    return len(shape) == len(want) and all(w is None or s == w for s, w in zip(shape, want))


def _spelled_shape(want: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if w is None else str(w) for w in want) + "]"
