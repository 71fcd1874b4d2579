"""The MTP kind's pure facts: the records of an MTP head's graph and what it reads of its target."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import GgufModel, has_meta, int_meta

# An MTP head's graph (upstream src/models/qwen35.cpp, qwen35moe.cpp, qwen3next.cpp, glm4-moe.cpp, mimo2.cpp graph_mtp): its
# token rows, its norms and their concat, eh_proj, the decoder layer's residuals, the head norm and the logits, and
# mtp_h_input, the hidden rows it is handed: a graph input only the head's hnorm reads (the shim reads a norm's
# source before the norm runs); captures before issue 42 have it in-process only, read back through the API
MTP_WIRING: tuple[str, ...] = (
    "mtp_tok_embd-*",
    "mtp_hnorm-*",
    "mtp_enorm-*",
    "mtp_concat-*",
    "mtp_eh_proj-*",
    "mtp_attn_residual-*",
    "mtp_ffn_inp-*",  # glm4-moe.cpp's and mimo2.cpp's name of mtp_attn_residual
    "mtp_post_ffn-*",
    names.H_NEXTN,
    names.RESULT_OUTPUT,
    names.DRAFT_LOGITS,
    names.MTP_H_INPUT,  # a graph input (above)
)
# Gemma 4's assistant's graph (gemma4-assistant.cpp): the target's scaled token rows, their concat with
# the handed hidden and pre_projection, per layer its norm, query (normed, roped), attention output and
# the residuals around the FFN, the final norm, the logits and h_nextn (torchref/mtp/gemma4_assistant.py)
GEMMA4_ASSISTANT_WIRING: tuple[str, ...] = (
    "inp_embd_target",
    "inp_xh",
    "pre_proj",
    "attn_norm-*",
    "Qcur_pos-*",
    "kqv_out-*",
    "attn_post_norm-*",
    "attn_out-*",
    "ffn_out-*",
    "out_scaled-*",
    names.RESULT_NORM,
    names.H_NEXTN,
    names.RESULT_OUTPUT,
    names.DRAFT_LOGITS,
)
# the drafter records of an MTP architecture whose graph is not graph_mtp's (MTP_WIRING)
ARCH_WIRING: dict[str, tuple[str, ...]] = {names.ARCH_GEMMA4_ASSISTANT: GEMMA4_ASSISTANT_WIRING}
# what an MTP head reads of its target: the post-final-norm hidden of every row (mimo2's: before the final norm; llama.cpp's
# llama_set_embeddings_nextn, unmasked), and the verify logits
MTP_TARGET_WIRING: tuple[str, ...] = (names.H_NEXTN, names.RESULT_OUTPUT)

MTP = "mtp"  # the MTP kind's name: its drafter runs in an MTP context (LLAMA_CONTEXT_TYPE_MTP)

HF_MTP_LAYERS = "mtp_num_hidden_layers"  # Qwen3.5's count of MTP blocks in config.json
HF_GLM_MTP_LAYERS = "num_nextn_predict_layers"  # GLM-4.5's: that many more decoder layers
# A checkpoint's model_type -> the config.json key that counts its MTP blocks, as the pinned converter
# reads it (conversion/qwen.py, glm.py, mimo.py); None: the config does not say, and every checkpoint
# of the type ships its heads (MiMo-V2's 3: conversion/mimo.py hardcodes the count). torchref.mtp.hf's
# HF_HEADS says where each family keeps its head.
MTP_LAYERS_KEY: dict[str, str | None] = {
    "qwen3_5_text": HF_MTP_LAYERS,
    "qwen3_5": HF_MTP_LAYERS,
    "qwen3_5_moe_text": HF_MTP_LAYERS,
    "qwen3_5_moe": HF_MTP_LAYERS,
    "glm4_moe": HF_GLM_MTP_LAYERS,
    "deepseek_v32": HF_GLM_MTP_LAYERS,  # DeepSeek-V3.2's: as DeepSeek-V3's
    "glm_moe_dsa": HF_GLM_MTP_LAYERS,  # GLM-5's: as DeepSeek-V3's
    "deepseek_v3": HF_GLM_MTP_LAYERS,  # DeepSeek-V3's head: the decoder layer after the trunk's, as GLM-4.5's
    "mimo_v2_flash": None,
    "qwen3_next": None,  # Qwen3-Next's config.json does not count its head (conversion/qwen.py counts mtp.layers.*)
}


# checkpoint families whose MTP heads featdiff reads from the converted GGUF only: model_type -> why
GGUF_ONLY_HEADS = {
    "step3p5": "Step-3.5's MTP heads are read from its converted GGUF only (no loader of the checkpoint's heads)",
    "nemotron_h": "Nemotron-H's MTP head is read from its converted GGUF only (transformers has no model code for it)",
    "hy_v3": "Hy3's MTP head is read from its converted GGUF only (transformers has no model code for it)",
    "cohere2_moe": "Cohere2-MoE's MTP head is read from its converted GGUF only (transformers has no model code for it)",
    "bailing_hybrid": "Ling 3.0's MTP head is read from its converted GGUF only (transformers has no model code for it)",
}


# MTP heads of the pinned tree featdiff does not model, by GGUF architecture: what their graph_mtp
# computes that the reference cannot, or why none runs (lint, capture and reference refuse the head in
# one line naming it; so does a capture around a program drafting with it: programs/exec.check_pair)
UNMODELLED_HEADS: dict[str, str] = {
    names.ARCH_DEEPSEEK4: (
        "DeepSeek-V4's head (deepseek4.cpp graph_mtp) is not modelled: its hyper-connections (the hidden "
        "handed over and recycled as `hyper_connection.count` streams of n_embd, mixed by hc_attn_* / "
        "hc_ffn_* through Sinkhorn and folded by output_hc_*), its attention (one shared key-value head "
        "with sinks, RoPE on the last dims undone on the output, a grouped low-rank output) and its "
        "sqrt-softplus routing with clamped SwiGLU, after a trunk whose compressed attention state (CSA / "
        "HCA, the lightning indexer) the reference cannot replay"
    ),
    names.ARCH_DOTS3NOTE: (
        "the pinned llama.cpp loads no MTP graph for dots3note: dots3note.cpp loads the nextn block's tensors "
        "as skipped (TENSOR_SKIP: 'model has unused tensor ... -- ignoring') and builds no graph_mtp, so an MTP "
        "context (--spec-type draft-mtp) gets the trunk's graph over a KV cache holding the nextn block alone, "
        "and no head drafts to compare"
    ),
}
# checkpoint model_type -> the GGUF architecture of its unmodelled head (UNMODELLED_HEADS)
UNMODELLED_CHECKPOINT_HEADS = {"deepseek_v4": names.ARCH_DEEPSEEK4}
# a drafter checkpoint's own model_type (its config.json's top level) -> the GGUF architecture the
# pinned converter writes it as (conversion/gemma.py Gemma4AssistantModel), read from that GGUF only
UNMODELLED_CHECKPOINT_DRAFTERS = {
    "gemma4_assistant": names.ARCH_GEMMA4_ASSISTANT,
    "gemma4_unified_assistant": names.ARCH_GEMMA4_ASSISTANT,
}
GGUF_ONLY_DRAFTER = (
    "Gemma 4's assistant is read from its converted GGUF only (conversion/gemma.py Gemma4AssistantModel writes "
    "it); pass draft.gguf as --model"
)


def unmodelled_head(arch: str, n_heads: int) -> str | None:
    """The line refusing a file of architecture `arch` carrying `n_heads` MTP heads featdiff does
    not model (UNMODELLED_HEADS), without the file's name; None for any other."""
    if n_heads <= 0 or arch not in UNMODELLED_HEADS:
        return None
    return f"an MTP head of architecture {arch!r}: {UNMODELLED_HEADS[arch]}; docs/modelled.md lists the heads it models"


def refused_head(g: GgufModel) -> str | None:
    """unmodelled_head of the GGUF `g`: its architecture and the heads it declares (nextn_predict_layers)."""
    return unmodelled_head(g.arch, int_meta(g, names.KEY_NEXTN_LAYERS, 0))


def is_mtp_checkpoint(config: Mapping[str, Any]) -> bool:
    """A checkpoint that declares MTP layers (config.json, or its `text_config`: MTP_LAYERS_KEY);
    InputError for one whose heads are read from its GGUF only (GGUF_ONLY_HEADS) or not modelled
    (UNMODELLED_CHECKPOINT_HEADS, UNMODELLED_CHECKPOINT_DRAFTERS)."""
    drafter = config.get(names.HF_MODEL_TYPE)
    if drafter in UNMODELLED_CHECKPOINT_DRAFTERS:
        raise InputError(f"{names.HF_CONFIG}: model_type {drafter!r}: {GGUF_ONLY_DRAFTER}")
    text = config.get("text_config", config)
    model_type = text.get(names.HF_MODEL_TYPE)
    n_declared = int(text.get(HF_GLM_MTP_LAYERS, 0) or 0)
    refused = unmodelled_head(UNMODELLED_CHECKPOINT_HEADS.get(str(model_type), ""), n_declared)
    if refused is not None:
        raise InputError(f"{names.HF_CONFIG}: model_type {model_type!r}: {refused}")
    if model_type in GGUF_ONLY_HEADS and n_declared > 0:
        raise InputError(
            f"{names.HF_CONFIG}: model_type {model_type!r}: {GGUF_ONLY_HEADS[model_type]}; pass the converted "
            "GGUF as --model"
        )
    if model_type not in MTP_LAYERS_KEY:
        return False
    key = MTP_LAYERS_KEY[model_type]
    return key is None or int(text.get(key, 0) or 0) > 0


# docs/modelled.md's MTP rows: per head architecture, what the reference computes as the pinned
# graph_mtp does, and what it refuses by name (one line, exit 2). Every head also refuses a tensor
# of its block it does not read (torchref/mtp/head.py); docs/guide-eagle3-mtp.md tells each head.
HEAD_DOCS: tuple[tuple[str, str, str], ...] = (
    (
        "step35",
        "Step-3.5's chained heads (step35.cpp graph_mtp: draft step k runs head k, block n_layer + k): q/k/v, "
        "q/k RMS norms, NeoX RoPE on half the head's dims on a full-attention block (all of them within the "
        "window on a sliding one), the per-head sigmoid gate `attn_gate`, experts routed by sigmoid (the "
        "file's gating where it says one) plus `exp_probs_b`, an ungated shared expert, the hidden state "
        "handed over and recycled before the norms; from the GGUF",
        "a non-zero `step35.swiglu_clamp_exp` / `swiglu_clamp_shexp`; `rope_freqs.weight` (llama3 RoPE "
        "factors); the heads from a checkpoint directory (read them from the GGUF). transformers 5.23 has no "
        "causal-LM class for `step3p5`: the trunk runs as a transformers stand-in of the same math "
        "(`featdiff fixture --variant mtp-step35`: `target-ref/`, qwen3_moe, a dense sliding-window trunk)",
    ),
    (
        "nemotron_h_moe",
        "Nemotron-H's head (nemotron-h-moe.cpp graph_mtp, block n_layer: the converter folds `mtp.layers.0` "
        "and `mtp.layers.1` into it): eh_proj over [enorm(e), hnorm(h)], q/k/v attention without RoPE, "
        "squared-ReLU experts without a gate routed by sigmoid (whatever the file says) plus `exp_probs_b`, "
        "an ungated shared expert, the head's LayerNorm (`layer_norm_epsilon`), output rows cropped before "
        "the FFN; the trunk's Mamba2 state rolled back; from the GGUF",
        "a latent MoE (`ffn_latent_down` / `ffn_latent_up`: tensors the reference does not read); the head "
        "from a checkpoint directory (read it from the GGUF): transformers 5.23 has no model code for it",
    ),
    (
        "hy_v3",
        "Hy3's head (hy-v3.cpp graph_mtp, block n_layer): eh_proj over [enorm(e), hnorm(h)], q/k/v attention "
        "with per-head q/k RMS norms and NeoX RoPE on the whole head, experts routed by sigmoid (the file's "
        "gating where it says one) plus the bare `exp_probs_b`, renormalized and times "
        "`expert_weights_scale`, an ungated shared expert; "
        "the head norm `nextn.shared_head_norm` (else `output_norm`) on every row, which the next step is "
        "handed (the target hands its `output_norm` rows); from the GGUF",
        "a gating function other than softmax or sigmoid; the head from a checkpoint directory (read it from "
        "the GGUF): transformers 5.23 has the trunk's model code (`hy_v3`), not the head's",
    ),
    (
        "cohere2moe",
        "Cohere2-MoE's head (cohere2moe.cpp graph_mtp, block n_layer): eh_proj over [enorm(e), hnorm(h)], "
        "Cohere's parallel layer: attention (q/k/v, interleaved RoPE on the whole head whatever the trunk's "
        "pattern) and the MoE both on `attn_norm`'s rows, experts routed by sigmoid (the file's gating where "
        "it says one), renormalized where the file says, the shared expert averaged in, the output FFN + "
        "input + attention output (`mtp_attn_out`, the attention's output alone, asked for by `--filter`); "
        "the head norm `nextn.shared_head_norm` (else `output_norm`) on every row, which the next step is "
        "handed; the logits times `logit_scale`; from the GGUF",
        "LayerNorm heads (`layer_norm_rms_epsilon` missing or 0: llama.cpp runs LLM_NORM); a gating function "
        "other than softmax or sigmoid; the head from a checkpoint directory (read it from the GGUF): "
        "transformers 5.23 has the trunk's model code (`cohere2_moe`), not the head's",
    ),
    (
        "bailingmoe3",
        "Ling 3.0's head (bailingmoe3.cpp graph_mtp, block n_layer): eh_proj over [enorm(e), hnorm(h)], the "
        "trunk's full-attention layer: MLA (`attn_q`, or the low-rank `attn_q_a`/`attn_q_b`; the compressed KV, "
        "RoPE on the decoupled dims in interleaved pairs) with each head's output times sigmoid of its "
        "`attn_gate` row, `ffn_norm`, experts routed by the file's gating function plus `exp_probs_b`, "
        "renormalized and times `expert_weights_scale` where the file says, an ungated shared expert; the head "
        "norm `layer_output_norm` on every row, which the next step is handed (the target hands its "
        "`output_norm` rows); the graph names `mtp_eh_proj` alone of the layer; the trunk's KDA state rolled "
        "back; from the GGUF",
        "group-limited routing (`expert_group_count` above 1); a VL file's M-RoPE (`rope.dimension_sections`); "
        "a non-zero `swiglu_clamp_exp` / `swiglu_clamp_shexp`; "
        "a gating function other than softmax or sigmoid; the head from a checkpoint directory (read it from "
        "the GGUF): transformers 5.23 has the trunk's model code (`bailing_hybrid`), not the head's",
    ),
    (
        names.ARCH_DEEPSEEK4,
        "nothing: DeepSeek-V4's head (deepseek4.cpp graph_mtp) is refused whole",
        "every `deepseek4` head, in one line (`lint` and `reference`, exit 2; its checkpoint directory too): "
        "the hidden it is handed and recycles is `hyper_connection.count` streams of n_embd (the trunk's "
        "state before `hc_head`), mixed before and after its attention and FFN by `hc_attn_*` / `hc_ffn_*` "
        "(sigmoid pre / post weights, a Sinkhorn-normalized combination) and folded by `output_hc_*` before "
        "the head norm; its attention is one shared key-value head with `attn_sinks`, RoPE on the last "
        "`rope.dimension_count` dims undone on the output and a grouped low-rank output (`attn_output_a` / "
        "`attn_output_b`); its experts are routed by sqrt-softplus with clamped SwiGLU; and its trunk's "
        "compressed attention state (CSA / HCA and the lightning indexer) is none the reference can replay",
    ),
    (
        names.ARCH_DOTS3NOTE,
        "nothing: the pinned llama.cpp loads no MTP graph for dots3note (dots3note.cpp), so no head drafts",
        "every `dots3note` file declaring nextn blocks, in one line (`lint`, `capture` and `reference`, exit 2; "
        "`capture --exec` of a program run with `--spec-type draft-mtp` on it too): its loader reads the "
        "nextn block's tensors with TENSOR_SKIP (left unloaded, 'model has unused tensor') and its "
        "build_arch_graph has no graph_mtp, so an MTP context gets the trunk's graph, which reads its "
        "memory as the trunk's DSA + sliding-window cache while that context keeps a plain KV cache of "
        "the nextn block alone",
    ),
    (
        names.ARCH_GEMMA4_ASSISTANT,
        "Gemma 4's assistant drafter (gemma4-assistant.cpp, `-md` with `--spec-type draft-mtp`; "
        "torchref/mtp/gemma4_assistant.py): `pre_projection` over [the target's token row times sqrt(target "
        "n_embd), the handed hidden]; per layer a query only (its RMS norm, NeoX RoPE, `rope_freqs` on the full "
        "layers) attending at scale 1 over the target's own cache (a sliding layer over target layer n_layer - 2's "
        "cells within the window, a full one over n_layer - 1's), the post-attention norm and residual, the "
        "tanh-GELU gated FFN between `ffn_norm` and `post_ffw_norm`, times `layer_output_scale`; the logits "
        "through its tied `token_embd` and `h_nextn` = `post_projection` of `output_norm`; its flow with no "
        "catch-up and every draft step at the round's first position (common/speculative.cpp is_mem_shared), "
        "in-process and around llama-speculative-simple and llama-server; from the GGUF",
        "its `gemma4_assistant` checkpoint directory (read it from the converted GGUF)",
    ),
)


def markdown_section() -> list[str]:
    """MTP's lines of docs/modelled.md (featdiff.kinds.registry.render_markdown joins them)."""
    return [
        "## MTP heads (`nextn` blocks)",
        "",
        "From `src/featdiff/kinds/mtp.py`: per head architecture, what the reference computes as the",
        "pinned graph does and what `featdiff reference` refuses by name (exit 2).",
        "",
        "| arch | modelled | refused |",
        "|---|---|---|",
        *(f"| `{arch}` | {modelled} | {refused} |" for arch, modelled, refused in HEAD_DOCS),
    ]


def mtp_head_block(d: GgufModel) -> int | None:
    """The block index of the GGUF's MTP head (its trunk's layer count: block_count counts the
    heads), None when the file declares none."""
    n_heads = int_meta(d, names.KEY_NEXTN_LAYERS, 0)
    return int_meta(d, names.KEY_BLOCK_COUNT) - n_heads if n_heads > 0 and has_meta(d, names.KEY_BLOCK_COUNT) else None
