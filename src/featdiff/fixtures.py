"""Tiny seeded models: a target (qwen3 or llama) and a DFlash (or DSpark) drafter, as GGUF and as
Hugging Face directories, with one wiring bug planted per variant.

A variant directory holds `target.gguf` and `draft.gguf` (what the run loads) and `target-hf/`,
`draft-hf/` (the trained checkpoint, always correct: the reference reads these). The `trained*`
variants hold a drafter actually trained on its target (featdiff.training, cached), and
`prompts.txt`: held-out prompts for `featdiff probe`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from safetensors.numpy import save_file

from featdiff import names
from featdiff.errors import InputError
from featdiff.outputs import check_output_dir, replaced

N_VOCAB = 512
MASK_TOKEN_ID = N_VOCAB - 1
N_POS_TRAIN = 4096
RMS_EPS = 1e-6
ROPE_BASE = 10000.0


@dataclass(frozen=True)
class Shape:
    """Dimensions of one transformer stack, in llama.cpp's vocabulary."""

    n_layer: int
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_embd_head: int = 16
    n_ff: int = 128


TARGET = Shape(n_layer=6)
DRAFT = Shape(n_layer=2)


@dataclass(frozen=True)
class Sizes:
    """The dimensions of a fixture pair; the default is the tiny pair the tests use."""

    target: Shape = TARGET
    draft: Shape = DRAFT
    n_vocab: int = N_VOCAB

    @property
    def mask_token_id(self) -> int:
        return self.n_vocab - 1


TINY = Sizes()
HF_TARGET_LAYER_IDS = (1, 3)  # output-of-layer ids; GGUF stores them + 1 = [2, 4]
BLOCK_SIZE = 4
MIN_LOG_SNR, MAX_LOG_SNR = -9.0, 9.0
MARKOV_RANK = 16          # R of a random DSpark's Markov head
MARKOV_W2_SCALE = 2.0     # markov_w2.scale where a variant ships one
CONF_GAIN = 2.0           # the confidence logit's spread: sigmoid spans most of (0, 1)


@dataclass(frozen=True)
class Variant:
    """What the checkpoint is, and what the GGUF the run loads gets wrong about it."""

    name: str
    doc: str
    target_arch: str = "qwen3"
    checkpoint_own_embd: bool = False  # the trained drafter has its own token_embd/output
    checkpoint_log_snr: bool = False   # the trained drafter is GIDD log-SNR conditioned
    gguf_layer_delta: int = 0          # added to every GGUF target layer id
    gguf_swap_fc_blocks: bool = False  # fc column blocks 0 and 1 swapped in the GGUF
    gguf_drop_own_embd: bool = False   # GGUF omits the drafter's own embeddings/head
    gguf_drop_log_snr: bool = False    # GGUF omits the log-SNR tensors and keys (upstream loads it)
    checkpoint_dspark: bool = False    # the trained drafter is DSpark: DFlash plus a Markov head
    checkpoint_conf_head: bool = False     # ... with a confidence head
    checkpoint_markov_scale: bool = False  # ... shipping markov_w2.scale
    checkpoint_bonus_anchor: bool = False  # ... laid out bonus-anchor (sample_from_anchor false)
    checkpoint_d2t: bool = False           # ... with a reduced draft vocabulary: own head of half the rows, d2t
    gguf_drop_markov: bool = False     # GGUF omits the Markov and confidence tensors, keeps the dflash.* keys
    gguf_flip_anchor: bool = False     # GGUF's dflash.sample_from_anchor is the opposite of the checkpoint's
    is_trained: bool = False           # the drafter is trained on its target (featdiff.training), not random


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("clean", "qwen3 target, drafter borrowing the target's embeddings and head"),
    Variant("own-embd", "drafter with its own token_embd/output", checkpoint_own_embd=True),
    Variant("llama", "llama-arch target, borrowing drafter", target_arch="llama"),
    Variant("log-snr", "GIDD log-SNR conditioned drafter (upstream llama.cpp refuses to load it)",
            checkpoint_log_snr=True),
    Variant("no-log-snr", "log-SNR trained drafter exported without its conditioning",
            checkpoint_log_snr=True, gguf_drop_log_snr=True),
    Variant("layers-plus1", "dflash.target_layers one too high", gguf_layer_delta=+1),
    Variant("layers-minus1", "dflash.target_layers without the +1 of the converter", gguf_layer_delta=-1),
    Variant("slots-swapped", "fc column blocks of slots 0 and 1 swapped", gguf_swap_fc_blocks=True),
    Variant("borrowed-embd", "own-embeddings drafter exported without them, so the run borrows the target's",
            checkpoint_own_embd=True, gguf_drop_own_embd=True),
    Variant("dspark", "anchor-first DSpark drafter: Markov head with markov_w2.scale, confidence head",
            checkpoint_dspark=True, checkpoint_conf_head=True, checkpoint_markov_scale=True),
    Variant("dspark-no-conf", "anchor-first DSpark drafter with a Markov head only",
            checkpoint_dspark=True),
    Variant("dspark-bonus", "bonus-anchor DSpark drafter (sample_from_anchor false) with a confidence head",
            checkpoint_dspark=True, checkpoint_conf_head=True, checkpoint_bonus_anchor=True),
    Variant("dspark-d2t", "anchor-first DSpark drafter drafting a reduced vocabulary (own head, d2t)",
            checkpoint_dspark=True, checkpoint_conf_head=True, checkpoint_d2t=True),
    Variant("dspark-lost-markov", "DSpark drafter exported without its Markov and confidence heads, keys kept",
            checkpoint_dspark=True, checkpoint_conf_head=True, checkpoint_markov_scale=True, gguf_drop_markov=True),
    Variant("dspark-anchor-flipped", "anchor-first DSpark drafter exported with dflash.sample_from_anchor = false",
            checkpoint_dspark=True, checkpoint_conf_head=True, gguf_flip_anchor=True),
    Variant("trained", "drafter trained on its target: accept rate means something", is_trained=True),
    Variant("trained-layers-minus1", "trained drafter, dflash.target_layers without the +1 of the converter",
            gguf_layer_delta=-1, is_trained=True),
    Variant("trained-log-snr", "trained GIDD log-SNR conditioned drafter (upstream llama.cpp refuses it)",
            checkpoint_log_snr=True, is_trained=True),
    Variant("trained-no-log-snr", "trained log-SNR drafter exported without its conditioning",
            checkpoint_log_snr=True, gguf_drop_log_snr=True, is_trained=True),
    Variant("trained-dspark", "trained anchor-first DSpark drafter with a confidence head",
            checkpoint_dspark=True, checkpoint_conf_head=True, is_trained=True),
)}
PROMPTS_FILE = "prompts.txt"  # a trained variant's held-out prompts, in `featdiff probe --prompts` format
HELD_OUT_PROMPTS = 8


def checked_variant(name: str) -> str:
    """`name` if it is a known variant, else an InputError listing the known ones."""
    if name not in VARIANTS:
        raise InputError(f"--variant {name!r}: no such fixture variant; choose one of {', '.join(VARIANTS)}")
    return name


def describe_variants() -> str:
    """One line per variant: name and the bug it plants."""
    return "\n".join(f"{v.name:22s} {v.doc}" for v in VARIANTS.values())


def write_fixture(outdir: str | Path, variant: str = "clean", seed: int = 0, sizes: Sizes | None = None) -> Path:
    """Write one variant's GGUFs and HF directories into `outdir`; return `outdir`.

    `sizes` defaults to TINY, or to `training.TRAINED_SIZES` for the trained variants.
    """
    v = VARIANTS[variant]
    out = check_output_dir(Path(outdir), (), "OUTDIR")
    out.mkdir(parents=True, exist_ok=True)
    sizes, target, draft = (_trained_weights if v.is_trained else _random_weights)(v, seed, sizes)
    with replaced(out / "target.gguf") as tmp:
        _write_target_gguf(tmp, target, v.target_arch, sizes)
    _write_target_hf(out / "target-hf", target, v.target_arch, sizes)
    _write_draft_hf(out / "draft-hf", draft, v, sizes)
    with replaced(out / "draft.gguf") as tmp:
        _write_draft_gguf(tmp, _gguf_view(draft, v, sizes), v, sizes, _dspark_keys(draft, v))
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


# --- weights (HF orientation: (out, in); equal to the GGUF numpy arrays) -----------------------

def _linear(rng: np.random.Generator, n_out: int, n_in: int) -> np.ndarray:
    return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _layer(rng: np.random.Generator, s: Shape, qk_norm: bool) -> dict[str, np.ndarray]:
    w = {
        "attn_norm": _norm(rng, s.n_embd),
        "attn_q": _linear(rng, s.n_head * s.n_embd_head, s.n_embd),
        "attn_k": _linear(rng, s.n_head_kv * s.n_embd_head, s.n_embd),
        "attn_v": _linear(rng, s.n_head_kv * s.n_embd_head, s.n_embd),
        "attn_output": _linear(rng, s.n_embd, s.n_head * s.n_embd_head),
        "ffn_norm": _norm(rng, s.n_embd),
        "ffn_gate": _linear(rng, s.n_ff, s.n_embd),
        "ffn_up": _linear(rng, s.n_ff, s.n_embd),
        "ffn_down": _linear(rng, s.n_embd, s.n_ff),
    }
    if qk_norm:
        w["attn_q_norm"] = _norm(rng, s.n_embd_head)
        w["attn_k_norm"] = _norm(rng, s.n_embd_head)
    return w


def target_weights(rng: np.random.Generator, arch: str, sz: Sizes) -> dict:
    """A random target (HF orientation), drawn from `rng`."""
    s = sz.target
    return {
        "token_embd": rng.standard_normal((sz.n_vocab, s.n_embd)).astype(np.float32),
        "output": _linear(rng, sz.n_vocab, s.n_embd),
        "output_norm": _norm(rng, s.n_embd),
        "layers": [_layer(rng, s, qk_norm=arch == "qwen3") for _ in range(s.n_layer)],
    }


def draft_weights(rng: np.random.Generator, v: Variant, sz: Sizes) -> dict:
    """A random drafter for variant `v`'s checkpoint (HF orientation), drawn from `rng`."""
    s = sz.draft
    n_extract = len(HF_TARGET_LAYER_IDS)
    w = {
        "fc": _linear(rng, s.n_embd, n_extract * sz.target.n_embd),
        "hidden_norm": _norm(rng, s.n_embd),
        "norm": _norm(rng, s.n_embd),
        "layers": [_layer(rng, s, qk_norm=True) for _ in range(s.n_layer)],
    }
    if v.checkpoint_own_embd:
        w["token_embd"] = rng.standard_normal((sz.n_vocab, s.n_embd)).astype(np.float32)
        w["output"] = _linear(rng, sz.n_vocab, s.n_embd)
    if v.checkpoint_log_snr:
        w["log_snr_fc1"] = _linear(rng, s.n_embd, names.LOG_SNR_N_FREQ)
        w["log_snr_fc1_b"] = (0.1 * rng.standard_normal(s.n_embd)).astype(np.float32)
        w["log_snr_fc2"] = _linear(rng, s.n_embd, s.n_embd)
        w["log_snr_fc2_b"] = (0.1 * rng.standard_normal(s.n_embd)).astype(np.float32)
    if v.checkpoint_dspark:
        w.update(_dspark_weights(rng, v, sz))
    return w


def _dspark_weights(rng: np.random.Generator, v: Variant, sz: Sizes) -> dict:
    """A random DSpark head set for variant `v` (HF orientation; `d2t` absolute ids), drawn from `rng`.

    The Markov bias `markov_w2 @ markov_w1[prev]` has a spread of about 1 (x markov_w2.scale), as
    the random drafter's logits do, so it moves the argmax of most rows.
    """
    s = sz.draft
    n_vocab_draft = sz.n_vocab // 2 if v.checkpoint_d2t else sz.n_vocab
    w = {"markov_w1": rng.standard_normal((sz.n_vocab, MARKOV_RANK)).astype(np.float32),
         "markov_w2": _linear(rng, n_vocab_draft, MARKOV_RANK)}
    if v.checkpoint_markov_scale:
        w["markov_w2_scale"] = np.array([MARKOV_W2_SCALE], dtype=np.float32)
    if v.checkpoint_conf_head:
        w["conf_proj"] = CONF_GAIN * _linear(rng, 1, s.n_embd + MARKOV_RANK)  # (1, n_embd + R)
        w["conf_proj_b"] = (0.1 * rng.standard_normal(1)).astype(np.float32)
    if v.checkpoint_d2t:
        w["d2t"] = np.sort(rng.choice(sz.n_vocab, n_vocab_draft, replace=False)).astype(np.int64)
        w["output"] = _linear(rng, n_vocab_draft, s.n_embd)  # the reduced head: one row per d2t entry
    return w


def _gguf_view(draft: dict, v: Variant, sz: Sizes) -> dict:
    """The drafter as the (possibly faulty) GGUF export holds it."""
    w = dict(draft)
    if v.gguf_swap_fc_blocks:
        n = sz.target.n_embd
        fc = w["fc"].copy()
        fc[:, 0:n], fc[:, n:2 * n] = draft["fc"][:, n:2 * n], draft["fc"][:, 0:n]  # (n_embd, n_extract * n_embd_tgt)
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
    return {names.KEY_SAMPLE_FROM_ANCHOR: v.checkpoint_bonus_anchor == v.gguf_flip_anchor,
            names.KEY_HAS_CONFIDENCE_HEAD: "conf_proj" in draft}


# --- GGUF --------------------------------------------------------------------------------------

def _permute_qk_for_ggml(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half q/k rows -> ggml's interleaved RoPE pairs (the llama converter's permute)."""
    n_out, n_in = w.shape
    return (w.reshape(n_head, 2, n_out // n_head // 2, n_in)  # (n_head, 2, head_dim/2, n_in)
            .swapaxes(1, 2)
            .reshape(n_out, n_in))


def _add_vocab(wr: GGUFWriter, sz: Sizes) -> None:
    tokens = ["<pad>"] + [f"w{i}" for i in range(1, sz.n_vocab - 1)] + ["<mask>"]
    wr.add_tokenizer_model("test")
    wr.add_token_list(tokens)
    wr.add_token_scores([0.0] * sz.n_vocab)
    wr.add_token_types([1] * (sz.n_vocab - 1) + [3])  # 1 = normal, 3 = control
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


def _write_target_gguf(path: Path, w: dict, arch: str, sz: Sizes) -> None:
    wr = GGUFWriter(str(path), arch)
    wr.add_name(f"featdiff tiny {arch} target")
    _add_stack_keys(wr, arch, sz.target)
    _add_vocab(wr, sz)
    wr.add_tensor(names.T_TOKEN_EMBD, w["token_embd"])
    wr.add_tensor(names.T_OUTPUT_NORM, w["output_norm"])
    wr.add_tensor(names.T_OUTPUT, w["output"])
    _add_layers(wr, w["layers"], (sz.target.n_head, sz.target.n_head_kv) if arch == "llama" else None)
    _finish(wr)


_DSPARK_GGUF = {"markov_w1": names.T_MARKOV_W1, "markov_w2": names.T_MARKOV_W2,
                "markov_w2_scale": names.T_MARKOV_W2_SCALE, "conf_proj": names.T_CONF_PROJ_W,
                "conf_proj_b": names.T_CONF_PROJ_B, "d2t": names.T_D2T}  # weights key -> GGUF tensor


def _write_draft_gguf(path: Path, w: dict, v: Variant, sz: Sizes, dspark_keys: dict[str, bool]) -> None:
    wr = GGUFWriter(str(path), names.ARCH_DFLASH)
    wr.add_name("featdiff tiny dflash drafter")
    _add_stack_keys(wr, names.ARCH_DFLASH, sz.draft)
    _add_vocab(wr, sz)
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
    return {f"{prefix}layers.{il}.{names.GGUF_TO_HF_LAYER[k]}.weight": a
            for il, layer in enumerate(layers) for k, a in layer.items()}


def _hf_config(s: Shape, n_vocab: int) -> dict:
    return {
        "hidden_size": s.n_embd, "num_hidden_layers": s.n_layer, "num_attention_heads": s.n_head,
        "num_key_value_heads": s.n_head_kv, "head_dim": s.n_embd_head, "intermediate_size": s.n_ff,
        "rms_norm_eps": RMS_EPS, "rope_theta": ROPE_BASE, "vocab_size": n_vocab,
        "max_position_embeddings": N_POS_TRAIN, "hidden_act": "silu", "torch_dtype": "float32",
    }


def _write_hf(path: Path, config: dict, tensors: dict[str, np.ndarray]) -> None:
    """A Hugging Face model directory: config.json and model.safetensors, each replaced whole."""
    path.mkdir(exist_ok=True)
    with replaced(path / "config.json") as tmp:
        tmp.write_text(json.dumps(config, indent=1))
    with replaced(path / "model.safetensors") as tmp:
        save_file(tensors, str(tmp))


def _write_target_hf(path: Path, w: dict, arch: str, sz: Sizes) -> None:
    arch_hf = {"qwen3": ("Qwen3ForCausalLM", "qwen3"), "llama": ("LlamaForCausalLM", "llama")}[arch]
    config = {"architectures": [arch_hf[0]], "model_type": arch_hf[1], **_hf_config(sz.target, sz.n_vocab),
              "tie_word_embeddings": False}
    tensors = {"model.embed_tokens.weight": w["token_embd"], "model.norm.weight": w["output_norm"],
               "lm_head.weight": w["output"], **_hf_layers("model.", w["layers"])}
    _write_hf(path, config, tensors)


_DSPARK_HF = {"markov_w1": names.HF_MARKOV_W1, "markov_w2": names.HF_MARKOV_W2,
              "markov_w2_scale": names.HF_MARKOV_W2_SCALE, "conf_proj": names.HF_CONF_PROJ_W,
              "conf_proj_b": names.HF_CONF_PROJ_B}  # weights key -> HF tensor (d2t: offsets, below)


def _write_draft_hf(path: Path, w: dict, v: Variant, sz: Sizes) -> None:
    dflash_config = {"target_layer_ids": list(HF_TARGET_LAYER_IDS), "mask_token_id": sz.mask_token_id}
    if v.checkpoint_log_snr:
        dflash_config.update({"log_snr_conditioning": True, "min_log_snr": MIN_LOG_SNR,
                              "max_log_snr": MAX_LOG_SNR})
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **_hf_config(sz.draft, sz.n_vocab),
              "block_size": BLOCK_SIZE, "num_target_layers": sz.target.n_layer,
              "target_hidden_size": sz.target.n_embd, "dflash_config": dflash_config}
    tensors = {"fc.weight": w["fc"], "hidden_norm.weight": w["hidden_norm"], "norm.weight": w["norm"],
               **_hf_layers("", w["layers"])}
    if "token_embd" in w:
        tensors["embed_tokens.weight"] = w["token_embd"]
    if "output" in w:
        tensors["lm_head.weight"] = w["output"]
    if "log_snr_fc1" in w:
        tensors.update({"log_snr_fc1.weight": w["log_snr_fc1"], "log_snr_fc1.bias": w["log_snr_fc1_b"],
                        "log_snr_fc2.weight": w["log_snr_fc2"], "log_snr_fc2.bias": w["log_snr_fc2_b"]})
    if "markov_w1" in w:
        config.update(_dspark_hf_config(w, v))
        tensors.update({name: w[key] for key, name in _DSPARK_HF.items() if key in w})
    if "d2t" in w:
        tensors[names.HF_D2T] = w["d2t"] - np.arange(w["d2t"].size, dtype=np.int64)  # HF offsets: id = d2t[i] + i
    _write_hf(path, config, tensors)


def _dspark_hf_config(w: dict, v: Variant) -> dict:
    """What a DSpark checkpoint's config.json adds (upstream conversion/qwen.py DSparkModel reads it)."""
    config = {"architectures": ["DSparkDraftModel"], names.HF_SAMPLE_FROM_ANCHOR: not v.checkpoint_bonus_anchor,
              "markov_head_type": "vanilla"}  # load_hf.MARKOV_HEAD_TYPE: the only type llama.cpp runs
    if "d2t" in w:
        config[names.HF_DRAFT_VOCAB_SIZE] = int(w["d2t"].size)
    return config
