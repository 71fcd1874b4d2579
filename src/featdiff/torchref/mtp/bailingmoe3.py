"""Bailing-MoE 3's (Ling 3.0's) MTP block attention as `src/models/bailingmoe3.cpp` graph_mtp computes
it, for torchref/mtp/layer.py's GRAPHS entry `bailingmoe3` (the rest of its head is the shared MoE
decoder layer: ffn_norm, experts routed by the file's gating function plus `exp_probs_b`,
renormalized and scaled where the file says, an ungated shared expert added; the head norm is the
block's `layer_output_norm`, applied to every row, which the next step is handed, as GLM-4.5's
post-norm hand-over: the target hands its `output_norm` rows).

The attention is the trunk's full-attention layer: MLA (torchref/mla.py: the query from `attn_q`,
or Ling-3.0-tiny's low-rank `attn_q_a -> attn_q_a_norm -> attn_q_b`; the compressed KV, RoPE on the
decoupled dims in interleaved pairs) with each head's output times sigmoid of its row of `attn_gate`
over the attention's input (the attn_norm rows) before `attn_output`.

Consumes the block's weights (GGUF names without `blk.<il>.`) and the attn_norm rows
`(n_tokens, n_embd)`; produces the attention output `(n_tokens, n_embd)` and the cache after it.
"""

from __future__ import annotations

import torch

from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import GgufModel, int_meta, meta
from featdiff.kinds.mtp import mtp_head_block
from featdiff.torchref.attention import KvCache
from featdiff.torchref.mla import mla_heads
from featdiff.torchref.numerics import linear
from featdiff.torchref.weights import Hparams

# bailingmoe3.cpp's MTP block (load_arch_tensors, blocks n_layer ..): the compressed KV and its norm,
# k_b / v_b, the head-wise output gate, attn_output, the FFN's norm; the query is either form
# (BAILINGMOE3_QUERY, read where the file has it)
BAILINGMOE3_ATTENTION = (
    "attn_norm",
    "attn_kv_a_mqa",
    "attn_kv_a_norm",
    "attn_k_b",
    "attn_v_b",
    "attn_gate",
    "attn_output",
    "ffn_norm",
)
BAILINGMOE3_QUERY = ("attn_q", "attn_q_a", "attn_q_a_norm", "attn_q_b")
# keys whose values the reference does not compute (refuse_unmodelled)
KEY_GROUP_COUNT = "{arch}.expert_group_count"  # build_moe_ffn's group-limited routing above 1
KEY_ROPE_SECTIONS = "{arch}.rope.dimension_sections"  # a VL file: M-RoPE (llama_model_rope_type)
# per-layer SwiGLU clamps of the experts and the shared expert (Ling's expert_swiglu_limit_list): build_moe_ffn
# and build_ffn clamp a layer whose entry is non-zero, the head's block among them
KEYS_SWIGLU_CLAMP = ("{arch}.swiglu_clamp_exp", "{arch}.swiglu_clamp_shexp")


def bailingmoe3_attention(
    hp: Hparams, b: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor, cache: KvCache
) -> tuple[torch.Tensor, KvCache]:
    """MLA over the attn_norm rows `x` (torchref/mla.py), each head's output `(n_tokens, n_head, v)`
    times sigmoid(attn_gate x) of its head, then attn_output. Returns the output `(n_tokens, n_embd)`
    and the cache with this eval's rows."""
    heads, cache_after = mla_heads(hp, b, x, positions, cache)  # (n_tokens, n_head, v)
    gate = torch.sigmoid(linear(x, b["attn_gate"]))  # (n_tokens, n_head)
    return linear((heads * gate[..., None]).reshape(x.shape[0], -1), b["attn_output"]), cache_after


def refuse_unmodelled(g: GgufModel) -> None:
    """InputError naming what of a bailingmoe3 file the reference does not compute: group-limited
    routing (expert_group_count above 1: build_moe_ffn then picks the top groups first), M-RoPE
    (a VL file's rope sections: bailingmoe3 then ropes with LLAMA_ROPE_TYPE_MROPE), a non-zero
    SwiGLU clamp (llama.cpp clamps that layer's experts; transformers' bailing_hybrid trunk never
    does), a head block without a query projection (llama.cpp would not load it)."""
    for key in (k.format(arch=g.arch) for k in KEYS_SWIGLU_CLAMP):
        value = meta(g, key, None)
        if value is not None and any(float(x) != 0.0 for x in (value if isinstance(value, list) else [value])):
            raise InputError(
                f"{g.path}: {key} = {value}; featdiff's bailingmoe3 reference does not clamp SwiGLU (transformers' "
                "bailing_hybrid trunk has no clamp either); convert a checkpoint without expert_swiglu_limit_list"
            )
    groups = int_meta(g, KEY_GROUP_COUNT.format(arch=g.arch), 0)
    if groups > 1:
        raise InputError(
            f"{g.path}: {KEY_GROUP_COUNT.format(arch=g.arch)} = {groups}: group-limited expert routing, which "
            "featdiff's bailingmoe3 reference does not model; convert a checkpoint with n_group 1"
        )
    if meta(g, KEY_ROPE_SECTIONS.format(arch=g.arch), None) is not None:
        raise InputError(
            f"{g.path}: {KEY_ROPE_SECTIONS.format(arch=g.arch)} is set (a VL file: llama.cpp ropes its head with "
            "M-RoPE), which featdiff's bailingmoe3 reference does not model; convert the text model"
        )
    il = mtp_head_block(g)
    if not any(f"blk.{il}.{q}.weight" in g.tensors for q in ("attn_q", "attn_q_a")):
        raise InputError(f"{g.path}: the MTP block {il} has no attn_q or attn_q_a; re-convert the checkpoint")
