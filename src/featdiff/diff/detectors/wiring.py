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
        return error_finding(ev, _placed_message(ev, key, value, name), WrongSourceFields(source=value, candidate=name))
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
                ev, _placed_message(ev, key, value, name), WrongSourceFields(source=value, candidate=name)
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


# Hypotheses of a GGUF written otherwise (the export's fix), and what the graph does instead when the
# GGUF is the reference's own (Evidence.weights_where == "graph"): the fix a user acts on follows it
GRAPH_FIXES = {
    names.HYP_NORM_NONE: "feeds fc the raw features although the GGUF carries the encoder norm: apply it before fc",
    names.HYP_NORM_UNIT: "normalizes the features without the GGUF's norm weight (or where it has none): read the "
    "GGUF's norm_before_fc and enc norm weight",
    names.HYP_D2T_OFFSETS: "maps the reduced vocabulary as offsets + row index although the GGUF's d2t holds "
    "absolute target ids: read d2t as it is",
    names.HYP_TABLE_TARGET: "embeds with the target's table although the GGUF ships its own token_embd: read the "
    "drafter's table",
    names.HYP_NORM_HNORM: "norms the MTP head's two inputs each with the other's weight although the GGUF's hnorm "
    "and enorm are the checkpoint's: the hidden takes hnorm, the token embedding enorm",
    names.HYP_NORM_ENORM: "norms the MTP head's two inputs each with the other's weight although the GGUF's hnorm "
    "and enorm are the checkpoint's: the hidden takes hnorm, the token embedding enorm",
    **{
        f"{names.HYP_ROUTING}={used}": f"routes the head's experts by {used} although the GGUF and the checkpoint "
        f"route by {trained}: pass build_moe_ffn the file's expert_gating_func (the graph's own default where the "
        "file has none)"
        for used, trained in (("softmax", "sigmoid"), ("sigmoid", "softmax"))
    },
    names.HYP_HALVES_ROPE_FIRST: "reads each head's query and the compressed KV row as [rope, nope] although the "
    "GGUF lays them out [nope, rope], as the checkpoint does: view q_nope and the latent from the front of each "
    "row, q_pe and k_pe behind them",
}


def _placed_message(ev: Evidence, key: str, value: str, candidate: str) -> str:
    """_source_message, or, where the evidence clears the GGUF of an export hypothesis, the graph's fix."""
    if f"{key}={value}" == names.HYP_TAP_ATTN_NORM:
        layers = ", ".join(f"attn_norm-{L}" for L in ev.layers.expected_layers) if ev.layers else "attn_norm-<L>"
        return (
            f"{ev.tensor} carries, in each slot, its target layer's attention norm output ({layers}), not the "
            f"layer's input (it matches the reference's {candidate}): the target hands over the normed state; tap "
            "the residual stream entering the layer (llama.cpp's t_layer_inp, set before the layer's attn_norm)"
        )
    fix = GRAPH_FIXES.get(f"{key}={value}")
    if ev.weights_where != "graph" or fix is None:
        return _source_message(ev.tensor, key, value, candidate)
    return (
        f"{ev.tensor} matches the reference's {candidate} while the GGUF holds what the reference read: the graph {fix}"
    )


def _source_message(tensor: str, key: str, value: str, candidate: str) -> str:
    if f"{key}={value}" == names.HYP_G_AFTER_NORM:
        return (
            f"{tensor} of this draft step normalizes the previous step's result_norm (it matches the reference's "
            f"{candidate}): the state handed from step to step must be eagle3_prenorm, before the output norm "
            "(upstream eagle3.cpp sets t_h_nextn before build_norm); hand on the pre-norm state"
        )
    if f"{key}={value}" == names.HYP_TERM_AFTER_NORM:
        return (
            f"{tensor} is the first layer's attention norm plus the log-SNR term (it matches the reference's "
            f"{candidate}): add dspark_log_snr_fc2 to the noise embeddings before the first layer, so the "
            f"residual stream carries it and the norm sees it"
        )
    if f"{key}={value}" in (names.HYP_ANCHOR_BONUS, names.HYP_ANCHOR_FIRST):
        trained, run = ("anchor-first", "bonus-anchor") if value == "bonus" else ("bonus-anchor", "anchor-first")
        return (
            f"{tensor} carries the Markov chain laid out {run} (it matches the reference's {candidate}) but "
            f"the checkpoint was trained {trained}: set {names.KEY_SAMPLE_FROM_ANCHOR} = "
            f"{'true' if trained == 'anchor-first' else 'false'} in the drafter's GGUF"
        )
    if f"{key}={value}" == names.HYP_FULL_ATTENTION:
        return (
            f"{tensor} is the layer computed over the whole context (it matches the reference's {candidate}) where "
            f"the checkpoint's layer slides over a window: write {names.ARCH_DFLASH}.attention.sliding_window and "
            f"_pattern into the GGUF (a converter that leaves them out runs the window as full attention)"
        )
    if f"{key}={value}" == names.HYP_RECURRENT_KEPT:
        return (
            f"{tensor} is the layer run on a recurrent state that kept the last verify's rejected drafts (it matches "
            f"the reference's {candidate}): the rollback moved the position back but not the state; restore the "
            "state of the last accepted row (llama_memory_seq_rm on a context whose n_rs_seq covers the draft "
            "length restores its snapshot)"
        )
    if f"{key}={value}" == names.HYP_LEVELS_SWAPPED:
        return (
            f"{tensor} puts the anchor row at min_log_snr and the mask rows at max_log_snr (it matches the "
            f"reference's {candidate}); GIDD conditions the anchor (a token that is not the mask) at "
            f"max_log_snr and every mask row at min_log_snr"
        )
    if f"{key}={value}" in (names.HYP_NORM_NONE, names.HYP_FC_NORM_NONE, names.HYP_NORM_UNIT, names.HYP_D2T_OFFSETS):
        return _eagle3_export_message(tensor, f"{key}={value}", candidate)
    if f"{key}={value}" in (names.HYP_NORM_HNORM, names.HYP_NORM_ENORM):
        return (
            f"{tensor} is normed with the head's {value} weight (it matches the reference's {candidate}): the "
            "GGUF's nextn hnorm and enorm hold each other's weights; re-export them, hnorm the hidden's norm and "
            "enorm the embedding's"
        )
    if f"{key}={value}" in _MTP_WRONG_NORM:
        return _mtp_wrong_norm_message(tensor, f"{key}={value}", candidate)
    if key == names.HYP_ROUTING:
        trained = "sigmoid" if value == "softmax" else "softmax"
        return (
            f"{tensor} is the head's block with its experts chosen and weighted by {value} (it matches the "
            f"reference's {candidate}) where the checkpoint routes by {trained}: write <arch>.expert_gating_func "
            f"= {_GATING_FUNC[trained]} ({trained}) into the GGUF (a file without it takes the graph's default)"
        )
    if f"{key}={value}" == names.HYP_HALVES_ROPE_FIRST:
        return (
            f"{tensor} is the head's MLA attention with each head's query and the compressed KV row read as [rope, "
            f"nope] (it matches the reference's {candidate}) where the checkpoint lays them out [nope, rope]: the "
            "GGUF's attn_q_b and attn_kv_a_mqa rows were reordered; re-convert them in the checkpoint's order"
        )
    if f"{key}={value}" == names.HYP_H_BATCH_LAST:
        return (
            f"{tensor} pairs the first token of this target batch with the batch's last hidden state, a later "
            f"position's (it matches the reference's {candidate}): a batch's first token takes the pending row the "
            "batch before left (zeros before the first batch; ikawrakow/ik_llama.cpp#2222)"
        )
    if f"{key}={value}" == names.HYP_G_BATCH_LAST:
        return (
            f"{tensor} pairs the first token of this target batch with the batch's last g row, a later position's "
            f"(it matches the reference's {candidate}): process()'s cross-ubatch bridge row must take the pending g "
            "the batch before left; a row whose g is a view of pending_g_last (common_batch::set_embd keeps no copy) "
            "reads it after this batch's refresh overwrote it: copy the pending row before the refresh, or decode "
            "the batch before it"
        )
    return (
        f"{tensor} comes from the {value} {key} (it matches the reference's {candidate}); the checkpoint "
        f"uses its own: ship it in the GGUF or fix which {key} the run reads"
    )


def _eagle3_export_message(tensor: str, hypothesis: str, candidate: str) -> str:
    """The fix of an EAGLE3 export fault a candidate names: the encoder norm, d2t."""
    if hypothesis == names.HYP_NORM_NONE:
        return (
            f"{tensor} is fc applied to the raw target features (it matches the reference's {candidate}) where the "
            f"checkpoint normalizes them first ({names.EAGLE3_ENC_INPUT_NORM}): set {names.KEY_EAGLE3_NORM_BEFORE_FC} "
            f"= true and ship {names.T_ENC_NORM} (the checkpoint's input_norm) in the drafter's GGUF"
        )
    if hypothesis == names.HYP_FC_NORM_NONE:
        return (
            f"{tensor} is fc applied to the raw target features (it matches the reference's {candidate}) where the "
            "checkpoint normalizes each target slot with its own RMSNorm (SpecForge's fc_norm.{0,1,2}.weight): the "
            "export dropped them; llama.cpp's eagle3 graph has no per-slot norm (the pinned converter refuses "
            "fc_norm.0.weight), so this drafter cannot run there as trained"
        )
    if hypothesis == names.HYP_NORM_UNIT:
        return (
            f"{tensor} is fc applied to RMS-normalized target features (it matches the reference's {candidate}, "
            f"the norm with a unit weight) where the checkpoint applies fc to the raw features: drop "
            f"{names.KEY_EAGLE3_NORM_BEFORE_FC} and {names.T_ENC_NORM} from the drafter's GGUF"
        )
    return (
        f"{tensor} puts the drafter's head row i at target id offset[i], the checkpoint's d2t offset, instead of "
        f"offset[i] + i (it matches the reference's {candidate}): the GGUF's {names.T_D2T} holds the HF offsets; "
        "it must hold absolute target ids, offset + row index, as the pinned converter writes them"
    )


# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_* value of each gating function (src/llama-hparams.h)
_GATING_FUNC = {"softmax": 1, "sigmoid": 2}

# the MTP wrong-norm hypotheses (torchref/mtp_flow.WRONG_NORM)
_MTP_WRONG_NORM = (names.HYP_H_PRENORM, names.HYP_CHAIN_PRENORM, names.HYP_H_POSTNORM, names.HYP_CHAIN_POSTNORM)


def _mtp_wrong_norm_message(tensor: str, hypothesis: str, candidate: str) -> str:
    """The fix when an MTP head is handed a hidden state on the wrong side of a norm: by the
    target (HYP_H_PRENORM, or HYP_H_POSTNORM for a head trained on the pre-norm state: the rows
    process() pairs and the first draft step's) or by the previous draft step (HYP_CHAIN_*)."""
    if hypothesis == names.HYP_H_PRENORM:
        return (
            f"{tensor} is the target's trunk output before the final norm (it matches the reference's {candidate}); "
            "the MTP head was trained on the post-norm state: hand over the output of the final norm (the qwen35 "
            "graph sets t_h_nextn after build_norm; ggml-org/llama.cpp#24025)"
        )
    if hypothesis == names.HYP_H_POSTNORM:
        return (
            f"{tensor} is the target's trunk output after the final norm (it matches the reference's {candidate}); "
            "this MTP head was trained on the pre-norm state: hand over the final norm's input (the mimo2 graph "
            "sets t_h_nextn before output_norm), the head applies its own hnorm"
        )
    if hypothesis == names.HYP_CHAIN_POSTNORM:
        return (
            f"{tensor} of this draft step comes from the previous step's state after the head norm (it matches the "
            f"reference's {candidate}): this head recycles mtp_post_ffn, the state before the head norm (the mimo2 "
            "graph sets t_h_nextn before mtp_shared_head_norm); recycle the pre-norm state"
        )
    return (
        f"{tensor} of this draft step comes from the previous step's state before the head norm (it matches the "
        f"reference's {candidate}): each step after the first must be handed the previous step's h_nextn, after "
        "the head norm, not mtp_post_ffn (vllm-project/vllm#47448); recycle the post-norm state"
    )
