"""Detectors of wiring: feature slots (which target layer, in which order) and the terms and
tables of the checkpoint, tested against the reference's candidates. Each `detect_<kind>(ev)`
tests one hypothesis on one divergent pair's `Evidence` and returns `Finding | None`; its
sentence is written beside it.
"""

from __future__ import annotations

import itertools

import numpy as np

from featdiff.core import names
from featdiff.diff.detectors.base import Evidence, error_finding, explains, fix_by_place, same_shape
from featdiff.diff.detectors.sources import placed_message
from featdiff.diff.fields import (
    ExtraTermFields,
    LayerOffsetFields,
    MissingTermFields,
    SlotPermutationFields,
    WrongSourceFields,
)
from featdiff.diff.metrics import relative_error
from featdiff.diff.result import Finding
from featdiff.diff.sketch import LayerMatch
from featdiff.diff.tolerance import Tolerance

MAX_PERMUTATION_SLOTS = 8  # exhaustive assignment up to 8! orders; greedy beyond
# A sketched distance carries the JL error (~sqrt(2 / SKETCH_DIM) = 0.18) on top of the noise.
LAYER_MATCH_SLACK = 2.0
# Candidate hypotheses another detector owns; every other `<record>@<key>=<value>` names a source.
OTHER_HYPOTHESES = (names.HYP_SLOTS, names.HYP_NO_LOG_SNR.partition("=")[0])
HYP_D2T = names.HYP_D2T_OFFSETS.partition("=")[0]  # logits scattered through another d2t: their infinities differ


# --- feature slots -------------------------------------------------------------------------------


def _layer_matched(lm: LayerMatch, slot: int, tol: Tolerance) -> bool:
    return lm.closest_error(slot) <= tol.rel * LAYER_MATCH_SLACK


def detect_layer_offset(ev: Evidence) -> Finding | None:
    """Hypothesis: a feature slot carries another target layer's input than the checkpoint's.
    Evidence: the slot x layer matrix puts the slot on layer L' != target_layers[k], within tolerance."""
    lm = ev.layers
    if lm is None:
        return None
    observed = lm.closest_layers
    off = [
        k
        for k, (o, e) in enumerate(zip(observed, lm.expected_layers))
        if o != e and _layer_matched(lm, k, ev.tolerance)
    ]
    if not off or sorted(observed) == sorted(lm.expected_layers):
        return None
    k = off[0]
    delta = observed[k] - lm.expected_layers[k]
    same = all(observed[j] - lm.expected_layers[j] == delta for j in range(len(observed)))
    hint = f" (every slot is off by {delta:+d}: {_layer_rule(ev, lm.expected_layers)})" if same else ""
    if not same and len(off) > 1:  # name every slot off, e.g. all of them on one layer
        hint = (
            f" (slots {', '.join(map(str, off))} are the inputs of layers {', '.join(str(observed[j]) for j in off)})"
        )
    return error_finding(
        ev,
        f"slot {k} of {ev.tensor} is the input of target layer {observed[k]}; "
        f"the checkpoint expects layer {lm.expected_layers[k]}{hint}",
        LayerOffsetFields(
            slot=k,
            expected_layer=lm.expected_layers[k],
            observed_layer=observed[k],
            delta=delta,
            observed_layers=tuple(observed),
            expected_layers=tuple(lm.expected_layers),
        ),
    )


def _layer_rule(ev: Evidence, expected: list[int] | tuple[int, ...]) -> str:
    """What the drafter's layer key must hold: the kind's rule, or, for a reference read from a HF
    checkpoint that says what its ids mean (Evidence.checkpoint), both conventions by name."""
    c = ev.checkpoint or {}
    mean, trainer, ids = c.get("layer_ids_mean"), c.get("trainer"), c.get("layer_ids")
    if mean == "output":
        return (
            f"the checkpoint's trainer ({trainer}) reads layer outputs, and llama.cpp taps layer inputs: the GGUF "
            f"must carry its ids + 1, {ev.kind.layer_key} = {list(expected)} for ids {ids}"
        )
    if mean == "input":
        return (
            f"the checkpoint's trainer ({trainer}) reads layer inputs, as llama.cpp taps them: {ev.kind.layer_key} "
            f"must be its ids as they are, {list(expected)}, with no + 1"
        )
    return f"{ev.kind.layer_key} must be the checkpoint's {ev.kind.layer_rule}"


def detect_slot_permutation(ev: Evidence) -> Finding | None:
    """Hypothesis: the slots of a concatenated feature row are reordered. Evidence: run slot k
    equals ref slot perm[k] (assignment over slot x slot errors), or the layer matrix maps the
    slots onto a reordering of target_layers, or run matches a ref candidate `<record>@slots=<perm>`."""
    perm = _slot_assignment(ev) or _layer_permutation(ev)
    if perm is None and ev.record == names.EAGLE3_FC_OUT:
        return _fc_columns_permuted(ev)
    perm = perm or _candidate_permutation(ev)
    if perm is None:
        return None
    if ev.record == names.layer_name(names.EAGLE3_CONCAT, 0):
        return error_finding(
            ev,
            f"{ev.tensor} holds [g_norm, embd_norm] (it matches the reference's {ev.record}@slots=1,0): the "
            "decoder's attention reads its two halves the other way round from the checkpoint's "
            "[embd_norm, g_norm]; concatenate the normalized token embedding first",
            SlotPermutationFields(permutation=tuple(perm)),
        )
    if ev.record.startswith(f"{names.MTP_CONCAT}-"):
        return error_finding(
            ev,
            f"{ev.tensor} holds [h_norm, e_norm] (it matches the reference's {ev.record}@slots=1,0): the MTP "
            "head's eh_proj reads its two halves the other way round from the checkpoint's [e_norm, h_norm]; "
            "concatenate the normalized token embedding first (ml-explore/mlx-lm#1469)",
            SlotPermutationFields(permutation=tuple(perm)),
        )
    return error_finding(
        ev,
        f"the slots of {ev.tensor} arrive in order {perm} instead of "
        f"{list(range(len(perm)))}; stage slot k from target_layers[k] and keep fc's column "
        f"blocks in the same order",
        SlotPermutationFields(permutation=tuple(perm)),
    )


def _slot_assignment(ev: Evidence) -> list[int] | None:
    k = ev.n_extract
    if k < 2 or not same_shape(ev) or ev.ref.shape[1] % k:
        return None
    ref = ev.ref.reshape(len(ev.ref), k, -1).transpose(1, 0, 2)  # (n_extract, R, n_embd)
    run = ev.run.reshape(len(ev.run), k, -1).transpose(1, 0, 2)  # (n_extract, R, n_embd)
    err = np.array([[relative_error(ref[j], run[i]) for j in range(k)] for i in range(k)])  # (run slot, ref slot)
    perm = best_assignment(err)
    if perm == list(range(k)) or any(err[i, p] > ev.tolerance.rel for i, p in enumerate(perm)):
        return None
    return perm


def _layer_permutation(ev: Evidence) -> list[int] | None:
    lm = ev.layers
    if lm is None or not all(_layer_matched(lm, k, ev.tolerance) for k in range(len(lm.expected_layers))):
        return None
    observed = list(lm.closest_layers)
    if observed == list(lm.expected_layers) or sorted(observed) != sorted(lm.expected_layers):
        return None
    return [list(lm.expected_layers).index(o) for o in observed]


def _fc_columns_permuted(ev: Evidence) -> Finding | None:
    """EAGLE3's `fc_out` matching `fc_out@slots=<perm>` while its input matched: fc's column
    blocks, not the features, are out of order."""
    perm = _candidate_permutation(ev)
    if perm is None:
        return None
    moved = ", ".join(f"block {p} holds the checkpoint's block {k}" for k, p in enumerate(perm) if p != k)
    return error_finding(
        ev,
        f"{ev.tensor} is fc applied to the feature slots in order {perm} instead of {list(range(len(perm)))} "
        f"(it matches the reference's {names.candidate_name(ev.record, names.slots_hypothesis(tuple(perm)))}) "
        f"while fc's input matches: "
        + fix_by_place(
            ev,
            f"the GGUF's {names.T_FC} has its column blocks permuted ({moved}): write its {len(perm)} blocks of "
            f"target_hidden_size columns in the checkpoint's order (block k multiplies the slot of "
            f"{names.KEY_EAGLE3_TARGET_LAYERS}[k])",
            f"the graph multiplies {names.T_FC}'s column blocks with the slots in another order (the GGUF's "
            f"{names.T_FC} is the reference's): concatenate the slots in {names.KEY_EAGLE3_TARGET_LAYERS} order "
            "before fc",
        ),
        SlotPermutationFields(permutation=tuple(perm)),
    )


def _candidate_permutation(ev: Evidence) -> list[int] | None:
    for _name, hyp, value, arr in _hypotheses(ev):
        if hyp == names.HYP_SLOTS and explains(arr, ev.run, ev.tolerance):
            return [int(x) for x in value.split(",")]
    return None


def best_assignment(cost: np.ndarray) -> list[int]:
    """The permutation p minimizing sum(cost[i, p[i]]): exhaustive up to 8 slots, greedy beyond."""
    n = cost.shape[0]
    if n <= MAX_PERMUTATION_SLOTS:
        best = min(itertools.permutations(range(n)), key=lambda p: sum(cost[i, p[i]] for i in range(n)))
        return list(best)
    perm, free = [], set(range(n))
    for i in range(n):
        j = min(free, key=lambda c: cost[i, c])
        perm.append(j)
        free.discard(j)
    return perm


# --- terms and sources ---------------------------------------------------------------------------


def _hypotheses(ev: Evidence):
    """(candidate name, hypothesis key, value, aligned rows) of each `<record>@<key>=<value>` candidate."""
    for name, arr in sorted(ev.candidates.items()):
        if names.CANDIDATE_SEP not in name:
            continue
        hyp = name.split(names.CANDIDATE_SEP, 1)[1]
        key, _, value = hyp.partition("=")
        yield name, key, value, arr


def _terms(ev: Evidence):
    """(name, aligned rows) of each term the checkpoint adds in this eval (names.TERM_RECORDS),
    shaped like this pair."""
    for name, arr in sorted(ev.candidates.items()):
        if names.CANDIDATE_SEP not in name and arr.shape == ev.ref.shape:
            yield name, arr


def detect_missing_term(ev: Evidence) -> Finding | None:
    """Hypothesis: the run leaves out a component the checkpoint adds. Evidence: run = ref - c
    within tolerance, c a term the reference records in the same eval (`dspark_log_snr_fc2`);
    or the run's graph has no node for the sum (`dspark_draft_embd_snr`) and this pair, which
    the first layer computes from it, is the first to diverge."""
    for name, term in _terms(ev):
        if same_shape(ev) and explains(ev.ref - term, ev.run, ev.tolerance):
            return error_finding(ev, _term_message(ev.tensor, name), MissingTermFields(term=name))
    return _unsummed_term(ev)


def _term_message(tensor: str, term: str) -> str:
    if term == names.DSPARK_MARKOV_BIAS:
        return (
            f"{tensor} lacks the Markov head's bias ({term}): the run drafted as plain DFlash, from row 1, one "
            f"row late; llama.cpp runs a drafter as DSpark only when its GGUF has {names.T_MARKOV_W1} and "
            f"{names.T_MARKOV_W2}: re-export them (see `featdiff lint`)"
        )
    return (
        f"{tensor} lacks the {term} term the checkpoint adds; the run's drafter ignores that conditioning "
        "(check its GGUF keys and tensors)"
    )


def _unsummed_term(ev: Evidence) -> Finding | None:
    """missing_term where the run never forms the sum: the first divergent record after it."""
    term, total = names.DSPARK_LOG_SNR_FC2, names.DSPARK_DRAFT_EMBD_SNR
    if total not in ev.absent or term not in ev.candidates or not ev.record or ev.record in names.LOG_SNR_SUM_INPUTS:
        return None
    return error_finding(
        ev,
        f"{ev.tensor} diverges because the drafter's first layer reads "
        f"{names.INP_NOISE_EMBD} without the {term} term the checkpoint adds: the run's graph has no "
        f"{total} ({names.INP_NOISE_EMBD} + {term}); build the log-SNR conditioning into the graph, "
        f"or export the drafter with its {names.KEY_LOG_SNR} keys and tensors for a build that has it",
        MissingTermFields(term=term, expected_in=total),
    )


def detect_extra_term(ev: Evidence) -> Finding | None:
    """Hypothesis: the run adds a component the checkpoint does not. Evidence: run = ref + c
    within tolerance, c a term the reference records in the same eval (e.g. a run whose
    `inp_noise_embd` already holds the sum: `dspark_log_snr_fc2`)."""
    for name, term in _terms(ev):
        if same_shape(ev) and explains(ev.ref + term, ev.run, ev.tolerance):
            return error_finding(
                ev,
                f"{ev.tensor} carries an extra {name} term the checkpoint does not add; drop it from the run's graph",
                ExtraTermFields(term=name),
            )
    return None


def detect_wrong_source(ev: Evidence) -> Finding | None:
    """Hypothesis: values come from another table or tensor than the checkpoint's. Evidence: run
    matches a ref candidate `<record>@<key>=<source>` (e.g. `inp_noise_embd@table=target`), or a
    reduced head's logits match `<logits>@d2t=offsets` (detect_wrong_source_of_vocabulary)."""
    for name, key, value, arr in _hypotheses(ev):
        if key == HYP_D2T or key in OTHER_HYPOTHESES or not explains(arr, ev.run, ev.tolerance):
            continue
        return error_finding(ev, placed_message(ev, key, value, name), WrongSourceFields(source=value, candidate=name))
    return detect_wrong_source_of_vocabulary(ev)


def detect_wrong_source_of_vocabulary(ev: Evidence) -> Finding | None:
    """Hypothesis: a reduced head's rows land on other target ids than the checkpoint's (an EAGLE3
    GGUF whose d2t holds the HF offsets). Evidence: run matches a ref candidate
    `<logits>@d2t=<how>` (`result_output@d2t=offsets`): its values where the candidate puts one
    row, -inf (or blanked with the ref's) where it puts none. The run's -inf where the checkpoint
    has a logit is this fault's signature: in the chain it belongs before detect_nonfinite, which
    otherwise claims `result_output` (detect_wrong_source reaches it only where nonfinite does
    not, e.g. `draft_logits`, whose -inf compare blanks)."""
    for name, key, value, arr in _hypotheses(ev):
        if key == HYP_D2T and _explains_scattered(arr, ev):
            return error_finding(
                ev, placed_message(ev, key, value, name), WrongSourceFields(source=value, candidate=name)
            )
    return None


def _explains_scattered(expected: np.ndarray, ev: Evidence) -> bool:
    """The run's logits are `expected`: where it is -inf (no head row lands there) the run holds
    -inf, or the 0 compare writes on both sides where both were -inf (align.comparable_values);
    where it is NaN (several rows land there, which one stays is a race) the run holds a value;
    everywhere else the run equals it within tolerance."""
    if expected.shape != ev.run.shape or ev.ref.shape != ev.run.shape:
        return False
    off, open_ = np.isneginf(expected), np.isnan(expected)  # (R, D) each
    blank = np.isneginf(ev.run) | ((ev.run == 0) & (ev.ref == 0))  # (R, D)
    if not off.any() or not blank[off].all() or not np.isfinite(ev.run[open_]).all():
        return False
    fixed = off | open_
    return explains(np.where(fixed, 0.0, expected), np.where(fixed, 0.0, ev.run), ev.tolerance)
