"""What the reference models of an EAGLE3 drafter: the `eagle3.*` keys and the tensors the pinned
llama.cpp's eagle3 loader and graphs read (`src/models/eagle3.cpp`, llama_model_base::load_hparams),
one table, as featdiff.kinds.dflash.modelled is for the `dflash` graph. The reference (torchref/eagle3/graph.py)
refuses a GGUF carrying anything else, lint lists it (featdiff.kinds.eagle3_checks, severity unmodelled), and
a capture records it in the manifest (`ModelInfo.unmodelled`) for compare to name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from featdiff.core import names

# EAGLE3's graphs (upstream src/models/eagle3.cpp): the encoder's input is named `inp_embd` as the
# decoder's token rows are; compare tells them apart by the eval's call (names.CALL_ENCODE)
EAGLE3_WIRING: tuple[str, ...] = (
    names.INP_TARGET_FEATURES,  # the reference's name of the encoder's input
    names.ENC_INP_EMBD,  # the encoder's features; the decoder's token rows
    names.EAGLE3_ENC_INPUT_NORM,  # only with eagle3.norm_before_fc
    names.EAGLE3_FC_OUT,
    # not inp_g_embeddings: the decoder's input itself (read by g_norm's norm and an add; a capture
    # records it with --filter since issue 42), which g_norm-0 and ffn_inp-0 carry: as a wiring name
    # it would make every capture before that a missing_tensor
    "embd_norm-*",
    "g_norm-*",
    "concat_embd-*",
    "ffn_inp-*",
    "eagle3_prenorm-*",
    names.RESULT_NORM,
    names.RESULT_OUTPUT,
    names.DRAFT_LOGITS,
)

T_ATTN_NORM_2 = "attn_norm_2"  # blk.0.attn_norm_2.weight: HF `hidden_norm`, on g
LAYER_TENSORS = (  # blk.0's, in load_arch_tensors' order
    *("attn_norm", T_ATTN_NORM_2, "attn_q", "attn_k", "attn_v", "attn_output"),
    *("ffn_norm", "ffn_gate", "ffn_up", "ffn_down"),
)
# The `eagle3.*` keys the reference reads as llama.cpp does (llama_model_base::load_hparams, then
# llama_model_eagle3::load_arch_hparams); any other one is refused. The yarn_* keys are left out:
# the llama-family loader may read them, and the reference does not.
MODELLED_KEYS = frozenset(
    f"{names.ARCH_EAGLE3}.{k}"
    for k in (
        "context_length embedding_length block_count feed_forward_length vocab_size attention.head_count "
        "attention.head_count_kv attention.key_length attention.value_length attention.layer_norm_rms_epsilon "
        "rope.freq_base rope.dimension_count rope.scaling.type rope.scaling.factor rope.scale_linear "
        "rope.scaling.attn_factor rope.scaling.original_context_length rope.scaling.finetuned "
        "target_layers target_hidden_size norm_before_residual norm_before_fc"
    ).split()
)
MODELLED_TENSORS = frozenset(
    {
        names.T_TOKEN_EMBD,
        names.T_OUTPUT,
        names.T_OUTPUT_NORM,
        names.T_FC,
        names.T_ENC_NORM,
        names.T_D2T,
        names.T_ROPE_FREQS,
        *(f"{names.GGUF_LAYER_PREFIX.format(il=0)}{k}.weight" for k in LAYER_TENSORS),
    }
)


def unmodelled_eagle3(keys: Iterable[str], tensors: Iterable[str]) -> tuple[str, ...]:
    """The `eagle3.*` keys and the tensors of an EAGLE3 GGUF the reference does not model."""
    prefix = f"{names.ARCH_EAGLE3}."
    return tuple(k for k in keys if k.startswith(prefix) and k not in MODELLED_KEYS) + tuple(
        t for t in tensors if t not in MODELLED_TENSORS
    )


def markdown_section() -> list[str]:
    """EAGLE3's lines of docs/modelled.md (featdiff.kinds.registry.render_markdown joins them)."""
    return [
        "## EAGLE3 drafters (`eagle3` arch)",
        "",
        "From `src/featdiff/kinds/eagle3.py`: the keys and tensors the pinned `src/models/eagle3.cpp` and",
        "its loader read, which the reference computes as they do. Any other `eagle3.*` key or tensor is",
        "refused as above.",
        "",
        "| name | kind |",
        "|---|---|",
        *(f"| `{k}` | key |" for k in sorted(MODELLED_KEYS)),
        *(f"| `{t}` | tensor |" for t in sorted(MODELLED_TENSORS)),
    ]


# --- the HF side: EAGLE3 checkpoints as their trainers write them ---------------------------------
# What a layer id means differs by trainer, and llama.cpp taps layer INPUTS (common/speculative.cpp:
# llama_set_embeddings_layer_inp): the output of layer L is the input of layer L + 1, so a
# checkpoint whose ids mean outputs needs ids + 1 in its GGUF. The pinned converter
# (conversion/llama.py LlamaModel) reads only the top-level `eagle_aux_hidden_state_layer_ids` and
# writes it unshifted; it never reads `eagle_config`, and it cannot map SpecForge's per-slot
# `fc_norm.{0,1,2}.weight` (no gguf name): it refuses such a checkpoint by that tensor's name.
LAYER_IDS_INPUT = "input"
LAYER_IDS_OUTPUT = "output"
LAYER_IDS_MEANINGS = (LAYER_IDS_INPUT, LAYER_IDS_OUTPUT)
HF_EAGLE_CONFIG = "eagle_config"  # SpecForge's nested block
HF_AUX_LAYER_IDS = "eagle_aux_hidden_state_layer_ids"
HF_FC_NORM = "fc_norm"  # SpecForge: true -> one RMSNorm per target slot, fc_norm.{k}.weight
HF_FC_NORM_TENSOR = "fc_norm.{k}.weight"
HF_HIDDEN_NORM = "hidden_norm"  # the layer's norm of g: blk.0.attn_norm_2
HF_INPUT_NORM = "input_norm.weight"  # norm_before_fc: one RMSNorm over the concatenated features
SPECULATORS_MARKERS = ("speculators_model_type", "speculators_config", "transformer_layer_config")
FLAG = "--layer-ids-mean"


@dataclass(frozen=True)
class Trainer:
    """One way an EAGLE3 checkpoint is written: how it is told, where its layer ids are, and
    which tensor of target layer L an id L names there."""

    name: str  # the manifest's `checkpoint.trainer`
    what: str  # who writes it, in words
    ids_at: str  # config.json path of its ids ("" : it states none)
    layer_ids_mean: str  # LAYER_IDS_INPUT or LAYER_IDS_OUTPUT
    why: str  # where its code taps the target


SPECFORGE = Trainer(
    "specforge",
    "SpecForge (sgl-project/SpecForge: midlayer.*, eagle_config)",
    f"{HF_EAGLE_CONFIG}.{HF_AUX_LAYER_IDS}",
    LAYER_IDS_OUTPUT,
    "its HF backend hooks layer L's output, its SGLang backend captures the input of layer L + 1",
)
SPECULATORS = Trainer(
    "speculators",
    "Eagle3Speculator (vLLM speculators: layers.0.*, speculators config)",
    HF_AUX_LAYER_IDS,
    LAYER_IDS_INPUT,
    "vLLM's EAGLE3 collects the input of layer L",
)
EAGLE = Trainer(
    "eagle",
    "EAGLE's own layout (SafeAILab EAGLE: midlayer.*, no ids stated)",
    "",
    LAYER_IDS_INPUT,
    "EAGLE keeps the inputs of layers [2, n // 2, n - 3], the converter's default; SpecForge's default "
    "outputs of [1, n // 2 - 1, n - 4] are the same tensors",
)
CONVERTER = Trainer(
    "converter",
    "ids at the top level beside midlayer.* (where the pinned converter reads them)",
    HF_AUX_LAYER_IDS,
    LAYER_IDS_INPUT,
    "conversion/llama.py writes them unshifted into eagle3.target_layers, which llama.cpp reads as layer inputs",
)
STATED = Trainer("stated", f"the convention stated by {FLAG}", HF_AUX_LAYER_IDS, "", "the user said so")
TRAINERS = (SPECFORGE, SPECULATORS, EAGLE, CONVERTER)

# config.json keys an EAGLE3 HF checkpoint may carry that the reference reads (eagle3_hf.py,
# load_hf._hparams, rope_params.hf_rope) ...
READ_KEYS = frozenset(
    (
        "hidden_size num_hidden_layers num_attention_heads num_key_value_heads head_dim intermediate_size "
        "rms_norm_eps rope_theta rope_scaling rope_parameters partial_rotary_factor max_position_embeddings "
        f"vocab_size draft_vocab_size target_hidden_size norm_before_fc norm_before_residual {HF_FC_NORM} "
        f"{HF_AUX_LAYER_IDS} {HF_EAGLE_CONFIG} transformer_layer_config"
    ).split()
)
# ... keys that change nothing the reference or llama.cpp computes, each with the reason ...
IRRELEVANT_KEYS: dict[str, str] = {
    **names.HF_WRITER_KEYS,
    "architectures": "names the class; the converter tells EAGLE3 by draft_vocab_size and one layer",
    "model_type": "the layer's family; the EAGLE3 layer is llama's whatever it says",
    "tie_word_embeddings": "the drafter's lm_head is its own (draft_vocab_size rows) or the target's",
    "speculators_model_type": "Eagle3Speculator's marker (tells the trainer)",
    "speculators_config": "Eagle3Speculator's proposal settings (draft tokens, verifier name), llama.cpp's flags",
    "speculators_version": "Eagle3Speculator's library version",
    "has_no_defaults_at_init": "Eagle3Speculator's config-class flag",
}
# ... and keys the reference reads only at the value every graph assumes (else: refused by name).
INERT_KEYS: dict[str, object] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "pretraining_tp": 1,
}
# tensors read besides the layer's: HF name -> why (t2d: the converter drops it, llama.cpp never reads it)
READ_TENSORS = ("fc.weight", HF_INPUT_NORM, "embed_tokens.weight", "norm.weight", "lm_head.weight", "d2t")
IRRELEVANT_TENSORS: dict[str, str] = {"t2d": "the target->draft mask; the converter drops it and no graph reads it"}
HF_LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.")  # SpecForge/EAGLE, Eagle3Speculator, plain llama
EAGLE_CONFIG_KEYS = (HF_AUX_LAYER_IDS, HF_FC_NORM, "norm_before_fc", "norm_before_residual")  # read in eagle_config


def eagle3_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """config.json as the reference reads it: Eagle3Speculator's `transformer_layer_config`
    fields over the top level (the converter's merge), `eagle_config` kept nested."""
    nested = raw.get("transformer_layer_config")
    return {**raw, **(nested if isinstance(nested, dict) else {})}


def is_eagle3_config(config: Mapping[str, Any]) -> bool:
    """The converter's test of an EAGLE3 checkpoint: `draft_vocab_size` and one hidden layer."""
    merged = eagle3_config(config)
    return names.HF_DRAFT_VOCAB_SIZE in merged and merged.get(names.HF_NUM_LAYERS) == 1


def trainer_of(config: Mapping[str, Any], tensors: Iterable[str]) -> Trainer | None:
    """The trainer that wrote the checkpoint, from its config (`eagle3_config`'s) and tensor
    names; None where it cannot be told (SpecForge's block without its ids, beside top-level ids)."""
    ec = config.get(HF_EAGLE_CONFIG)
    top = config.get(HF_AUX_LAYER_IDS)
    if isinstance(ec, dict):
        if ec.get(HF_AUX_LAYER_IDS) is not None and top is not None and list(top) != list(ec[HF_AUX_LAYER_IDS]):
            return None  # two id lists: which one the trainer read cannot be told
        if ec.get(HF_AUX_LAYER_IDS) is None and top is not None:
            return None  # SpecForge reads only the nested ids: the top-level ones are someone else's
        return SPECFORGE
    names_ = list(tensors)
    if any(k in config for k in SPECULATORS_MARKERS) or any(t.startswith("layers.0.") for t in names_):
        return SPECULATORS
    return EAGLE if top is None else CONVERTER


def stated_layer_ids(config: Mapping[str, Any], trainer: Trainer) -> list[int] | None:
    """The checkpoint's own layer ids where its trainer keeps them; None: it states none."""
    ec = config.get(HF_EAGLE_CONFIG)
    if trainer is SPECFORGE and isinstance(ec, dict):
        return ec.get(HF_AUX_LAYER_IDS)
    return config.get(HF_AUX_LAYER_IDS) or (ec.get(HF_AUX_LAYER_IDS) if isinstance(ec, dict) else None)


def unread_keys(config: Mapping[str, Any]) -> tuple[str, ...]:
    """config.json keys (nested `eagle_config.*` ones by their path) the reference neither reads
    nor lists as irrelevant, and inert keys at another value (`key = value`)."""
    out = [k for k in config if k not in READ_KEYS and k not in IRRELEVANT_KEYS and k not in INERT_KEYS]
    out += [f"{k} = {config[k]!r}" for k, v in INERT_KEYS.items() if k in config and config[k] != v]
    ec = config.get(HF_EAGLE_CONFIG)
    if isinstance(ec, dict):
        out += [f"{HF_EAGLE_CONFIG}.{k}" for k in ec if k not in EAGLE_CONFIG_KEYS]
    return tuple(out)


def unread_tensors(tensors: Iterable[str], prefix: str) -> tuple[str, ...]:
    """The checkpoint's tensors the reference does not read: not the layer's (`prefix`), not
    READ_TENSORS, fc_norm or an irrelevant one."""
    hf_names = {**names.GGUF_TO_HF_LAYER, T_ATTN_NORM_2: HF_HIDDEN_NORM}
    layer = {f"{prefix}{hf_names[k]}.weight" for k in LAYER_TENSORS}  # no q/k norms: the graph has none
    fc_norm = {HF_FC_NORM_TENSOR.format(k=k) for k in range(3)}
    known = layer | fc_norm | set(READ_TENSORS) | set(IRRELEVANT_TENSORS)
    return tuple(t for t in tensors if t not in known)
