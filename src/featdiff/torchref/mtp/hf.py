"""An MTP head read from its Hugging Face checkpoint, held as the pinned converter writes it into
the GGUF (torchref/mtp/head.py's MtpHead): a Qwen3.5 or Qwen3.5-MoE checkpoint's `mtp.*` tensors
(conversion/qwen.py _QwenMtpMixin: every norm plus one, a MoE head's experts stacked), a GLM-4.5
one's extra decoder layer `model.layers.<n_layer>.*` (conversion/glm.py Glm4MoeModel: norms as they
are, the experts stacked), or a MiMo-V2 one's first `model.mtp.layers.0.*` (conversion/mimo.py
MimoV2Model: a sliding-window layer, norms as they are).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.kinds.mtp import HF_MTP_LAYERS, MTP_LAYERS_KEY, is_mtp_checkpoint
from featdiff.torchref.mtp.head import MtpHead
from featdiff.torchref.mtp.hf_mla import (
    deepseek32_head_tensors,
    deepseek_head_tensors,
    deepseek_hparams,
    glm_dsa_head_tensors,
)
from featdiff.torchref.mtp.layer import MOE_CHOICE_BIAS, MOE_EXPERTS, MOE_ROUTER, MoeRouting
from featdiff.torchref.weights import Hparams, Source

# the MTP block's decoder tensors (blk.<il>.<name>.weight) and the HF names the converter maps
# them from (mtp.layers.0.<hf>.weight); a Qwen3.5 block's post-attention norm is
# `post_attention_norm` in GGUF (LLM_TENSOR_ATTN_POST_NORM)
ATTENTION_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",  # (2 * n_head * head_dim, n_embd): per head [q, gate]
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
}
DENSE_FFN_TENSORS = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# a Qwen3.5-MoE head's FFN (Qwen2MoeModel's map): the router, the shared expert and its sigmoid
# gate (HF (1, n_embd)); the experts' matrices stacked (EXPERT)
MOE_FFN_TENSORS = {
    MOE_ROUTER: "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# expert x's matrix in a Qwen3.5-MoE or GLM-4.5 checkpoint (after the layer's prefix); the converter
# stacks them on dim 0 into ffn_<proj>_exps (modify_tensors)
EXPERT = "mlp.experts.{x}.{proj}_proj.weight"
# nextn tensors (blk.<il>.nextn.<name>.weight) and their HF names (mtp.<hf>.weight)
NEXTN_TENSORS = {
    names.NEXTN_EH_PROJ: "fc",
    "enorm": "pre_fc_norm_embedding",
    "hnorm": "pre_fc_norm_hidden",
    "shared_head_norm": "norm",
}
HF_MTP_PREFIX = "mtp."
HF_MTP_LAYER = "mtp.layers.0."
# norms a Qwen3.5 checkpoint stores zero-centred (x * (1 + w)); the converter adds one
# (conversion/qwen.py Qwen3NextModel.modify_tensors: every `norm.weight` but the linear attention's)
HF_NORM_SUFFIX = "norm"
HF_MOE_INTERMEDIATE_SIZE = "moe_intermediate_size"  # a MoE config's expert width (it may say no intermediate_size)
# GLM-4.5's head layer (HF names after `model.layers.<n_layer>.`) -> the block's GGUF keys, as the
# converter maps them (gguf-py tensor_mapping: attention with biases, the sigmoid router and its
# choice bias, the ungated shared expert); its q/k norms where config.json says `use_qk_norm`
GLM_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    **{f"attn_{p}{s}": f"self_attn.{p}_proj.{w}" for p in "qkv" for s, w in (("", "weight"), (".bias", "bias"))},
    "attn_output": "self_attn.o_proj.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    MOE_ROUTER: "mlp.gate.weight",
    MOE_CHOICE_BIAS: "mlp.gate.e_score_correction_bias",
    **{f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")},
}
GLM_QK_NORMS = {"attn_q_norm": "self_attn.q_norm.weight", "attn_k_norm": "self_attn.k_norm.weight"}
GLM_NEXTN = {names.NEXTN_EH_PROJ: "eh_proj.weight", "enorm": "enorm.weight", "hnorm": "hnorm.weight"}
GLM_HEAD_NORM = "shared_head.norm.weight"
# MiMo-V2's head layer (HF names after `model.mtp.layers.0.`) -> the GGUF's, as MimoV2Model maps
# them: q/k/v fused, the sinks (the converter adds `.weight`), the FFN norm (ffn_norm: MiMo's
# post_attention_layernorm), a dense FFN; the head norm is its final_layernorm (layer_output_norm)
MIMO_HEAD_LAYER = "model.mtp.layers.0."
MIMO_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "attn_qkv": "self_attn.qkv_proj.weight",  # (n_head d_k + n_head_kv (d_k + d_v), n_embd): rows [q, k, v]
    "attn_output": "self_attn.o_proj.weight",
    "attn_sinks": "self_attn.attention_sink_bias",
    "ffn_norm": "post_attention_layernorm.weight",
    **{f"ffn_{p}": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}
MIMO_NEXTN = GLM_NEXTN  # eh_proj, enorm, hnorm inside the head's layer, as GLM-4.5's
MIMO_HEAD_NORM = "final_layernorm.weight"
MIMO_RMS_EPS_DEFAULT = 1e-5  # conversion/mimo.py: layernorm_epsilon, else this (not rms_norm_eps)


@dataclass(frozen=True)
class _HfHead:
    """Where one family's checkpoint keeps its head and how the converter writes it."""

    arch: str  # llama.cpp's architecture of the converted GGUF
    # the config.json key that counts its MTP blocks (GLM-4.5's ship as that many more decoder
    # layers); None: the config does not say, and every checkpoint of the type ships its heads
    # (MiMo-V2's 3: conversion/mimo.py hardcodes the count)
    layers_key: str | None
    rotary_default: float  # partial_rotary_factor where config.json says none (the converter's default)
    prefix: Callable[[dict[str, Any]], str]  # the text config -> the prefix of the head's tensors
    fields: Callable[[Callable[[str], torch.Tensor], dict[str, Any], str], dict[str, Any]]  # MtpHead's own fields
    hparams: Callable[[dict[str, Any], _HfHead], Hparams]  # the text config -> the block's dims
    # the text config -> the prefix of every tensor of the family's MTP heads (strict loading)
    namespace: Callable[[dict[str, Any]], str]


def mtp_from_hf(path: Path, dtype: torch.dtype, device: torch.device) -> MtpHead:
    """The head of a Qwen3.5 checkpoint (`mtp.*` tensors), a GLM-4.5 one (decoder layer n_layer)
    or a MiMo-V2 one (`model.mtp.layers.0`), held as the converter writes it (HF_HEADS)."""
    path = Path(path)
    config = json.loads((path / names.HF_CONFIG).read_text())
    text = config.get("text_config", config)
    if not is_mtp_checkpoint(config):
        raise InputError(
            f"{path}: config.json declares no MTP layers ({', '.join(sorted({k.layers_key for k in HF_HEADS.values() if k.layers_key}))}); "
            "pass a checkpoint with its MTP head"
        )
    kind = HF_HEADS[text[names.HF_MODEL_TYPE]]
    tensors = _checkpoint_tensors(path)
    read: set[str] = set()

    def hf(name: str) -> torch.Tensor:
        if name not in tensors:
            raise InputError(f"{path}: tensor {name} is missing; the checkpoint's MTP head is incomplete")
        read.add(name)
        return tensors[name].to(dtype=dtype, device=device)

    prefix = kind.prefix(text)

    def model_tensor(suffix: str) -> torch.Tensor:
        name = next((k for k in tensors if k.endswith(suffix) and not k.startswith(prefix)), suffix)
        return hf(name)

    tied = bool(text.get(names.HF_TIE_EMBEDDINGS, config.get(names.HF_TIE_EMBEDDINGS, False)))
    embd = model_tensor(names.HF_EMBED_TOKENS)
    head = MtpHead(
        source=Source(path, is_gguf=False),
        hparams=kind.hparams(text, kind),
        il=int(text[names.HF_NUM_LAYERS]),
        **kind.fields(hf, text, prefix),
        token_embd=embd,
        output=embd if tied else model_tensor(names.HF_LM_HEAD),
    )
    found = [f"config.json {k}" for k in unread_mtp_keys(text)]
    found += [f"tensor {t}" for t in unread_head_tensors(tensors, read, kind.namespace(text))]
    if found:
        raise InputError(
            f"{path}: carries {', '.join(found)}, which featdiff's MTP reference does not read (a comparison would "
            "silently leave it out); drop it, or model it or list it as irrelevant with its reason in "
            "src/featdiff/torchref/mtp/hf.py (MTP_IRRELEVANT)"
        )
    return head


# Strict loading: the head's own config keys (any key naming mtp or nextn) and every tensor under the
# head's namespace must be read, or listed here with the reason (the trunk's are the target's).
MTP_READ_KEYS = (HF_MTP_LAYERS, "num_nextn_predict_layers")
MTP_INERT_KEYS: dict[str, object] = {
    "mtp_use_dedicated_embeddings": False,  # true: the head embeds with its own table, which llama.cpp has no tensor for
}
MTP_IRRELEVANT: dict[str, str] = {
    "model.mtp.layers.[1-9]*": "MiMo-V2's later heads: a single head's reference drafts with the first; a chain's "
    "(a GGUF of several heads) reads them (torchref/mtp/chain.py)",
}


def unread_mtp_keys(text: dict[str, Any]) -> tuple[str, ...]:
    """The head's config keys (naming mtp or nextn) the reference does not read, and inert ones
    at another value (`key = value`)."""
    mine = [k for k in text if "mtp" in k.lower() or "nextn" in k.lower()]
    out = [k for k in mine if k not in MTP_READ_KEYS and k not in MTP_INERT_KEYS]
    return (*out, *(f"{k} = {text[k]!r}" for k, v in MTP_INERT_KEYS.items() if k in text and text[k] != v))


def unread_head_tensors(tensors: Iterable[str], read: set[str], namespace: str) -> tuple[str, ...]:
    """The tensors under the head's `namespace` that no field was read from, nor listed as irrelevant."""
    return tuple(
        t
        for t in tensors
        if t.startswith(namespace) and t not in read and not any(fnmatch.fnmatchcase(t, p) for p in MTP_IRRELEVANT)
    )


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, by name."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob(names.HF_WEIGHTS_GLOB)):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is no mapping)
                tensors[k] = st.get_tensor(k)
    return tensors


def _hf_hparams(text: dict[str, Any], kind: _HfHead) -> Hparams:
    """The block's dims as the converter writes them: the model's heads, NeoX RoPE on the first
    head_dim x partial_rotary_factor dims, one layer."""
    n_embd, n_head = int(text[names.HF_HIDDEN_SIZE]), int(text[names.HF_NUM_HEADS])
    head_dim = int(text.get(names.HF_HEAD_DIM) or n_embd // n_head)
    rope = text.get("rope_parameters") or {}
    return Hparams(
        arch=kind.arch,
        n_layer=1,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(text.get(names.HF_NUM_KV_HEADS, n_head)),
        n_embd_head=head_dim,
        n_ff=int(text.get(names.HF_INTERMEDIATE_SIZE) or text.get(HF_MOE_INTERMEDIATE_SIZE) or 0),
        n_vocab=int(text[names.HF_VOCAB_SIZE]),
        rms_eps=float(text[names.HF_RMS_EPS]),
        rope_base=float(rope.get(names.HF_ROPE_THETA, text.get(names.HF_ROPE_THETA, names.ROPE_FREQ_BASE_DEFAULT))),
        rope_type="neox",
        n_rot=int(head_dim * float(rope.get("partial_rotary_factor", kind.rotary_default))),
    )


def hf_head_tensors(hf: Callable[[str], torch.Tensor], n_expert: int = 0) -> dict[str, Any]:
    """The head's own fields (eh_proj, the norms, the block) from a checkpoint's `mtp.*` tensors,
    `hf(name)` each, as the converter writes them: `mtp.fc` -> eh_proj, `pre_fc_norm_embedding` /
    `_hidden` -> enorm / hnorm, `mtp.norm` -> the head norm, `mtp.layers.0.*` -> the block, every
    norm plus one (a Qwen3.5 checkpoint's norms are zero-centred); with `n_expert`, a MoE FFN's
    tensors (Qwen3.5-MoE) in place of the dense one's."""
    ffn = MOE_FFN_TENSORS if n_expert else DENSE_FFN_TENSORS
    block = {
        k: _plus_one(hf(f"{HF_MTP_LAYER}{v}.weight"), k.endswith(HF_NORM_SUFFIX))
        for k, v in (ATTENTION_TENSORS | ffn).items()
    }
    block |= _stacked_experts(hf, HF_MTP_LAYER, n_expert)
    nextn = {k: _plus_one(hf(f"{HF_MTP_PREFIX}{v}.weight"), k != names.NEXTN_EH_PROJ) for k, v in NEXTN_TENSORS.items()}
    return {
        "eh_proj": nextn[names.NEXTN_EH_PROJ],
        "enorm": nextn["enorm"],
        "hnorm": nextn["hnorm"],
        "block": block,
        "head_norm": nextn["shared_head_norm"],
    }


def _stacked_experts(hf: Callable[[str], torch.Tensor], prefix: str, n_expert: int) -> dict[str, torch.Tensor]:
    """The layer `prefix`'s experts, each projection's matrices stacked as the converter stacks
    them: ffn_gate_exps and ffn_up_exps (n_expert, n_ff, n_embd), ffn_down_exps (n_expert, n_embd, n_ff)."""
    if not n_expert:
        return {}
    return {
        stacked: torch.stack([hf(prefix + EXPERT.format(x=x, proj=proj)) for x in range(n_expert)])
        for stacked, proj in zip(MOE_EXPERTS, ("gate", "up", "down"), strict=True)
    }


def _plus_one(t: torch.Tensor, is_norm: bool) -> torch.Tensor:
    return t + 1.0 if is_norm else t


def _qwen35_fields(hf: Callable[[str], torch.Tensor], text: dict[str, Any], prefix: str) -> dict[str, Any]:
    return hf_head_tensors(hf)


def _qwen35moe_fields(hf: Callable[[str], torch.Tensor], text: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A Qwen3.5-MoE head: its MoE FFN routed as qwen35moe.cpp routes (softmax, the top-k
    renormalized, unscaled: llama.cpp's literals, whatever config.json says)."""
    n_expert = int(text["num_experts"])
    return {**hf_head_tensors(hf, n_expert), "routing": MoeRouting(int(text["num_experts_per_tok"]))}


def glm_head_tensors(hf: Callable[[str], torch.Tensor], text: dict[str, Any], prefix: str) -> dict[str, Any]:
    """GLM-4.5's head fields from its decoder layer `prefix` (`model.layers.<n_layer>.`), `hf(name)`
    each, as Glm4MoeModel writes them: eh_proj, enorm, hnorm and `shared_head.norm` -> the head
    norm, the layer -> the block (GLM_BLOCK_TENSORS, each expert's matrices stacked
    `(n_expert, ...)`), norms as they are; its routing from config.json (sigmoid, as the converter
    writes `expert_gating_func`; norm_topk_prob; routed_scaling_factor)."""
    block = {k: hf(prefix + v) for k, v in GLM_BLOCK_TENSORS.items()}
    if text.get("use_qk_norm"):
        block |= {k: hf(prefix + v) for k, v in GLM_QK_NORMS.items()}
    block |= _stacked_experts(hf, prefix, int(text["n_routed_experts"]))
    routing = MoeRouting(
        int(text["num_experts_per_tok"]),
        float(text.get("routed_scaling_factor") or 0.0),
        has_sigmoid_gating=True,
        has_weights_norm=bool(text.get("norm_topk_prob", False)),
    )
    nextn = {k: hf(prefix + v) for k, v in GLM_NEXTN.items()}
    return {**nextn, "block": block, "head_norm": hf(prefix + GLM_HEAD_NORM), "routing": routing}


def mimo_head_tensors(hf: Callable[[str], torch.Tensor], text: dict[str, Any], prefix: str) -> dict[str, Any]:
    """MiMo-V2's head fields from its first MTP layer `prefix`, `hf(name)` each, as MimoV2Model
    writes them (MIMO_BLOCK_TENSORS, MIMO_NEXTN, the head norm final_layernorm), norms as they are."""
    return {
        **{k: hf(prefix + v) for k, v in MIMO_NEXTN.items()},
        "block": {k: hf(prefix + v) for k, v in MIMO_BLOCK_TENSORS.items()},
        "head_norm": hf(prefix + MIMO_HEAD_NORM),
    }


def _mimo_hparams(text: dict[str, Any], kind: _HfHead) -> Hparams:
    """MiMo-V2's head block as the converter writes it: a sliding-window layer (the pattern it
    extends with 1s), so the sliding layers' KV heads and RoPE base, RoPE on head_dim x the top
    partial_rotary_factor dims, the value scale, its layernorm_epsilon."""
    rope = text["rope_parameters"]
    sliding = {**rope["sliding_attention"], "partial_rotary_factor": rope["partial_rotary_factor"]}
    hp = _hf_hparams({**text, "rope_parameters": sliding}, kind)
    return replace(
        hp,
        n_head_kv=int(text["swa_num_key_value_heads"]),
        rms_eps=float(text.get("layernorm_epsilon", MIMO_RMS_EPS_DEFAULT)),
        attn_value_scale=float(text.get("attention_value_scale") or 0.0),
        n_swa=int(text["sliding_window"]),
        swa_layers=(True,),
    )


def _mtp_layer(text: dict[str, Any]) -> str:
    """Qwen3.5 keeps its head under `mtp.`."""
    return HF_MTP_PREFIX


def _mimo_mtp_layer(text: dict[str, Any]) -> str:
    """MiMo-V2 keeps its heads under `model.mtp.layers.<i>.`; featdiff models the first."""
    return MIMO_HEAD_LAYER


def _mimo_namespace(text: dict[str, Any]) -> str:
    """MiMo-V2's heads, all of them: `model.mtp.`."""
    return MIMO_HEAD_LAYER.removesuffix("layers.0.")


def _extra_layer(text: dict[str, Any]) -> str:
    """GLM-4.5 keeps its head as the decoder layer after the trunk's."""
    return names.HF_TARGET_PREFIX + names.HF_LAYER_PREFIX.format(il=int(text[names.HF_NUM_LAYERS]))


_QWEN35 = _HfHead(
    names.ARCH_QWEN35, MTP_LAYERS_KEY["qwen3_5"], 0.25, _mtp_layer, _qwen35_fields, _hf_hparams, _mtp_layer
)
_QWEN35MOE = _HfHead(
    names.ARCH_QWEN35MOE, MTP_LAYERS_KEY["qwen3_5_moe"], 0.25, _mtp_layer, _qwen35moe_fields, _hf_hparams, _mtp_layer
)
# model_type -> where its head is and how the converter writes it (its layers key: kinds/mtp.py's
# MTP_LAYERS_KEY, which tells a checkpoint with a head)
HF_HEADS = {
    "qwen3_5_text": _QWEN35,
    "qwen3_5": _QWEN35,
    "qwen3_5_moe_text": _QWEN35MOE,
    "qwen3_5_moe": _QWEN35MOE,
    "glm4_moe": _HfHead(
        names.ARCH_GLM4MOE, MTP_LAYERS_KEY["glm4_moe"], 0.5, _extra_layer, glm_head_tensors, _hf_hparams, _extra_layer
    ),
    # Qwen3-Next: Qwen3.5-MoE's head layout and conversion, its count unsaid in config.json
    "qwen3_next": _HfHead(names.ARCH_QWEN3NEXT, None, 0.25, _mtp_layer, _qwen35moe_fields, _hf_hparams, _mtp_layer),
    # DeepSeek-V3: GLM-4.5's layout (the decoder layer after the trunk's), MLA (torchref/mtp/hf_mla.py)
    "deepseek_v3": _HfHead(
        names.ARCH_DEEPSEEK2,
        MTP_LAYERS_KEY["deepseek_v3"],
        1.0,
        _extra_layer,
        deepseek_head_tensors,
        deepseek_hparams,
        _extra_layer,
    ),
    "deepseek_v32": _HfHead(
        names.ARCH_DEEPSEEK32,
        MTP_LAYERS_KEY["deepseek_v32"],
        1.0,
        _extra_layer,
        deepseek32_head_tensors,
        deepseek_hparams,
        _extra_layer,
    ),
    # GLM-5: DeepSeek-V3.2's head layer (its indexer unused), its routing sigmoid (hf_mla.glm_dsa_head_tensors)
    "glm_moe_dsa": _HfHead(
        names.ARCH_GLM_DSA,
        MTP_LAYERS_KEY["glm_moe_dsa"],
        1.0,
        _extra_layer,
        glm_dsa_head_tensors,
        deepseek_hparams,
        _extra_layer,
    ),
    "mimo_v2_flash": _HfHead(
        names.ARCH_MIMO2,
        MTP_LAYERS_KEY["mimo_v2_flash"],
        1.0,
        _mimo_mtp_layer,
        mimo_head_tensors,
        _mimo_hparams,
        _mimo_namespace,
    ),
}
