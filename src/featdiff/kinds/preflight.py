"""A drafter GGUF's problems, alone or against its target GGUF, each with its severity, read
without running anything: `featdiff lint` (featdiff.verdict.lint) lists them all, and
`preflight` refuses the fatal ones before llama.cpp loads a pair (capture and probe call it).
Below the stages, so capture and the reference both read it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from featdiff.core import names
from featdiff.core.blocks import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DRAFT_MAX,
    block_rows,
    block_size_problem,
    check_rounds_fit,
    clamped_draft_max,
)
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import (
    GgmlLoader,
    GgufModel,
    array_len,
    has_meta,
    int_list_meta,
    int_meta,
    meta,
    read_gguf,
    trained_context,
)
from featdiff.kinds import registry as kinds
from featdiff.kinds.dflash.checks import log_snr_problems
from featdiff.kinds.dflash.dspark import DSPARK_FILE_TENSORS, dspark_key_problems, dspark_problems
from featdiff.kinds.mtp import refused_head
from featdiff.kinds.problems import ADVISORY, FATAL, UNMODELLED, Problem, Severity, d2t_problems, layer_id_problems
from featdiff.kinds.unmodelled import gguf_unmodelled


def preflight(
    model: Path,
    target: Path,
    *,
    rounds: int | None = None,
    draft_max: int = DEFAULT_DRAFT_MAX,
    ggml: GgmlLoader | None = None,
) -> None:
    """Refuse, before llama.cpp sees them, a pair it would abort on, refuse or misrun from the
    first decode: lint's fatal problems (InputError, the first problem, one line). With `rounds`,
    also a flow whose positions reach past the target's trained context (`draft_max` drafts per
    block, as capture's `--draft-max`; the prompt is not known yet: the shortest). `ggml`: the
    build's loader, which teaches the reader tensor types newer than gguf-py (gguf_reader)."""
    d, t = read_gguf(Path(model), ggml), read_gguf(Path(target), ggml)
    fatal = [p.text for p in drafter_problems(d, t) if p.severity == FATAL]
    if fatal:
        more = f" ({len(fatal) - 1} more: `featdiff lint {model} --target {target}`)" if len(fatal) > 1 else ""
        raise InputError(f"{model}: {fatal[0]}{more}")
    if rounds is not None:
        check_rounds_fit(rounds, _capture_block_rows(d, draft_max), trained_context(t), Path(target))


def drafter_problems(d: GgufModel, t: GgufModel | None) -> list[Problem]:
    """Every problem of the drafter `d` (and its fit to the target `t`), each with its severity:
    the checks of its kind's architecture (featdiff.kinds); an MTP head featdiff does not model,
    named (kinds.mtp.UNMODELLED_HEADS)."""
    refused = refused_head(d)
    if refused is not None:
        return [Problem(refused, FATAL)]
    if d.arch not in kinds.ALL_DRAFTER_ARCHS:
        return [
            Problem(
                f"{names.KEY_ARCH} = {d.arch!r}, expected one of {', '.join(kinds.ALL_DRAFTER_ARCHS)}; pass the "
                "drafter GGUF as the model and its target with --target",
                FATAL,
            )
        ]
    checks = kinds.kind_of(d.arch, d.tensors, str(d.path)).check_table()
    return [Problem(text, severity) for check, severity in checks for text in check(d, t)]


def _capture_block_rows(d: GgufModel, draft_max: int) -> int:
    """The positions a round of an in-process capture reaches with `draft_max` drafts: a DFlash
    block's rows (featdiff.core.blocks), EAGLE3's anchor and drafts."""
    if not kinds.kind_of(d.arch, d.tensors).block_flow:  # EAGLE3, MTP: the anchor and its drafts
        return draft_max + 1
    block_size = int_meta(d, names.KEY_BLOCK_SIZE, DEFAULT_BLOCK_SIZE)
    first_row = _first_draft_row(d)
    return block_rows(clamped_draft_max(draft_max, block_size, first_row), first_row)


def _first_draft_row(d: GgufModel) -> int:
    """The block row llama.cpp reads the drafter's first draft from: its block kind's rule
    (DrafterKind.first_draft_row); 1 where a kind has none."""
    rule = kinds.kind_of(d.arch, d.tensors, str(d.path)).first_draft_row
    return rule(d) if rule is not None else 1


def _n_embd(g: GgufModel) -> int | None:
    return int_meta(g, names.KEY_EMBEDDING_LENGTH) if has_meta(g, names.KEY_EMBEDDING_LENGTH) else None


def _n_vocab(g: GgufModel) -> int | None:
    """The vocabulary size llama.cpp uses: the token list, else the embedding table's rows."""
    n = array_len(g, names.KEY_TOKEN_LIST)
    if n is None and names.T_TOKEN_EMBD in g.tensors:
        n = g.tensors[names.T_TOKEN_EMBD].ne[1]
    return n


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
    n_embd = _n_embd(d)
    problems = []
    if n_embd is not None and list(fc.ne) != [n_extract * n_embd, n_embd]:
        problems.append(
            f"{names.T_FC} ne = {list(fc.ne)} but llama.cpp loads it as [n_extract * n_embd, n_embd] "
            f"= [{n_extract * n_embd}, {n_embd}]; re-export fc for {n_extract} target layers"
        )
    n_embd_tgt = _n_embd(t) if t is not None else None
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
    problem = block_size_problem(int_meta(d, names.KEY_BLOCK_SIZE), _first_draft_row(d))
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
        n_vocab = _n_vocab(g) if g is not None else None
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
    n_embd = _n_embd(d)
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
    n_embd = _n_embd(d)
    n_vocab_tgt = _n_vocab(t) if t is not None else None
    n_vocab = n_vocab_tgt if n_vocab_tgt is not None else array_len(d, names.KEY_TOKEN_LIST)
    whose = "the target's" if n_vocab_tgt is not None else "the drafter's"
    d2t = d.tensors.get(names.T_D2T)
    problems = []
    if t is not None and n_vocab_tgt is not None and _n_vocab(d) not in (None, n_vocab_tgt):
        problems.append(
            f"the drafter's vocabulary has {_n_vocab(d)} tokens, the target's {n_vocab_tgt}; "
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
    problems = dspark_problems(shapes, _n_embd(d), _n_vocab(d))
    n_vocab = (_n_vocab(t) if t is not None else None) or _n_vocab(d)
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


def _unmodelled_problems(d: GgufModel, t: GgufModel | None) -> list[str]:
    """The drafter's keys and tensors llama.cpp computes and the reference does not model."""
    return [
        f"{name} is computed by llama.cpp but not modelled by featdiff's reference, which refuses this "
        "drafter (docs/modelled.md); a capture runs and records it"
        for name in gguf_unmodelled(d)
    ]


# Each check of a drafter and the severity of its problems, in lint's order: written once, so lint
# lists them all and preflight refuses the fatal ones. Each kind names its table (DrafterKind.checks).
DFLASH_CHECKS: tuple[tuple[Callable[[GgufModel, GgufModel | None], list[str]], Severity], ...] = (
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
        _unmodelled_problems,
        UNMODELLED,
    ),  # llama.cpp runs them; the reference refuses them (featdiff.kinds.dflash.modelled)
)


# --- EAGLE3 (upstream src/models/eagle3.cpp, common_speculative_impl_draft_eagle3) ----------------


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
    n_embd_tgt = _n_embd(t) if t is not None else None
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
    n_vocab = _n_vocab(t) if t is not None else None
    ids = np.asarray(d.data[names.T_D2T].data).reshape(-1)  # (n_vocab_draft,): I64 read raw
    if n_vocab is not None and ids.size and (ids.min() < 0 or ids.max() >= n_vocab):
        return [
            f"{names.T_D2T} holds ids outside the target's vocabulary of {n_vocab} (min {ids.min()}, max "
            f"{ids.max()}); write absolute ids (offsets + row index), as the converter does"
        ]
    return []


EAGLE3_CHECKS: tuple[tuple[Callable[[GgufModel, GgufModel | None], list[str]], Severity], ...] = (
    (_eagle3_layer_problems, FATAL),
    (_eagle3_fc_problems, FATAL),
    (_eagle3_d2t_problems, FATAL),
    (_unmodelled_problems, UNMODELLED),  # featdiff.kinds.eagle3
)


# --- MTP (upstream src/models/qwen35.cpp graph_mtp, common_speculative_impl_draft_mtp) -------------


def mtp_head_block(d: GgufModel) -> int | None:
    """The block index of the GGUF's MTP head (its trunk's layer count: block_count counts the
    heads), None when the file declares none."""
    n_heads = int_meta(d, names.KEY_NEXTN_LAYERS, 0)
    return int_meta(d, names.KEY_BLOCK_COUNT) - n_heads if n_heads > 0 and has_meta(d, names.KEY_BLOCK_COUNT) else None


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
    n_embd_tgt = _n_embd(t) if t is not None else None
    if n_embd_tgt is not None and n_embd_tgt != _n_embd(d):
        return [f"the head is {_n_embd(d)} wide, the target {n_embd_tgt}: pair the MTP GGUF with its own target"]
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
    if out != _n_embd(t):
        return [f"the assistant hands back {out} wide rows (embedding_length_out), the target is {_n_embd(t)} wide"]
    return []


MTP_CHECKS: tuple[tuple[Callable[[GgufModel, GgufModel | None], list[str]], Severity], ...] = (
    (_mtp_head_problems, FATAL),
)
