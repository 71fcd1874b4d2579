"""The tiny Hugging Face target families (qwen3moe, gpt-oss, qwen35, glm4moe, mimo2, gemma4, nemotron_h):
each family's transformers config at the tiny sizes and the gains its seeded weights get."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from featdiff.factory import pairs

EMBD_STD = 1.0  # token embeddings ~ N(0, 1), as pairs.target_weights draws them
NORM_SPREAD = 0.1  # norm weights 1 + N(0, 0.1): pairs._norm
N_EXPERT, N_EXPERT_USED = 4, 2  # the tiny MoE: 4 experts, top-2
N_FF_EXPERT = 32  # each expert's FFN width
# gpt-oss: the window of its sliding layers (even layers: transformers' default layer_types and
# llama.cpp's openai-moe swa pattern 2 agree), shorter than the tests' prompt plus its drafts
SLIDING_WINDOW = 8
# gpt-oss's experts' gate/up projection drawn this much wider than N(0, 1/n_in): at 1 no gate
# reaches the swiglu clamp (limit 7; measured max |x| 3.7 on the tests' prompt), at 3 a few
# percent do, so the fixture runs the clamp llama.cpp must reproduce
GATE_UP_GAIN = 3.0
# gpt-oss-20b's YaRN (its config.json rope_scaling), but for `truncate`: the checkpoint says
# false (correction dims not rounded) while llama.cpp always rounds them (ggml.c
# ggml_rope_yarn_corr_dims floorf/ceilf; the pinned converter writes no truncate key), so a
# converted gpt-oss runs slightly other RoPE angles than it was trained with (measured on this
# fixture with truncate false: NMSE 4.5e-6 at l_out-0 by position 24, over compare's 4e-6).
# The fixture takes the rounding both sides run, so its pair compares clean through YaRN.
YARN_FACTOR, YARN_N_CTX_ORIG = 32.0, 4096
GPT_OSS_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": YARN_FACTOR,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": YARN_N_CTX_ORIG,
    "rope_theta": 150000.0,
    "truncate": True,
}


TOKENIZER_SPM, TOKENIZER_BPE, TOKENIZER_BYTE_BPE = "spm", "bpe", "byte-bpe"
# each tokenizer's converter bootstrap (converter.BOOTSTRAPS), None: the converter's own route
BOOTSTRAP_OF: dict[str, str | None] = {TOKENIZER_SPM: "spm", TOKENIZER_BPE: None, TOKENIZER_BYTE_BPE: "pre"}
# GLM-4.5's converter class reads GLM's own special tokens (`_set_vocab_glm`): its fixtures'
# tokenizer.model converts through this bootstrap instead (converter.BOOTSTRAPS)
BOOTSTRAP_GLM = "glm"
# MiMo-V2's converter class writes three chained MTP heads; its fixture converts one (converter.BOOTSTRAPS)
BOOTSTRAP_MIMO = "mimo"


@dataclass(frozen=True)
class Family:
    """One target family: its transformers config, as a function of the tiny sizes."""

    name: str  # llama.cpp's architecture name (the converted GGUF's general.architecture), or its -variant
    doc: str
    config: Callable[[pairs.Sizes], object]
    gains: tuple[tuple[str, float], ...] = ()  # (parameter or buffer name suffix, factor on its seeded draw)
    # converted with --no-mtp: a Qwen3.5 checkpoint without MTP layers (conversion/qwen.py
    # Qwen3NextModel.__init__ asserts MTP tensors unless told there are none)
    no_mtp: bool = False
    # the drafter converted against this family's own target-hf/ (as a user converts a drafter of
    # that target), not the fixtures' qwen3 one: possible where the converter's target class can
    # set a vocabulary on the drafter (not Qwen3-MoE, see write_family_fixture). A Qwen3.5 target's
    # drafter so gets the degenerate M-RoPE `dflash.rope.dimension_sections` a real one has.
    draft_against_target: bool = False
    # the target's tokenizer as its checkpoints ship it: SentencePiece `tokenizer.model` (TOKENIZER_SPM:
    # the Qwen and gpt-oss fixtures, converted through the "spm" bootstrap), a Llama-style BPE
    # `tokenizer.json` (TOKENIZER_BPE: Gemma 4, whose converter class reads no other) or a GPT-2
    # byte-level one (TOKENIZER_BYTE_BPE: Nemotron-H, converted through the "pre" bootstrap). A BPE
    # family's drafter converts against its own target (llama.cpp refuses a drafter whose
    # vocabulary type differs from the target's)
    tokenizer: str = TOKENIZER_SPM
    # persistent buffers the checkpoint saves and llama.cpp reads (Gemma 4's per-layer
    # `layer_scalar`, Nemotron-H's router bias): drawn 1 + N(0, NORM_SPREAD) like a norm, not left
    # at transformers' init
    buffers: tuple[str, ...] = ()


def _tiny_fields(sz: pairs.Sizes) -> dict[str, Any]:
    """The config fields every family takes from the tiny target's sizes (head_dim goes through a
    config's **kwargs where its class does not type it)."""
    s = sz.target
    return {
        "vocab_size": sz.n_vocab,
        "hidden_size": s.n_embd,
        "intermediate_size": s.n_ff,
        "num_hidden_layers": s.n_layer,
        "num_attention_heads": s.n_head,
        "num_key_value_heads": s.n_head_kv,
        "head_dim": s.n_embd_head,
    }


def _qwen3moe_config(sz: pairs.Sizes) -> object:
    from transformers import Qwen3MoeConfig

    fields: dict[str, Any] = {
        **_tiny_fields(sz),
        "moe_intermediate_size": N_FF_EXPERT,
        "num_experts": N_EXPERT,
        "num_experts_per_tok": N_EXPERT_USED,
        "norm_topk_prob": True,  # Qwen3-30B-A3B's, and llama.cpp's qwen3moe graph's
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "rms_norm_eps": pairs.RMS_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": pairs.ROPE_BASE},
        "tie_word_embeddings": False,
    }
    return Qwen3MoeConfig(**fields)


def _gpt_oss_config(sz: pairs.Sizes) -> object:
    """gpt-oss at the tiny sizes: attention biases and per-head sinks, sliding window on the even
    layers, experts with biases and the clamped swiglu (alpha 1.702, limit 7: the only values
    llama.cpp's openai-moe graph runs, llama-graph.cpp LLM_FFN_SWIGLU_OAI_MOE), softmax over the
    top-k router logits; gpt-oss-20b's YaRN (GPT_OSS_ROPE)."""
    from transformers import GptOssConfig

    s = sz.target
    fields: dict[str, Any] = {
        **_tiny_fields(sz),
        "intermediate_size": N_FF_EXPERT,  # each expert's width (the converter's expert_feed_forward_length)
        "num_local_experts": N_EXPERT,
        "num_experts_per_tok": N_EXPERT_USED,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention" if il % 2 == 0 else "full_attention" for il in range(s.n_layer)],
        "max_position_embeddings": int(YARN_FACTOR * YARN_N_CTX_ORIG),
        "rms_norm_eps": pairs.RMS_EPS,
        "rope_parameters": dict(GPT_OSS_ROPE),
        "attention_bias": True,  # llama.cpp's openai-moe requires attn_output.bias
        "tie_word_embeddings": False,
    }
    return GptOssConfig(**fields)


# Qwen3.5 (llama.cpp's qwen35): gated delta-net (linear attention) layers with a full-attention
# layer every QWEN35_FULL_EVERY-th. At 3 on the 6 tiny layers, layers 2 and 5 are full attention:
# the fixtures' drafter taps layers 2 and 4 (GGUF ids, pairs.HF_TARGET_LAYER_IDS + 1), one of each
# kind, so a tap one layer off reads the other kind's input. The converter writes the interval
# (conversion/qwen.py Qwen3NextModel: full_attention_interval, default 4) and the layer kinds
QWEN35_FULL_EVERY = 3
# the gated delta-net's heads: llama.cpp requires key and value heads of one size (qwen35.cpp
# load_arch_tensors: head_v_dim = ssm_d_state); more value heads than key heads, as Qwen3.5-9B
# has (16 / 32), so the converter's V-head reordering (_LinearAttentionVReorderBase) is exercised
QWEN35_LINEAR_HEAD_DIM, QWEN35_LINEAR_K_HEADS, QWEN35_LINEAR_V_HEADS = 16, 2, 4
QWEN35_CONV_KERNEL = 4  # Qwen3.5's linear_conv_kernel_dim
# Qwen3.5's interleaved M-RoPE at the tiny head size: rotate half the head (Qwen3.5 rotates a
# quarter of 256), 4 rotary pairs split t/h/w as the sections say (they must sum to the pairs:
# the converter's default [11, 11, 10] fits 256-wide heads only, and ggml aborts on it here,
# ops.cpp "GGML_ASSERT(sect_dims <= ne0)"). On text every section has the same position.
QWEN35_ROPE: dict[str, Any] = {
    "rope_type": "default",
    "rope_theta": pairs.ROPE_BASE,
    "partial_rotary_factor": 0.5,
    "mrope_section": [2, 1, 1],
    "mrope_interleaved": True,
}


def qwen35_layer_types(n_layer: int) -> list[str]:
    """Qwen3.5's layer kinds: full attention on every QWEN35_FULL_EVERY-th layer, else linear."""
    return ["full_attention" if (il + 1) % QWEN35_FULL_EVERY == 0 else "linear_attention" for il in range(n_layer)]


def _qwen35_config(sz: pairs.Sizes) -> object:
    """Qwen3.5's text model at the tiny sizes: gated delta-net layers (conv, gated delta rule,
    gated norm) and full-attention layers (output gate, q/k norms, partial interleaved M-RoPE,
    which on text positions is plain RoPE on the rotated quarter)."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_qwen35_fields(sz), intermediate_size=sz.target.n_ff)


def _qwen35_fields(sz: pairs.Sizes) -> dict[str, Any]:
    """The config fields Qwen3.5 and Qwen3.5-MoE share at the tiny sizes: all but the FFN's."""
    s = sz.target
    fields: dict[str, Any] = {
        **_tiny_fields(sz),
        "layer_types": qwen35_layer_types(s.n_layer),
        "full_attention_interval": QWEN35_FULL_EVERY,  # a config.json key the converter reads
        "linear_conv_kernel_dim": QWEN35_CONV_KERNEL,
        "linear_key_head_dim": QWEN35_LINEAR_HEAD_DIM,
        "linear_value_head_dim": QWEN35_LINEAR_HEAD_DIM,
        "linear_num_key_heads": QWEN35_LINEAR_K_HEADS,
        "linear_num_value_heads": QWEN35_LINEAR_V_HEADS,
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "rms_norm_eps": pairs.RMS_EPS,
        "rope_parameters": dict(QWEN35_ROPE),
        "tie_word_embeddings": False,
    }
    del fields["intermediate_size"]  # the dense MLP's width: Qwen3.5's alone
    return fields


def _qwen35moe_config(sz: pairs.Sizes) -> object:
    """Qwen3.5-MoE's text model at the tiny sizes: Qwen3.5's layers (_qwen35_fields) with a sparse
    MoE block in place of each dense MLP: N_EXPERT experts of width N_FF_EXPERT (fused
    `experts.gate_up_proj`), top-N_EXPERT_USED with the chosen weights renormalized (transformers'
    router always does, as llama.cpp's qwen35moe graph does), and one shared expert of width
    N_FF_EXPERT behind a sigmoid gate (`shared_expert_gate`). Not a registered family: the MTP
    fixtures (featdiff.factory.mtp) use it."""
    from transformers import Qwen3_5MoeTextConfig

    fields: dict[str, Any] = {
        **_qwen35_fields(sz),
        "moe_intermediate_size": N_FF_EXPERT,
        "shared_expert_intermediate_size": N_FF_EXPERT,
        "num_experts": N_EXPERT,
        "num_experts_per_tok": N_EXPERT_USED,
    }
    return Qwen3_5MoeTextConfig(**fields)


# GLM-4.5 (llama.cpp's glm4moe) as GLM-4.5-Air is built: attention with q/k/v biases and no q/k
# norms, NeoX RoPE on half the head (the converter writes rope.dimension_count = head_dim x
# partial_rotary_factor), a dense first layer then MoE layers routed by sigmoid: experts chosen by
# sigmoid(logit) + the router's `e_score_correction_bias` (one group: n_group = topk_group = 1),
# weighted by their sigmoids renormalized and times `routed_scaling_factor`, plus one shared expert
GLM4MOE_ROUTED_SCALE = 2.5  # GLM-4.5's routed_scaling_factor: a scale llama.cpp applies (not 0 or 1)
# the router's choice bias drawn this much wider than a norm (1 + N(0, 0.3)): at 1 its spread is
# small beside the sigmoids' and, measured on the MTP head in the tests' flow (38 rows through it,
# tests/llama/test_mtp_capture.py), decides no row's experts; at 3 it decides 3 rows' experts, so the
# fixture runs choices the bias makes
CHOICE_BIAS_GAIN = 3.0
GLM4MOE_ROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": pairs.ROPE_BASE, "partial_rotary_factor": 0.5}


def _glm4moe_config(sz: pairs.Sizes) -> object:
    """GLM-4.5's model at the tiny sizes (GLM4MOE_ROPE, first_k_dense_replace 1: layer 0 dense,
    the others N_EXPERT experts of width N_FF_EXPERT, top-N_EXPERT_USED, one shared expert), no
    MTP layers (`num_nextn_predict_layers` 0: fixtures_mtp adds the head). Not a registered
    family: the MTP fixtures use it."""
    from transformers import Glm4MoeConfig

    fields: dict[str, Any] = {
        **_tiny_fields(sz),
        "moe_intermediate_size": N_FF_EXPERT,
        "n_routed_experts": N_EXPERT,
        "num_experts_per_tok": N_EXPERT_USED,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": GLM4MOE_ROUTED_SCALE,
        "attention_bias": True,
        "use_qk_norm": False,
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "rms_norm_eps": pairs.RMS_EPS,
        "rope_parameters": dict(GLM4MOE_ROPE),
        "tie_word_embeddings": False,
    }
    return Glm4MoeConfig(**fields)


# MiMo-V2-Flash (llama.cpp's mimo2) as XiaomiMiMo/MiMo-V2-Flash is built: hybrid attention (full
# attention on the first and last layers, sliding windows between, as its `hybrid_layer_pattern`
# starts and ends), twice the KV heads and attention sinks on the sliding layers, query/key heads
# wider than value heads (head_dim vs v_head_dim), values scaled by `attention_value_scale`, NeoX
# RoPE on part of each head with a base per layer kind; a dense first layer, then experts routed
# by sigmoid + a choice bias (one group), renormalized, unscaled (routed_scaling_factor 1). The
# value scale is 0.5 here (MiMo's is 0.707): transformers scales V before its cache, llama.cpp the
# attention's output after wo (mimo2.cpp), and a power of two keeps the f16 cache's rows the same.
MIMO2_V_HEAD_DIM = 8  # (n_embd_head_v; the tiny target's n_embd_head 16 is n_embd_head_k)
MIMO2_VALUE_SCALE = 0.5
MIMO2_ROTARY = 0.5  # partial_rotary_factor: RoPE on 8 of the 16 dims (MiMo's 0.334 of 192)
MIMO2_ROPE_SWA = 1000.0  # the sliding layers' rope base (MiMo's 10000 beside its full layers' 5e6)


def mimo2_layer_types(n_layer: int) -> list[str]:
    """MiMo-V2's layer kinds: full attention on the first and last layers, sliding between."""
    return ["full_attention" if il in (0, n_layer - 1) else "sliding_attention" for il in range(n_layer)]


def _mimo2_config(sz: pairs.Sizes) -> object:
    """MiMo-V2-Flash's model at the tiny sizes, and the keys of MiMo's own config.json that the
    pinned converter reads (conversion/mimo.py MimoV2Model: hybrid_layer_pattern, the sliding
    layers' dims under swa_*, topk_method, layernorm_epsilon, partial_rotary_factor at the top of
    rope_parameters), which transformers keeps as they are. Not a registered family: the MTP
    fixtures use it."""
    from transformers import MiMoV2FlashConfig

    s = sz.target
    kinds = mimo2_layer_types(s.n_layer)
    n_kv = 1  # the full layers'; transformers gives the sliding layers twice as many
    rope = {"rope_type": "default", "partial_rotary_factor": MIMO2_ROTARY}
    fields: dict[str, Any] = {
        **_tiny_fields(sz),
        "num_key_value_heads": n_kv,
        "v_head_dim": MIMO2_V_HEAD_DIM,
        "layer_types": kinds,
        "mlp_layer_types": ["dense"] + ["sparse"] * (s.n_layer - 1),
        "sliding_window": SLIDING_WINDOW,
        "attention_value_scale": MIMO2_VALUE_SCALE,
        "moe_intermediate_size": N_FF_EXPERT,
        "n_routed_experts": N_EXPERT,
        "num_experts_per_tok": N_EXPERT_USED,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "rms_norm_eps": pairs.RMS_EPS,
        "rope_parameters": {
            "full_attention": {**rope, "rope_theta": pairs.ROPE_BASE},
            "sliding_attention": {**rope, "rope_theta": MIMO2_ROPE_SWA},
            "partial_rotary_factor": MIMO2_ROTARY,
        },
        "tie_word_embeddings": False,
        # MiMo's config.json keys, read by the converter
        "hybrid_layer_pattern": [int(k == "sliding_attention") for k in kinds],
        "swa_head_dim": s.n_embd_head,
        "swa_v_head_dim": MIMO2_V_HEAD_DIM,
        "swa_num_attention_heads": s.n_head,
        "swa_num_key_value_heads": 2 * n_kv,
        "topk_method": "noaux_tc",
        "layernorm_epsilon": pairs.RMS_EPS,
    }
    return MiMoV2FlashConfig(**fields)


# Gemma 4 (llama.cpp's gemma4) as its dense 31B is built: sliding-window layers with a full-attention
# layer every GEMMA4_FULL_EVERY-th (the last layer always full), the full layers with wider heads
# (GEMMA4_GLOBAL_HEAD_DIM), fewer KV heads, keys reused as values (`attention_k_eq_v`) and
# proportional RoPE on a quarter of the head; q/k/v norms, attention scale 1, sandwich norms, a
# per-layer output scalar, tied embeddings scaled by sqrt(n_embd) and final logit softcapping. On
# the 6 tiny layers the full ones are 2 and 5, so the drafter's taps (layer inputs 2 and 4) read
# one of each kind's input.
GEMMA4_FULL_EVERY = 3
GEMMA4_GLOBAL_HEAD_DIM, GEMMA4_GLOBAL_KV_HEADS = 32, 1
GEMMA4_SOFTCAP = 30.0  # gemma-4-31B's final_logit_softcapping


def gemma4_layer_types(n_layer: int) -> list[str]:
    """Gemma 4's layer kinds: full attention on every GEMMA4_FULL_EVERY-th layer, else sliding."""
    return ["full_attention" if (il + 1) % GEMMA4_FULL_EVERY == 0 else "sliding_attention" for il in range(n_layer)]


def _gemma4_config(sz: pairs.Sizes) -> object:
    """Gemma 4's text model at the tiny sizes (transformers' defaults for RoPE: the sliding layers'
    plain RoPE at base 1e4, the full layers' proportional RoPE at 1e6 on a quarter of the head),
    no per-layer embeddings and no shared KV layers (the 31B and 26B-A4B have neither)."""
    from transformers import Gemma4TextConfig

    s = sz.target
    fields: dict[str, Any] = {  # global_head_dim, num_global_key_value_heads: **kwargs of the config
        **_tiny_fields(sz),
        "global_head_dim": GEMMA4_GLOBAL_HEAD_DIM,
        "num_global_key_value_heads": GEMMA4_GLOBAL_KV_HEADS,
        "attention_k_eq_v": True,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": gemma4_layer_types(s.n_layer),
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": sz.n_vocab,
        "num_kv_shared_layers": 0,
        "final_logit_softcapping": GEMMA4_SOFTCAP,
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "rms_norm_eps": pairs.RMS_EPS,
        "tie_word_embeddings": True,
        "bos_token_id": 1,  # fixtures.SPM_SPECIAL's ids
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    return Gemma4TextConfig(**fields)


# Gemma 4's other mechanisms, in a second tiny target: per-layer embeddings (a PLE_WIDTH-wide
# token embedding per layer, gated into each layer's output) and the last GEMMA4_KV_SHARED layers
# attending over the cache of the last earlier layer of their kind (E2B and E4B have both; their
# shared layers' MLPs double wide), and an MoE block of N_EXPERT experts beside the dense MLP
# (26B-A4B). llama.cpp reuses layer n_kv - 1 for a full layer and n_kv - 2 for a sliding one
# (llama-model.cpp), which transformers' "last layer of the kind" matches when the last layer
# keeping its own KV is full and the one before it sliding: layers 2 and 1 here.
GEMMA4_PLE_WIDTH, GEMMA4_KV_SHARED = 8, 3


def _gemma4_ple_moe_config(sz: pairs.Sizes) -> object:
    """The dense Gemma 4 fixture (`_gemma4_config`) with per-layer embeddings, shared KV layers
    (double-wide MLPs on them) and an MoE block in every layer."""
    from transformers import Gemma4TextConfig

    dense: Any = _gemma4_config(sz)
    fields: dict[str, Any] = {
        **dense.to_dict(),
        "hidden_size_per_layer_input": GEMMA4_PLE_WIDTH,
        "num_kv_shared_layers": GEMMA4_KV_SHARED,
        "use_double_wide_mlp": True,
        "enable_moe_block": True,
        "num_experts": N_EXPERT,
        "top_k_experts": N_EXPERT_USED,
        "moe_intermediate_size": N_FF_EXPERT,
    }
    return Gemma4TextConfig(**fields)


# Nemotron-H as Nemotron 3 Nano is built (llama.cpp's nemotron_h_moe): one block kind per layer,
# Mamba2 (recurrent), attention without RoPE, or an MoE of squared-ReLU experts with a shared one.
# The drafter's taps read the inputs of layers 2 (attention) and 4 (MoE); layers 0 and 3 are
# Mamba2, so rejected drafts must be rolled back out of their state. (A dense "mlp" block is left
# out: the pinned converter counts only "moe" blocks as MLPs when it reads `layers_block_type`,
# conversion/nemotron.py _MLP_LAYER_TYPES, and writes an "mlp" block's FFN length as 0, which
# llama.cpp then loads as a Mamba2 layer and refuses: "blk.1.ssm_in.weight not found".)
NEMOTRON_H_BLOCKS = ("linear_attention", "moe", "full_attention", "linear_attention", "moe", "full_attention")
NEMOTRON_SSM_STATE, NEMOTRON_SSM_HEAD_DIM, NEMOTRON_SSM_GROUPS = 16, 16, 2
NEMOTRON_SSM_EXPAND = 2  # the Mamba2 mixer's width over the model's, as Nemotron-H's (8 heads at the tiny 64)


def _nemotron_h_config(sz: pairs.Sizes) -> object:
    """Nemotron-H at the given sizes: Mamba2 mixers (conv 4, heads of 16 twice the model's width,
    2 groups, state 16), attention and MoE blocks in NEMOTRON_H_BLOCKS' order, repeated to the
    layer count (the tiny target's 6 layers are the pattern once)."""
    from transformers import NemotronHConfig

    fields: dict[str, Any] = {
        **_tiny_fields(sz),
        "layers_block_type": [NEMOTRON_H_BLOCKS[il % len(NEMOTRON_H_BLOCKS)] for il in range(sz.target.n_layer)],
        "ssm_state_size": NEMOTRON_SSM_STATE,
        "mamba_num_heads": NEMOTRON_SSM_EXPAND * sz.target.n_embd // NEMOTRON_SSM_HEAD_DIM,
        "mamba_head_dim": NEMOTRON_SSM_HEAD_DIM,
        "n_groups": NEMOTRON_SSM_GROUPS,
        "conv_kernel": 4,
        "chunk_size": 16,
        "n_routed_experts": N_EXPERT,
        "num_experts_per_tok": N_EXPERT_USED,
        "moe_intermediate_size": N_FF_EXPERT,
        "moe_shared_expert_intermediate_size": N_FF_EXPERT,
        "n_shared_experts": 1,
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "layer_norm_epsilon": pairs.RMS_EPS,
        "tie_word_embeddings": False,
    }
    del fields["num_hidden_layers"]  # the block list says how many (the config warns on both)
    return NemotronHConfig(**fields)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen3moe", f"Qwen3-MoE target: {N_EXPERT} experts, top-{N_EXPERT_USED}", _qwen3moe_config),
        Family(
            "gpt-oss",
            f"gpt-oss target: sinks, sliding window {SLIDING_WINDOW} on even layers, "
            f"{N_EXPERT} biased experts, top-{N_EXPERT_USED}, YaRN x{YARN_FACTOR:g}",
            _gpt_oss_config,
            gains=(("mlp.experts.gate_up_proj", GATE_UP_GAIN),),
        ),
        Family(
            "qwen35",
            f"Qwen3.5 target: gated delta-net layers, full attention every {QWEN35_FULL_EVERY}rd layer",
            _qwen35_config,
            no_mtp=True,
            draft_against_target=True,
        ),
        Family(
            "gemma4",
            f"Gemma 4 target: sliding window {SLIDING_WINDOW}, full attention every {GEMMA4_FULL_EVERY}rd layer "
            "(wider heads, keys as values, proportional RoPE), softcapped tied head",
            _gemma4_config,
            draft_against_target=True,
            tokenizer=TOKENIZER_BPE,
            buffers=("layer_scalar",),
        ),
        Family(
            "gemma4-ple-moe",
            f"Gemma 4 target as the dense one, with {GEMMA4_PLE_WIDTH}-wide per-layer embeddings, the last "
            f"{GEMMA4_KV_SHARED} layers reading earlier layers' KV, and {N_EXPERT} experts, top-{N_EXPERT_USED}, "
            "beside each dense MLP",
            _gemma4_ple_moe_config,
            draft_against_target=True,
            tokenizer=TOKENIZER_BPE,
            buffers=("layer_scalar",),
        ),
        Family(
            "nemotron_h",
            "Nemotron-H target: Mamba2, attention and MoE blocks (" + ", ".join(NEMOTRON_H_BLOCKS) + ")",
            _nemotron_h_config,
            draft_against_target=True,
            tokenizer=TOKENIZER_BYTE_BPE,
            buffers=("e_score_correction_bias",),  # the router's choice bias, which llama.cpp adds (exp_probs_b)
        ),
    )
}
