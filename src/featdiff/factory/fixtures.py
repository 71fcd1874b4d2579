"""Tiny seeded models: a target (qwen3 or llama) and a DFlash (or DSpark) drafter, as GGUF and as
Hugging Face directories, with one wiring bug planted per variant.

A variant directory holds `target.gguf` and `draft.gguf` (what the run loads) and `target-hf/`,
`draft-hf/` (the trained checkpoint, always correct: the reference reads these). The `trained*`
variants hold a drafter actually trained on its target (featdiff.factory.training, cached), and
`prompts.txt`: held-out prompts for `featdiff probe`. The pairs themselves (dimensions, variants,
random weights) are `featdiff.factory.pairs`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from safetensors.numpy import save_file

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.outputs import check_output_dir, replaced
from featdiff.factory.pairs import (
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
    from featdiff.factory import training  # torch, and a first training (then cached), only when asked for

    sizes = sizes or training.TRAINED_SIZES
    pair = training.trained_pair(seed, sizes)
    draft = pair.draft_dspark if v.checkpoint_dspark else pair.draft_log_snr if v.checkpoint_log_snr else pair.draft
    return sizes, pair.target, draft


def _write_held_out_prompts(path: Path, seed: int, sizes: Sizes) -> None:
    from featdiff.factory import training

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


# --- converter keys on a clean pair (featdiff.kinds.dflash.modelled; tests/reference/test_modelled.py) -------
# Each feature: the drafter GGUF keys the pinned converter writes, and the config.json fields it
# writes them from (conversion/qwen.py DFlashModel.set_gguf_parameters). A feature fixture is the
# clean pair with both added: a correct model llama.cpp computes as its metadata says.


MASK_ROW_SEED = 7  # the drafter's own mask row: a vector unlike any row of the target's table
