"""Gemma 4's assistant drafter (llama.cpp's `gemma4-assistant`, src/models/gemma4-assistant.cpp) as a
fixture pair: the tiny Gemma 4 target of the `gemma4` family (factory/hf_families.py) and a tiny
`Gemma4AssistantForCausalLM` for it, both converted by the pinned converter (conversion/gemma.py
Gemma4AssistantModel writes `draft.gguf`). llama.cpp drafts with it as `-md draft.gguf --spec-type
draft-mtp`; featdiff models it (torchref/mtp/gemma4_assistant.py), and the pair is what that is
tested on (tests/llama/test_gemma4_assistant.py).

The assistant's attention has queries only: it reads the target's KV cache (the pinned loader shares
its sliding layers with the target's layer n_layer - 2 and its full ones with n_layer - 1), so its
heads are the target's per kind (width and count of KV heads), and its layer kinds come in the
target's order, sliding first.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from featdiff.core.outputs import check_output_dir, replaced
from featdiff.factory import pairs
from featdiff.factory.converter import (
    DRAFT_GGUF,
    DRAFT_HF,
    TARGET_GGUF,
    TARGET_HF,
    convert_checkpoint,
    write_bpe_tokenizer,
)
from featdiff.factory.hf_families import (
    BOOTSTRAP_OF,
    EMBD_STD,
    FAMILIES,
    GEMMA4_GLOBAL_HEAD_DIM,
    GEMMA4_GLOBAL_KV_HEADS,
    NORM_SPREAD,
    SLIDING_WINDOW,
    TOKENIZER_BYTE_BPE,
)
from featdiff.factory.hf_targets import write_hf_target

GEMMA4_ASSISTANT = "gemma4-assistant"
GEMMA4_ASSISTANT_DOC = (
    "Gemma 4 target (as `gemma4`) with Gemma 4's assistant drafter as draft.gguf (2 query-only layers over the "
    "target's KV cache, its own 32-wide embeddings; -md with --spec-type draft-mtp)"
)
GEMMA4_ASSISTANT_VARIANTS = {GEMMA4_ASSISTANT: GEMMA4_ASSISTANT_DOC}
ASSISTANT_N_EMBD, ASSISTANT_N_FF = 32, 64  # narrower than the target's 64, as the published assistants are
ASSISTANT_LAYER_TYPES = ("sliding_attention", "full_attention")
LAYER_SCALAR = "layer_scalar"  # Gemma 4's per-layer output scalar, a buffer the checkpoint saves
ASSISTANT_STREAM = 5  # the assistant's weights: torch seed seed * 100 + 5, apart from the target's (seed)
# what transformers' module of the assistant has that the checkpoint does not: each layer's own key
# and value projections (the assistant reads the target's; published checkpoints carry none)
_OWN_KV = re.compile(r"\.self_attn\.(k_proj|v_proj|k_norm)\.")


def write_gemma4_assistant_fixture(outdir: str | Path, variant: str = GEMMA4_ASSISTANT, seed: int = 0) -> Path:
    """The Gemma 4 target and its assistant in `outdir`, as HF directories (`target-hf/`,
    `draft-hf/`) and as the pinned converter's GGUFs; return `outdir`."""
    fam = FAMILIES["gemma4"]
    out = check_output_dir(Path(outdir), (), "OUTDIR")
    write_hf_target(out / TARGET_HF, fam, seed)
    write_bpe_tokenizer(out / TARGET_HF, pairs.TINY.n_vocab, byte_level=fam.tokenizer == TOKENIZER_BYTE_BPE)
    bootstrap = BOOTSTRAP_OF[fam.tokenizer]
    convert_checkpoint(out / TARGET_HF, out / TARGET_GGUF, bootstrap=bootstrap)
    write_hf_assistant(out / DRAFT_HF, out / TARGET_HF, seed)
    convert_checkpoint(out / DRAFT_HF, out / DRAFT_GGUF, bootstrap=bootstrap)
    with replaced(out / "VARIANT") as tmp:
        tmp.write_text(f"{variant} (transformers target and assistant, converted): {GEMMA4_ASSISTANT_DOC}\n")
    return out


def write_hf_assistant(path: Path, target_hf: Path, seed: int) -> Path:
    """A tiny `Gemma4AssistantForCausalLM` for the target in `target_hf`, with seeded weights, saved
    into `path` as its checkpoints are laid out (every layer's KV shared, no k/v projections), with
    the target's tokenizer files."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    target = json.loads((target_hf / "config.json").read_text())
    config = Gemma4AssistantConfig(text_config=_text_config(target), backbone_hidden_size=target["hidden_size"])
    config.architectures = ["Gemma4AssistantForCausalLM"]
    text: Any = config.text_config
    # transformers 5.23's Gemma4TextConfig.kv_sharing_modes refuses a text model whose every layer
    # reads a shared cache (no layer of a kind makes one), which the assistant's config demands
    # (validate_architecture): build it with none shared, save it with all shared, drop _OWN_KV
    text.num_kv_shared_layers = 0
    model = Gemma4AssistantForCausalLM(config)
    _seeded(model, seed)
    text.num_kv_shared_layers = len(ASSISTANT_LAYER_TYPES)
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(path, safe_serialization=True)
    weights = path / "model.safetensors"
    kept = {k: v for k, v in load_file(str(weights)).items() if not _OWN_KV.search(k)}
    save_file(kept, str(weights), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target_hf / name, path / name)
    return path


def _text_config(target: dict[str, Any]) -> Any:
    """The assistant's decoder: the target's head widths and KV head counts per layer kind (it
    attends over the target's cache), RoPE and window, at ASSISTANT_N_EMBD."""
    from transformers import Gemma4TextConfig

    fields: dict[str, Any] = {  # global_head_dim, num_global_key_value_heads: **kwargs of the config
        "vocab_size": target["vocab_size"],
        "hidden_size": ASSISTANT_N_EMBD,
        "intermediate_size": ASSISTANT_N_FF,
        "num_hidden_layers": len(ASSISTANT_LAYER_TYPES),
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target["head_dim"],
        "global_head_dim": GEMMA4_GLOBAL_HEAD_DIM,
        "num_global_key_value_heads": GEMMA4_GLOBAL_KV_HEADS,
        "attention_k_eq_v": True,
        "layer_types": list(ASSISTANT_LAYER_TYPES),
        "sliding_window": SLIDING_WINDOW,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "rope_parameters": target["rope_parameters"],
        "rms_norm_eps": pairs.RMS_EPS,
        "max_position_embeddings": pairs.N_POS_TRAIN,
        "tie_word_embeddings": True,
        "final_logit_softcapping": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    return Gemma4TextConfig(**fields)


def _seeded(model: Any, seed: int) -> None:
    """Every parameter, and each layer's `layer_scalar` buffer, drawn from seed * 100 +
    ASSISTANT_STREAM as the family targets' are (factory/hf_targets.py): matrices N(0, 1/n_in),
    vectors 1 + N(0, NORM_SPREAD), the embedding table N(0, EMBD_STD)."""
    import torch

    g = torch.Generator().manual_seed(seed * 100 + ASSISTANT_STREAM)
    embed = model.get_input_embeddings().weight
    scalars = [(n, b) for n, b in sorted(model.named_buffers()) if n.endswith(LAYER_SCALAR)]
    with torch.no_grad():
        for _, p in [*sorted(model.named_parameters()), *scalars]:
            draw = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p is embed:
                p.copy_(draw * EMBD_STD)
            elif p.ndim <= 1:
                p.copy_(1.0 + NORM_SPREAD * draw)
            else:
                p.copy_(draw / math.sqrt(p.shape[-1]))
