"""The manifest's entry of a model (dump v1 `models`), read from its GGUF: sizes, hash, what is unmodelled,
DSpark's heads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featdiff.core import names
from featdiff.core.gguf_reader import GgmlLoader, GgufModel, file_sha256, meta, read_gguf
from featdiff.dump.manifest_fields import ModelInfo, dspark_info
from featdiff.kinds import registry as kinds
from featdiff.kinds.unmodelled import gguf_unmodelled


def model_info(path: Path, with_hash: bool = True, ggml: GgmlLoader | None = None) -> ModelInfo:
    """The wiring metadata of a target or drafter GGUF, as a manifest records it."""
    g = read_gguf(path, ggml)
    vocab = meta(g, names.KEY_TOKEN_LIST, [])
    is_draft = g.arch == names.ARCH_DFLASH
    layer_key = kinds.kind_of(g.arch, g.tensors).layer_key if kinds.is_drafter_arch(g.arch) else names.KEY_TARGET_LAYERS
    log_snr = None
    if is_draft:
        log_snr = {
            "enabled": bool(meta(g, names.KEY_LOG_SNR, False)),
            "min": meta(g, names.KEY_MIN_LOG_SNR, None),
            "max": meta(g, names.KEY_MAX_LOG_SNR, None),
        }
    return ModelInfo(
        path=str(path),
        sha256=file_sha256(path) if with_hash else "",
        architecture=g.arch,
        n_layer=int(meta(g, names.KEY_BLOCK_COUNT, 0)),
        n_embd=int(meta(g, names.KEY_EMBEDDING_LENGTH, 0)),
        n_vocab=len(vocab),
        weight_types=tuple(sorted({t.ggml_type for t in g.tensors.values() if len(t.ne) == 2})),
        target_layers=tuple(int(x) for x in meta(g, layer_key, [])),
        block_size=int(meta(g, names.KEY_BLOCK_SIZE, 0)),
        mask_token_id=int(meta(g, names.KEY_MASK_TOKEN, -1)),
        log_snr=log_snr,
        has_own_embeddings=is_draft and names.T_TOKEN_EMBD in g.tensors,
        has_log_snr_tensors=any(n in g.tensors for n in names.LOG_SNR_TENSORS),
        rope_freq_base=float(meta(g, names.KEY_ROPE_FREQ_BASE, names.ROPE_FREQ_BASE_DEFAULT)),
        dspark=_gguf_dspark(g, len(vocab)) if is_draft else None,
        unmodelled=gguf_unmodelled(g) if kinds.is_drafter_arch(g.arch) else (),
    )


def _gguf_dspark(model: GgufModel, n_vocab: int) -> dict[str, Any] | None:
    """The `dspark` entry of a drafter GGUF: None without markov_w1 (llama.cpp runs it as DFlash)."""
    w1 = model.tensors.get(names.T_MARKOV_W1)
    if w1 is None:
        return None
    d2t = model.tensors.get(names.T_D2T)
    return dspark_info(
        rank=int(w1.ne[0]),
        has_confidence_head=names.T_CONF_PROJ_W in model.tensors,  # ggml ne [rank, n_vocab]
        sample_from_anchor=bool(meta(model, names.KEY_SAMPLE_FROM_ANCHOR, True)),
        causal=bool(meta(model, names.KEY_CAUSAL, False)),
        n_vocab_draft=int(d2t.ne[0]) if d2t is not None else n_vocab,
    )
