"""A DeepSeek-V3 checkpoint's MTP head (its decoder layer `model.layers.<n_layer>.*`, laid out as
GLM-4.5's) held as the pinned converter writes it for llama.cpp's deepseek2 (conversion/deepseek.py
DeepseekV2Model.modify_tensors): MLA's tensors under their GGUF names, `kv_b_proj` split per head
into k_b `(n_head, kv_lora, nope)` (transposed) and v_b `(n_head, v, kv_lora)`, each expert's
matrices stacked, norms as they are; for torchref/mtp/hf.py's HF_HEADS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from featdiff.core import names
from featdiff.torchref.mtp.layer import MOE_CHOICE_BIAS, MOE_EXPERTS, MOE_ROUTER, MoeRouting
from featdiff.torchref.weights import Hparams

# the head layer (HF names after `model.layers.<n_layer>.`) -> the block's GGUF keys (gguf-py's deepseek2 map)
DEEPSEEK_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "attn_q_a": "self_attn.q_a_proj.weight",
    "attn_q_a_norm": "self_attn.q_a_layernorm.weight",
    "attn_q_b": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "attn_output": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    MOE_ROUTER: "mlp.gate.weight",
    MOE_CHOICE_BIAS: "mlp.gate.e_score_correction_bias",
    **{f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")},
}
HF_KV_B = "self_attn.kv_b_proj.weight"  # (n_head (nope + v), kv_lora): per head rows [k_nope, v]
HF_EXPERT = "mlp.experts.{x}.{proj}_proj.weight"
DEEPSEEK_NEXTN = {names.NEXTN_EH_PROJ: "eh_proj.weight", "enorm": "enorm.weight", "hnorm": "hnorm.weight"}
DEEPSEEK_HEAD_NORM = "shared_head.norm.weight"
HF_SCORING_FUNC = "scoring_func"  # DeepSeek-V3's config.json: "sigmoid" (the converter's expert_gating_func 2)
HF_SIGMOID = "sigmoid"


def deepseek_head_tensors(hf: Callable[[str], torch.Tensor], text: dict[str, Any], prefix: str) -> dict[str, Any]:
    """DeepSeek-V3's head fields from its decoder layer `prefix`, `hf(name)` each: eh_proj, enorm,
    hnorm, `shared_head.norm` -> the head norm, the layer -> the block (DEEPSEEK_BLOCK_TENSORS,
    kv_b split, experts stacked); its routing from config.json (scoring_func; softmax where it
    says none, as deepseek2.cpp reads a file without expert_gating_func; norm_topk_prob;
    routed_scaling_factor)."""
    block = {k: hf(prefix + v) for k, v in DEEPSEEK_BLOCK_TENSORS.items()}
    block |= split_kv_b(hf(prefix + HF_KV_B), int(text["num_attention_heads"]), int(text["qk_nope_head_dim"]))
    n_expert = int(text["n_routed_experts"])
    for stacked, proj in zip(MOE_EXPERTS, ("gate", "up", "down"), strict=True):  # (n_expert, ...) each
        block[stacked] = torch.stack([hf(prefix + HF_EXPERT.format(x=x, proj=proj)) for x in range(n_expert)])
    routing = MoeRouting(
        int(text["num_experts_per_tok"]),
        float(text.get("routed_scaling_factor") or 0.0),
        has_sigmoid_gating=text.get(HF_SCORING_FUNC) == HF_SIGMOID,
        has_weights_norm=bool(text.get("norm_topk_prob", False)),
    )
    nextn = {k: hf(prefix + v) for k, v in DEEPSEEK_NEXTN.items()}
    return {**nextn, "block": block, "head_norm": hf(prefix + DEEPSEEK_HEAD_NORM), "routing": routing}


def split_kv_b(kv_b: torch.Tensor, n_head: int, nope: int) -> dict[str, torch.Tensor]:
    """kv_b `(n_head (nope + v), kv_lora)` as the converter splits it: attn_k_b `(n_head, kv_lora,
    nope)` (k_b transposed, for the absorbed query) and attn_v_b `(n_head, v, kv_lora)`."""
    per_head = kv_b.reshape(n_head, -1, kv_b.shape[-1])  # (n_head, nope + v, kv_lora)
    return {"attn_k_b": per_head[:, :nope].transpose(1, 2), "attn_v_b": per_head[:, nope:]}


def deepseek_hparams(text: dict[str, Any], kind: Any) -> Hparams:
    """The head block's dims as the converter writes them: MQA over the latent (one KV head of
    kv_lora + qk_rope dims), RoPE on the qk_rope dims (interleaved pairs: torchref/mla.py)."""
    rope = text.get("rope_parameters") or {}
    n_rot = int(text["qk_rope_head_dim"])
    return Hparams(
        arch=kind.arch,
        n_layer=1,
        n_embd=int(text[names.HF_HIDDEN_SIZE]),
        n_head=int(text[names.HF_NUM_HEADS]),
        n_head_kv=1,
        n_embd_head=int(text["kv_lora_rank"]) + n_rot,
        n_ff=int(text.get("moe_intermediate_size") or 0),
        n_vocab=int(text[names.HF_VOCAB_SIZE]),
        rms_eps=float(text[names.HF_RMS_EPS]),
        rope_base=float(rope.get(names.HF_ROPE_THETA, text.get(names.HF_ROPE_THETA, names.ROPE_FREQ_BASE_DEFAULT))),
        rope_type="normal",
        n_rot=n_rot,
    )


# DeepSeek-V3.2's indexer in the head layer (HF names after the prefix) -> the block's GGUF keys
# (torchref/mla.py DSA_INDEXER): read, so strict loading knows them, and unused, as graph_mtp leaves them
DSA_INDEXER_TENSORS = {
    "indexer.k_norm": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj": "self_attn.indexer.weights_proj.weight",
    "indexer.attn_k": "self_attn.indexer.wk.weight",
    "indexer.attn_q_b": "self_attn.indexer.wq_b.weight",
}


def deepseek32_head_tensors(hf: Callable[[str], torch.Tensor], text: dict[str, Any], prefix: str) -> dict[str, Any]:
    """DeepSeek-V3.2's head fields: DeepSeek-V3's (deepseek_head_tensors) plus its layer's indexer,
    which deepseek32.cpp's graph_mtp does not use."""
    fields = deepseek_head_tensors(hf, text, prefix)
    return {**fields, "block": {**fields["block"], **{k: hf(prefix + v) for k, v in DSA_INDEXER_TENSORS.items()}}}


def glm_dsa_head_tensors(hf: Callable[[str], torch.Tensor], text: dict[str, Any], prefix: str) -> dict[str, Any]:
    """GLM-5's head fields: DeepSeek-V3.2's (deepseek32_head_tensors), routed by sigmoid: transformers'
    glm_moe_dsa router is one (its config has no scoring_func), and glm-dsa.cpp reads a file without
    expert_gating_func as sigmoid, where deepseek2.cpp reads softmax."""
    fields = deepseek32_head_tensors(hf, text, prefix)
    return {**fields, "routing": replace(fields["routing"], has_sigmoid_gating=True)}
