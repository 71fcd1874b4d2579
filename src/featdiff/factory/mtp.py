"""Tiny Qwen3.5 targets with a multi-token-prediction (MTP, "nextn") head, for llama.cpp's
`--spec-type draft-mtp`: the qwen35 family's target (featdiff.factory.hf_targets, the same weights for
the same seed) with a seeded MTP block added to its checkpoint as Qwen3.5 checkpoints ship it,
and the pinned converter's GGUFs of it. The directory is the fixture layout: `target-hf/`,
`target.gguf`, `VARIANT`, and for `mtp-separate` `draft.gguf`; there is no `draft-hf/` (the head
lives in the target's checkpoint, and the converter's `--mtp` cuts the draft GGUF out of it). The
`trained-mtp` variant is the family's target with a faint trunk (TRUNK_GAIN) and a head trained on
its greedy text (featdiff.factory.training.mtp, cached per machine), and `prompts.txt`: held-out prompts
for `featdiff probe`, as fixtures.write_fixture writes them for the trained DFlash pairs.

What the converter (conversion/qwen.py _QwenMtpMixin) writes of the head (GGUF_FROM_HF names each
tensor): block n_layer (6), one past the trunk, a full-attention Qwen3.5 layer (`mtp.layers.0.*`)
with the nextn tensors: `eh_proj` from `mtp.fc` (n_embd, 2 n_embd), whose input is
[enorm(embed(token)), hnorm(h)], embedding first (qwen35.cpp graph_mtp), and the `enorm`, `hnorm`
and `shared_head_norm` norms. Every norm is written as 1 + its HF weight (Qwen3.5's RMSNorm scales
by 1 + w; Qwen3NextModel.modify_tensors), matrices as they are. `qwen35.block_count` counts the
head (n_layer + 1) and `qwen35.nextn_predict_layers` is 1; `--no-mtp` drops the block and both.
`--mtp` keeps the block and the tensors it reads of the trunk: token_embd, output_norm, output.

The `mtp-qwen35moe` variant is the same on a tiny Qwen3.5-MoE target (hf_targets._qwen35moe_config,
llama.cpp's `qwen35moe`): every layer's dense MLP a sparse MoE block (router `mlp.gate`, per-expert
`mlp.experts.{x}.{gate,up,down}_proj` as transformers saves them, a shared expert and its sigmoid
gate), and so the head's decoder layer (GGUF_FROM_HF_MOE: the converter stacks the experts into
`ffn_{gate,up,down}_exps`).

The `mtp-glm4moe` variant is a tiny GLM-4.5 target (hf_targets._glm4moe_config, llama.cpp's
`glm4moe`) with its head as GLM-4.5 ships it: one more decoder layer `model.layers.<n_layer>.*`
(an MoE layer: sigmoid router with its choice bias, experts, shared expert) holding `eh_proj`,
`enorm`, `hnorm` and `shared_head.norm`, and `num_nextn_predict_layers` 1 (GGUF_FROM_HF_GLM: the
converter's Glm4MoeModel keeps the layer as block n_layer, its norms as they are).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.outputs import check_output_dir, replaced
from featdiff.factory import mtp_bailingmoe3 as bm
from featdiff.factory import mtp_cohere2moe as cm
from featdiff.factory import mtp_deepseek as ds
from featdiff.factory import mtp_hy_v3 as hy
from featdiff.factory import mtp_nemotron as nh
from featdiff.factory import pairs
from featdiff.factory.converter import (
    CONVERTER,
    DRAFT_GGUF,
    TARGET_GGUF,
    TARGET_HF,
    convert_checkpoint,
)
from featdiff.factory.fixtures import PROMPTS_FILE, _write_held_out_prompts
from featdiff.factory.hf_families import (
    BOOTSTRAP_GLM,
    BOOTSTRAP_MIMO,
    BOOTSTRAP_OF,
    CHOICE_BIAS_GAIN,
    FAMILIES,
    N_EXPERT,
    N_EXPERT_USED,
    TOKENIZER_BYTE_BPE,
    TOKENIZER_SPM,
    Family,
    _glm4moe_config,
    _qwen35moe_config,
)
from featdiff.factory.hf_targets import gain_of, write_hf_target
from featdiff.factory.mtp_mimo2 import (
    GGUF_FROM_HF_MIMO2,
    HF_MIMO_FC,
    HF_MIMO_NORMS,
    MIMO2_TARGET,
    MIMO_LAYER,
    mimo2_layer,
)
from featdiff.factory.mtp_qwen3next import QWEN3NEXT_TARGET
from featdiff.factory.pairs import _linear, _norm

FAMILY = "qwen35"  # the hf_targets family whose target carries the head
ARCH_QWEN35MOE = "qwen35moe"  # llama.cpp's Qwen3.5-MoE (the converter's Qwen3_5MoeTextModel)
# the MoE variant's target: Qwen3.5's tiny layers with MoE FFNs, seeded as a family's (not one of
# hf_targets.FAMILIES: it has no DFlash fixture of its own)
MOE_TARGET = Family(
    ARCH_QWEN35MOE,
    f"Qwen3.5-MoE target: Qwen3.5's layers, {N_EXPERT} experts, top-{N_EXPERT_USED}, and a shared expert",
    _qwen35moe_config,
)
HF_N_MTP = "mtp_num_hidden_layers"  # config.json: how many MTP blocks (the converter's nextn count)
N_MTP = 1  # llama.cpp's qwen35 MTP graph runs exactly one block (graph_mtp asserts it)
HF_LAYER_PREFIX = "model.layers."  # where transformers saves the trunk's layers
HF_FULL_ATTENTION = "full_attention"  # the layer kind (config.json layer_types) the MTP block copies
HF_SAFETENSORS = "model.safetensors"  # write_hf_target saves one file (no index at the tiny size)
SAFETENSORS_META = {"format": "pt"}  # what save_pretrained writes: transformers reads the file as torch's
# The head's own tensors beside its decoder layer: the fc over [embedding, hidden] and three norms
HF_FC = "mtp.fc.weight"
HF_NORMS = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")
# What the converter writes of the head's tensors (conversion/qwen.py _QwenMtpMixin.filter_tensors
# and the qwen35 tensor map): HF -> GGUF, the block one past the trunk's layers
_IL = pairs.TINY.target.n_layer
_BLK = f"blk.{_IL}."
_LAYER = "mtp.layers.0."
NEXTN_NORMS = ("enorm", "hnorm", "shared_head_norm")  # the GGUF's names of the embedding's, the hidden's, the head's


def _nextn_head(fc: str, norms: tuple[str, ...]) -> dict[str, str]:
    """A checkpoint's head fc and its three norms (NEXTN_NORMS' order) -> their GGUF nextn names."""
    return {
        fc: names.T_NEXTN.format(il=_IL, name=names.NEXTN_EH_PROJ),
        **{hf: names.T_NEXTN.format(il=_IL, name=name) for hf, name in zip(norms, NEXTN_NORMS, strict=True)},
    }


_HEAD_AND_ATTENTION = {
    **_nextn_head(HF_FC, HF_NORMS),
    _LAYER + "input_layernorm.weight": _BLK + "attn_norm.weight",
    _LAYER + "self_attn.q_proj.weight": _BLK + "attn_q.weight",  # query and output gate, per head
    _LAYER + "self_attn.k_proj.weight": _BLK + "attn_k.weight",
    _LAYER + "self_attn.v_proj.weight": _BLK + "attn_v.weight",
    _LAYER + "self_attn.o_proj.weight": _BLK + "attn_output.weight",
    _LAYER + "self_attn.q_norm.weight": _BLK + "attn_q_norm.weight",
    _LAYER + "self_attn.k_norm.weight": _BLK + "attn_k_norm.weight",
    _LAYER + "post_attention_layernorm.weight": _BLK + "post_attention_norm.weight",
}
GGUF_FROM_HF = {
    **_HEAD_AND_ATTENTION,
    _LAYER + "mlp.gate_proj.weight": _BLK + "ffn_gate.weight",
    _LAYER + "mlp.up_proj.weight": _BLK + "ffn_up.weight",
    _LAYER + "mlp.down_proj.weight": _BLK + "ffn_down.weight",
}
# The MoE variant's head (qwen35moe.cpp load_block_mtp): its layer's MoE block in place of the
# dense MLP. Expert x's matrix is slice x (ggml's slowest axis, ne[2]) of the GGUF's stacked
# `ffn_*_exps` (Qwen2MoeModel.modify_tensors); the shared expert's gate (1, n_embd) is
# `ffn_gate_inp_shexp`, its ne (n_embd, 1)
HF_EXPERT = _LAYER + "mlp.experts.{x}.{proj}_proj.weight"
GGUF_FROM_HF_MOE = {
    **_HEAD_AND_ATTENTION,
    _LAYER + "mlp.gate.weight": _BLK + "ffn_gate_inp.weight",
    _LAYER + "mlp.shared_expert.gate_proj.weight": _BLK + "ffn_gate_shexp.weight",
    _LAYER + "mlp.shared_expert.up_proj.weight": _BLK + "ffn_up_shexp.weight",
    _LAYER + "mlp.shared_expert.down_proj.weight": _BLK + "ffn_down_shexp.weight",
    _LAYER + "mlp.shared_expert_gate.weight": _BLK + "ffn_gate_inp_shexp.weight",
    **{
        HF_EXPERT.format(x=x, proj=proj): f"{_BLK}ffn_{proj}_exps.weight"
        for proj in ("gate", "up", "down")
        for x in range(N_EXPERT)
    },
}
# The GLM variant's target: GLM-4.5's layers (hf_targets._glm4moe_config), llama.cpp's glm4moe
# (not one of hf_targets.FAMILIES: it has no DFlash fixture of its own)
GLM4MOE_TARGET = Family(
    names.ARCH_GLM4MOE,
    f"GLM-4.5 target: attention biases, half-head RoPE, a dense first layer, then {N_EXPERT} experts, "
    f"top-{N_EXPERT_USED} by sigmoid + a choice bias, and a shared expert",
    _glm4moe_config,
    gains=(("e_score_correction_bias", CHOICE_BIAS_GAIN),),
    buffers=("e_score_correction_bias",),  # the router's choice bias, which llama.cpp adds (exp_probs_b)
)
# GLM-4.5 ships its head as one more decoder layer, model.layers.<n_layer> (config.json
# `num_nextn_predict_layers`), with the nextn tensors inside it: `eh_proj` over [enorm(embed(token)),
# hnorm(h)] and the head norm `shared_head.norm` (GLM-4.5 ships no `embed_tokens` or
# `shared_head.head` copy: the head reads the model's). The converter's Glm4MoeModel keeps the layer
# as block n_layer and maps the nextn names as they are (gguf-py tensor_mapping NEXTN_*); its norms
# are plain RMSNorm weights, written as they are.
HF_GLM_N_MTP = "num_nextn_predict_layers"
_GLM_LAYER = f"{HF_LAYER_PREFIX}{_IL}."
HF_GLM_FC = _GLM_LAYER + "eh_proj.weight"
HF_GLM_NORMS = tuple(_GLM_LAYER + f"{n}.weight" for n in ("enorm", "hnorm", "shared_head.norm"))
_GLM_ATTENTION = {
    **{f"{_GLM_LAYER}self_attn.{p}_proj.{w}": f"{_BLK}attn_{p}.{w}" for p in "qkv" for w in ("weight", "bias")},
    _GLM_LAYER + "self_attn.o_proj.weight": _BLK + "attn_output.weight",
    _GLM_LAYER + "input_layernorm.weight": _BLK + "attn_norm.weight",
    _GLM_LAYER + "post_attention_layernorm.weight": _BLK + "post_attention_norm.weight",
}
GGUF_FROM_HF_GLM = {
    **_nextn_head(HF_GLM_FC, HF_GLM_NORMS),
    **_GLM_ATTENTION,
    _GLM_LAYER + "mlp.gate.weight": _BLK + "ffn_gate_inp.weight",
    _GLM_LAYER + "mlp.gate.e_score_correction_bias": _BLK + "exp_probs_b.bias",
    **{
        f"{_GLM_LAYER}mlp.shared_experts.{p}_proj.weight": f"{_BLK}ffn_{p}_shexp.weight" for p in ("gate", "up", "down")
    },
    **{
        f"{_GLM_LAYER}mlp.experts.{x}.{proj}_proj.weight": f"{_BLK}ffn_{proj}_exps.weight"
        for proj in ("gate", "up", "down")
        for x in range(N_EXPERT)
    },
}


def _first_full_attention(config: dict) -> int:
    """Qwen3.5's MTP layer is a full-attention layer: the first of the trunk's."""
    return config["layer_types"].index(HF_FULL_ATTENTION)


def _last_layer(config: dict) -> int:
    """GLM-4.5's MTP layer is an MoE decoder layer, as the trunk's last."""
    return int(config["num_hidden_layers"]) - 1


def _copied_layer(
    shaped_as: Callable[[dict], int], config: dict, target: dict[str, np.ndarray], head_layer: str
) -> dict[str, tuple[int, ...]]:
    """The head's decoder layer (under `head_layer`) shaped as the target's layer `shaped_as(config)`."""
    layer = f"{HF_LAYER_PREFIX}{shaped_as(config)}."
    return {head_layer + k[len(layer) :]: a.shape for k, a in target.items() if k.startswith(layer)}


@dataclass(frozen=True)
class HeadLayout:
    """Where a family's checkpoints keep an MTP head, and how its decoder layer is shaped."""

    n_mtp_key: str | None  # config.json: how many MTP blocks (None: MiMo's does not say)
    layer: str  # the prefix of the head's decoder layer
    fc: str  # over [embedding, hidden]: (n_embd, 2 n_embd)
    norms: tuple[str, ...]  # enorm, hnorm, the head norm: (n_embd,) each
    # (config.json, the target's tensors, `layer`) -> the shapes of the head's decoder layer's tensors
    block_shapes: Callable[[dict, dict[str, np.ndarray], str], dict[str, tuple[int, ...]]]


QWEN35_HEAD = HeadLayout(HF_N_MTP, _LAYER, HF_FC, HF_NORMS, partial(_copied_layer, _first_full_attention))
GLM4MOE_HEAD = HeadLayout(HF_GLM_N_MTP, _GLM_LAYER, HF_GLM_FC, HF_GLM_NORMS, partial(_copied_layer, _last_layer))
MIMO2_HEAD = HeadLayout(None, MIMO_LAYER, HF_MIMO_FC, HF_MIMO_NORMS, mimo2_layer)


@dataclass(frozen=True)
class MtpTarget:
    """One target family with an MTP head: its model, where its checkpoint keeps the head, what the
    converter writes of the head and how (bootstrap: a converter.BOOTSTRAPS key; norm_offset: what
    the converter adds to a norm weight)."""

    family: Family
    head: HeadLayout
    gguf_from_hf: dict[str, str]
    bootstrap: str | None
    norm_offset: float = 0.0
    config_json: tuple[tuple[str, Any], ...] = ()  # config.json's keys beside what transformers saves


_SPM = BOOTSTRAP_OF[TOKENIZER_SPM]
QWEN35_MTP = MtpTarget(FAMILIES[FAMILY], QWEN35_HEAD, GGUF_FROM_HF, _SPM, norm_offset=1.0)
QWEN35MOE_MTP = MtpTarget(MOE_TARGET, QWEN35_HEAD, GGUF_FROM_HF_MOE, _SPM, norm_offset=1.0)
GLM4MOE_MTP = MtpTarget(GLM4MOE_TARGET, GLM4MOE_HEAD, GGUF_FROM_HF_GLM, BOOTSTRAP_GLM)
MIMO2_MTP = MtpTarget(MIMO2_TARGET, MIMO2_HEAD, GGUF_FROM_HF_MIMO2, BOOTSTRAP_MIMO)
# DeepSeek-V3 ships its head as GLM-4.5 does, one more decoder layer (factory/mtp_deepseek.py)
DEEPSEEK2_MTP = MtpTarget(ds.DEEPSEEK2_TARGET, GLM4MOE_HEAD, ds.GGUF_FROM_HF_DEEPSEEK2, ds.BOOTSTRAP_DEEPSEEK)
DEEPSEEK32_MTP = MtpTarget(ds.DEEPSEEK32_TARGET, GLM4MOE_HEAD, ds.GGUF_FROM_HF_DEEPSEEK32, ds.BOOTSTRAP_DEEPSEEK32)
GLM_DSA_MTP = MtpTarget(ds.GLM_DSA_TARGET, GLM4MOE_HEAD, ds.GGUF_FROM_HF_GLM_DSA, ds.BOOTSTRAP_GLM_DSA)
# Qwen3-Next's head is Qwen3.5-MoE's, its config.json without the count (factory/mtp_qwen3next.py)
QWEN3NEXT_MTP = MtpTarget(QWEN3NEXT_TARGET, replace(QWEN35_HEAD, n_mtp_key=None), GGUF_FROM_HF_MOE, _SPM, 1.0)
# Nemotron-H's head as the pinned converter expects it, two sub-layers (factory/mtp_nemotron.py)
NEMOTRON_H_HEAD = HeadLayout(nh.HF_N_MTP, nh.HF_MTP, nh.HF_FC, nh.HF_NORMS, nh.nemotron_head_shapes)
NEMOTRON_H_MOE_MTP = MtpTarget(
    nh.NEMOTRON_H_MOE_TARGET, NEMOTRON_H_HEAD, nh.GGUF_FROM_HF_NEMOTRON, BOOTSTRAP_OF[TOKENIZER_BYTE_BPE]
)
# Hy3 ships its head as GLM-4.5 does, one more decoder layer (factory/mtp_hy_v3.py)
HY_V3_HEAD = replace(GLM4MOE_HEAD, fc=hy.HF_FC, norms=hy.HF_NORMS)
HY_V3_MTP = MtpTarget(hy.HY_V3_TARGET, HY_V3_HEAD, hy.GGUF_FROM_HF_HY_V3, BOOTSTRAP_OF[TOKENIZER_BYTE_BPE])
# Cohere2-MoE's head as the pinned converter reads it, GLM-4.5's layout (factory/mtp_cohere2moe.py)
COHERE2MOE_MTP = MtpTarget(
    cm.COHERE2MOE_TARGET, GLM4MOE_HEAD, cm.GGUF_FROM_HF_COHERE2MOE, BOOTSTRAP_OF[TOKENIZER_BYTE_BPE]
)
# Ling 3.0's head, GLM-4.5's layout, config.json as a Ling checkpoint's (factory/mtp_bailingmoe3.py)
BAILINGMOE3_MTP = MtpTarget(
    bm.BAILINGMOE3_TARGET,
    replace(GLM4MOE_HEAD, fc=bm.HF_FC, norms=bm.HF_NORMS),
    bm.GGUF_FROM_HF_BAILINGMOE3,
    bm.BOOTSTRAP_BAILINGMOE3,
    config_json=tuple(bm.CONFIG_JSON.items()),
)
# the head's weights: rng [seed, MTP_STREAM], apart from the pair's (seed), DFlash2's ([seed, 2])
# and EAGLE3's ([seed, 3]); the target's (hf_targets._seeded on seed) stay the qwen35 family's
MTP_STREAM = 4
VARIANT_FILE = "VARIANT"
# The trained variant's target: the family's, every trunk layer writing TRUNK_GAIN of what it wrote
# to the residual stream (its mixer's and its FFN's output projections). At full gain the random
# Qwen3.5 is chaotic, its next token a function of the whole context (seed 0: a token's most
# frequent greedy successor follows it 9% of the time), and a trained one-layer head predicts
# 2.5% of held-out tokens; at 0.05 the embedding leads (90%), the faint layers keep some context,
# and the trained head accepts about 2 of 3 drafts (training.mtp)
TRUNK_GAIN = 0.05
TRUNK_WRITES = ("linear_attn.out_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight")


@dataclass(frozen=True)
class MtpVariant:
    """One MTP fixture: the same checkpoint, converted with the head inside the target or apart."""

    name: str
    doc: str
    has_separate_head: bool  # target.gguf converted --no-mtp, draft.gguf the --mtp head alone
    is_trained: bool = False  # the faint-trunk target and its trained head (training.mtp), with prompts.txt
    target: MtpTarget = QWEN35_MTP  # the target family and its head

    @property
    def arch(self) -> str:
        """llama.cpp's architecture of the converted GGUFs."""
        return self.target.family.name

    @property
    def gguf_from_hf(self) -> dict[str, str]:
        """The head's tensors: HF name -> the GGUF tensor the converter writes it into."""
        return self.target.gguf_from_hf


_VARIANTS = (
    MtpVariant(
        "mtp",
        "Qwen3.5 target with its MTP head inside target.gguf, no draft.gguf (target.gguf is --target and "
        "--model; --spec-type draft-mtp)",
        has_separate_head=False,
    ),
    MtpVariant(
        "mtp-separate",
        "Qwen3.5 target (--no-mtp) and its MTP head alone as draft.gguf (--mtp; --spec-type draft-mtp)",
        has_separate_head=True,
    ),
    MtpVariant(
        "trained-mtp",
        "Qwen3.5 target with a faint trunk and its MTP head trained on its greedy text, inside target.gguf "
        "(as `mtp`): accept rate means something",
        has_separate_head=False,
        is_trained=True,
    ),
    MtpVariant(
        "mtp-qwen35moe",
        f"Qwen3.5-MoE target ({N_EXPERT} experts, top-{N_EXPERT_USED}, a shared expert) with its MTP head, an MoE "
        "layer, inside target.gguf (as `mtp`; llama.cpp's qwen35moe)",
        has_separate_head=False,
        target=QWEN35MOE_MTP,
    ),
    MtpVariant(
        "mtp-glm4moe",
        f"GLM-4.5 target (attention biases, a dense first layer, {N_EXPERT} experts top-{N_EXPERT_USED} by sigmoid "
        "+ a choice bias, a shared expert) with its MTP head, an MoE layer, inside target.gguf (as `mtp`; "
        "llama.cpp's glm4moe)",
        has_separate_head=False,
        target=GLM4MOE_MTP,
    ),
    MtpVariant(
        "mtp-mimo2",
        "MiMo-V2-Flash target (sliding-window layers with sinks, narrower value heads, a value scale, sigmoid-routed "
        "experts) with one MTP head, a sliding-window layer with fused q/k/v and a dense FFN handed the trunk's "
        "output before the final norm, inside target.gguf (as `mtp`; llama.cpp's mimo2)",
        has_separate_head=False,
        target=MIMO2_MTP,
    ),
    MtpVariant("mtp-deepseek2", ds.DEEPSEEK2_DOC, has_separate_head=False, target=DEEPSEEK2_MTP),
    MtpVariant("mtp-deepseek32", ds.DEEPSEEK32_DOC, has_separate_head=False, target=DEEPSEEK32_MTP),
    MtpVariant("mtp-glm-dsa", ds.GLM_DSA_DOC, has_separate_head=False, target=GLM_DSA_MTP),
    MtpVariant(
        "mtp-qwen3next",
        f"Qwen3-Next target (gated delta-net, gated attention, {N_EXPERT} experts top-{N_EXPERT_USED} and a gated "
        "shared expert) with its MTP head, an MoE layer, inside target.gguf (as `mtp`; llama.cpp's qwen3next)",
        has_separate_head=False,
        target=QWEN3NEXT_MTP,
    ),
    MtpVariant("mtp-nemotron-h-moe", nh.NEMOTRON_H_MOE_DOC, has_separate_head=False, target=NEMOTRON_H_MOE_MTP),
    MtpVariant("mtp-hy-v3", hy.HY_V3_DOC, has_separate_head=False, target=HY_V3_MTP),
    MtpVariant("mtp-cohere2moe", cm.COHERE2MOE_DOC, has_separate_head=False, target=COHERE2MOE_MTP),
    MtpVariant("mtp-bailingmoe3", bm.BAILINGMOE3_DOC, has_separate_head=False, target=BAILINGMOE3_MTP),
)
MTP_SETTINGS: dict[str, MtpVariant] = {v.name: v for v in _VARIANTS}
MTP_VARIANTS: dict[str, str] = {v.name: v.doc for v in _VARIANTS}


def checked_mtp_variant(name: str) -> MtpVariant:
    """`name`'s settings, else an InputError listing the known variants."""
    if name not in MTP_SETTINGS:
        raise InputError(f"--variant {name!r}: no such MTP fixture variant; choose one of {', '.join(MTP_VARIANTS)}")
    return MTP_SETTINGS[name]


def write_mtp_fixture(outdir: str | Path, variant: str = "mtp", seed: int = 0) -> Path:
    """Write `variant`'s fixture into `outdir`: the qwen35 family's target of `seed` (the MoE
    variant: MOE_TARGET's) with an MTP head of `seed` in `target-hf/` (a trained variant: its
    faint-trunk target and the head trained on it, and `prompts.txt`), and the pinned converter's
    GGUFs of it; return `outdir`. An earlier fixture's `draft.gguf` is removed where the variant
    has none (the head inside target.gguf), and its `prompts.txt` where the variant is untrained."""
    v = checked_mtp_variant(variant)
    out = check_output_dir(Path(outdir), (), "OUTDIR")
    hf = write_hf_target(out / TARGET_HF, v.target.family, seed)
    nh.write_target_tokenizer(hf, v.target.family)
    if v.is_trained:
        faint_trunk(hf)
    add_mtp_head(hf, seed, v.target)
    if v.is_trained:
        _update_tensors(hf, _trained_head(hf, seed))
        _write_held_out_prompts(out / PROMPTS_FILE, seed, pairs.TINY)
    else:
        (out / PROMPTS_FILE).unlink(missing_ok=True)  # a trained fixture's held-out prompts
    bootstrap = v.target.bootstrap
    convert_checkpoint(hf, out / TARGET_GGUF, bootstrap=bootstrap, no_mtp=v.has_separate_head)
    if v.has_separate_head:
        convert_checkpoint(hf, out / DRAFT_GGUF, bootstrap=bootstrap, mtp_only=True)
    else:
        (out / DRAFT_GGUF).unlink(missing_ok=True)  # another fixture's drafter
    with replaced(out / VARIANT_FILE) as tmp:
        tmp.write_text(f"{v.name}: {v.doc} (converted by {CONVERTER})\n")
    return out


def add_mtp_head(hf: Path, seed: int, mtp: MtpTarget = QWEN35_MTP) -> None:
    """The checkpoint `hf` (`mtp`'s target as write_hf_target saves it) given an MTP head laid out
    as its family ships it: the count (`mtp_num_hidden_layers`, GLM's `num_nextn_predict_layers`)
    and the family's `config_json` keys in its config.json, and `mtp_weights` in its safetensors file."""
    from safetensors.numpy import load_file

    config_path = hf / names.HF_CONFIG
    config = json.loads(config_path.read_text())
    _update_tensors(hf, mtp_weights(config, load_file(str(hf / HF_SAFETENSORS)), seed, mtp))
    if mtp.head.n_mtp_key is None:  # MiMo's config.json does not count its heads
        return
    with replaced(config_path) as tmp:
        written = {**config, **dict(mtp.config_json), mtp.head.n_mtp_key: N_MTP}
        tmp.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")


def faint_trunk(hf: Path) -> None:
    """The checkpoint `hf`'s trunk layers writing TRUNK_GAIN of what they wrote to the residual
    stream: the trained variant's target."""
    from safetensors.numpy import load_file

    held = load_file(str(hf / HF_SAFETENSORS))
    writes = {k for k in held if k.startswith(HF_LAYER_PREFIX) and k.endswith(TRUNK_WRITES)}
    _update_tensors(hf, {k: held[k] * np.float32(TRUNK_GAIN) for k in writes})


def _trained_head(hf: Path, seed: int) -> dict[str, np.ndarray]:
    """The `mtp.*` tensors of `hf`'s head trained on its target (trained once per machine, then cached)."""
    from featdiff.factory.training import mtp  # torch, and a first training, only when asked for

    return mtp.trained_mtp(hf, seed).head


def _update_tensors(hf: Path, tensors: dict[str, np.ndarray]) -> None:
    """The checkpoint's safetensors file with `tensors` added, or in place of those it holds."""
    from safetensors.numpy import load_file, save_file

    held = load_file(str(hf / HF_SAFETENSORS))
    with replaced(hf / HF_SAFETENSORS) as tmp:
        save_file({**held, **tensors}, str(tmp), metadata=SAFETENSORS_META)


def mtp_weights(
    config: dict, target: dict[str, np.ndarray], seed: int, mtp: MtpTarget = QWEN35_MTP
) -> dict[str, np.ndarray]:
    """The MTP head of `seed` for the checkpoint `target` (HF names, HF orientation (out, in)),
    laid out as `mtp.head` says: its decoder layer shaped as `head.block_shapes` says
    (Qwen3.5: as the first full-attention layer; in an MoE target its router, experts and shared
    expert too, and GLM's router bias; MiMo-V2: a sliding layer's attention, fused, and a dense
    FFN), the fc from [embedding, hidden] to n_embd, and its norms;
    matrices N(0, 1/n_in), vectors 1 + N(0, 0.1), each draw times the family's gain, as
    hf_targets._seeded draws the target."""
    head, gains = mtp.head, dict(mtp.family.gains)
    n_embd = config["hidden_size"]
    shapes = head.block_shapes(config, target, head.layer)
    shapes |= {head.fc: (n_embd, 2 * n_embd)} | dict.fromkeys(head.norms, (n_embd,))  # fc: (n_embd, 2 n_embd)
    rng = np.random.default_rng([seed, MTP_STREAM])
    drawn = {k: _linear(rng, *s) if len(s) == 2 else _norm(rng, s[0]) for k, s in sorted(shapes.items())}
    return {k: _gained(a, gain_of(k, gains)) for k, a in drawn.items()}


def _gained(a: np.ndarray, gain: float) -> np.ndarray:
    """A draw of pairs._linear or pairs._norm made `gain` times as wide: a matrix scaled, a vector's
    spread around 1 scaled (unchanged at gain 1)."""
    if gain == 1.0:
        return a
    return (a * gain if a.ndim == 2 else 1.0 + gain * (a - 1.0)).astype(np.float32)
