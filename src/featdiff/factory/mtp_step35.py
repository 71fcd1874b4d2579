"""Tiny Step-3.5 targets with their chained MTP heads (llama.cpp's `step35`), for the `mtp-step35`
fixtures. transformers 5.23 carries no Step-3.5 model code, so the checkpoint is written as the
pinned converter expects it (conversion/step3.py Step35Model: `Step3p5ForCausalLM`, its heads
appended as `model.layers.<n_layer + k>`, zero-centred norms written + 1) and as step35.cpp loads
it: every trunk layer a dense, sliding-window layer (full RoPE) whose window outlasts any test's
context, no attention gate; each head a full-attention layer (RoPE on half the head,
step35.cpp's n_rot_full / 2) with the head-wise gate `g_proj`, N_EXPERT experts routed by sigmoid
plus `router_bias` (step35.cpp's default gating), a shared expert, and its own shared-head norm.

The reference runs the trunk through transformers' `qwen3_moe` (every layer in `mlp_only_layers`):
at this config its math is the Step-3.5 trunk's, and `target-ref/` holds those weights under
Qwen3-MoE's names (norms as llama.cpp multiplies them). The heads are read from target.gguf
(torchref/mtp/step35.py). `-permuted` holds the heads in reverse block order in the GGUF.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from featdiff.core import names
from featdiff.core.outputs import check_output_dir
from featdiff.factory import pairs
from featdiff.factory.converter import (
    TARGET_GGUF,
    TARGET_HF,
    TOKENIZER_MODEL,
    convert_checkpoint,
    write_spm_tokenizer,
)
from featdiff.factory.hf_families import N_EXPERT, N_EXPERT_USED, N_FF_EXPERT
from featdiff.factory.mtp import HF_SAFETENSORS
from featdiff.factory.mtp_chain import ChainVariant, export_chain, permuted

BOOTSTRAP_STEP35 = "step35"  # converter.BOOTSTRAPS: config.json read as written, tokenizer.model as the vocabulary
TARGET_REF = "target-ref"  # the trunk as transformers' qwen3_moe runs it (the reference's --target)
N_HEADS = 3  # Step-3.5-Flash's MTP heads (num_nextn_predict_layers)
N_LAYER = 4  # the tiny trunk
SLIDING_WINDOW = 4096  # outlasts every test's context: the trunk's sliding layers see every cell
SHARED_FF = 32  # share_expert_dim
NORM_SPREAD = 0.1  # zero-centred norm weights drawn around 0 (the converter adds 1)


_CLEAN_DOC = (
    f"Step-3.5 target (a dense sliding-window trunk) with its {N_HEADS} chained MTP heads (gated attention, "
    "sigmoid-routed experts + a shared expert) inside target.gguf, converted from the converter's own layout "
    "(no transformers code); draft step k runs head k"
)
_CLEAN = ChainVariant("mtp-step35", _CLEAN_DOC)
_VARIANTS = (_CLEAN, permuted(_CLEAN, "mtp-step35-chain-permuted"))
STEP35_SETTINGS = {v.name: v for v in _VARIANTS}
STEP35_VARIANTS = {v.name: v.doc for v in _VARIANTS}


def write_step35_fixture(outdir: str | Path, variant: str = "mtp-step35", seed: int = 0) -> Path:
    """Write `variant`'s fixture into `outdir` (target-hf/, target-ref/, target.gguf, VARIANT); return it."""
    v = STEP35_SETTINGS[variant]
    out = check_output_dir(Path(outdir), (), "OUTDIR")
    weights = step35_weights(seed)
    hf = _write_checkpoint(out / TARGET_HF, _step35_config(), weights)
    write_spm_tokenizer(hf / TOKENIZER_MODEL, pairs.TINY.n_vocab)
    _write_checkpoint(out / TARGET_REF, _qwen3moe_config(), qwen3moe_weights(weights))
    return export_chain(convert_checkpoint(hf, out / TARGET_GGUF, bootstrap=BOOTSTRAP_STEP35), v, out)


def _step35_config() -> dict:
    """config.json as conversion/step3.py reads it: the trunk's layers sliding, the heads' full."""
    s, n_all = pairs.TINY.target, N_LAYER + N_HEADS
    layer_types = ["sliding_attention"] * N_LAYER + ["full_attention"] * N_HEADS
    return {
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "vocab_size": pairs.TINY.n_vocab,
        "hidden_size": s.n_embd,
        "intermediate_size": s.n_ff,
        "num_hidden_layers": N_LAYER,
        "num_attention_heads": s.n_head,
        "num_attention_groups": s.n_head_kv,
        "head_dim": s.n_embd_head,
        "rms_norm_eps": pairs.RMS_EPS,
        "rope_theta": pairs.ROPE_BASE,
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": layer_types,
        "partial_rotary_factors": [1.0 if t == "sliding_attention" else 0.5 for t in layer_types],
        "moe_num_experts": N_EXPERT,
        "moe_top_k": N_EXPERT_USED,
        "moe_intermediate_size": N_FF_EXPERT,
        "share_expert_dim": SHARED_FF,
        "norm_expert_weight": True,
        "moe_layers_enum": ",".join(str(i) for i in range(N_LAYER, n_all)),
        "num_nextn_predict_layers": N_HEADS,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _qwen3moe_config() -> dict:
    """transformers' Qwen3-MoE with every layer dense: the Step-3.5 trunk above."""
    s = pairs.TINY.target
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": pairs.TINY.n_vocab,
        "hidden_size": s.n_embd,
        "intermediate_size": s.n_ff,
        "num_hidden_layers": N_LAYER,
        "num_attention_heads": s.n_head,
        "num_key_value_heads": s.n_head_kv,
        "head_dim": s.n_embd_head,
        "rms_norm_eps": pairs.RMS_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": pairs.ROPE_BASE},
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "mlp_only_layers": list(range(N_LAYER)),
        "num_experts": N_EXPERT,
        "num_experts_per_tok": N_EXPERT_USED,
        "moe_intermediate_size": N_FF_EXPERT,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def step35_weights(seed: int) -> dict[str, np.ndarray]:
    """The Step-3.5 checkpoint's tensors (its names, zero-centred norms), seeded."""
    rng = np.random.default_rng(seed)
    s, n_vocab = pairs.TINY.target, pairs.TINY.n_vocab
    q, kv = s.n_head * s.n_embd_head, s.n_head_kv * s.n_embd_head
    out = {"model.embed_tokens.weight": _draw(rng, (n_vocab, s.n_embd), 1.0)}
    for il in range(N_LAYER + N_HEADS):
        p = f"model.layers.{il}."
        for norm, n in (("input_layernorm", s.n_embd), ("post_attention_layernorm", s.n_embd),
                        ("self_attn.q_norm", s.n_embd_head), ("self_attn.k_norm", s.n_embd_head)):  # fmt: skip
            out[f"{p}{norm}.weight"] = _norm(rng, n)
        for name, shape in (("q_proj", (q, s.n_embd)), ("k_proj", (kv, s.n_embd)), ("v_proj", (kv, s.n_embd))):
            out[f"{p}self_attn.{name}.weight"] = _draw(rng, shape, s.n_embd)
        out[f"{p}self_attn.o_proj.weight"] = _draw(rng, (s.n_embd, q), q)
        out |= _head(rng, p) if il >= N_LAYER else _dense(rng, p)
    out["model.norm.weight"] = _norm(rng, s.n_embd)
    out["lm_head.weight"] = _draw(rng, (n_vocab, s.n_embd), s.n_embd)
    return out


def _dense(rng: np.random.Generator, p: str) -> dict[str, np.ndarray]:
    s = pairs.TINY.target
    return {
        f"{p}mlp.gate_proj.weight": _draw(rng, (s.n_ff, s.n_embd), s.n_embd),
        f"{p}mlp.up_proj.weight": _draw(rng, (s.n_ff, s.n_embd), s.n_embd),
        f"{p}mlp.down_proj.weight": _draw(rng, (s.n_embd, s.n_ff), s.n_ff),
    }


def _head(rng: np.random.Generator, p: str) -> dict[str, np.ndarray]:
    """One MTP block: the gate, the MoE FFN with its choice bias and shared expert, the NextN wiring."""
    s, e, f = pairs.TINY.target, N_EXPERT, N_FF_EXPERT
    return {
        f"{p}self_attn.g_proj.weight": _draw(rng, (s.n_head, s.n_embd), s.n_embd),
        f"{p}moe.gate.weight": _draw(rng, (e, s.n_embd), s.n_embd),
        f"{p}moe.router_bias": _draw(rng, (e,), 4.0),
        f"{p}moe.gate_proj.weight": _draw(rng, (e, f, s.n_embd), s.n_embd),  # (n_expert, n_ff_exp, n_embd)
        f"{p}moe.up_proj.weight": _draw(rng, (e, f, s.n_embd), s.n_embd),
        f"{p}moe.down_proj.weight": _draw(rng, (e, s.n_embd, f), f),  # (n_expert, n_embd, n_ff_exp)
        f"{p}share_expert.gate_proj.weight": _draw(rng, (SHARED_FF, s.n_embd), s.n_embd),
        f"{p}share_expert.up_proj.weight": _draw(rng, (SHARED_FF, s.n_embd), s.n_embd),
        f"{p}share_expert.down_proj.weight": _draw(rng, (s.n_embd, SHARED_FF), SHARED_FF),
        f"{p}eh_proj.weight": _draw(rng, (s.n_embd, 2 * s.n_embd), 2 * s.n_embd),  # (n_embd, 2 * n_embd)
        f"{p}enorm.weight": _norm(rng, s.n_embd),
        f"{p}hnorm.weight": _norm(rng, s.n_embd),
        f"{p}transformer.shared_head.norm.weight": _norm(rng, s.n_embd),
    }


def qwen3moe_weights(step35: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The trunk's tensors under Qwen3-MoE's names: the heads left out, norms + 1 (the converter's)."""
    heads = tuple(f"model.layers.{il}." for il in range(N_LAYER, N_LAYER + N_HEADS))
    return {
        name: (a + 1.0).astype(np.float32) if name.endswith("norm.weight") else a
        for name, a in step35.items()
        if not name.startswith(heads)
    }


def _draw(rng: np.random.Generator, shape: tuple[int, ...], fan_in: float) -> np.ndarray:
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    return (NORM_SPREAD * rng.standard_normal(n)).astype(np.float32)


def _write_checkpoint(d: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / names.HF_CONFIG).write_text(json.dumps(config, indent=1, sort_keys=True))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(d / HF_SAFETENSORS))
    return d
