"""DFlash2 on a draft block (upstream `src/models/dflash.cpp`: `build_dflash2_conv`,
`build_dflash2_selector` and the DFlash2 branches of the decoder graph).

Consumes a drafter's DFlash2 tensors and keys (`DFlash2`, loaded by `of_gguf` / `of_hf`) and the
block's hidden rows; produces the layer records with the four local convolutions
(`attn_conv_in`, `attn_conv_out`, `ffn_conv_in`, `ffn_conv_out`), the selector logits
(`logit_scale`, `final_logit_softcapping`) and the candidate lattice `dflash2_lattice` the driver
walks (featdiff.kinds.dflash.dflash2). Inject evals are unchanged: the convs run on the noise block only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.torchref.attention import KvCache
from featdiff.torchref.numerics import f32_scalar, ffn, linear, rms_norm
from featdiff.torchref.stack import LayerTrace, Named, layer_trace, scaled_output, self_attention

# GGUF keys and tensors (src/llama-arch.cpp LLM_KV_DFLASH_* / LLM_TENSOR_DFLASH_*)
KEY_CONV_KERNEL_SIZE = "dflash.conv_kernel_size"
KEY_CONV_GROUP_SIZE = "dflash.conv_group_size"
KEY_SELECTOR_RANK = "dflash.selector_rank"
KEY_SELECTOR_TOP_K = names.KEY_SELECTOR_TOP_K
KEY_LOGIT_SCALE = "dflash.logit_scale"
KEY_SOFTCAP = "dflash.final_logit_softcapping"
T_SELECTOR_PREV = "selector_predecessor.weight"  # numpy (n_vocab, rank)
T_SELECTOR_NEXT = "selector_successor.weight"  # numpy (n_vocab, rank)
T_SELECTOR_HIDDEN = "selector_hidden.weight"  # numpy (rank, n_embd)
KEYS = (KEY_CONV_KERNEL_SIZE, KEY_CONV_GROUP_SIZE, KEY_SELECTOR_RANK, KEY_SELECTOR_TOP_K, KEY_LOGIT_SCALE, KEY_SOFTCAP)
LAYER_CONV = ("attn_conv_base", "attn_conv_proj.weight", "ffn_conv_base", "ffn_conv_proj.weight")
# HF names (gguf-py tensor_mapping.py DFLASH_*; the converter prefixes `model.` and adds `.weight`
# to the codebooks, conversion/qwen.py DFlashModel.modify_tensors)
HF_SELECTOR = {
    T_SELECTOR_PREV: "candidate_selector.predecessor_codebook",
    T_SELECTOR_NEXT: "candidate_selector.successor_codebook",
    T_SELECTOR_HIDDEN: "candidate_selector.hidden_projection.weight",
}
HF_LAYER_CONV = {
    "attn_conv_base": "attention_conv.base_kernel",
    "attn_conv_proj.weight": "attention_conv.kernel_projection.weight",
    "ffn_conv_base": "mlp_conv.base_kernel",
    "ffn_conv_proj.weight": "mlp_conv.kernel_projection.weight",
}
# callback names (dflash.cpp)
ATTN_CONV_IN, ATTN_CONV_OUT = "attn_conv_in", "attn_conv_out"
FFN_CONV_IN, FFN_CONV_OUT = "ffn_conv_in", "ffn_conv_out"
LATTICE = names.DFLASH2_LATTICE
SIDE_IN, SIDE_OUT = 0, 1  # build_dflash2_conv's `side`: before the sub-block, after it


@dataclass(frozen=True)
class ConvPair:
    """One sub-block's conv: a static kernel plus a per-token one projected from its input."""

    base: torch.Tensor  # (2, kernel, n_embd): [side, tap, channel]
    proj: torch.Tensor  # (2 * kernel * n_groups, n_embd): rows [side, tap, group]


@dataclass(frozen=True)
class DFlash2:
    """DFlash2's local convolutions (per layer) and candidate selector, with its keys."""

    kernel_size: int
    group_size: int
    top_k: int
    rank: int
    block_size: int  # dflash.block_size: the lattice has min(block rows, block_size) rows
    logit_scale: float  # 0: none
    softcap: float  # 0: none
    attn_conv: tuple[ConvPair, ...]
    ffn_conv: tuple[ConvPair, ...]
    selector_prev: torch.Tensor  # (n_vocab, rank)
    selector_next: torch.Tensor  # (n_vocab, rank)
    selector_hidden: torch.Tensor  # (rank, n_embd)


# --- loading ------------------------------------------------------------------------------------


def of_tensors(
    keys: Mapping[str, Any],
    tensor: Callable[[str], torch.Tensor | None],
    n_layer: int,
    n_embd: int,
    block_size: int,
    path: str,
) -> DFlash2 | None:
    """The DFlash2 record from GGUF-named keys and tensors (`tensor(name)`: None when absent); None
    without `selector_hidden.weight`, as llama.cpp runs such a file as DFlash. InputError where
    llama.cpp's loader throws (dflash.cpp load_arch_tensors)."""
    hidden = tensor(T_SELECTOR_HIDDEN)
    if hidden is None:
        return None
    ints = {k: int(keys.get(k) or 0) for k in (KEY_CONV_KERNEL_SIZE, KEY_CONV_GROUP_SIZE, KEY_SELECTOR_RANK)}
    top_k = int(keys.get(KEY_SELECTOR_TOP_K) or 0)
    if min(*ints.values(), top_k, block_size) <= 0:
        raise InputError(f"{path}: DFlash2 selector present but {ints | {KEY_SELECTOR_TOP_K: top_k}}; set all four")
    gs = ints[KEY_CONV_GROUP_SIZE]
    if n_embd % gs or n_embd < top_k * (top_k + 1):
        raise InputError(f"{path}: n_embd {n_embd} must divide by conv_group_size {gs} and be >= top_k (top_k + 1)")
    return DFlash2(
        kernel_size=ints[KEY_CONV_KERNEL_SIZE],
        group_size=gs,
        top_k=top_k,
        rank=ints[KEY_SELECTOR_RANK],
        block_size=block_size,
        logit_scale=float(keys.get(KEY_LOGIT_SCALE) or 0.0),
        softcap=float(keys.get(KEY_SOFTCAP) or 0.0),
        attn_conv=tuple(_pair(tensor, path, il, "attn") for il in range(n_layer)),
        ffn_conv=tuple(_pair(tensor, path, il, "ffn") for il in range(n_layer)),
        selector_prev=_required(tensor, path, T_SELECTOR_PREV),
        selector_next=_required(tensor, path, T_SELECTOR_NEXT),
        selector_hidden=hidden,
    )


def _required(tensor: Callable[[str], torch.Tensor | None], path: str, name: str) -> torch.Tensor:
    t = tensor(name)
    if t is None:
        raise InputError(f"{path}: DFlash2 drafter without {name}; re-export it with the pinned converter")
    return t


def _pair(tensor: Callable[[str], torch.Tensor | None], path: str, il: int, part: str) -> ConvPair:
    return ConvPair(
        base=_required(tensor, path, f"blk.{il}.{part}_conv_base"),
        proj=_required(tensor, path, f"blk.{il}.{part}_conv_proj.weight"),
    )


def hf_name(gguf_name: str, layer_prefix: str) -> str:
    """The HF checkpoint's name of a DFlash2 tensor (`layer_prefix`: names.HF_LAYER_PREFIX)."""
    if gguf_name in HF_SELECTOR:
        return HF_SELECTOR[gguf_name]
    _, il, rest = gguf_name.split(".", 2)
    return layer_prefix.format(il=il) + HF_LAYER_CONV[rest]


# --- the graph ----------------------------------------------------------------------------------


def conv(dfl: DFlash2, hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, side: int) -> torch.Tensor:
    """`build_dflash2_conv` on one block `(n_tokens, n_embd)`: row p = sum over taps t of
    (dynamic[p, side, t, group(c)] + base[side, t, c]) * hidden[p - t, c], rows before the block 0.
    Terms are added tap by tap, as ggml adds them."""
    n_tokens, n_embd = hidden.shape
    k, gs = dfl.kernel_size, dfl.group_size
    coeffs = dynamic.reshape(n_tokens, 2, k, n_embd // gs)[:, side]  # (n_tokens, kernel, n_groups)
    weight = coeffs.repeat_interleave(gs, dim=-1) + base[side]  # (n_tokens, kernel, n_embd)
    result = weight[:, 0] * hidden
    for tap in range(1, min(k, n_tokens)):
        shifted = torch.cat([hidden.new_zeros(tap, n_embd), hidden[: n_tokens - tap]])  # (n_tokens, n_embd)
        result = result + weight[:, tap] * shifted
    return result


def layer_forward(
    hp: Any, dfl: DFlash2, layer: Any, x: torch.Tensor, positions: torch.Tensor, cache: KvCache, il: int, causal: bool
) -> tuple[LayerTrace, list[Named]]:
    """One DFlash2 decoder layer over the block `x` (dflash.cpp graph<false>, token branch): the
    layer of stack.layer_forward with the attention and FFN sub-blocks each wrapped in a conv."""
    attn, mlp = dfl.attn_conv[il], dfl.ffn_conv[il]
    h = rms_norm(x, layer.attn_norm, hp.rms_eps)
    attn_dynamic = linear(h, attn.proj)  # (n_tokens, 2 * kernel * n_groups)
    h_in = conv(dfl, h, attn_dynamic, attn.base, SIDE_IN)
    a = self_attention(hp, layer, h_in, positions, cache, il, causal)
    attn_out = scaled_output(hp, linear(a.kqv_out, layer.wo))  # (n_tokens, n_embd)
    attn_out = conv(dfl, attn_out, attn_dynamic, attn.base, SIDE_OUT)
    ffn_inp = attn_out + x
    f = rms_norm(ffn_inp, layer.ffn_norm, hp.rms_eps)
    ffn_dynamic = linear(f, mlp.proj)  # (n_tokens, 2 * kernel * n_groups)
    f_in = conv(dfl, f, ffn_dynamic, mlp.base, SIDE_IN)
    ffn_out = ffn(f_in, layer)
    ffn_conv_out = conv(dfl, ffn_out, ffn_dynamic, mlp.base, SIDE_OUT)
    trace = layer_trace(h, a, ffn_inp, ffn_out, ffn_conv_out + ffn_inp)
    named = [
        Named(f"{ATTN_CONV_IN}-{il}", h_in),
        Named(f"{ATTN_CONV_OUT}-{il}", attn_out),
        Named(f"{FFN_CONV_IN}-{il}", f_in),
        Named(f"{FFN_CONV_OUT}-{il}", ffn_conv_out),
    ]
    return trace, named


def selector_logits(dfl: DFlash2, logits: torch.Tensor) -> torch.Tensor:
    """The head's logits as DFlash2's graph transforms them before the selector (and before the
    d2t scatter): x logit_scale, then softcap * tanh(x / softcap)."""
    if dfl.logit_scale != 0.0:
        logits = logits * f32_scalar(dfl.logit_scale)
    if dfl.softcap > 0.0:
        logits = torch.tanh(logits * f32_scalar(1.0 / f32_scalar(dfl.softcap))) * f32_scalar(dfl.softcap)
    return logits


def top_k_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """ggml_top_k on the CPU backend (ggml-cpu ops.cpp): the k best ids, best first, then ids 0 and
    1 swapped ("emphasize that the order is not important"), `(n_tokens, k)` int64."""
    ids = torch.topk(logits, k, dim=-1).indices  # (n_tokens, k)
    if k > 1:
        ids = ids[:, [1, 0, *range(2, k)]]  # (n_tokens, k)
    return ids


def lattice(dfl: DFlash2, logits: torch.Tensor, norm: torch.Tensor, anchor: int) -> torch.Tensor:
    """`dflash2_lattice` of one block `(min(n_tokens, block_size), n_embd)`: row 0 zeros; row p
    the top-k candidate ids (as floats) then the scores `(top_k pred, top_k succ)` flattened, zero
    padded. score[i, j] = sum_r next[cand_p[j], r] prev[pred_i, r] gate[p, r] + logits[p, cand_p[j]],
    pred the candidates of row p-1 (row 1: the anchor token, the same for every i)."""
    n_tokens, n_embd = norm.shape
    rows = min(n_tokens, dfl.block_size)
    cand = top_k_ids(logits, dfl.top_k)  # (n_tokens, top_k)
    unary = torch.gather(logits, 1, cand)  # (n_tokens, top_k)
    gate = linear(norm, dfl.selector_hidden)  # (n_tokens, rank)
    out = norm.new_zeros(rows, n_embd)  # (rows, n_embd)
    for p in range(1, rows):
        pred = cand[p - 1] if p > 1 else torch.tensor([anchor], device=cand.device)  # (n_pred,)
        cond = dfl.selector_prev[pred] * gate[p]  # (n_pred, rank)
        score = cond @ dfl.selector_next[cand[p]].T  # (n_pred, top_k)
        score = score.expand(dfl.top_k, dfl.top_k) + unary[p]  # (top_k, top_k)
        out[p, : dfl.top_k] = cand[p].to(out.dtype)
        out[p, dfl.top_k : dfl.top_k + dfl.top_k * dfl.top_k] = score.reshape(-1)  # (top_k * top_k,)
    return out
