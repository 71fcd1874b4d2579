"""What the reference models of a DFlash drafter: one table of every GGUF key and tensor the pinned
llama.cpp's `dflash` graph or its loader reads (`src/models/dflash.cpp`, `src/llama-model.cpp`
load_hparams, names from `src/llama-arch.cpp`), and of what the pinned converter writes
(`conversion/qwen.py` DFlashModel / DSparkModel), each marked modelled or not.

Consumes a drafter's metadata (GGUF keys and tensor names, or a HF config.json and tensor names);
produces the names it carries that the reference does not compute as llama.cpp does. The reference
refuses those (exit 2), lint lists them, capture records them in the manifest (`ModelInfo.unmodelled`)
and compare names them instead of reporting a wiring fault. It sits below `gguf_reader` because
capture, lint and the reference all read it; its section of docs/modelled.md is rendered from it
(kinds/dflash/modelled_doc.py, joined by featdiff.kinds.registry.render_markdown).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from featdiff.core import names
from featdiff.core.phases import Phase

Kind = Literal["key", "tensor", "file"]
DFLASH_PREFIX = f"{names.ARCH_DFLASH}."
MASK_EMBEDDING_FILE = "mask_embedding.pt"  # a HF drafter's own mask row, which the converter patches in


@dataclass(frozen=True)
class Entry:
    """One key or tensor of a drafter: whether the reference computes it as the pinned graph does.

    `name` is the GGUF key, or the GGUF tensor name (`blk.*.` for every layer); `hf` names the
    config.json fields (dotted under `dflash_config.`) the converter writes it from. `inert` are the
    values at which an unmodelled key changes nothing llama.cpp computes (its default), so a file
    carrying one is not refused.
    """

    name: str
    kind: Kind
    modelled: bool
    how: str
    hf: tuple[str, ...] = ()
    inert: tuple[Any, ...] = ()


def _k(key: str, modelled: bool, how: str, hf: tuple[str, ...] = (), inert: tuple[Any, ...] = ()) -> Entry:
    return Entry(DFLASH_PREFIX + key, "key", modelled, how, hf, inert)


def _t(name: str, modelled: bool, how: str, hf: tuple[str, ...] = ()) -> Entry:
    return Entry(name, "tensor", modelled, how, hf)


_DC = names.HF_DFLASH_CONFIG + "."
KEY_EMBEDDING_SCALE = DFLASH_PREFIX + "embedding_scale"
KEY_ATTN_VALUE_SCALE = DFLASH_PREFIX + "attention.value_scale"
KEY_LOGIT_SCALE = DFLASH_PREFIX + "logit_scale"
KEY_SOFTCAP = DFLASH_PREFIX + "final_logit_softcapping"
KEY_ATTN_SCALE = DFLASH_PREFIX + "attention.scale"
KEY_SLIDING_WINDOW = DFLASH_PREFIX + "attention.sliding_window"
KEY_SLIDING_WINDOW_PATTERN = DFLASH_PREFIX + "attention.sliding_window_pattern"
KEY_ROPE_SECTIONS = DFLASH_PREFIX + "rope.dimension_sections"
HF_EMBEDDING_SCALE = "input_embedding_scale"  # dflash_config's, else the top level's (converter)
HF_VALUE_SCALE = "attention_value_scale"  # dflash_config's
HF_OUTPUT_MULTIPLIER = "output_multiplier"
HF_SOFTCAP = "final_logit_softcapping"
HF_PARTIAL_ROTARY = "partial_rotary_factor"  # the rotated share of the head (the converter's rope_parameters)
HF_ROPE_IS_NEOX = "rope_is_neox_style"  # false: the converter permutes q/k rows into NeoX order
T_FC_SCALE = "fc.scale"
LAYER_ATTN_SINKS = "attn_sinks"  # blk.<il>.attn_sinks.weight, (n_head,) float32
HF_ATTN_SINKS = "self_attn.sinks"  # gpt-oss's name, which the converter maps (it appends `.weight`)
HF_FC_SCALE = "fc.weight_scale_2"  # ModelOpt's per-tensor scale, written as fc.scale (conversion/base.py)

# In the order llama.cpp reads them: load_hparams, then llama_model_dflash::load_arch_hparams,
# then the graph's gguf_kv lookups; the converter-only keys last.
TABLE: tuple[Entry, ...] = (
    _k("context_length", True, "the positions the flow may reach (check_rounds_fit)", ("max_position_embeddings",)),
    _k("embedding_length", True, "n_embd", ("hidden_size",)),
    _k("block_count", True, "n_layer", ("num_hidden_layers",)),
    _k("feed_forward_length", True, "n_ff", ("intermediate_size",)),
    _k("attention.head_count", True, "n_head", ("num_attention_heads",)),
    _k("attention.head_count_kv", True, "n_head_kv (GQA)", ("num_key_value_heads",)),
    _k("attention.key_length", True, "n_embd_head", ("head_dim",)),
    _k("attention.value_length", True, "equal to key_length, as the dflash graph asserts", ("head_dim",)),
    _k("attention.causal", True, "block rows attend causally (default: non-causal)", ("is_causal", _DC + "causal")),
    _k("rope.freq_base", True, "RoPE base", ("rope_theta",)),
    _k(
        "rope.dimension_count",
        True,
        "partial rotary: the first n_rot dims rotate, the rest pass through",
        (HF_PARTIAL_ROTARY,),
    ),
    _k("rope.scaling.type", True, "none / linear / yarn (others refused by rope_params)", ("rope_scaling",)),
    _k("rope.scaling.factor", True, "freq_scale = 1 / factor", ("rope_scaling.factor",)),
    _k("rope.scale_linear", True, "the factor's older key", ()),
    _k("rope.scaling.attn_factor", True, "multiplies cos and sin", ()),
    _k("rope.scaling.original_context_length", True, "YaRN's correction dims", ()),
    _k("rope.scaling.finetuned", True, "read, never computed with", (), ()),
    *(
        _k(
            f"rope.scaling.{k}",
            True,
            "not read by the dflash loader: llama.cpp keeps its default, as the reference does",
        )
        for k in ("yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow")
    ),
    _k("vocab_size", True, "not read: the vocabulary is the token list's", ("vocab_size",)),
    _k("attention.layer_norm_rms_epsilon", True, "every RMS norm's eps", ("rms_norm_eps",)),
    _k(
        "embedding_scale",
        True,
        "inp_noise_embd = token rows x scale (0: none), as ggml_scale after get_rows",
        (_DC + HF_EMBEDDING_SCALE, HF_EMBEDDING_SCALE),
    ),
    _k(
        "attention.value_scale",
        True,
        "each layer's attention output (after wo) x scale before the residual (0: none)",
        (_DC + HF_VALUE_SCALE,),
    ),
    _k(
        "logit_scale",
        True,
        "applied by the graph to DFlash2's selector logits only: result_output of DFlash/DSpark is unscaled",
        (_DC + HF_OUTPUT_MULTIPLIER, HF_OUTPUT_MULTIPLIER),
    ),
    _k(
        "final_logit_softcapping",
        True,
        "as logit_scale: DFlash2's selector only, result_output of DFlash/DSpark is uncapped",
        (_DC + HF_SOFTCAP, HF_SOFTCAP),
    ),
    _k("attention.scale", False, "replaces the 1/sqrt(n_embd_head) attention scale", (), (0.0,)),
    _k("hidden_activation", False, "gelu FFN (silu is the default and modelled)", (), ("silu",)),
    _k(
        "rope.dimension_sections",
        True,
        "M-RoPE through ggml_rope_multi: the degenerate sections [s, 0, 0, 0] the converter writes for "
        "an M-RoPE target's drafter put every rotated pair in the text position's section, as NeoX RoPE "
        "(degenerate_sections); any other sections are refused by the loader",
        ("target's rope_scaling.mrope_section",),
    ),
    _k("block_size", True, "the draft block's rows", (_DC + "block_size", "block_size")),
    _k("target_layers", True, "the tapped target layers (hf + 1)", (_DC + "target_layer_ids",)),
    _k(
        "conv_kernel_size",
        True,
        "DFlash2's local conv: taps over the block's earlier rows",
        (_DC + "conv_kernel_size",),
    ),
    _k("conv_group_size", True, "DFlash2's local conv: channels sharing a dynamic tap", (_DC + "conv_group_size",)),
    _k("selector_rank", True, "DFlash2's candidate selector: the codebooks' width", (_DC + "selector_rank",)),
    _k(
        "selector_top_k",
        True,
        "DFlash2's candidate selector: candidates per row of dflash2_lattice, walked as the driver does",
        (_DC + "selector_top_k",),
    ),
    _k("hyper_connection.count", False, "the DeepSeek-V4 DSpark graph (graph_dsv4)", (), (0,)),
    _k(
        "attention.sliding_window",
        True,
        "interleaved sliding-window attention: a SWA layer's query at p1 sees no key at p0 with p1 - p0 >= "
        "window (LLAMA_SWA_TYPE_STANDARD); keys ahead, the rest of the non-causal block, stay visible",
        (_DC + "swa_window_size", "sliding_window", _DC + "use_swa", "use_sliding_window"),
        (0,),
    ),
    _k(
        "attention.sliding_window_pattern",
        True,
        "which layers slide: one bool per layer, required with a window",
        ("layer_types", _DC + "use_swa"),
    ),
    _k("attention.key_length_swa", False, "SWA layers' head size", ()),
    _k("attention.value_length_swa", False, "SWA layers' head size", ()),
    _k("rope.dimension_count_swa", False, "SWA layers' rotated dims", ()),
    _k("sample_from_anchor", True, "DSpark's first draft row (anchor-first or bonus anchor)", ("sample_from_anchor",)),
    _k("has_confidence_head", True, "checked against conf_proj (lint)", ()),
    _k(
        "log_snr_conditioning", True, "GIDD log-SNR term (the fork's graph; docs/records.md)", (_DC + names.HF_LOG_SNR,)
    ),
    _k("min_log_snr", True, "the mask rows' level", (_DC + names.HF_MIN_LOG_SNR,)),
    _k("max_log_snr", True, "the anchor rows' level", (_DC + names.HF_MAX_LOG_SNR,)),
    # tensors: load_arch_tensors, then the generic `.scale` pass of llama_model_base::load_tensors
    _t(names.T_TOKEN_EMBD, True, "the noise embeddings (else the target's)", ("embed_tokens.weight",)),
    _t(names.T_D2T, True, "reduced head rows scattered to absolute target ids", ("d2t",)),
    _t(names.T_MARKOV_W1, True, "DSpark Markov head", (names.HF_MARKOV_W1,)),
    _t(names.T_MARKOV_W2, True, "DSpark Markov head", (names.HF_MARKOV_W2,)),
    _t(names.T_MARKOV_W2_SCALE, True, "DSpark Markov head scale", (names.HF_MARKOV_W2_SCALE,)),
    _t(names.T_CONF_PROJ_W, True, "DSpark confidence head", (names.HF_CONF_PROJ_W,)),
    _t(names.T_CONF_PROJ_B, True, "DSpark confidence head", (names.HF_CONF_PROJ_B,)),
    _t(
        "selector_predecessor.weight",
        True,
        "DFlash2 selector codebook of the previous row's candidate",
        ("candidate_selector.predecessor_codebook",),
    ),
    _t(
        "selector_successor.weight",
        True,
        "DFlash2 selector codebook of the row's candidate",
        ("candidate_selector.successor_codebook",),
    ),
    _t(
        "selector_hidden.weight",
        True,
        "DFlash2 selector gate on result_norm",
        ("candidate_selector.hidden_projection.weight",),
    ),
    _t(names.T_FC, True, "the feature fusion", (names.HF_FC,)),
    _t(T_FC_SCALE, True, "multiplies fc's product before the encoder norm (build_lora_mm's w_s)", (HF_FC_SCALE,)),
    _t(names.T_ENC_NORM, True, "the encoder norm (inp_g_embeddings)", (names.HF_HIDDEN_NORM,)),
    _t(names.T_OUTPUT_NORM, True, "the final norm (result_norm)", (names.HF_NORM,)),
    _t(names.T_OUTPUT, True, "the head (else the drafter's token_embd, else the target's)", (names.HF_LM_HEAD,)),
    _t("output.scale", False, "multiplies the head's product (per-tensor weight scale)"),
    *(
        _t(f"blk.*.{k}.weight", True, f"layer tensor {k}", (f"layers.*.{hf}.weight",))
        for k, hf in names.GGUF_TO_HF_LAYER.items()
    ),
    *(
        _t(f"blk.*.{k}.scale", False, f"multiplies {k}'s product (per-tensor weight scale)")
        for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    ),
    _t("blk.*.post_attention_norm.weight", False, "RMS norm of the attention output before the residual"),
    _t("blk.*.post_ffw_norm.weight", False, "RMS norm of the FFN output before the residual"),
    _t("blk.*.layer_output_scale.weight", False, "multiplies l_out"),
    _t(names.T_ROPE_FREQS, True, "llama3 per-pair frequency factors"),
    _t(
        f"blk.*.{LAYER_ATTN_SINKS}.weight",
        True,
        "per-head sink logit: one more softmax term with no value row, folded into flash attention's running "
        "max and sum after the cells (ggml_flash_attn_ext_add_sinks)",
        (f"layers.*.{HF_ATTN_SINKS}",),
    ),
    _t(
        "blk.*.attn_conv_base",
        True,
        "DFlash2's static conv kernel around attention",
        ("layers.*.attention_conv.base_kernel",),
    ),
    _t(
        "blk.*.attn_conv_proj.weight",
        True,
        "DFlash2's per-token conv kernel around attention, from noise_norm",
        ("layers.*.attention_conv.kernel_projection.weight",),
    ),
    _t("blk.*.ffn_conv_base", True, "DFlash2's static conv kernel around the FFN", ("layers.*.mlp_conv.base_kernel",)),
    _t(
        "blk.*.ffn_conv_proj.weight",
        True,
        "DFlash2's per-token conv kernel around the FFN, from ffn_norm",
        ("layers.*.mlp_conv.kernel_projection.weight",),
    ),
    *(_t(n, True, "GIDD log-SNR MLP", (n,)) for n in names.LOG_SNR_TENSORS),
    Entry(
        MASK_EMBEDDING_FILE,
        "file",
        True,
        "the converter writes this vector into token_embd's mask row (the drafter's own table, else a copy "
        "of the target's, with the target's head as output): the reference's noise embedding reads it there",
        (MASK_EMBEDDING_FILE,),
    ),
    Entry(
        HF_ROPE_IS_NEOX,
        "key",
        True,
        "false: interleaved-RoPE checkpoint, whose q/k rows (and q/k norms) the converter permutes per head "
        "into NeoX order, as the reference does (HF directory only; with partial rotary refused)",
        (HF_ROPE_IS_NEOX,),
        (True,),
    ),
)
_BY_NAME = {e.name: e for e in TABLE}
# Where the pinned graph (src/models/dflash.cpp) first reads an entry the reference does not
# model: (phase, record) of the first drafter record whose value depends on it. compare judges
# no drafter record from there on (docs/findings.md, `unmodelled`). An entry not listed here, or a
# name the table lacks, is first read by fc (FIRST_USE_UNKNOWN): every record the drafter computes.
Use = tuple[str, str]
FIRST_USE_UNKNOWN: Use = (Phase.INJECT, names.INP_G_EMBEDDINGS)
_ATTENTION: Use = (Phase.DRAFT, names.layer_name(names.KQV_OUT, 0))  # the draft block's first attention
_FFN: Use = (Phase.DRAFT, names.layer_name(names.FFN_OUT, 0))
_CONV: Use = (Phase.DRAFT, names.layer_name(names.QCUR, 0))  # DFlash2's conv reads noise_norm, feeds wq
_SELECTOR: Use = (Phase.DRAFT, "dflash2_lattice")  # after result_output: the selector's own node
_FIRST_USE: dict[str, Use] = {
    "fc.scale": (Phase.INJECT, names.INP_G_EMBEDDINGS),
    KEY_ATTN_SCALE: _ATTENTION,
    KEY_SLIDING_WINDOW: _ATTENTION,
    KEY_SLIDING_WINDOW_PATTERN: _ATTENTION,
    DFLASH_PREFIX + "hidden_activation": _FFN,
    KEY_ROPE_SECTIONS: (Phase.INJECT, names.layer_name(names.KCUR_INJECTED, 0)),
    "blk.*.attn_q.scale": (Phase.DRAFT, names.layer_name(names.QCUR, 0)),
    "blk.*.attn_k.scale": (Phase.INJECT, names.layer_name(names.KCUR_INJECTED, 0)),
    "blk.*.attn_v.scale": (Phase.INJECT, names.layer_name(names.VCUR_INJECTED, 0)),
    "blk.*.attn_output.scale": (Phase.DRAFT, names.layer_name(names.FFN_INP, 0)),
    **{f"blk.*.{k}.scale": _FFN for k in ("ffn_gate", "ffn_up", "ffn_down")},
    "blk.*.post_attention_norm.weight": (Phase.DRAFT, names.layer_name(names.FFN_INP, 0)),
    "blk.*.post_ffw_norm.weight": (Phase.DRAFT, names.layer_name(names.L_OUT, 0)),
    "blk.*.layer_output_scale.weight": (Phase.DRAFT, names.layer_name(names.L_OUT, 0)),
    "output.scale": (Phase.DRAFT, names.RESULT_OUTPUT),
    MASK_EMBEDDING_FILE: (Phase.DRAFT, names.INP_NOISE_EMBD),
    **{DFLASH_PREFIX + k: _CONV for k in ("conv_kernel_size", "conv_group_size")},
    **{
        f"blk.*.{k}": _CONV
        for k in ("attn_conv_base", "attn_conv_proj.weight", "ffn_conv_base", "ffn_conv_proj.weight")
    },
    **{DFLASH_PREFIX + k: _SELECTOR for k in ("selector_rank", "selector_top_k")},
    **{f"selector_{k}.weight": _SELECTOR for k in ("predecessor", "successor", "hidden")},
}

# HF drafter tensors the reference reads that no GGUF tensor entry names (the converter drops t2d)
_HF_IGNORED = ("t2d",)


# Strict loading of a DFlash (DSpark, DFlash2) HF drafter's top-level config.json keys (issue 47):
# a key is read (by the converter: TABLE's fields, or by torchref/load_hf.py: HF_READ_KEYS), listed
# here as irrelevant with the reason, or accepted only at the value every graph assumes
# (HF_INERT_KEYS); any other is refused by name (exit 2), never silently left out.
HF_READ_KEYS = frozenset(
    (
        "hidden_size num_hidden_layers num_attention_heads num_key_value_heads head_dim intermediate_size "
        "vocab_size rms_norm_eps rope_theta rope_scaling rope_parameters partial_rotary_factor "
        "max_position_embeddings dflash_config block_size is_causal architectures mask_token_id target_layer_ids "
        "aux_hidden_state_layer_ids transformer_layer_config sample_from_anchor markov_head_type draft_vocab_size "
        f"{HF_ROPE_IS_NEOX} use_sliding_window sliding_window layer_types"
    ).split()
)  # load_hf._hparams, rope_params.hf_rope, load_hf.converter_config (DSpark's schemas), _dspark, _d2t
HF_IRRELEVANT_KEYS: dict[str, str] = {
    **names.HF_WRITER_KEYS,
    "model_type": "the stack's family; the converter picks DFlashModel/DSparkModel by architectures, one dflash graph",
    "num_target_layers": "the target's depth, which the target's own checkpoint states; target_layer_ids name the taps",
    "target_hidden_size": "the target's width; fc.weight's columns (slots x width) carry it, checked against the target",
    "max_window_layers": "transformers derives layer_types from it; the converter reads layer_types",
    "auto_map": "transformers' remote-code class names",
}
HF_INERT_KEYS: dict[str, object] = {
    "hidden_act": "silu",  # dflash.hidden_activation: another is refused on the GGUF side too
    "attention_bias": False,  # the dflash graph has no q/k/v/o biases
    "mlp_bias": False,
    "tie_word_embeddings": False,  # the head is lm_head, else the drafter's or the target's table (load_hf)
    "pretraining_tp": 1,
}


def unread_hf_keys(config: Mapping[str, Any]) -> tuple[str, ...]:
    """A DFlash drafter's top-level config.json keys (as the converter reads it: DSpark's
    `transformer_layer_config` merged, load_hf.converter_config) that neither the converter nor the
    reference reads nor HF_IRRELEVANT_KEYS lists, and HF_INERT_KEYS at another value (`key = value`)."""
    table = {
        h.split(".", 1)[0] for e in TABLE if e.kind == "key" for h in e.hf if not h.startswith(_DC) and " " not in h
    }
    known = table | HF_READ_KEYS | HF_IRRELEVANT_KEYS.keys() | HF_INERT_KEYS.keys()
    out = [k for k in config if k not in known]
    return (*out, *(f"{k} = {config[k]!r}" for k, v in HF_INERT_KEYS.items() if k in config and config[k] != v))


def degenerate_sections(n_embd_head: int) -> tuple[int, int, int, int]:
    """The M-RoPE sections the converter writes for an M-RoPE target's drafter (conversion/qwen.py
    DFlashModel: `[head_dim // 2, 0, 0, 0]`)."""
    return (n_embd_head // 2, 0, 0, 0)


def sections_modelled(sections: Iterable[int]) -> bool:
    """Whether `dflash.rope.dimension_sections` computes as NeoX RoPE: no sections at all, or only
    the first (ggml_rope_multi puts rotated pair i in section (i mod s0) < s0, the text position's)."""
    s = tuple(int(x) for x in sections)
    return len(s) == 4 and not any(s[1:])


def entry(name: str) -> Entry:
    """The table's entry of a GGUF key or tensor name (a layer's tensor matches its `blk.*.` row)."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    return next(e for e in TABLE if e.kind == "tensor" and fnmatch.fnmatchcase(name, e.name))


def first_use(name: str) -> Use:
    """(phase, record) where the drafter graph first reads the unmodelled `name` (a manifest's
    `models.draft.unmodelled` entry): FIRST_USE_UNKNOWN when the table does not say."""
    e = _matching(name)
    return _FIRST_USE.get(e.name if e is not None else name, FIRST_USE_UNKNOWN)


def still_unmodelled(found: Iterable[str]) -> tuple[str, ...]:
    """The names of a manifest's `unmodelled` list this featdiff still does not model (a dump
    written before a feature was modelled names it; the reference computes it now)."""
    return tuple(n for n in found if (e := _matching(n)) is None or not e.modelled or n in _BY_VALUE)


def _matching(name: str) -> Entry | None:
    if name in _BY_NAME:
        return _BY_NAME[name]
    return next((e for e in TABLE if e.kind == "tensor" and fnmatch.fnmatchcase(name, e.name)), None)


def _inert(e: Entry, value: Any) -> bool:
    v = tuple(value) if isinstance(value, list) else value
    return any(v == x for x in e.inert)


# Modelled keys modelled at some values only: key -> whether a value is (a manifest's list names
# the key without its value, so still_unmodelled keeps these)
_BY_VALUE = {KEY_ROPE_SECTIONS: sections_modelled}


def unmodelled_in(keys: Mapping[str, Any], tensors: Iterable[str]) -> tuple[str, ...]:
    """The `dflash.*` keys and tensors of a drafter GGUF the reference does not model, each once
    (a layer's tensor as its `blk.*.` table name); a name the table lacks counts as unmodelled."""
    out: list[str] = []
    for key, value in keys.items():
        if not key.startswith(DFLASH_PREFIX):
            continue
        e = _matching(key)
        at_value = _BY_VALUE.get(key)
        if e is None or (not e.modelled and not _inert(e, value)) or (at_value is not None and not at_value(value)):
            out.append(key)
    for name in tensors:
        e = _matching(name)
        label = name if e is None else e.name
        if (e is None or not e.modelled) and label not in out:
            out.append(label)
    return tuple(out)


def converter_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """The table's `dflash.*` keys the pinned converter writes from a drafter's config.json
    (conversion/qwen.py DFlashModel.set_gguf_parameters), those the reference reads or refuses."""
    dc = config.get(names.HF_DFLASH_CONFIG) or {}
    out: dict[str, Any] = {}
    if (v := dc.get(HF_VALUE_SCALE)) is not None:
        out[KEY_ATTN_VALUE_SCALE] = float(v)
    for key, field in ((KEY_LOGIT_SCALE, HF_OUTPUT_MULTIPLIER), (KEY_EMBEDDING_SCALE, HF_EMBEDDING_SCALE)):
        if (v := dc.get(field, config.get(field))) is not None:
            out[key] = float(v)
    softcap = dc.get(HF_SOFTCAP, config.get(HF_SOFTCAP))
    if softcap is not None and float(softcap) > 0:
        out[KEY_SOFTCAP] = float(softcap)
    for field in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if "conv_kernel_size" in dc and field in dc:
            out[DFLASH_PREFIX + field] = int(dc[field])
    use_swa = config.get("use_sliding_window", False) or dc.get("use_swa", False)
    window = dc.get("swa_window_size") or config.get("sliding_window")
    if use_swa and window:
        out[KEY_SLIDING_WINDOW] = int(window)
        layer_types = config.get("layer_types") or []
        n_layer = int(config.get(names.HF_NUM_LAYERS, 0))
        out[KEY_SLIDING_WINDOW_PATTERN] = (
            [True] * n_layer if dc.get("use_swa", False) else [t == "sliding_attention" for t in layer_types]
        )
    return out


def unmodelled_in_hf(config: Mapping[str, Any], tensors: Iterable[str], files: Iterable[str]) -> tuple[str, ...]:
    """What a HF drafter directory carries that the reference does not model: the GGUF keys the
    converter would write from it (named with their config field), its tensors no modelled entry
    reads, and `mask_embedding.pt`."""
    out = [f"{key} (config.json {_hf_field(key, config)})" for key in unmodelled_in(converter_keys(config), ())]
    hf_modelled = [h for e in TABLE if e.modelled and e.kind == "tensor" for h in e.hf]
    for name in tensors:
        if name in _HF_IGNORED or any(fnmatch.fnmatchcase(name, h) for h in hf_modelled):
            continue
        if name not in out:
            out.append(name)
    out += [f for f in files if (e := _BY_NAME.get(f)) is not None and e.kind == "file" and not e.modelled]
    return tuple(out)


def _hf_field(key: str, config: Mapping[str, Any]) -> str:
    """The config.json field `key` was written from: the first of the entry's that is set."""
    dc = config.get(names.HF_DFLASH_CONFIG) or {}
    for field in _BY_NAME[key].hf:
        where, _, leaf = field.rpartition(".")
        if (dc if where else config).get(leaf) is not None:
            return field
    return _BY_NAME[key].hf[0] if _BY_NAME[key].hf else key


def supported_line() -> str:
    """One line: the `dflash.*` features beyond the base graph that the reference models."""
    extra = (KEY_EMBEDDING_SCALE, KEY_ATTN_VALUE_SCALE, KEY_LOGIT_SCALE, KEY_SOFTCAP)
    return (
        "featdiff models "
        + ", ".join(extra)
        + ", dflash.attention.causal, sliding-window attention, attention sinks, fc.scale, partial rotary,"
        + " RoPE scaling, interleaved-RoPE checkpoints, DSpark heads, DFlash2, d2t and log-SNR"
        + " (docs/modelled.md)"
    )


def refusal(path: str, found: tuple[str, ...]) -> str:
    """The one-line InputError message for a drafter carrying unmodelled features."""
    return (
        f"{path}: carries {', '.join(found)}, which llama.cpp computes and featdiff's reference does not "
        f"model; a comparison would blame the wiring for it. {supported_line()}; compare a drafter "
        "without it, or add it to featdiff (src/featdiff/kinds/dflash/modelled.py)"
    )
