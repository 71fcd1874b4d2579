"""What the reference models of an EAGLE3 drafter: the `eagle3.*` keys and the tensors the pinned
llama.cpp's eagle3 loader and graphs read (`src/models/eagle3.cpp`, llama_model_base::load_hparams),
one table, as featdiff.modelled is for the `dflash` graph. The reference (torchref/eagle3.py)
refuses a GGUF carrying anything else, lint lists it (featdiff.preflight, severity unmodelled), and
a capture records it in the manifest (`ModelInfo.unmodelled`) for compare to name.
"""

from __future__ import annotations

from collections.abc import Iterable

from featdiff import names

T_ATTN_NORM_2 = "attn_norm_2"  # blk.0.attn_norm_2.weight: HF `hidden_norm`, on g
LAYER_TENSORS = (  # blk.0's, in load_arch_tensors' order
    *("attn_norm", T_ATTN_NORM_2, "attn_q", "attn_k", "attn_v", "attn_output"),
    *("ffn_norm", "ffn_gate", "ffn_up", "ffn_down"),
)
# The `eagle3.*` keys the reference reads as llama.cpp does (llama_model_base::load_hparams, then
# llama_model_eagle3::load_arch_hparams); any other one is refused. The yarn_* keys are left out:
# the llama-family loader may read them, and the reference does not.
MODELLED_KEYS = frozenset(
    f"{names.ARCH_EAGLE3}.{k}"
    for k in (
        "context_length embedding_length block_count feed_forward_length vocab_size attention.head_count "
        "attention.head_count_kv attention.key_length attention.value_length attention.layer_norm_rms_epsilon "
        "rope.freq_base rope.dimension_count rope.scaling.type rope.scaling.factor rope.scale_linear "
        "rope.scaling.attn_factor rope.scaling.original_context_length rope.scaling.finetuned "
        "target_layers target_hidden_size norm_before_residual norm_before_fc"
    ).split()
)
MODELLED_TENSORS = frozenset(
    {
        names.T_TOKEN_EMBD,
        names.T_OUTPUT,
        names.T_OUTPUT_NORM,
        names.T_FC,
        names.T_ENC_NORM,
        names.T_D2T,
        names.T_ROPE_FREQS,
        *(f"{names.GGUF_LAYER_PREFIX.format(il=0)}{k}.weight" for k in LAYER_TENSORS),
    }
)


def unmodelled_eagle3(keys: Iterable[str], tensors: Iterable[str]) -> tuple[str, ...]:
    """The `eagle3.*` keys and the tensors of an EAGLE3 GGUF the reference does not model."""
    prefix = f"{names.ARCH_EAGLE3}."
    return tuple(k for k in keys if k.startswith(prefix) and k not in MODELLED_KEYS) + tuple(
        t for t in tensors if t not in MODELLED_TENSORS
    )
