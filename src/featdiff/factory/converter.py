"""The pinned llama.cpp's own converter (`convert_hf_to_gguf.py`, drafters: `conversion/qwen.py`
DFlashModel, DSparkModel) run on featdiff's Hugging Face checkpoints. Consumes a fixture's
`target-hf/` and `draft-hf/` (plus the SentencePiece `tokenizer.model` written here); produces the
GGUFs a user gets from them, cached per machine by the inputs' and the converter's hashes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from featdiff.core import names
from featdiff.core.cache_dir import cache_root, making
from featdiff.core.errors import InputError
from featdiff.core.outputs import check_output_dir, replaced
from featdiff.factory import pairs
from featdiff.factory.features import write_feature_fixture
from featdiff.factory.fixtures import (
    N_BYTES,
    SPM_SPECIAL,
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    VOCAB_SPM,
    write_fixture,
)
from featdiff.llama.binding import project_tree

log = logging.getLogger(__name__)

CONVERTER = "convert_hf_to_gguf.py"
# What the converter's output depends on besides its inputs: the script, its model classes and
# the gguf-py it puts first on sys.path (unless $NO_LOCAL_GGUF; we clear that)
CONVERTER_SOURCES = (CONVERTER, "conversion", "gguf-py/gguf")
# The converter's imports (requirements/requirements-convert_hf_to_gguf.txt of the pinned tree)
CONVERTER_MODULES = ("torch", "transformers", "sentencepiece")
CONVERTER_REQUIREMENTS = "transformers==4.57.6 sentencepiece==0.2.1"
OUTTYPE = "f32"  # the fixtures' weights are float32: f32 keeps them bit for bit
CACHE_SUBDIR = "converted"
CONVERT_TIMEOUT_S = 600  # one tiny checkpoint takes ~5 s, nearly all of it importing torch and transformers
TOKENIZER_MODEL = "tokenizer.model"  # Qwen-family set_vocab tries SentencePiece before tokenizer.json
TARGET_HF, DRAFT_HF = "target-hf", "draft-hf"
TARGET_GGUF, DRAFT_GGUF = "target.gguf", "draft.gguf"
WRITER_PREFIX = "writer-"  # featdiff's own GGUFs of a converted feature fixture, kept beside the converter's
ERROR_TAIL_LINES = 3
# The converter's MTP switches (convert_hf_to_gguf.py argparse; mutually exclusive there): `--no-mtp`
# leaves a checkpoint's MTP head out, `--mtp` writes the head alone (with the embedding, output
# norm and LM head it reads). Given an output file, `--mtp` writes that file (the `mtp-` prefix is
# added only to a name it makes up for an output directory). Each is part of the cache key.
NO_MTP_FLAG, MTP_ONLY_FLAG = "--no-mtp", "--mtp"
_KEY_OF_FLAG = {NO_MTP_FLAG: "-nomtp", MTP_ONLY_FLAG: "-mtponly"}
# A converter class that reads a BPE tokenizer.json (`_set_vocab_gpt2`: Qwen3-MoE, ...) refuses the
# fixtures' 512-token vocabulary (its pre-tokenizer hash is in no upstream list), so a transformers
# family fixture (featdiff.factory.hf_targets) converts through a bootstrap: the pinned converter run with
# one vocabulary method replaced. "spm": `_set_vocab_gpt2` read as `_set_vocab_sentencepiece` (the
# fixtures' tokenizer.model); "pre": for a class with its own BPE set_vocab (Nemotron-H), an
# unrecognized pre-tokenizer hash named "default" (llama.cpp's default BPE pre-tokenizer) instead
# of raising; "glm": for GLM-4.5 (Glm4MoeModel.set_vocab reads GLM's own special tokens,
# `_set_vocab_glm`), the fixtures' tokenizer.model read as `_set_vocab_sentencepiece`. Only the
# vocabulary's route changes; hparams and tensors are upstream's. "mimo" (MiMo-V2, as "spm") is
# the one that changes more: MiMo ships 3 chained MTP heads (model.mtp.layers.{0,1,2}) and its
# converter class hardcodes that count (MimoV2Model._n_nextn: the config does not say it), so a
# checkpoint with one head would convert to nextn_predict_layers 3 and blocks llama.cpp then misses
# at load. The single-head fixture (`mtp-mimo2`) carries one and converts with
# the count set to it; the chained one (`mtp-mimo2-chain`, factory/mtp_chain.py) carries three
# and converts with the converter's own count.
# "deepseek" (DeepSeek-V3): DeepseekV2Model, the pinned converter's class for DeepseekV3ForCausalLM,
# drops the appended MTP layer (`skip_mtp = True`); its subclass Glm4MoeLiteModel (GLM-4.7-Flash, also
# llama.cpp's deepseek2) keeps it and writes `nextn_predict_layers`, so DeepseekV3ForCausalLM is
# converted with that class, its vocabulary (`_set_vocab_glm`) read from tokenizer.model
# (factory/mtp_deepseek.py). "deepseek32" (DeepSeek-V3.2, whose class keeps its head): DeepseekV32Model's
# set_vocab (AutoTokenizer, then the BPE route) read as `_set_vocab_sentencepiece`. "step35" (Step-3.5, as
# "spm"): the converter's pinned transformers (CONVERTER_REQUIREMENTS) knows no `step3p5`, so the converter
# reads config.json as written; transformers 5.23 maps `step3p5` to its Step3p7TextConfig, whose dict
# renames the keys Step35Model reads (num_attention_groups, moe_num_experts, ...): that config is read
# as the pinned one reads it (factory/mtp_step35.py). "bailingmoe3" (Ling 3.0, as "pre"): the same for
# transformers 5.23's `bailing_hybrid`, whose dict renames keys BailingMoeV3Model reads (norm_topk_prob
# as moe_renormalize, ...): config.json read as written (factory/mtp_bailingmoe3.py)
MIMO_N_NEXTN = 1
# argv: [-c, bootstrap, script, args...]
_BOOTSTRAP_HEAD = (
    "import runpy, sys\nfrom pathlib import Path\ntree = Path(sys.argv[1]).parent\n"
    "sys.path[0:0] = [str(tree), str(tree / 'gguf-py')]\nfrom conversion.base import TextModel\n"
)
_BOOTSTRAP_RUN = "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
_PRE_VOCAB = (  # an unrecognized pre-tokenizer hash named "default" instead of raising
    "known = TextModel.get_vocab_base_pre\n"
    + "def pre(self, tokenizer):\n"
    + "    try:\n        return known(self, tokenizer)\n"
    + "    except NotImplementedError:\n        return 'default'\n"
    + "TextModel.get_vocab_base_pre = pre\n"
)


def _raw_config(model_type: str) -> str:
    """A bootstrap's lines reading config.json as written (the pinned transformers knows no `model_type`)."""
    return (
        "import conversion.base as _base\n"
        + "def _read_config(dir_model, *args, **kwargs):\n"
        + f"    raise ValueError('{model_type}: read config.json as the pinned transformers does')\n"
        + "_base.AutoConfig = type('AutoConfig', (), {'from_pretrained': staticmethod(_read_config)})\n"
    )


BOOTSTRAPS = {
    "spm": _BOOTSTRAP_HEAD + "TextModel._set_vocab_gpt2 = TextModel._set_vocab_sentencepiece\n" + _BOOTSTRAP_RUN,
    "pre": _BOOTSTRAP_HEAD + _PRE_VOCAB + _BOOTSTRAP_RUN,
    "glm": _BOOTSTRAP_HEAD + "TextModel._set_vocab_glm = TextModel._set_vocab_sentencepiece\n" + _BOOTSTRAP_RUN,
    "mimo": _BOOTSTRAP_HEAD
    + "TextModel._set_vocab_gpt2 = TextModel._set_vocab_sentencepiece\n"
    + "from conversion.mimo import MimoV2Model\n"
    + f"MimoV2Model._n_nextn = {MIMO_N_NEXTN}\n"
    + _BOOTSTRAP_RUN,
    "deepseek": _BOOTSTRAP_HEAD
    + "TextModel._set_vocab_glm = TextModel._set_vocab_sentencepiece\n"
    + "from conversion.base import ModelBase\nfrom conversion.glm import Glm4MoeLiteModel\n"
    + "ModelBase.register('DeepseekV3ForCausalLM')(Glm4MoeLiteModel)\n"
    + _BOOTSTRAP_RUN,
    "step35": _BOOTSTRAP_HEAD
    + "TextModel._set_vocab_gpt2 = TextModel._set_vocab_sentencepiece\n"
    + _raw_config("step3p5")
    + _BOOTSTRAP_RUN,
    "bailingmoe3": _BOOTSTRAP_HEAD + _PRE_VOCAB + _raw_config("bailing_hybrid") + _BOOTSTRAP_RUN,
    "deepseek32": _BOOTSTRAP_HEAD
    + "from conversion.deepseek import DeepseekV32Model\n"
    + "DeepseekV32Model.set_vocab = TextModel._set_vocab_sentencepiece\n"
    + _BOOTSTRAP_RUN,
}

# A DSpark checkpoint's config.json schemas (conversion/qwen.py DSparkModel.__init__): "nested" as
# featdiff writes it (`dflash_config`), the DFlash lineage's flat `target_layer_ids` and
# `mask_token_id`, and the EAGLE3 style (`aux_hidden_state_layer_ids`: ids of layer inputs, so
# hf + 1; the stack's sizes under `transformer_layer_config`). Without `sample_from_anchor` the
# converter decides by schema: the lineage samples from the anchor, the EAGLE3 style does not.
DSPARK_SCHEMAS = ("nested", "lineage", "eagle3")
_STACK_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "hidden_act",
)  # what transformer_layer_config holds (fixtures._hf_config's stack keys)
# Checkpoint features the pinned converter refuses ("Can not map tensor"), so no correct GGUF of
# them can be converted: Variant field -> why
_UNCONVERTIBLE = {
    "checkpoint_log_snr": "upstream's converter maps no log_snr_fc* tensor",
    "checkpoint_markov_scale": "the Qwen DSpark converter maps no markov_head.markov_w2.scale",
}

# sentencepiece_model.proto: ModelProto.pieces = 1 {piece = 1, score = 2, type = 3},
# .trainer_spec = 2 {model_type = 3 (BPE = 2), vocab_size = 4, byte_fallback = 35},
# .normalizer_spec = 3 {name = 1, add_dummy_prefix = 3, remove_extra_whitespaces = 4, escape_whitespaces = 5}
_PB_VARINT, _PB_FIXED32, _PB_BYTES = 0, 5, 2
_SPM_BPE = 2


def unconvertible_reason(variant: str) -> str | None:
    """Why the converter cannot make `variant`'s GGUFs, or None: a variant whose GGUF export plants
    a fault (`gguf_*`) is not a correct model, and some checkpoints hold what the converter refuses."""
    v = pairs.VARIANTS[variant]
    planted = [f.name for f in dataclasses.fields(v) if f.name.startswith("gguf_") and getattr(v, f.name) != f.default]
    if planted:
        return f"its GGUF export plants a fault ({', '.join(planted)}); the converter writes only correct GGUFs"
    return next((why for field, why in _UNCONVERTIBLE.items() if getattr(v, field)), None)


def write_converted_fixture(
    outdir: str | Path, variant: str = "clean", seed: int = 0, dspark_schema: str = "nested"
) -> Path:
    """Write `variant`'s HF checkpoints into `outdir` (a DSpark drafter's config.json in
    `dspark_schema`) and the pinned converter's GGUFs of them as `target.gguf` and `draft.gguf`
    (the fixture layout); return `outdir`."""
    if (why := unconvertible_reason(variant)) is not None:
        raise InputError(f"variant {variant!r}: {why}; choose a correct variant")
    out = check_output_dir(Path(outdir), (), "OUTDIR")
    write_fixture(out, variant, seed, vocab=VOCAB_SPM)
    if dspark_schema != "nested":
        config_path = out / DRAFT_HF / names.HF_CONFIG
        config = dspark_config(json.loads(config_path.read_text()), dspark_schema)
        with replaced(config_path) as tmp:
            tmp.write_text(json.dumps(config, indent=1))
    return _convert_pair(out, f"{variant} (converted by {CONVERTER}): {pairs.VARIANTS[variant].doc}")


# Feature fixtures (fixtures.write_feature_fixture) whose checkpoint the pinned converter cannot
# write: feature -> why. ModelOpt per-tensor scales (`*.weight_scale_2`) are mapped only beside
# NVFP4 weights (conversion/base.py _generate_nvfp4_tensors: 4-bit packed weights, block scales
# and an input scale), which featdiff's fixtures do not make; their GGUFs come from featdiff's writer.
UNCONVERTIBLE_FEATURES = {
    "fc-scale": "the converter writes fc.scale only from an NVFP4 ModelOpt checkpoint",
    "q-scale": "the converter writes attn_q.scale only from an NVFP4 ModelOpt checkpoint",
}


def write_converted_feature_fixture(outdir: str | Path, feature: str, seed: int = 0) -> Path:
    """Write `feature`'s fixture (fixtures.write_feature_fixture: the clean pair with one modelled
    converter key, tensor or file) into `outdir`, its GGUFs then replaced by the pinned converter's
    of its HF directories; return `outdir`. featdiff's own GGUFs stay beside them as
    `writer-target.gguf` / `writer-draft.gguf`, for comparing the two writers."""
    if feature in UNCONVERTIBLE_FEATURES:
        raise InputError(f"feature {feature!r}: {UNCONVERTIBLE_FEATURES[feature]}; use fixtures.write_feature_fixture")
    out = write_feature_fixture(check_output_dir(Path(outdir), (), "OUTDIR"), feature, seed, vocab=VOCAB_SPM)
    return _converted_in_place(out, f"clean + {feature}")


def write_converted_dflash2_fixture(outdir: str | Path, seed: int = 0) -> Path:
    """The DFlash2 pair (fixtures_dflash2) with the pinned converter's GGUFs, featdiff's beside
    them as for write_converted_feature_fixture; return `outdir`."""
    from featdiff.factory.dflash2 import write_dflash2_fixture

    out = write_dflash2_fixture(check_output_dir(Path(outdir), (), "OUTDIR"), seed, vocab=VOCAB_SPM)
    return _converted_in_place(out, "clean + DFlash2")


def _converted_in_place(out: Path, what: str) -> Path:
    """A fixture directory whose GGUFs featdiff wrote (with the SentencePiece vocabulary), given the
    converter's GGUFs of its HF directories in their place; featdiff's moved to `writer-*.gguf`."""
    for name in (TARGET_GGUF, DRAFT_GGUF):
        (out / name).replace(out / f"{WRITER_PREFIX}{name}")
    return _convert_pair(out, f"{what} (converted by {CONVERTER})")


def _convert_pair(out: Path, variant_line: str) -> Path:
    """The converter's `target.gguf` and `draft.gguf` of the fixture directory `out`'s HF
    checkpoints (the target's SentencePiece tokenizer.model written first), and `variant_line` as
    its VARIANT; return `out`."""
    n_vocab = json.loads((out / TARGET_HF / names.HF_CONFIG).read_text())["vocab_size"]
    write_spm_tokenizer(out / TARGET_HF / TOKENIZER_MODEL, n_vocab)
    convert_checkpoint(out / TARGET_HF, out / TARGET_GGUF)
    convert_checkpoint(out / DRAFT_HF, out / DRAFT_GGUF, target_dir=out / TARGET_HF)
    with replaced(out / "VARIANT") as tmp:
        tmp.write_text(variant_line + "\n")
    return out


def dspark_config(config: dict, schema: str) -> dict:
    """A DSpark drafter's config.json, as featdiff writes it (nested `dflash_config`), in `schema`
    (DSPARK_SCHEMAS). The lineage and EAGLE3 forms state no `sample_from_anchor`: the checkpoint's
    layout must be the one the converter assumes for that schema."""
    if schema not in DSPARK_SCHEMAS:
        raise InputError(f"DSpark schema {schema!r}: choose one of {', '.join(DSPARK_SCHEMAS)}")
    if "markov_head_type" not in config:
        raise InputError(f"config {config.get('architectures')}: not a DSpark drafter; the schemas are DSpark's")
    if schema == "nested":
        return dict(config)
    flat = {k: v for k, v in config.items() if k not in (names.HF_DFLASH_CONFIG, names.HF_SAMPLE_FROM_ANCHOR)}
    hf_ids = config[names.HF_DFLASH_CONFIG][names.HF_TARGET_LAYER_IDS]
    if config[names.HF_SAMPLE_FROM_ANCHOR] != (schema == "lineage"):
        raise InputError(
            f"{schema} DSpark schema implies sample_from_anchor = {schema == 'lineage'}; pick a variant laid out so"
        )
    flat[names.HF_MASK_TOKEN_ID] = config[names.HF_DFLASH_CONFIG][names.HF_MASK_TOKEN_ID]
    if schema == "lineage":
        return {**flat, names.HF_TARGET_LAYER_IDS: hf_ids}
    stack = {k: flat.pop(k) for k in _STACK_KEYS}
    return {**flat, "aux_hidden_state_layer_ids": [i + 1 for i in hf_ids], "transformer_layer_config": stack}


def convert_checkpoint(
    hf_dir: Path,
    out: Path,
    target_dir: Path | None = None,
    tree: Path | None = None,
    bootstrap: str | None = None,
    no_mtp: bool = False,
    mtp_only: bool = False,
) -> Path:
    """`hf_dir` converted to the GGUF `out` by the pinned tree's converter (`--target-model-dir
    target_dir` for a drafter; `bootstrap`: a BOOTSTRAPS key; `no_mtp`: `--no-mtp`, which a
    Qwen3.5 checkpoint without MTP layers needs: conversion/qwen.py asserts MTP tensors otherwise,
    and which leaves a checkpoint's MTP head out; `mtp_only`: `--mtp`, the MTP head alone, as a
    separate draft GGUF), from the per-machine cache when the same inputs were converted by the
    same converter before; return `out`."""
    tree = tree or project_tree()
    if not (tree / CONVERTER).is_file():
        raise InputError(f"{tree / CONVERTER}: no such file; the pinned llama.cpp tree is unpacked by `make setup`")
    route = f"-{bootstrap}-{hashlib.sha256(BOOTSTRAPS[bootstrap].encode()).hexdigest()[:8]}" if bootstrap else ""
    flags = tuple(flag for flag, on in ((NO_MTP_FLAG, no_mtp), (MTP_ONLY_FLAG, mtp_only)) if on)
    key = conversion_key(hf_dir, target_dir, tree) + route + "".join(_KEY_OF_FLAG[f] for f in flags)
    cached = cache_root() / CACHE_SUBDIR / f"{key}.gguf"
    with making(cached):  # another process converting the same inputs: wait for its GGUF
        if not cached.is_file():
            with replaced(cached) as tmp:
                _run_converter(tree, hf_dir, tmp, target_dir, bootstrap, flags)
    with replaced(Path(out)) as tmp:
        shutil.copyfile(cached, tmp)
    return Path(out)


def conversion_key(hf_dir: Path, target_dir: Path | None, tree: Path) -> str:
    """The cache key of one conversion: every input file's name and bytes, the output type and
    the converter's sources."""
    h = hashlib.sha256(f"{OUTTYPE}\0{CONVERTER_REQUIREMENTS}\0".encode())
    for label, root in (("hf", hf_dir), ("target", target_dir), ("converter", tree)):
        if root is None:
            continue
        files = (
            _converter_files(tree) if label == "converter" else sorted(p for p in Path(root).iterdir() if p.is_file())
        )
        for path in files:
            h.update(f"{label}/{path.relative_to(root)}\0".encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _converter_files(tree: Path) -> list[Path]:
    files: list[Path] = []
    for name in CONVERTER_SOURCES:
        path = tree / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def _run_converter(
    tree: Path,
    hf_dir: Path,
    out: Path,
    target_dir: Path | None,
    bootstrap: str | None = None,
    flags: tuple[str, ...] = (),
) -> None:
    script = tree / CONVERTER
    missing = [m for m in CONVERTER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(f"{script} needs {', '.join(missing)}; pip install {CONVERTER_REQUIREMENTS}")
    runner = ["-c", BOOTSTRAPS[bootstrap]] if bootstrap else []
    argv = [sys.executable, *runner, str(script), str(hf_dir), "--outfile", str(out), "--outtype", OUTTYPE]
    if target_dir is not None:
        argv += ["--target-model-dir", str(target_dir)]
    argv += flags
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the tree's own gguf-py
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})  # a local directory: never the hub
    log.info("converting %s with %s", hf_dir, script)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S, check=False)
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-ERROR_TAIL_LINES:])
        raise InputError(f"{hf_dir}: {CONVERTER} exited {done.returncode}: {tail}")


# --- the tokenizer ------------------------------------------------------------------------------


def write_spm_tokenizer(path: Path, n_vocab: int) -> None:
    """The fixtures' SentencePiece vocabulary of `n_vocab` tokens (fixtures.VOCAB_SPM: unk, bos,
    eos, the 256 byte tokens, words, `<mask>` last) as a `tokenizer.model`, written byte by byte
    (no protobuf)."""
    n_words = n_vocab - 1 - len(SPM_SPECIAL) - N_BYTES
    pieces = [(SPM_SPECIAL[0], TOKEN_UNKNOWN), *((t, TOKEN_CONTROL) for t in SPM_SPECIAL[1:])]
    pieces += [(f"<0x{b:02X}>", TOKEN_BYTE) for b in range(N_BYTES)]
    pieces += [(f"w{i}", TOKEN_NORMAL) for i in range(len(pieces), len(pieces) + n_words)] + [("<mask>", TOKEN_CONTROL)]
    body = b"".join(_pb_bytes(1, _pb_bytes(1, p.encode()) + _pb_float(2, 0.0) + _pb_int(3, t)) for p, t in pieces)
    body += _pb_bytes(2, _pb_int(3, _SPM_BPE) + _pb_int(4, len(pieces)) + _pb_int(35, 1))
    body += _pb_bytes(3, _pb_bytes(1, b"identity") + _pb_int(3, 0) + _pb_int(4, 0) + _pb_int(5, 1))
    with replaced(Path(path)) as tmp:
        tmp.write_bytes(body)


def write_bpe_tokenizer(hf_dir: Path, n_vocab: int, byte_level: bool = False) -> None:
    """The fixtures' vocabulary (fixtures.VOCAB_SPM's ids: unk, bos, eos, 256 byte tokens, words,
    `<mask>` last) as a BPE `tokenizer.json` and its `tokenizer_config.json` in `hf_dir`, as the
    checkpoints of a family ship it: Llama-style (byte fallback `<0xNN>` tokens, a Sequence
    decoder: Gemma 4, whose converter class reads it through gguf-py's LlamaHfVocab) or, with
    `byte_level`, GPT-2 style (the 256 bytes as their printable characters: Nemotron-H, written as
    llama.cpp's `gpt2` vocabulary, which needs every byte's token). llama.cpp's BPE vocabulary needs
    at least one merge, so the first words are the word-start mark, `w` and their merge; token ids
    keep their meaning for the weights."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if byte_level:
        start, byte_tokens = _BYTE_CHARS[ord(" ")], list(_BYTE_CHARS)
        pieces = [*SPM_SPECIAL, *byte_tokens, start + "w"]  # `w` is a byte token already
    else:
        start, byte_tokens = "\u2581", [f"<0x{b:02X}>" for b in range(N_BYTES)]  # SentencePiece's word start
        pieces = [*SPM_SPECIAL, *byte_tokens, start, "w", start + "w"]
    pieces += [f"w{i}" for i in range(len(pieces), n_vocab - 1)] + ["<mask>"]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(
        models.BPE(
            vocab=vocab, merges=[(start, "w")], unk_token=SPM_SPECIAL[0], byte_fallback=not byte_level, fuse_unk=True
        )
    )
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(start), normalizers.Replace(" ", start)])
        tok.decoder = decoders.Sequence(
            [decoders.Replace(start, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    tok.add_special_tokens([AddedToken(t, special=True) for t in (*SPM_SPECIAL, "<mask>")])
    unk, bos, eos = SPM_SPECIAL
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": unk, "bos_token": bos, "eos_token": eos}
    with replaced(Path(hf_dir) / "tokenizer.json") as tmp:
        tok.save(str(tmp))
    with replaced(Path(hf_dir) / "tokenizer_config.json") as tmp:
        tmp.write_text(json.dumps(config, indent=1) + "\n")


def _byte_chars() -> tuple[str, ...]:
    """GPT-2's byte-level alphabet: byte b as a printable character (the printable Latin-1 bytes
    as themselves, the others as 256 + n in order), the token text a `gpt2` vocabulary holds."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    shifted = iter(range(256, 512))
    return tuple(chr(b) if b in keep else chr(next(shifted)) for b in range(N_BYTES))


_BYTE_CHARS = _byte_chars()


def _pb_varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _pb_int(field: int, n: int) -> bytes:
    return _pb_varint(field << 3 | _PB_VARINT) + _pb_varint(n)


def _pb_float(field: int, x: float) -> bytes:
    return _pb_varint(field << 3 | _PB_FIXED32) + struct.pack("<f", x)


def _pb_bytes(field: int, payload: bytes) -> bytes:
    return _pb_varint(field << 3 | _PB_BYTES) + _pb_varint(len(payload)) + payload
