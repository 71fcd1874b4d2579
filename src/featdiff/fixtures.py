"""Tiny seeded models: a target (qwen3 or llama) and a DFlash (or DSpark) drafter, as GGUF and as
Hugging Face directories, with one wiring bug planted per variant.

A variant directory holds `target.gguf` and `draft.gguf` (what the run loads) and `target-hf/`,
`draft-hf/` (the trained checkpoint, always correct: the reference reads these). The `trained*`
variants hold a drafter actually trained on its target (featdiff.training, cached), and
`prompts.txt`: held-out prompts for `featdiff probe`. The pairs themselves (dimensions, variants,
random weights) are `featdiff.pairs`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter
from safetensors import safe_open
from safetensors.numpy import save_file

from featdiff import names
from featdiff.errors import InputError
from featdiff.gguf_rewrite import rewrite_gguf
from featdiff.outputs import check_output_dir, replaced
from featdiff.pairs import (
    BLOCK_SIZE,
    HF_TARGET_LAYER_IDS,
    MAX_LOG_SNR,
    MIN_LOG_SNR,
    N_POS_TRAIN,
    RMS_EPS,
    ROPE_BASE,
    ROPE_SCALINGS,
    TINY,
    VARIANTS,
    Shape,
    Sizes,
    Variant,
    draft_weights,
    target_weights,
)
from featdiff.torchref.rope_params import llama3_freq_factors

PROMPTS_FILE = "prompts.txt"  # a trained variant's held-out prompts, in `featdiff probe --prompts` format
HELD_OUT_PROMPTS = 8


# The GGUFs' tokenizer: llama.cpp's "test" vocabulary (a rolling hash of the text, any text
# tokenizes; the pinned tree has it), or a SentencePiece one whose byte tokens cover any text, for
# older llama.cpp builds, which lack "test". Token ids keep their meaning for the weights either way.
VOCAB_TEST, VOCAB_SPM = "test", "llama"
VOCABS = (VOCAB_TEST, VOCAB_SPM)
SPM_SPECIAL = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: unk, bos, eos
N_BYTES = 256
# llama.h's token types
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_BYTE = 1, 2, 3, 6


def checked_variant(name: str) -> str:
    """`name` if it is a known variant, else an InputError listing the known ones."""
    if name not in VARIANTS:
        raise InputError(f"--variant {name!r}: no such fixture variant; choose one of {', '.join(VARIANTS)}")
    return name


def describe_variants() -> str:
    """One line per variant: name and the bug it plants."""
    return "\n".join(f"{v.name:22s} {v.doc}" for v in VARIANTS.values())


def write_fixture(
    outdir: str | Path, variant: str = "clean", seed: int = 0, sizes: Sizes | None = None, vocab: str = VOCAB_TEST
) -> Path:
    """Write one variant's GGUFs and HF directories into `outdir`; return `outdir`.

    `sizes` defaults to TINY, or to `training.TRAINED_SIZES` for the trained variants. `vocab`
    names the GGUFs' tokenizer (VOCABS): the weights and token ids are the same either way.
    """
    if vocab not in VOCABS:
        raise InputError(f"vocab {vocab!r}: choose one of {', '.join(VOCABS)}")
    v = VARIANTS[variant]
    out = check_output_dir(Path(outdir), (), "OUTDIR")
    out.mkdir(parents=True, exist_ok=True)
    sizes, target, draft = (_trained_weights if v.is_trained else _random_weights)(v, seed, sizes)
    with replaced(out / "target.gguf") as tmp:
        _write_target_gguf(tmp, target, v.target_arch, sizes, v.rope, vocab)
    _write_target_hf(out / "target-hf", target, v.target_arch, sizes, v.rope)
    _write_draft_hf(out / "draft-hf", draft, v, sizes)
    with replaced(out / "draft.gguf") as tmp:
        _write_draft_gguf(tmp, _gguf_view(draft, v, sizes), v, sizes, _dspark_keys(draft, v), vocab)
    if v.is_trained:
        with replaced(out / PROMPTS_FILE) as tmp:
            _write_held_out_prompts(tmp, seed, sizes)
    with replaced(out / "VARIANT") as tmp:
        tmp.write_text(f"{v.name}: {v.doc}\n")
    return out


def _random_weights(v: Variant, seed: int, sizes: Sizes | None) -> tuple[Sizes, dict, dict]:
    """Sizes, target and drafter weights of an untrained variant, drawn from `seed`."""
    sizes = sizes or TINY
    rng = np.random.default_rng(seed)
    return sizes, target_weights(rng, v.target_arch, sizes), draft_weights(rng, v, sizes)


def _trained_weights(v: Variant, seed: int, sizes: Sizes | None) -> tuple[Sizes, dict, dict]:
    """Sizes, target and (conditioned or plain) drafter of the trained pair of `seed`."""
    from featdiff import training  # torch, and a first training (then cached), only when asked for

    sizes = sizes or training.TRAINED_SIZES
    pair = training.trained_pair(seed, sizes)
    draft = pair.draft_dspark if v.checkpoint_dspark else pair.draft_log_snr if v.checkpoint_log_snr else pair.draft
    return sizes, pair.target, draft


def _write_held_out_prompts(path: Path, seed: int, sizes: Sizes) -> None:
    from featdiff import training

    training.write_prompts(path, training.held_out_prompts(seed, HELD_OUT_PROMPTS, sizes))


def _gguf_view(draft: dict, v: Variant, sz: Sizes) -> dict:
    """The drafter as the (possibly faulty) GGUF export holds it."""
    w = dict(draft)
    if v.gguf_swap_fc_blocks:
        n = sz.target.n_embd
        fc = w["fc"].copy()
        fc[:, 0:n], fc[:, n : 2 * n] = (
            draft["fc"][:, n : 2 * n],
            draft["fc"][:, 0:n],
        )  # (n_embd, n_extract * n_embd_tgt)
        w["fc"] = fc
    if v.gguf_drop_own_embd:
        w.pop("token_embd", None)
        w.pop("output", None)
    if v.gguf_drop_log_snr:
        for k in ("log_snr_fc1", "log_snr_fc1_b", "log_snr_fc2", "log_snr_fc2_b"):
            w.pop(k, None)
    if v.gguf_drop_markov:
        for k in ("markov_w1", "markov_w2", "markov_w2_scale", "conf_proj", "conf_proj_b"):
            w.pop(k, None)
    return w


def _dspark_keys(draft: dict, v: Variant) -> dict[str, bool]:
    """The dflash.* keys a DSpark export writes (upstream DSparkModel), from the checkpoint: kept
    when the export drops the heads; sample_from_anchor flipped where the variant says so."""
    if "markov_w1" not in draft:
        return {}
    return {
        names.KEY_SAMPLE_FROM_ANCHOR: v.checkpoint_bonus_anchor == v.gguf_flip_anchor,
        names.KEY_HAS_CONFIDENCE_HEAD: "conf_proj" in draft,
    }


# --- GGUF --------------------------------------------------------------------------------------


def _permute_qk_for_ggml(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half q/k rows -> ggml's interleaved RoPE pairs (the llama converter's permute)."""
    n_out, n_in = w.shape
    return (
        w.reshape(n_head, 2, n_out // n_head // 2, n_in)  # (n_head, 2, head_dim/2, n_in)
        .swapaxes(1, 2)
        .reshape(n_out, n_in)
    )


def _add_vocab(wr: GGUFWriter, sz: Sizes, vocab: str = VOCAB_TEST) -> None:
    if vocab == VOCAB_SPM:
        words = [f"w{i}" for i in range(len(SPM_SPECIAL) + N_BYTES, sz.n_vocab - 1)]
        tokens = [*SPM_SPECIAL, *(f"<0x{b:02X}>" for b in range(N_BYTES)), *words, "<mask>"]
        types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * N_BYTES
        types += [TOKEN_NORMAL] * len(words) + [TOKEN_CONTROL]
        if len(tokens) != sz.n_vocab:
            raise InputError(f"vocab {vocab!r}: needs n_vocab > {len(SPM_SPECIAL) + N_BYTES}, got {sz.n_vocab}")
        wr.add_tokenizer_model(VOCAB_SPM)
        wr.add_bos_token_id(1)
        wr.add_eos_token_id(2)
        wr.add_unk_token_id(0)
    else:
        tokens = ["<pad>"] + [f"w{i}" for i in range(1, sz.n_vocab - 1)] + ["<mask>"]
        types = [TOKEN_NORMAL] * (sz.n_vocab - 1) + [TOKEN_CONTROL]
        wr.add_tokenizer_model(VOCAB_TEST)
    wr.add_token_list(tokens)
    wr.add_token_scores([0.0] * sz.n_vocab)
    wr.add_token_types(types)
    wr.add_uint32(names.KEY_MASK_TOKEN, sz.mask_token_id)


def _add_stack_keys(wr: GGUFWriter, arch: str, s: Shape) -> None:
    wr.add_uint32(f"{arch}.context_length", N_POS_TRAIN)
    wr.add_uint32(f"{arch}.embedding_length", s.n_embd)
    wr.add_uint32(f"{arch}.block_count", s.n_layer)
    wr.add_uint32(f"{arch}.feed_forward_length", s.n_ff)
    wr.add_uint32(f"{arch}.attention.head_count", s.n_head)
    wr.add_uint32(f"{arch}.attention.head_count_kv", s.n_head_kv)
    wr.add_uint32(f"{arch}.attention.key_length", s.n_embd_head)
    wr.add_uint32(f"{arch}.attention.value_length", s.n_embd_head)
    wr.add_uint32(f"{arch}.rope.dimension_count", s.n_embd_head)
    wr.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", RMS_EPS)
    wr.add_float32(f"{arch}.rope.freq_base", ROPE_BASE)


def _add_rope_scaling(wr: GGUFWriter, arch: str, rope: str, n_rot: int) -> None:
    """A `rope` variant's scaling as the GGUF converter writes it: llama3 as the `rope_freqs`
    tensor of per-pair factors, YaRN as `{arch}.rope.scaling.*` keys."""
    if not rope:
        return
    spec = ROPE_SCALINGS[rope]
    if rope == "llama3":
        factors = llama3_freq_factors(
            ROPE_BASE,
            n_rot,
            spec["factor"],
            spec["low_freq_factor"],
            spec["high_freq_factor"],
            spec["original_max_position_embeddings"],
        )
        wr.add_tensor(names.T_ROPE_FREQS, np.array(factors, dtype=np.float32))
        return
    wr.add_string(names.KEY_ROPE_SCALING_TYPE.format(arch=arch), spec["rope_type"])
    wr.add_float32(names.KEY_ROPE_SCALING_FACTOR.format(arch=arch), spec["factor"])
    wr.add_uint32(names.KEY_ROPE_SCALING_ORIG_CTX.format(arch=arch), spec["original_max_position_embeddings"])


def _add_layers(wr: GGUFWriter, layers: list[dict], permute_heads: tuple[int, int] | None) -> None:
    for il, layer in enumerate(layers):
        for k, a in layer.items():
            if permute_heads and k in ("attn_q", "attn_k"):
                a = _permute_qk_for_ggml(a, permute_heads[0] if k == "attn_q" else permute_heads[1])
            wr.add_tensor(f"blk.{il}.{k}.weight", a)


def _finish(wr: GGUFWriter) -> None:
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def _write_target_gguf(path: Path, w: dict, arch: str, sz: Sizes, rope: str = "", vocab: str = VOCAB_TEST) -> None:
    wr = GGUFWriter(str(path), arch)
    wr.add_name(f"featdiff tiny {arch} target")
    _add_stack_keys(wr, arch, sz.target)
    _add_rope_scaling(wr, arch, rope, sz.target.n_embd_head)
    _add_vocab(wr, sz, vocab)
    wr.add_tensor(names.T_TOKEN_EMBD, w["token_embd"])
    wr.add_tensor(names.T_OUTPUT_NORM, w["output_norm"])
    wr.add_tensor(names.T_OUTPUT, w["output"])
    _add_layers(wr, w["layers"], (sz.target.n_head, sz.target.n_head_kv) if arch == "llama" else None)
    _finish(wr)


_DSPARK_GGUF = {
    "markov_w1": names.T_MARKOV_W1,
    "markov_w2": names.T_MARKOV_W2,
    "markov_w2_scale": names.T_MARKOV_W2_SCALE,
    "conf_proj": names.T_CONF_PROJ_W,
    "conf_proj_b": names.T_CONF_PROJ_B,
    "d2t": names.T_D2T,
}  # weights key -> GGUF tensor


def _write_draft_gguf(
    path: Path, w: dict, v: Variant, sz: Sizes, dspark_keys: dict[str, bool], vocab: str = VOCAB_TEST
) -> None:
    wr = GGUFWriter(str(path), names.ARCH_DFLASH)
    wr.add_name("featdiff tiny dflash drafter")
    _add_stack_keys(wr, names.ARCH_DFLASH, sz.draft)
    _add_rope_scaling(wr, names.ARCH_DFLASH, v.rope, sz.draft.n_embd_head)
    _add_vocab(wr, sz, vocab)
    gguf_ids = [i + 1 + v.gguf_layer_delta for i in HF_TARGET_LAYER_IDS]  # converter: gguf = hf + 1
    wr.add_array(names.KEY_TARGET_LAYERS, gguf_ids)
    wr.add_uint32(names.KEY_BLOCK_SIZE, BLOCK_SIZE)
    if "log_snr_fc1" in w:
        wr.add_bool(names.KEY_LOG_SNR, True)
        wr.add_float32(names.KEY_MIN_LOG_SNR, MIN_LOG_SNR)
        wr.add_float32(names.KEY_MAX_LOG_SNR, MAX_LOG_SNR)
        wr.add_tensor(names.T_LOG_SNR_FC1_W, w["log_snr_fc1"])
        wr.add_tensor(names.T_LOG_SNR_FC1_B, w["log_snr_fc1_b"])
        wr.add_tensor(names.T_LOG_SNR_FC2_W, w["log_snr_fc2"])
        wr.add_tensor(names.T_LOG_SNR_FC2_B, w["log_snr_fc2_b"])
    for key, value in dspark_keys.items():
        wr.add_bool(key, value)
    wr.add_tensor(names.T_FC, w["fc"])
    wr.add_tensor(names.T_ENC_NORM, w["hidden_norm"])
    wr.add_tensor(names.T_OUTPUT_NORM, w["norm"])
    if "token_embd" in w:
        wr.add_tensor(names.T_TOKEN_EMBD, w["token_embd"])
    if "output" in w:
        wr.add_tensor(names.T_OUTPUT, w["output"])
    _add_layers(wr, w["layers"], None)
    for key, name in _DSPARK_GGUF.items():
        if key in w:
            wr.add_tensor(name, w[key])  # d2t: int64 -> I64, as llama.cpp reads it
    _finish(wr)


# --- Hugging Face directories ------------------------------------------------------------------


def _hf_layers(prefix: str, layers: list[dict]) -> dict[str, np.ndarray]:
    return {
        f"{prefix}layers.{il}.{names.GGUF_TO_HF_LAYER[k]}.weight": a
        for il, layer in enumerate(layers)
        for k, a in layer.items()
    }


def _hf_config(s: Shape, n_vocab: int, rope: str = "") -> dict:
    scaling = {"rope_scaling": ROPE_SCALINGS[rope]} if rope else {}
    return {
        **scaling,
        "hidden_size": s.n_embd,
        "num_hidden_layers": s.n_layer,
        "num_attention_heads": s.n_head,
        "num_key_value_heads": s.n_head_kv,
        "head_dim": s.n_embd_head,
        "intermediate_size": s.n_ff,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_BASE,
        "vocab_size": n_vocab,
        "max_position_embeddings": N_POS_TRAIN,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def _write_hf(path: Path, config: dict, tensors: dict[str, np.ndarray]) -> None:
    """A Hugging Face model directory: config.json and model.safetensors, each replaced whole."""
    path.mkdir(exist_ok=True)
    with replaced(path / "config.json") as tmp:
        tmp.write_text(json.dumps(config, indent=1))
    with replaced(path / "model.safetensors") as tmp:
        save_file(tensors, str(tmp))


def _write_target_hf(path: Path, w: dict, arch: str, sz: Sizes, rope: str = "") -> None:
    arch_hf = {"qwen3": ("Qwen3ForCausalLM", "qwen3"), "llama": ("LlamaForCausalLM", "llama")}[arch]
    config = {
        "architectures": [arch_hf[0]],
        "model_type": arch_hf[1],
        **_hf_config(sz.target, sz.n_vocab, rope),
        "tie_word_embeddings": False,
    }
    tensors = {
        "model.embed_tokens.weight": w["token_embd"],
        "model.norm.weight": w["output_norm"],
        "lm_head.weight": w["output"],
        **_hf_layers("model.", w["layers"]),
    }
    _write_hf(path, config, tensors)


_DSPARK_HF = {
    "markov_w1": names.HF_MARKOV_W1,
    "markov_w2": names.HF_MARKOV_W2,
    "markov_w2_scale": names.HF_MARKOV_W2_SCALE,
    "conf_proj": names.HF_CONF_PROJ_W,
    "conf_proj_b": names.HF_CONF_PROJ_B,
}  # weights key -> HF tensor (d2t: offsets, below)


def drafter_hf_config(sz: Sizes, dflash_config: dict, rope: str = "", block_size: int = BLOCK_SIZE) -> dict:
    """A DFlash drafter's HF config.json, as the DFlash checkpoints lay it out."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **_hf_config(sz.draft, sz.n_vocab, rope),
        "block_size": block_size,
        "num_target_layers": sz.target.n_layer,
        "target_hidden_size": sz.target.n_embd,
        "dflash_config": dflash_config,
    }


def _write_draft_hf(path: Path, w: dict, v: Variant, sz: Sizes) -> None:
    dflash_config = {"target_layer_ids": list(HF_TARGET_LAYER_IDS), "mask_token_id": sz.mask_token_id}
    if v.checkpoint_log_snr:
        dflash_config.update({"log_snr_conditioning": True, "min_log_snr": MIN_LOG_SNR, "max_log_snr": MAX_LOG_SNR})
    config = drafter_hf_config(sz, dflash_config, v.rope)
    tensors = {
        "fc.weight": w["fc"],
        "hidden_norm.weight": w["hidden_norm"],
        "norm.weight": w["norm"],
        **_hf_layers("", w["layers"]),
    }
    if "token_embd" in w:
        tensors["embed_tokens.weight"] = w["token_embd"]
    if "output" in w:
        tensors["lm_head.weight"] = w["output"]
    if "log_snr_fc1" in w:
        tensors.update(
            {
                "log_snr_fc1.weight": w["log_snr_fc1"],
                "log_snr_fc1.bias": w["log_snr_fc1_b"],
                "log_snr_fc2.weight": w["log_snr_fc2"],
                "log_snr_fc2.bias": w["log_snr_fc2_b"],
            }
        )
    if "markov_w1" in w:
        config.update(_dspark_hf_config(w, v))
        tensors.update({name: w[key] for key, name in _DSPARK_HF.items() if key in w})
    if "d2t" in w:
        tensors[names.HF_D2T] = w["d2t"] - np.arange(w["d2t"].size, dtype=np.int64)  # HF offsets: id = d2t[i] + i
    _write_hf(path, config, tensors)


def _dspark_hf_config(w: dict, v: Variant) -> dict:
    """What a DSpark checkpoint's config.json adds (upstream conversion/qwen.py DSparkModel reads it)."""
    config = {
        "architectures": ["DSparkDraftModel"],
        names.HF_SAMPLE_FROM_ANCHOR: not v.checkpoint_bonus_anchor,
        "markov_head_type": "vanilla",
    }  # load_hf.MARKOV_HEAD_TYPE: the only type llama.cpp runs
    if "d2t" in w:
        config[names.HF_DRAFT_VOCAB_SIZE] = int(w["d2t"].size)
    return config


# --- converter keys on a clean pair (featdiff.modelled; tests/reference/test_modelled.py) -------
# Each feature: the drafter GGUF keys the pinned converter writes, and the config.json fields it
# writes them from (conversion/qwen.py DFlashModel.set_gguf_parameters). A feature fixture is the
# clean pair with both added: a correct model llama.cpp computes as its metadata says.


def _feature_specs() -> dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """feature -> (GGUF keys, dflash_config fields, top-level config.json fields)."""
    from featdiff import modelled as m

    n_layer = TINY.draft.n_layer
    pattern = [il % 2 == 0 for il in range(n_layer)]
    return {
        "embedding-scale": ({m.KEY_EMBEDDING_SCALE: 2.0}, {m.HF_EMBEDDING_SCALE: 2.0}, {}),
        "value-scale": ({m.KEY_ATTN_VALUE_SCALE: 0.5}, {m.HF_VALUE_SCALE: 0.5}, {}),
        "logit-scale": (
            {m.KEY_LOGIT_SCALE: 3.0, m.KEY_SOFTCAP: 30.0},
            {m.HF_OUTPUT_MULTIPLIER: 3.0, m.HF_SOFTCAP: 30.0},
            {},
        ),
        "fc-scale": ({}, {}, {}),
        "attn-sinks": ({}, {}, {}),
        "q-scale": ({}, {}, {}),
        "interleaved-rope": ({}, {}, {m.HF_ROPE_IS_NEOX: False}),
        "sliding-window": (
            {m.KEY_SLIDING_WINDOW: 4, m.KEY_SLIDING_WINDOW_PATTERN: pattern},
            {},
            {
                "use_sliding_window": True,
                "sliding_window": 4,
                "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern],
            },
        ),
        "causal": ({names.KEY_CAUSAL: True}, {}, {names.HF_IS_CAUSAL: True}),
        "partial-rotary": (
            {names.KEY_ROPE_DIMS.format(arch=names.ARCH_DFLASH): TINY.draft.n_embd_head // 2},
            {},
            {m.HF_PARTIAL_ROTARY: 0.5},
        ),
        # the drafter of an M-RoPE target: the converter reads the sections off the target's
        # config.json (MROPE_TARGET_FIELDS), the drafter's own states nothing
        "mrope-sections": ({m.KEY_ROPE_SECTIONS: list(m.degenerate_sections(TINY.draft.n_embd_head))}, {}, {}),
        "mask-embedding": ({}, {}, {}),
    }


# What an M-RoPE target's config.json says (Qwen3-VL's text config): the target itself runs text,
# whose positions are equal in every section, so only the drafter's keys change
MROPE_TARGET_FIELDS = {"rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1]}}


FC_SCALE = 1e-3  # fc.scale: small enough that the encoder norm's eps shows it (s^2 ms ~ RMS_EPS)
SINK_LOGIT = 1.5  # every head's attention sink logit: a sizeable share of each softmax
Q_SCALE = 0.5  # attn_q's per-tensor weight scale: a feature the reference refuses (modelled.py)


def _feature_tensors(feature: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """feature -> (GGUF tensors, HF tensors) it adds: fc's ModelOpt per-tensor scale, which the
    converter writes as `fc.scale`; per-head attention sinks (gpt-oss's `self_attn.sinks`); attn_q's
    per-tensor scale (ModelOpt's `weight_scale_2`, `blk.*.attn_q.scale`), which the reference refuses."""
    from featdiff import modelled as m

    d = TINY.draft
    if feature == "fc-scale":
        scale = np.array([FC_SCALE], dtype=np.float32)  # (1,)
        return {m.T_FC_SCALE: scale}, {m.HF_FC_SCALE: scale.reshape(())}
    if feature == "attn-sinks":
        sinks = np.full(d.n_head, SINK_LOGIT, dtype=np.float32) + np.arange(d.n_head, dtype=np.float32) / d.n_head
        return (
            {f"blk.{il}.attn_sinks.weight": sinks for il in range(d.n_layer)},
            {f"layers.{il}.self_attn.sinks": sinks for il in range(d.n_layer)},
        )
    if feature == "mask-embedding":
        return {}, {}  # the GGUF's are the target's tables: _mask_embedding_tensors
    if feature == "q-scale":
        scale = np.array([Q_SCALE], dtype=np.float32)  # (1,)
        return (
            {f"blk.{il}.attn_q.scale": scale for il in range(d.n_layer)},
            {f"layers.{il}.self_attn.q_proj.weight_scale_2": scale.reshape(()) for il in range(d.n_layer)},
        )
    return {}, {}


# a drafter's HF tensors an interleaved-RoPE checkpoint holds in interleaved order
# (conversion/qwen.py DFlashModel._ROPE_PERMUTE_SUFFIXES)
_ROPE_PERMUTED_HF = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)


def _interleaved_rope(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The clean drafter's HF tensors as an interleaved-RoPE checkpoint (`rope_is_neox_style:
    false`) holds them: per head, the NeoX order's dims i and i + d/2 made the pair 2i, 2i + 1, the
    inverse of the converter's permutation, so the converter's GGUF of it is the clean GGUF."""
    d = TINY.draft.n_embd_head
    out = dict(tensors)
    for name, a in tensors.items():
        if name.endswith(_ROPE_PERMUTED_HF):
            halves = a.reshape(-1, 2, d // 2, *a.shape[1:])  # (n_head, 2, n_embd_head / 2, ...)
            out[name] = np.ascontiguousarray(halves.swapaxes(1, 2).reshape(a.shape))  # pairs interleaved
    return out


def feature_names() -> tuple[str, ...]:
    return tuple(_feature_specs())


def write_feature_fixture(outdir: str | Path, feature: str, seed: int = 0, vocab: str = VOCAB_TEST) -> Path:
    """The clean pair in `outdir` with `feature`'s converter keys in `draft.gguf` and its fields in
    `draft-hf/config.json` (`_feature_specs`); return `outdir`."""
    specs = _feature_specs()
    if feature not in specs:
        raise InputError(f"feature {feature!r}: choose one of {', '.join(specs)}")
    gguf_keys, dflash_fields, top_fields = specs[feature]
    gguf_tensors, hf_tensors = _feature_tensors(feature)
    out = write_fixture(outdir, "clean", seed, vocab=vocab)
    if feature == "mask-embedding":
        gguf_tensors = _mask_embedding(out, seed)
    if feature == "mrope-sections":
        _update_json(out / "target-hf" / "config.json", MROPE_TARGET_FIELDS)
    rewrite_gguf(out / "draft.gguf", out / "draft.gguf", gguf_keys, gguf_tensors)
    if hf_tensors or feature == "interleaved-rope":
        weights = out / "draft-hf" / "model.safetensors"
        with safe_open(str(weights), "np") as st:
            tensors = {k: st.get_tensor(k) for k in st.keys()}
        if feature == "interleaved-rope":
            tensors = _interleaved_rope(tensors)
        with replaced(weights) as tmp:
            save_file({**tensors, **hf_tensors}, str(tmp))
    _update_json(out / "draft-hf" / "config.json", {**top_fields, names.HF_DFLASH_CONFIG: dflash_fields})
    with replaced(out / "VARIANT") as tmp:
        tmp.write_text(f"clean + {feature}: {', '.join([*gguf_keys, *sorted(gguf_tensors)])}\n")
    return out


def _update_json(path: Path, fields: dict[str, Any]) -> None:
    """`path`'s JSON object with `fields` set (a dict value updates the dict already there)."""
    config = json.loads(path.read_text())
    for k, v in fields.items():
        config[k] = {**config[k], **v} if isinstance(v, dict) and isinstance(config.get(k), dict) else v
    with replaced(path) as tmp:
        tmp.write_text(json.dumps(config, indent=1))


MASK_ROW_SEED = 7  # the drafter's own mask row: a vector unlike any row of the target's table


def _mask_embedding(out: Path, seed: int) -> dict[str, np.ndarray]:
    """A drafter that ships its own mask row as `draft-hf/mask_embedding.pt` (MiMo's layout); return
    the GGUF tensors the converter makes of it: the target's table with that row patched in as the
    drafter's `token_embd`, and the target's head as its `output`."""
    import torch

    from featdiff.modelled import MASK_EMBEDDING_FILE

    with safe_open(str(out / "target-hf" / "model.safetensors"), "np") as st:
        table = st.get_tensor("model.embed_tokens.weight").copy()  # (n_vocab, n_embd)
        head = st.get_tensor("lm_head.weight")  # (n_vocab, n_embd)
    rng = np.random.default_rng(seed + MASK_ROW_SEED)
    row = rng.standard_normal(table.shape[1]).astype(np.float32)  # (n_embd,)
    torch.save(
        {"mask_token_id": TINY.mask_token_id, "embedding": torch.from_numpy(row)},
        out / "draft-hf" / MASK_EMBEDDING_FILE,
    )
    table[TINY.mask_token_id] = row
    return {"token_embd.weight": table, "output.weight": head}
