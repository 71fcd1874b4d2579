"""Feature fixtures: a clean pair with one checkpoint feature the reference models or refuses (an M-RoPE
target, fc scales, attention sinks...), for `featdiff fixture --feature`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.outputs import replaced
from featdiff.factory.fixtures import MASK_ROW_SEED, VOCAB_TEST, write_fixture
from featdiff.factory.gguf_rewrite import rewrite_gguf
from featdiff.factory.pairs import (
    TINY,
)


def _feature_specs() -> dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """feature -> (GGUF keys, dflash_config fields, top-level config.json fields)."""
    from featdiff.kinds.dflash import modelled as m

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
Q_SCALE = 0.5  # attn_q's per-tensor weight scale: a feature the reference refuses (kinds/dflash/modelled.py)


def _feature_tensors(feature: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """feature -> (GGUF tensors, HF tensors) it adds: fc's ModelOpt per-tensor scale, which the
    converter writes as `fc.scale`; per-head attention sinks (gpt-oss's `self_attn.sinks`); attn_q's
    per-tensor scale (ModelOpt's `weight_scale_2`, `blk.*.attn_q.scale`), which the reference refuses."""
    from featdiff.kinds.dflash import modelled as m

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


def _mask_embedding(out: Path, seed: int) -> dict[str, np.ndarray]:
    """A drafter that ships its own mask row as `draft-hf/mask_embedding.pt` (MiMo's layout); return
    the GGUF tensors the converter makes of it: the target's table with that row patched in as the
    drafter's `token_embd`, and the target's head as its `output`."""
    import torch

    from featdiff.kinds.dflash.modelled import MASK_EMBEDDING_FILE

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
