"""What a dump's manifest says about a model: read from the GGUF with the `gguf` package.

Consumes a GGUF path; produces a `ModelInfo` (architecture, sizes, DFlash metadata, tensor
types) that capture and inspect record, and that compare reads back from the manifest.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from featdiff import names
from featdiff.errors import InputError
from featdiff.modelled import unmodelled_in

log = logging.getLogger(__name__)

HASH_CHUNK = 1 << 22
GGUF_PY = "gguf-py"  # ModelInfo.dequantized_by when the `gguf` package dequantized the weights


# what a `models` entry without the fields a producer always writes reads as: unknown
UNKNOWN_MODEL: dict[str, Any] = {"path": "", "sha256": "", "architecture": "", "n_layer": 0, "n_embd": 0, "n_vocab": 0}


@dataclass(frozen=True)
class ModelInfo:
    """The metadata of one model that matters for wiring."""

    path: str
    sha256: str
    architecture: str
    n_layer: int
    n_embd: int
    n_vocab: int
    weight_types: tuple[str, ...]  # distinct ggml types of the 2-D weights
    target_layers: tuple[int, ...] = ()  # drafter: input-of-layer ids (GGUF convention)
    block_size: int = 0
    mask_token_id: int = -1
    log_snr: dict[str, Any] | None = None  # {"enabled", "min", "max"} for a drafter
    has_own_embeddings: bool = False
    has_log_snr_tensors: bool = False
    rope_freq_base: float = names.ROPE_FREQ_BASE_DEFAULT
    dspark: dict[str, Any] | None = None  # a DSpark drafter's heads (`dspark_info`); None without markov_w1
    # a reference's GGUF: who dequantized its weights, GGUF_PY or the libggml-base file; None: not
    # said (a capture, whose build's ggml reads them; a HF checkpoint, never quantized)
    dequantized_by: str | None = None
    # a drafter's keys and tensors llama.cpp computes and the reference does not model
    # (featdiff.modelled); optional (docs/dump.md): written only when there is one
    unmodelled: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["weight_types"] = list(self.weight_types)
        d["target_layers"] = list(self.target_layers)
        if self.dequantized_by is None:  # optional (docs/dump.md): written only where it says something
            del d["dequantized_by"]
        if self.unmodelled:
            d["unmodelled"] = list(self.unmodelled)
        else:
            del d["unmodelled"]
        return dict(sorted(d.items()))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelInfo:
        """A manifest's `models` entry (its field types checked by featdiff.dump on reading); a
        field an older or hand-made dump lacks reads as unknown: "", 0, (), or its default."""
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        return cls(
            **{
                **UNKNOWN_MODEL,
                **d,
                "weight_types": tuple(d.get("weight_types", ())),
                "target_layers": tuple(d.get("target_layers", ())),
                "unmodelled": tuple(d.get("unmodelled", ())),
            }
        )


def dspark_info(
    rank: int, has_confidence_head: bool, sample_from_anchor: bool, causal: bool, n_vocab_draft: int
) -> dict[str, Any]:
    """ModelInfo's `dspark` entry (docs/dump.md): what the Markov and confidence heads are."""
    return {
        "markov": True,
        "rank": rank,
        "confidence_head": has_confidence_head,
        "sample_from_anchor": sample_from_anchor,
        "causal": causal,
        "n_vocab_draft": n_vocab_draft,
    }


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


# gguf-py's reader refuses a tensor type id its enum lacks with this in the message
UNKNOWN_TYPE_MESSAGE = "is not a valid GGMLQuantizationType"


def open_gguf(path: Path):
    """A `gguf.GGUFReader` for `path`, or an InputError naming the file. A tensor type newer
    than gguf-py (Q2_0, ...) is learnt from the default llama.cpp build's ggml, once."""
    from gguf import GGUFReader

    for first in (True, False):
        try:
            return GGUFReader(str(path))
        except (ValueError, OSError, KeyError, IndexError) as e:
            if first and UNKNOWN_TYPE_MESSAGE in str(e) and _learn_types(path, e):
                continue  # the types it lacked are taught: read again
            raise InputError(f"{path}: not a readable GGUF ({e}); re-export the model") from None
    raise AssertionError("unreachable: the second read returns or raises")


def _learn_types(path: Path, error: Exception) -> bool:
    """Teach gguf-py the tensor types of the default build's ggml; whether any was new."""
    from featdiff.llama import ggml_dequant

    try:
        taught = ggml_dequant.teach_gguf_py(ggml_dequant.load(None))
    except InputError as e:
        raise InputError(
            f"{path}: holds a tensor type gguf-py does not know ({error}) and no llama.cpp build is at hand to "
            f"read it ({e}); set $FEATDIFF_LLAMA_DIR to a build that reads it"
        ) from None
    log.info("%s: tensor types %s read through the default build's ggml", path, ", ".join(taught) or "none")
    return bool(taught)


def field_value(reader, key: str, default: Any = None) -> Any:
    """A metadata value: str, number, bool, or list for arrays; `default` when absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def model_info(path: Path, with_hash: bool = True) -> ModelInfo:
    """Read the wiring metadata of a target or drafter GGUF."""
    reader = open_gguf(path)
    arch = field_value(reader, names.KEY_ARCH)
    if arch is None:
        raise InputError(f"{path}: no {names.KEY_ARCH}; this GGUF lacks the llama.cpp metadata")
    tensors = {t.name: t for t in reader.tensors}
    vocab = field_value(reader, "tokenizer.ggml.tokens", [])
    is_draft = arch == names.ARCH_DFLASH
    log_snr = None
    if is_draft:
        log_snr = {
            "enabled": bool(field_value(reader, names.KEY_LOG_SNR, False)),
            "min": field_value(reader, names.KEY_MIN_LOG_SNR),
            "max": field_value(reader, names.KEY_MAX_LOG_SNR),
        }
    return ModelInfo(
        path=str(path),
        sha256=file_sha256(path) if with_hash else "",
        architecture=arch,
        n_layer=int(field_value(reader, f"{arch}.block_count", 0)),
        n_embd=int(field_value(reader, f"{arch}.embedding_length", 0)),
        n_vocab=len(vocab),
        weight_types=tuple(sorted({t.tensor_type.name.lower() for t in reader.tensors if len(t.shape) == 2})),
        target_layers=tuple(int(x) for x in field_value(reader, names.KEY_TARGET_LAYERS, [])),
        block_size=int(field_value(reader, names.KEY_BLOCK_SIZE, 0)),
        mask_token_id=int(field_value(reader, names.KEY_MASK_TOKEN, -1)),
        log_snr=log_snr,
        has_own_embeddings=is_draft and names.T_TOKEN_EMBD in tensors,
        has_log_snr_tensors=any(n in tensors for n in names.LOG_SNR_TENSORS),
        rope_freq_base=float(
            field_value(reader, names.KEY_ROPE_FREQ_BASE.format(arch=arch), names.ROPE_FREQ_BASE_DEFAULT)
        ),
        dspark=_gguf_dspark(reader, tensors, len(vocab)) if is_draft else None,
        unmodelled=gguf_unmodelled(reader) if is_draft else (),
    )


def gguf_unmodelled(reader) -> tuple[str, ...]:
    """The drafter GGUF's `dflash.*` keys and tensors the reference does not model (featdiff.modelled)."""
    keys = {k: f.contents() for k, f in reader.fields.items() if k.startswith(f"{names.ARCH_DFLASH}.")}
    return unmodelled_in(keys, (t.name for t in reader.tensors))


def _gguf_dspark(reader, tensors: dict[str, Any], n_vocab: int) -> dict[str, Any] | None:
    """The `dspark` entry of a drafter GGUF: None without markov_w1 (llama.cpp runs it as DFlash)."""
    w1 = tensors.get(names.T_MARKOV_W1)
    if w1 is None:
        return None
    d2t = tensors.get(names.T_D2T)
    return dspark_info(
        rank=int(w1.shape[0]),
        has_confidence_head=names.T_CONF_PROJ_W in tensors,  # ggml ne [rank, n_vocab]
        sample_from_anchor=bool(field_value(reader, names.KEY_SAMPLE_FROM_ANCHOR, True)),
        causal=bool(field_value(reader, names.KEY_CAUSAL, False)),
        n_vocab_draft=int(d2t.shape[0]) if d2t is not None else n_vocab,
    )
