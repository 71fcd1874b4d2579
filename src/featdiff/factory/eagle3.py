"""A tiny seeded EAGLE3 drafter beside the fixtures' tiny target: `draft-hf/` in the SpecForge
(`LlamaForCausalLMEagle3`) layout, and both GGUFs made by the pinned converter
(`conversion/llama.py` LlamaModel, which takes a 1-layer checkpoint with `draft_vocab_size` for
EAGLE3). The directory is the fixture layout: `target-hf/`, `draft-hf/`, `target.gguf`,
`draft.gguf`, `VARIANT`. The `trained-eagle3` pair is the trained pair's target with an EAGLE3
drafter trained on it (featdiff.factory.training.eagle3, cached per machine), and `prompts.txt`: held-out
prompts for `featdiff probe`, as fixtures.write_fixture writes them for the trained DFlash pairs.

What `draft.gguf` holds of the HF tensors (a reference reading `draft-hf/` must apply the same):
* `midlayer.self_attn.{q,k}_proj` -> `blk.0.attn_{q,k}`, rows permuted per head from HF's
  rotate-half order into ggml's interleaved RoPE pairs (LlamaModel.undo_permute; q by n_head, k by
  n_head_kv); every other matrix is as in HF, numpy order (out, in).
* `midlayer.input_layernorm` -> `blk.0.attn_norm` (the token embeddings' norm),
  `midlayer.hidden_norm` -> `blk.0.attn_norm_2` (the fc output's), `midlayer.post_attention_layernorm`
  -> `blk.0.ffn_norm`, `norm` -> `output_norm`, `lm_head` -> `output` (draft_vocab_size rows),
  `input_norm` -> `enc.output_norm` (norm_before_fc), `embed_tokens` -> `token_embd`.
* `d2t`: HF offsets (target id = d2t[i] + i) -> absolute target ids, I64; `t2d` is dropped.
* `eagle3.target_layers`: `eagle_aux_hidden_state_layer_ids` as stated (no shift), else
  [2, n_layer // 2, n_layer - 3]; llama.cpp reads each as the INPUT of that target layer
  (common/speculative.cpp: llama_get_embeddings_layer_inp; id n_layer: the final hidden state).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.outputs import check_output_dir
from featdiff.factory.converter import (
    CONVERTER,
    DRAFT_GGUF,
    DRAFT_HF,
    TARGET_GGUF,
    TARGET_HF,
    TOKENIZER_MODEL,
    convert_checkpoint,
    write_spm_tokenizer,
)
from featdiff.factory.fixtures import (
    PROMPTS_FILE,
    VOCAB_SPM,
    _hf_config,
    _write_held_out_prompts,
    _write_hf,
    _write_target_hf,
    write_fixture,
)
from featdiff.factory.gguf_rewrite import rewrite_gguf
from featdiff.factory.pairs import TINY, Shape, _linear, _norm

# config.json fields of an EAGLE3 checkpoint the converter reads (its GGUF keys: names.KEY_EAGLE3_*)
HF_ARCH = "LlamaForCausalLMEagle3"  # one of the names conversion/llama.py registers for LlamaModel
HF_AUX_LAYER_IDS = "eagle_aux_hidden_state_layer_ids"
HF_TARGET_HIDDEN_SIZE = "target_hidden_size"
HF_NORM_BEFORE_FC = "norm_before_fc"
HF_NORM_BEFORE_RESIDUAL = "norm_before_residual"

# The converter's names for the checkpoint's tensors (t2d it drops): HF -> GGUF. The q/k rows are
# permuted on the way (module docstring), `d2t` made absolute; the rest are copied as they are.
GGUF_FROM_HF = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "enc.output_norm.weight",
    "embed_tokens.weight": "token_embd.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "d2t": "d2t",
}

DRAFT = Shape(n_layer=1)  # llama.cpp's EAGLE3 graph has exactly one decoder layer
# HF tensor -> the heads whose rows the converter permutes (LlamaModel.permute: q by n_head, k by n_head_kv)
ROPE_PERMUTED = {
    "midlayer.self_attn.q_proj.weight": DRAFT.n_head,
    "midlayer.self_attn.k_proj.weight": DRAFT.n_head_kv,
}
N_EXTRACT = 3  # llama.cpp requires exactly three target layers (low, mid, high)
N_SPECIAL = 3  # unk, bos, eos (fixtures.SPM_SPECIAL): always in the draft vocabulary
TARGET_LAYERS = (1, 3, 5)  # layer-input ids of the 6-layer tiny target
# training.TRAINED_SIZES.n_vocab (not imported here: featdiff.factory.training imports torch). The trained
# drafter drafts the whole vocabulary; the converter keeps the first 256 pieces of the tiny pair's
# SentencePiece vocabulary (unk, bos, eos and bytes 0x00-0xFC), which no trained token needs as text
TRAINED_N_VOCAB = 256
DRAFT_STREAM = 3  # the drafter's weights: rng [seed, 3], apart from the pair's (seed) and DFlash2's ([seed, 2])
VARIANT_FILE = "VARIANT"
LAYOUT_CONVERTER, LAYOUT_SPECFORGE, LAYOUT_SPECULATORS, LAYOUT_EAGLE = "converter", "specforge", "speculators", "eagle"
SPECFORGE_EAGLE_CONFIG = "eagle_config"  # SpecForge's nested block: its ids name layer OUTPUTS (input = id + 1)
SPECULATORS_ARCH = "Eagle3Speculator"  # one of the names conversion/llama.py registers for LlamaModel
SPECULATORS_LAYER_CONFIG = "transformer_layer_config"  # the converter merges it over the top level
SPECULATORS_PREFIX = "layers.0."  # Eagle3Speculator's layer (the converter renames it model.layers.0.)
FC_NORM_TENSOR = "fc_norm.{k}.weight"
FC_NORM_PREFIX = "fc_norm."
HF_WEIGHTS = "model.safetensors"  # fixtures._write_hf's one weights file
STAGING_PREFIX = ".eagle3-"  # the pair is built in a scratch directory inside `outdir`, then moved in


@dataclass(frozen=True)
class Eagle3Variant:
    """One EAGLE3 fixture: the checkpoint's settings, all correct (the converter writes them)."""

    name: str
    doc: str
    target_variant: str = "clean"  # fixtures variant whose target this pair uses: "clean" (qwen3), "llama"
    n_vocab: int = TINY.n_vocab  # the target's vocabulary
    n_vocab_draft: int = TINY.n_vocab // 2  # rows of lm_head; d2t maps them to target ids
    target_layers: tuple[int, ...] | None = TARGET_LAYERS  # None: config states none, the converter's default
    norm_before_fc: bool = False  # RMSNorm (input_norm) on the concatenated target features before fc
    has_own_embeddings: bool = False  # embed_tokens.weight shipped, else the target's token_embd is borrowed
    is_trained: bool = False  # the trained pair (featdiff.factory.training.eagle3), with held-out prompts.txt
    # a target family run through transformers (featdiff.factory.hf_targets): its target-hf/ and the
    # converter's target.gguf replace the qwen3 target the drafter converts against (the drafter
    # reads only the target's sizes and vocabulary there, which the tiny families share)
    target_family: str = ""
    # how the checkpoint is laid out: the converter's (top-level ids beside midlayer.*), a trainer's
    # (LAYOUTS: SpecForge's nested ids naming layer outputs, Eagle3Speculator's, EAGLE's own)
    layout: str = LAYOUT_CONVERTER
    fc_norm: bool = False  # SpecForge's per-slot feature norms fc_norm.{0,1,2}.weight (fc_norm: true)


_VARIANTS = (
    Eagle3Variant(
        "eagle3", "qwen3 target, EAGLE3 drafter drafting a reduced vocabulary (d2t), target layers [1, 3, 5]"
    ),
    Eagle3Variant(
        "eagle3-full-vocab",
        "EAGLE3 drafter over the whole target vocabulary (identity d2t)",
        n_vocab_draft=TINY.n_vocab,
    ),
    Eagle3Variant(
        "eagle3-norm-before-fc", "EAGLE3 drafter normalizing the target features before fc", norm_before_fc=True
    ),
    Eagle3Variant("eagle3-llama", "llama-arch target, EAGLE3 drafter", target_variant="llama"),
    Eagle3Variant(
        "eagle3-default-layers", "EAGLE3 drafter stating no target layers (converter default)", target_layers=None
    ),
    Eagle3Variant("eagle3-own-embd", "EAGLE3 drafter with its own token embeddings", has_own_embeddings=True),
    Eagle3Variant(
        "eagle3-qwen3moe",
        "Qwen3-MoE target through transformers (reference from target-hf/), EAGLE3 drafter",
        target_family="qwen3moe",
    ),
    Eagle3Variant(
        "eagle3-specforge",
        "SpecForge's layout: ids of layer outputs [0, 2, 4] under eagle_config (the GGUF carries them + 1: the "
        "pinned converter, which reads no eagle_config, wrote its default, fixed after it)",
        layout=LAYOUT_SPECFORGE,
    ),
    Eagle3Variant(
        "eagle3-specforge-fc-norm",
        "SpecForge's layout with fc_norm (one RMSNorm per target slot): the pinned converter refuses it; "
        "draft.gguf is what a converter dropping fc_norm.* writes (an export fault)",
        layout=LAYOUT_SPECFORGE,
        fc_norm=True,
    ),
    Eagle3Variant(
        "eagle3-speculators",
        "Eagle3Speculator's layout (vLLM speculators: layers.0.*, transformer_layer_config, ids of layer inputs)",
        layout=LAYOUT_SPECULATORS,
    ),
    Eagle3Variant(
        "eagle3-eagle",
        "EAGLE's own layout (midlayer.*, no ids: the inputs of [2, n // 2, n - 3], the converter's default)",
        layout=LAYOUT_EAGLE,
        target_layers=None,
    ),
    Eagle3Variant(
        "trained-eagle3",
        "EAGLE3 drafter trained on the trained target (full vocabulary): accept rate means something",
        n_vocab=TRAINED_N_VOCAB,
        n_vocab_draft=TRAINED_N_VOCAB,
        is_trained=True,
    ),
)
EAGLE3_SETTINGS: dict[str, Eagle3Variant] = {v.name: v for v in _VARIANTS}
EAGLE3_VARIANTS: dict[str, str] = {v.name: v.doc for v in _VARIANTS}


def checked_eagle3_variant(name: str) -> Eagle3Variant:
    """`name`'s settings, else an InputError listing the known variants."""
    if name not in EAGLE3_SETTINGS:
        raise InputError(
            f"--variant {name!r}: no such EAGLE3 fixture variant; choose one of {', '.join(EAGLE3_VARIANTS)}"
        )
    return EAGLE3_SETTINGS[name]


def write_eagle3_fixture(outdir: str | Path, variant: str = "eagle3", seed: int = 0) -> Path:
    """Write `variant`'s pair into `outdir`: the fixtures' target of `seed` (the trained pair's,
    for a trained variant) and an EAGLE3 drafter (HF directories), and the pinned converter's GGUFs
    of both; return `outdir`. A trained variant adds `prompts.txt`; any other removes an earlier one.

    The pair is built in a scratch directory inside `outdir` and moved in whole: each of
    `target-hf/`, `draft-hf/` and the GGUFs is either the old one or the new one, never a mix
    (a DFlash `draft-hf/` of an earlier `write_fixture` is replaced entirely)."""
    v = checked_eagle3_variant(variant)
    out = check_output_dir(Path(outdir), (), "OUTDIR")
    out.mkdir(parents=True, exist_ok=True)
    files = (TARGET_GGUF, DRAFT_GGUF, VARIANT_FILE) + ((PROMPTS_FILE,) if v.is_trained else ())
    with tempfile.TemporaryDirectory(dir=out, prefix=STAGING_PREFIX) as scratch:
        staging = _write_target(Path(scratch) / "pair", v, seed)
        _write_hf(staging / DRAFT_HF, eagle3_hf_config(v), eagle3_weights(variant, seed))
        _convert(staging, v, Path(scratch))
        if v.target_family:
            _family_target(staging, Path(scratch), v.target_family, seed)
        (staging / VARIANT_FILE).write_text(f"{v.name}: {v.doc} (converted by {CONVERTER})\n")
        for name in (TARGET_HF, DRAFT_HF):
            _swap_dir(staging / name, out / name, Path(scratch))
        for name in files:
            (staging / name).replace(out / name)  # one rename each: old or new, never partly written
    if not v.is_trained:
        (out / PROMPTS_FILE).unlink(missing_ok=True)  # another pair's held-out prompts
    return out


def _write_target(pair: Path, v: Eagle3Variant, seed: int) -> Path:
    """`pair` holding `v`'s target checkpoint `target-hf/` (and a trained variant's `prompts.txt`),
    written by the fixtures' writers; return `pair`."""
    if not v.is_trained:
        staging = write_fixture(pair, v.target_variant, seed, vocab=VOCAB_SPM)
        shutil.rmtree(staging / DRAFT_HF)  # write_fixture's DFlash drafter
        return staging
    from featdiff.factory.training import TRAINED_SIZES, eagle3  # torch, and a first training, only when asked for

    pair.mkdir()
    _write_target_hf(pair / TARGET_HF, eagle3.target_weights(seed), names.ARCH_QWEN3, TRAINED_SIZES)
    _write_held_out_prompts(pair / PROMPTS_FILE, seed, TRAINED_SIZES)
    return pair


def eagle3_weights(variant: str, seed: int) -> dict[str, np.ndarray]:
    """`variant`'s drafter as `draft-hf/model.safetensors` holds it: HF names, HF orientation
    (out, in), `d2t` as offsets (target id = d2t[i] + i), `t2d` a mask over the target vocabulary.
    A trained variant's is the trained drafter of `seed` (trained once per machine, then cached)."""
    v = checked_eagle3_variant(variant)
    if v.is_trained:
        from featdiff.factory.training import eagle3

        return dict(eagle3.trained_eagle3(seed).draft)
    s, n_embd_tgt = DRAFT, TINY.target.n_embd
    n_attn_inp = 2 * s.n_embd  # the layer's attention reads [norm(embedding), norm(fc out)]
    rng = np.random.default_rng([seed, DRAFT_STREAM])
    w = {
        "fc.weight": _linear(rng, s.n_embd, N_EXTRACT * n_embd_tgt),  # (n_embd, n_extract * n_embd_tgt)
        "midlayer.input_layernorm.weight": _norm(rng, s.n_embd),
        "midlayer.hidden_norm.weight": _norm(rng, s.n_embd),
        "midlayer.self_attn.q_proj.weight": _linear(rng, s.n_head * s.n_embd_head, n_attn_inp),
        "midlayer.self_attn.k_proj.weight": _linear(rng, s.n_head_kv * s.n_embd_head, n_attn_inp),
        "midlayer.self_attn.v_proj.weight": _linear(rng, s.n_head_kv * s.n_embd_head, n_attn_inp),
        "midlayer.self_attn.o_proj.weight": _linear(rng, s.n_embd, s.n_head * s.n_embd_head),
        "midlayer.post_attention_layernorm.weight": _norm(rng, s.n_embd),
        "midlayer.mlp.gate_proj.weight": _linear(rng, s.n_ff, s.n_embd),
        "midlayer.mlp.up_proj.weight": _linear(rng, s.n_ff, s.n_embd),
        "midlayer.mlp.down_proj.weight": _linear(rng, s.n_embd, s.n_ff),
        "norm.weight": _norm(rng, s.n_embd),
        "lm_head.weight": _linear(rng, v.n_vocab_draft, s.n_embd),  # (n_vocab_draft, n_embd)
    }
    ids = _draft_ids(rng, v.n_vocab_draft)
    w["d2t"] = ids - np.arange(ids.size, dtype=np.int64)  # HF offsets
    w["t2d"] = np.isin(np.arange(TINY.n_vocab), ids)  # (n_vocab,) bool
    if v.norm_before_fc:
        w["input_norm.weight"] = _norm(rng, N_EXTRACT * n_embd_tgt)
    if v.has_own_embeddings:
        w["embed_tokens.weight"] = rng.standard_normal((TINY.n_vocab, s.n_embd)).astype(np.float32)
    if v.fc_norm:  # far from unit weights: dropping them moves fc_out well past the noise
        w |= {FC_NORM_TENSOR.format(k=k): _norm(rng, n_embd_tgt) * (1.0 + k) for k in range(N_EXTRACT)}
    if v.layout == LAYOUT_SPECULATORS:
        w = {
            SPECULATORS_PREFIX + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k: a
            for k, a in w.items()
        }
    return w


def converted_weights(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A drafter's weights (`eagle3_weights`) under the names GGUF_FROM_HF maps, as draft.gguf
    holds them: Eagle3Speculator's `layers.0.*` as `midlayer.*` (the converter reads both), SpecForge's
    `fc_norm.*` left out (llama.cpp's eagle3 graph has no per-slot norm: the GGUF lacks them)."""
    renamed = {
        "midlayer." + k.removeprefix(SPECULATORS_PREFIX) if k.startswith(SPECULATORS_PREFIX) else k: a
        for k, a in w.items()
    }
    return {k: a for k, a in renamed.items() if not k.startswith(FC_NORM_PREFIX)}


def _draft_ids(rng: np.random.Generator, n_vocab_draft: int) -> np.ndarray:
    """The target ids of the draft vocabulary, sorted: the special tokens and a random rest (all
    of them for a full-size draft vocabulary)."""
    rest = rng.choice(np.arange(N_SPECIAL, TINY.n_vocab), n_vocab_draft - N_SPECIAL, replace=False)
    return np.sort(np.concatenate([np.arange(N_SPECIAL), rest])).astype(np.int64)  # (n_vocab_draft,)


def eagle3_hf_config(v: Eagle3Variant) -> dict:
    """`v`'s config.json, as SpecForge lays out a `LlamaForCausalLMEagle3` checkpoint."""
    config = {
        "architectures": [HF_ARCH],
        "model_type": "llama",
        **_hf_config(DRAFT, v.n_vocab),
        names.HF_DRAFT_VOCAB_SIZE: v.n_vocab_draft,
        HF_TARGET_HIDDEN_SIZE: TINY.target.n_embd,
        HF_NORM_BEFORE_FC: v.norm_before_fc,
        HF_NORM_BEFORE_RESIDUAL: False,
        "tie_word_embeddings": False,
    }
    if v.target_layers is not None:
        config[HF_AUX_LAYER_IDS] = list(v.target_layers)
    if v.layout == LAYOUT_SPECFORGE:
        return _specforge_config(config, v)
    if v.layout == LAYOUT_SPECULATORS:
        return _speculators_config(config, v)
    if v.layout == LAYOUT_EAGLE:  # EAGLE writes the llama fields and draft_vocab_size, nothing of EAGLE3's own
        return {
            k: a
            for k, a in config.items()
            if k not in (HF_TARGET_HIDDEN_SIZE, HF_NORM_BEFORE_FC, HF_NORM_BEFORE_RESIDUAL)
        }
    return config


def _specforge_config(config: dict, v: Eagle3Variant) -> dict:
    """SpecForge's config.json: the ids under eagle_config naming layer OUTPUTS (the input of L + 1
    is the output of L), fc_norm stated as it is."""
    ids = config.pop(HF_AUX_LAYER_IDS, None)
    nested = {HF_AUX_LAYER_IDS: [i - 1 for i in ids]} if ids is not None else {}
    return {**config, SPECFORGE_EAGLE_CONFIG: nested, "fc_norm": v.fc_norm}


def _speculators_config(config: dict, v: Eagle3Variant) -> dict:
    """Eagle3Speculator's config.json: the layer's llama fields nested, the EAGLE3 fields (ids of
    layer inputs) at the top level."""
    layer_keys = set(_hf_config(DRAFT, v.n_vocab)) | {"model_type"}
    top = {k: a for k, a in config.items() if k not in layer_keys}
    layer = {k: a for k, a in config.items() if k in layer_keys}
    return {
        **top,
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        SPECULATORS_LAYER_CONFIG: layer,
    }


def _convert(pair: Path, v: Eagle3Variant, scratch: Path) -> None:
    """The converter's `target.gguf` and `draft.gguf` of `pair`'s HF directories (as
    converter._convert_pair: the target's tokenizer.model first, of the tiny pair's vocabulary,
    which a trained pair's config.json cuts to TRAINED_N_VOCAB; the drafter reads the target's
    config.json and vocabulary).

    A SpecForge checkpoint goes through what the pinned converter cannot do: with fc_norm (no GGUF
    name: it refuses fc_norm.0.weight) a copy without those tensors is converted, as a converter
    dropping them would; its ids (under eagle_config, which the converter never reads: it writes
    its default) are written + 1, the layer inputs llama.cpp taps."""
    write_spm_tokenizer(pair / TARGET_HF / TOKENIZER_MODEL, TINY.n_vocab)
    convert_checkpoint(pair / TARGET_HF, pair / TARGET_GGUF)
    draft = pair / DRAFT_HF
    if v.fc_norm:
        draft = scratch / "draft-without-fc-norm"
        shutil.copytree(pair / DRAFT_HF, draft)
        kept = {k: a for k, a in load_file(str(draft / HF_WEIGHTS)).items() if not k.startswith(FC_NORM_PREFIX)}
        save_file(kept, str(draft / HF_WEIGHTS))
    convert_checkpoint(draft, pair / DRAFT_GGUF, target_dir=pair / TARGET_HF)
    if v.layout == LAYOUT_SPECFORGE and v.target_layers is not None:
        rewrite_gguf(pair / DRAFT_GGUF, pair / DRAFT_GGUF, keys={names.KEY_EAGLE3_TARGET_LAYERS: list(v.target_layers)})


def _family_target(pair: Path, scratch: Path, family: str, seed: int) -> None:
    """`pair`'s target replaced by `family`'s (featdiff.factory.hf_targets: its HF checkpoint and the
    converter's GGUF of it), the drafter already converted against the qwen3 target of the same sizes."""
    from featdiff.factory.hf_targets import write_family_fixture

    fam = write_family_fixture(scratch / "family", family, seed)
    shutil.rmtree(pair / TARGET_HF)
    (fam / TARGET_HF).replace(pair / TARGET_HF)
    (fam / TARGET_GGUF).replace(pair / TARGET_GGUF)


def _swap_dir(new: Path, dst: Path, trash: Path) -> None:
    """`new` renamed to `dst`; an existing `dst` is moved into `trash` first (two renames: `dst`
    is briefly absent, never partly written)."""
    if dst.exists():
        dst.rename(trash / f"old-{dst.name}")
    new.rename(dst)
