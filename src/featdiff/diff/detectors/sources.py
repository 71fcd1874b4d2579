"""What a reference candidate a run's record matches says, and the fix it calls for: for each
`<record>@<key>=<value>` hypothesis wiring.detect_wrong_source names, the sentence of its finding,
the export's fix where the GGUF differs from what the checkpoint says, or the graph's where the
evidence clears the GGUF (GRAPH_FIXES). Pure: strings from the evidence.
"""

from __future__ import annotations

from featdiff.core import names
from featdiff.diff.detectors.base import Evidence

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


def placed_message(ev: Evidence, key: str, value: str, candidate: str) -> str:
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


# The sentence of each hypothesis whose fix says no more than its tensor and candidate (`{tensor}`,
# `{candidate}`); the others are written in _source_message
SOURCE_MESSAGES = {
    names.HYP_G_AFTER_NORM: "{tensor} of this draft step normalizes the previous step's result_norm (it matches the "
    "reference's {candidate}): the state handed from step to step must be eagle3_prenorm, before the output norm "
    "(upstream eagle3.cpp sets t_h_nextn before build_norm); hand on the pre-norm state",
    names.HYP_TERM_AFTER_NORM: "{tensor} is the first layer's attention norm plus the log-SNR term (it matches the "
    "reference's {candidate}): add dspark_log_snr_fc2 to the noise embeddings before the first layer, so the "
    "residual stream carries it and the norm sees it",
    names.HYP_FULL_ATTENTION: "{tensor} is the layer computed over the whole context (it matches the reference's "
    "{candidate}) where the checkpoint's layer slides over a window: write "
    + names.ARCH_DFLASH
    + ".attention.sliding_window and _pattern into the GGUF (a converter that leaves them out runs the window as "
    "full attention)",
    names.HYP_RECURRENT_KEPT: "{tensor} is the layer run on a recurrent state that kept the last verify's rejected "
    "drafts (it matches the reference's {candidate}): the rollback moved the position back but not the state; "
    "restore the state of the last accepted row (llama_memory_seq_rm on a context whose n_rs_seq covers the draft "
    "length restores its snapshot)",
    names.HYP_LEVELS_SWAPPED: "{tensor} puts the anchor row at min_log_snr and the mask rows at max_log_snr (it "
    "matches the reference's {candidate}); GIDD conditions the anchor (a token that is not the mask) at "
    "max_log_snr and every mask row at min_log_snr",
    names.HYP_HALVES_ROPE_FIRST: "{tensor} is the head's MLA attention with each head's query and the compressed KV "
    "row read as [rope, nope] (it matches the reference's {candidate}) where the checkpoint lays them out [nope, "
    "rope]: the GGUF's attn_q_b and attn_kv_a_mqa rows were reordered; re-convert them in the checkpoint's order",
    names.HYP_H_BATCH_LAST: "{tensor} pairs the first token of this target batch with the batch's last hidden "
    "state, a later position's (it matches the reference's {candidate}): a batch's first token takes the pending "
    "row the batch before left (zeros before the first batch; ikawrakow/ik_llama.cpp#2222)",
    names.HYP_G_BATCH_LAST: "{tensor} pairs the first token of this target batch with the batch's last g row, a "
    "later position's (it matches the reference's {candidate}): process()'s cross-ubatch bridge row must take the "
    "pending g the batch before left; a row whose g is a view of pending_g_last (common_batch::set_embd keeps no "
    "copy) reads it after this batch's refresh overwrote it: copy the pending row before the refresh, or decode "
    "the batch before it",
}


def _source_message(tensor: str, key: str, value: str, candidate: str) -> str:
    hypothesis = f"{key}={value}"
    if hypothesis in SOURCE_MESSAGES:
        return SOURCE_MESSAGES[hypothesis].format(tensor=tensor, candidate=candidate)
    if hypothesis in (names.HYP_ANCHOR_BONUS, names.HYP_ANCHOR_FIRST):
        trained, run = ("anchor-first", "bonus-anchor") if value == "bonus" else ("bonus-anchor", "anchor-first")
        return (
            f"{tensor} carries the Markov chain laid out {run} (it matches the reference's {candidate}) but "
            f"the checkpoint was trained {trained}: set {names.KEY_SAMPLE_FROM_ANCHOR} = "
            f"{'true' if trained == 'anchor-first' else 'false'} in the drafter's GGUF"
        )
    if hypothesis in (names.HYP_NORM_NONE, names.HYP_FC_NORM_NONE, names.HYP_NORM_UNIT, names.HYP_D2T_OFFSETS):
        return _eagle3_export_message(tensor, hypothesis, candidate)
    if hypothesis in (names.HYP_NORM_HNORM, names.HYP_NORM_ENORM):
        return (
            f"{tensor} is normed with the head's {value} weight (it matches the reference's {candidate}): the "
            "GGUF's nextn hnorm and enorm hold each other's weights; re-export them, hnorm the hidden's norm and "
            "enorm the embedding's"
        )
    if hypothesis in _MTP_WRONG_NORM:
        return _mtp_wrong_norm_message(tensor, hypothesis, candidate)
    if key == names.HYP_ROUTING:
        trained = "sigmoid" if value == "softmax" else "softmax"
        return (
            f"{tensor} is the head's block with its experts chosen and weighted by {value} (it matches the "
            f"reference's {candidate}) where the checkpoint routes by {trained}: write <arch>.expert_gating_func "
            f"= {_GATING_FUNC[trained]} ({trained}) into the GGUF (a file without it takes the graph's default)"
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
