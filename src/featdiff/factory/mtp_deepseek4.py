"""A tiny DeepSeek-V4 target with its MTP head (llama.cpp's `deepseek4`), for the `mtp-deepseek4`
fixture: a head llama.cpp runs (`--spec-type draft-mtp -md draft.gguf`) and featdiff refuses by
name (kinds.mtp.UNMODELLED_HEADS). transformers 5.23 has the trunk's model code (`deepseek_v4`) and
none for the head, and the pinned converter (conversion/deepseek.py DeepseekV4Model) reads DeepSeek's
own layout, not transformers': the checkpoint in `target-hf/` is written in that layout, as
DeepSeek-V4-Flash ships it, seeded:

* `embed`, `norm`, `head` and the hyper-connection head `hc_head_{fn,base,scale}`;
* per layer `layers.<i>.*`: `hc_attn_*` / `hc_ffn_*` (HC_MULT streams; fn over the flattened streams),
  `attn_norm`, `ffn_norm`, the attention (`attn.wq_a`, `q_norm`, `wq_b`, the one shared key-value head
  `wkv` and `kv_norm`, the grouped low-rank output `wo_a` / `wo_b`, `attn_sink`), the router `ffn.gate`
  with its bias, the routed experts `ffn.experts.<e>.w{1,2,3}` as DeepSeek ships them (MXFP4: two E2M1
  codes a byte and one E8M0 `scale` per 32 values; the converter repacks them into ggml's MXFP4
  losslessly) and the shared expert `ffn.shared_experts.w{1,2,3}`;
* layer COMPRESSED's attention compresses at ratio 4 (`attn.compressor.*`) with the lightning indexer
  (`attn.indexer.*`): the pinned deepseek4 build needs one such layer, its indexer cache's Hadamard
  rotation being sized from the layers it holds (llama_kv_cache::build_input_k_rot divides by zero,
  SIGFPE, with none); every other layer is a plain sliding-window one (ratio 0);
* the head `mtp.0.*`: a decoder layer as above (ratio 0) with `e_proj` / `h_proj` (the converter
  concatenates them into `nextn.eh_proj`, Q8_0), `enorm`, `hnorm`, `norm` (`nextn.shared_head_norm`)
  and its own `hc_head_*`, which the converter's `--mtp` file holds as the model's.

The converter writes `target.gguf` without the head (its default skips `mtp.*`) and `draft.gguf` with
the head alone (`--mtp`: block n_layer, `deepseek4.nextn_predict_layers` 1, with the token table, the
final norm and the output head). The vocabulary is the fixtures' SentencePiece one, read through the
"spm" bootstrap.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from featdiff.core import names
from featdiff.core.outputs import check_output_dir, replaced
from featdiff.factory import pairs
from featdiff.factory.converter import (
    CONVERTER,
    DRAFT_GGUF,
    TARGET_GGUF,
    TARGET_HF,
    TOKENIZER_MODEL,
    convert_checkpoint,
    write_spm_tokenizer,
)
from featdiff.factory.hf_families import BOOTSTRAP_OF, N_EXPERT, N_EXPERT_USED, N_FF_EXPERT, TOKENIZER_SPM
from featdiff.factory.mtp import HF_SAFETENSORS
from featdiff.factory.pairs import _linear, _norm

VARIANT = "mtp-deepseek4"
DEEPSEEK4_DOC = (
    "DeepSeek-V4 target (hyper-connections, sink attention with a grouped low-rank output, sqrt-softplus "
    "experts; one compressed-attention layer) with its MTP head alone in draft.gguf (`--mtp`; llama.cpp's "
    "deepseek4), written in DeepSeek's own layout; the reference refuses the head by name"
)
DEEPSEEK4_VARIANTS = {VARIANT: DEEPSEEK4_DOC}
N_LAYER = 2  # the trunk: layer 0 sliding-window, layer 1 compressed
COMPRESSED = 1  # the trunk layer that compresses at ratio 4 with the lightning indexer
CSA_RATIO = 4  # deepseek4.cpp's DSV4_CSA_RATIO
HC_MULT = 4  # hyper-connection streams (deepseek4.cpp asserts 4)
HC_MIX = (2 + HC_MULT) * HC_MULT  # a layer's mixes: HC_MULT pre, HC_MULT post, HC_MULT^2 combination
N_HEAD, HEAD_DIM, ROPE_DIM = 4, 32, 16  # heads, their width (one shared key-value head), rotated dims
Q_LORA, O_GROUPS, O_LORA = 32, 2, 16  # the low-rank query, the output's groups and their rank
INDEX_HEADS, INDEX_DIM, INDEX_TOPK = 2, 64, 16  # the lightning indexer (not the head's: no head has one)
MXFP4_BLOCK = 32  # values per E8M0 scale
E8M0_BIAS = 127
EXPERT_SCALE_EXP = -6  # the experts' E8M0 scale, 2^-6: E2M1 codes (|x| <= 6) give weights within 0.094
SLIDING_WINDOW = pairs.N_POS_TRAIN  # outlasts every flow


def deepseek4_config() -> dict:
    """config.json as DeepSeek-V4-Flash ships it (the keys conversion/deepseek.py reads), at the tiny sizes."""
    s = pairs.TINY.target
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": pairs.TINY.n_vocab,
        "hidden_size": s.n_embd,
        "num_hidden_layers": N_LAYER,
        "num_attention_heads": N_HEAD,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "qk_rope_head_dim": ROPE_DIM,
        "q_lora_rank": Q_LORA,
        "o_groups": O_GROUPS,
        "o_lora_rank": O_LORA,
        "moe_intermediate_size": N_FF_EXPERT,
        "n_routed_experts": N_EXPERT,
        "num_experts_per_tok": N_EXPERT_USED,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "sliding_window": SLIDING_WINDOW,
        "compress_ratios": [CSA_RATIO if i == COMPRESSED else 0 for i in range(N_LAYER + 1)],  # the head's last
        "compress_rope_theta": 160000.0,
        "hc_mult": HC_MULT,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "num_hash_layers": 0,
        "index_n_heads": INDEX_HEADS,
        "index_head_dim": INDEX_DIM,
        "index_topk": INDEX_TOPK,
        "rms_norm_eps": pairs.RMS_EPS,
        "rope_theta": pairs.ROPE_BASE,
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def deepseek4_weights(seed: int) -> dict[str, np.ndarray]:
    """The checkpoint's tensors of `seed`, in DeepSeek's layout (the module's docstring)."""
    rng = np.random.default_rng(seed)
    n_embd, n_vocab = pairs.TINY.target.n_embd, pairs.TINY.n_vocab
    w = {
        "embed.weight": rng.standard_normal((n_vocab, n_embd)).astype(np.float32),
        "norm.weight": _norm(rng, n_embd),
        "head.weight": _linear(rng, n_vocab, n_embd),
        **_hc_head(rng, ""),
    }
    for i in range(N_LAYER):
        w |= _layer(rng, f"layers.{i}.", compressed=i == COMPRESSED)
    head = "mtp.0."
    w |= _layer(rng, head, compressed=False)
    w |= {f"{head}e_proj.weight": _linear(rng, n_embd, n_embd), f"{head}h_proj.weight": _linear(rng, n_embd, n_embd)}
    w |= {f"{head}{n}.weight": _norm(rng, n_embd) for n in ("enorm", "hnorm", "norm")}
    return w | _hc_head(rng, head)


def _hc_head(rng: np.random.Generator, prefix: str) -> dict[str, np.ndarray]:
    """The hyper-connection head: HC_MULT weights from the flattened streams, their base and scale."""
    n = HC_MULT * pairs.TINY.target.n_embd
    return {
        f"{prefix}hc_head_fn": _linear(rng, HC_MULT, n),
        f"{prefix}hc_head_base": (0.1 * rng.standard_normal(HC_MULT)).astype(np.float32),
        f"{prefix}hc_head_scale": np.array([0.5], np.float32),
    }


def _layer(rng: np.random.Generator, p: str, compressed: bool) -> dict[str, np.ndarray]:
    """One decoder layer `p` (`layers.<i>.` or the head's `mtp.0.`): hyper-connections, attention
    (compressed at CSA_RATIO with the indexer where `compressed`), the router and the experts."""
    d = pairs.TINY.target.n_embd
    w: dict[str, np.ndarray] = {}
    for hc in ("hc_attn", "hc_ffn"):
        w[f"{p}{hc}_fn"] = _linear(rng, HC_MIX, HC_MULT * d)
        w[f"{p}{hc}_base"] = (0.1 * rng.standard_normal(HC_MIX)).astype(np.float32)
        w[f"{p}{hc}_scale"] = (0.5 + 0.1 * rng.random(3)).astype(np.float32)  # pre, post, combination
    w |= {f"{p}attn_norm.weight": _norm(rng, d), f"{p}ffn_norm.weight": _norm(rng, d)}
    a = f"{p}attn."
    w |= {
        f"{a}attn_sink": rng.standard_normal(N_HEAD).astype(np.float32),
        f"{a}wq_a.weight": _linear(rng, Q_LORA, d),
        f"{a}q_norm.weight": _norm(rng, Q_LORA),
        f"{a}wq_b.weight": _linear(rng, N_HEAD * HEAD_DIM, Q_LORA),
        f"{a}wkv.weight": _linear(rng, HEAD_DIM, d),
        f"{a}kv_norm.weight": _norm(rng, HEAD_DIM),
        f"{a}wo_a.weight": _linear(rng, O_GROUPS * O_LORA, N_HEAD * HEAD_DIM // O_GROUPS),
        f"{a}wo_b.weight": _linear(rng, d, O_GROUPS * O_LORA),
    }
    if compressed:
        w |= _compressor(rng, f"{a}compressor.", HEAD_DIM)
        w |= _compressor(rng, f"{a}indexer.compressor.", INDEX_DIM)
        w |= {
            f"{a}indexer.wq_b.weight": _linear(rng, INDEX_HEADS * INDEX_DIM, Q_LORA),
            f"{a}indexer.weights_proj.weight": _linear(rng, INDEX_HEADS, d),
        }
    f = f"{p}ffn."
    w |= {
        f"{f}gate.weight": _linear(rng, N_EXPERT, d),
        f"{f}gate.bias": (0.1 * rng.standard_normal(N_EXPERT)).astype(np.float32),
    }
    for e in range(N_EXPERT):
        for name, (rows, cols) in (("w1", (N_FF_EXPERT, d)), ("w2", (d, N_FF_EXPERT)), ("w3", (N_FF_EXPERT, d))):
            w[f"{f}experts.{e}.{name}.weight"], w[f"{f}experts.{e}.{name}.scale"] = _mxfp4(rng, rows, cols)
    s = f"{f}shared_experts."
    w |= {f"{s}w1.weight": _linear(rng, N_FF_EXPERT, d), f"{s}w3.weight": _linear(rng, N_FF_EXPERT, d)}
    return w | {f"{s}w2.weight": _linear(rng, d, N_FF_EXPERT)}


def _compressor(rng: np.random.Generator, p: str, width: int) -> dict[str, np.ndarray]:
    """A ratio-4 compressor `p` of `width`-wide rows: overlapping windows, so twice as wide projections."""
    d = pairs.TINY.target.n_embd
    return {
        f"{p}wkv.weight": _linear(rng, 2 * width, d),
        f"{p}wgate.weight": _linear(rng, 2 * width, d),
        f"{p}ape": (0.1 * rng.standard_normal((CSA_RATIO, 2 * width))).astype(np.float32),
        f"{p}norm.weight": _norm(rng, width),
    }


def _mxfp4(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """A routed expert's (rows, cols) weight as DeepSeek ships it: random E2M1 codes, two a byte
    (element 2i in the low nibble), and one E8M0 scale per MXFP4_BLOCK values."""
    codes = rng.integers(0, 16, size=(rows, cols), dtype=np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = np.full((rows, cols // MXFP4_BLOCK), E8M0_BIAS + EXPERT_SCALE_EXP, np.uint8)
    return packed.astype(np.uint8), scale


def write_deepseek4_fixture(outdir: str | Path, variant: str = VARIANT, seed: int = 0) -> Path:
    """Write the fixture into `outdir` (target-hf/, target.gguf, draft.gguf, VARIANT); return it."""
    from safetensors.numpy import save_file

    out = check_output_dir(Path(outdir), (), "OUTDIR")
    hf = out / TARGET_HF
    hf.mkdir(parents=True, exist_ok=True)
    (hf / names.HF_CONFIG).write_text(json.dumps(deepseek4_config(), indent=1, sort_keys=True))
    save_file({k: np.ascontiguousarray(v) for k, v in deepseek4_weights(seed).items()}, str(hf / HF_SAFETENSORS))
    write_spm_tokenizer(hf / TOKENIZER_MODEL, pairs.TINY.n_vocab)
    bootstrap = BOOTSTRAP_OF[TOKENIZER_SPM]
    convert_checkpoint(hf, out / TARGET_GGUF, bootstrap=bootstrap)
    convert_checkpoint(hf, out / DRAFT_GGUF, bootstrap=bootstrap, mtp_only=True)
    with replaced(out / "VARIANT") as tmp:
        tmp.write_text(f"{variant}: {DEEPSEEK4_VARIANTS[variant]} (converted by {CONVERTER})\n")
    return out
