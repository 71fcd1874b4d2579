"""An MTP head (multi-token prediction, llama.cpp's "nextn" block) as the pinned graphs compute
it (upstream `src/models/qwen35.cpp`, `qwen35moe.cpp`, `glm4-moe.cpp` and `mimo2.cpp` graph_mtp),
and its GGUF loader (the checkpoint's is torchref/mtp/hf.py):

    e = embed(token)                      mtp_tok_embd-<il>   (the head's own table, else the model's)
    [e_norm, h_norm] = [enorm(e), hnorm(h)]  mtp_enorm / mtp_hnorm / mtp_concat-<il>: embedding first
    x = eh_proj [e_norm, h_norm]          mtp_eh_proj-<il>
    x += gated attention(attn_norm(x))    mtp_attn_residual-<il>: q/gate interleaved per head, q/k
                                          norms, RoPE on the first n_rot dims, causal over the cache
    x += SwiGLU(post_attention_norm(x))   mtp_post_ffn-<il>
    h_nextn = head_norm(x)                h_nextn: the next step's recycled hidden
    logits = head h_nextn                 result_output

`h` is the target's post-final-norm hidden of the previous position (the target graph's
`h_nextn`), or the previous draft step's `h_nextn`. Besides the graph's names each eval records
the candidates compare names faults from (docs/records.md): `mtp_concat-<il>@slots=1,0` (the
halves as [h, e]), `mtp_hnorm-<il>@norm=enorm` / `mtp_enorm-<il>@norm=hnorm` (the two norms each
with the other's weight), and `mtp_h_input@h=prenorm` / `mtp_hnorm-<il>@h=prenorm` (the head handed
the target's hidden before its final norm), `@h=l_out-<il>` (an earlier layer's) or
`@h=chain_prenorm` (a step handed the previous step's `mtp_post_ffn`, before the head norm), given
those rows; a MoE block's `mtp_post_ffn-<il>@routing=<softmax|sigmoid>` (routed by the other gating
function) and an MLA block's `mtp_ffn_inp-<il>@halves=rope_first` (its query and compressed KV rows
read as [rope, nope]).

What differs by architecture is in mtp_layer.GRAPHS: glm4moe's decoder layer is GLM-4.5's (q/k/v
with biases, no output gate, RoPE on the first n_rot dims), its residual is named
`mtp_ffn_inp-<il>`, and its MoE FFN (as qwen35moe's, a routed one in place of the SwiGLU) chooses
its experts by sigmoid plus a choice bias. mimo2's (MiMo-V2) is a sliding-window layer with fused
q/k/v, sinks and a value scale, its head norm `layer_output_norm`, and it keeps the hidden state
before the norms: `h` is the target's trunk output before its final norm, and `h_nextn` (the
output rows only) is mtp_post_ffn, the head norm applied after it for the logits; its wrong-norm
candidates are `@h=postnorm` and `@h=chain_postnorm`.

Weights are held in the GGUF's convention (norm weights as llama.cpp multiplies them: a Qwen3.5
checkpoint's zero-centred norms plus one, as the converter writes them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import GgufModel, array_from_tensor, int_meta, meta, read_gguf_weights
from featdiff.llama import ggml_dequant
from featdiff.kinds.mtp import mtp_head_block, refused_head
from featdiff.torchref.attention import KvCache
from featdiff.torchref.load_gguf import _rope_scaling
from featdiff.torchref.mtp.layer import (
    ATTENTION_OPTIONAL,
    BIAS_SUFFIX,
    DENSE_FFN,
    GRAPHS,
    MOE_CHOICE_BIAS,
    MOE_EXPERTS,
    MOE_GATE_UP,
    MOE_ROUTER,
    MOE_SHARED,
    MTP_ARCHS,
    MoeRouting,
    moe_ffn,
    swiglu,
)
from featdiff.torchref.numerics import linear, rms_norm
from featdiff.torchref.stack import Named
from featdiff.torchref.weights import Hparams, Source, Target


@dataclass(frozen=True)
class MtpHead:
    """One MTP head: its block and the tables it reads (the model's own where the block has none)."""

    source: Source
    hparams: Hparams  # the block's attention dims and RoPE; n_layer 1 (its cache has one layer)
    il: int  # the block's index in the GGUF (the trunk's layer count): its graph names' suffix
    eh_proj: torch.Tensor  # (n_embd, 2 * n_embd)
    enorm: torch.Tensor  # (n_embd,)
    hnorm: torch.Tensor  # (n_embd,)
    block: dict[str, torch.Tensor]  # the block's GGUF names (`<key>` of `<key>.weight`, or a `.bias` key) -> weights
    head_norm: torch.Tensor  # (n_embd,): nextn.shared_head_norm, else (mimo2) layer_output_norm, else output_norm
    token_embd: torch.Tensor  # (n_vocab, n_embd): nextn.embed_tokens, else the model's table
    output: torch.Tensor  # (n_vocab, n_embd): nextn.shared_head_head, else the model's head
    routing: MoeRouting | None = None  # a MoE block's (block holds MOE_ROUTER); None: a dense FFN
    logit_scale: float = (
        0.0  # the logits' factor where the graph applies the file's (MtpGraph.logit_scale_key); 0: none
    )


@dataclass(frozen=True)
class MtpPass:
    """One decode of the head: its logits and h_nextn rows, the records, the cache after it."""

    logits: torch.Tensor  # (n_outputs, n_vocab)
    h_nextn: torch.Tensor  # (n_tokens, n_embd): the next step's hidden, as the arch's graph recycles it
    other_norm: torch.Tensor  # (n_tokens, n_embd): the state the other convention would recycle (MtpGraph.is_prenorm)
    records: tuple[Named, ...]
    cache: KvCache


def decode(
    head: MtpHead,
    tokens: torch.Tensor,
    h: torch.Tensor,
    positions: torch.Tensor,
    cache: KvCache,
    alternatives: Mapping[str, torch.Tensor] | None = None,
    outputs: bool = True,
) -> MtpPass:
    """The MTP graph over rows (token, h) at `positions`, causal over the cached cells; every row
    an output, or none (`outputs`: process()'s catch-up decode, whose `result_output` has no rows).
    `alternatives`: hypothesis -> the rows `(n_tokens, n_embd)` the head would be handed under it,
    recorded as `mtp_h_input@<hypothesis>` and `mtp_hnorm-<il>@<hypothesis>`."""
    hp, il = head.hparams, head.il
    e = head.token_embd[tokens]  # (n_tokens, n_embd)
    h_norm = rms_norm(h, head.hnorm, hp.rms_eps)
    e_norm = rms_norm(e, head.enorm, hp.rms_eps)
    concat = torch.cat([e_norm, h_norm], dim=1)  # (n_tokens, 2 * n_embd): ggml_concat(e_norm, h_norm, 0)
    x = linear(concat, head.eh_proj)  # (n_tokens, n_embd)
    graph = GRAPHS[hp.arch]
    out = _decoder_layer(head, x, positions, cache)
    residual, post_ffn, cache_after = out.residual, out.post_ffn, out.cache
    normed = graph.head_norm(post_ffn, head.head_norm, hp.rms_eps)
    logits = linear(normed if outputs else normed[:0], head.output)  # (n_outputs, n_vocab)
    if head.logit_scale:  # cohere2moe.cpp scales the head's logits by f_logit_scale
        logits = logits * head.logit_scale
    # mimo2.cpp takes the output rows before naming h_nextn; the post-norm graphs name all rows
    h_nextn, other = (post_ffn, normed) if graph.is_prenorm else (normed, post_ffn)
    h_nextn_rows = h_nextn if outputs or not graph.is_prenorm else h_nextn[:0]  # (n_outputs or n_tokens, n_embd)
    if graph.has_early_rows and not outputs:  # qwen3next.cpp: no output rows from the residual on
        residual, post_ffn, h_nextn_rows = residual[:0], post_ffn[:0], h_nextn_rows[:0]  # (0, n_embd) each
    if graph.has_rows_before_ffn and not outputs:  # nemotron-h-moe.cpp: the residual keeps every row
        post_ffn, h_nextn_rows = post_ffn[:0], h_nextn_rows[:0]  # (0, n_embd) each
    layer = lambda base: names.layer_name(base, il)  # noqa: E731
    candidates = [Named(names.candidate_name(layer(names.MTP_CONCAT), names.slots_hypothesis((1, 0))),
                        torch.cat([h_norm, e_norm], dim=1)),
                  Named(names.candidate_name(layer(names.MTP_HNORM), names.HYP_NORM_ENORM),
                        rms_norm(h, head.enorm, hp.rms_eps)),
                  Named(names.candidate_name(layer(names.MTP_ENORM), names.HYP_NORM_HNORM),
                        rms_norm(e, head.hnorm, hp.rms_eps))]  # fmt: skip
    if out.crossed is not None:  # the MoE block routed by the other gating function (names.HYP_ROUTING)
        routed_by = (
            names.HYP_ROUTING_SOFTMAX if head.routing and head.routing.has_sigmoid_gating else names.HYP_ROUTING_SIGMOID
        )
        candidates.append(
            Named(names.candidate_name(layer(names.MTP_POST_FFN), routed_by), out.crossed[: len(post_ffn)])
        )
    if out.other_halves is not None:  # MLA's rows read [rope, nope] (names.HYP_HALVES_ROPE_FIRST)
        candidates.append(
            Named(
                names.candidate_name(layer(graph.residual), names.HYP_HALVES_ROPE_FIRST),
                out.other_halves[: len(residual)],
            )
        )
    for hypothesis, rows in (alternatives or {}).items():
        candidates += [
            Named(names.candidate_name(names.MTP_H_INPUT, hypothesis), rows),
            Named(names.candidate_name(layer(names.MTP_HNORM), hypothesis), rms_norm(rows, head.hnorm, hp.rms_eps)),
        ]
    records = (
        Named(names.MTP_H_INPUT, h),
        Named(layer(names.MTP_TOK_EMBD), e),
        Named(layer(names.MTP_HNORM), h_norm),
        Named(layer(names.MTP_ENORM), e_norm),
        Named(layer(names.MTP_CONCAT), concat),
        Named(layer(names.MTP_EH_PROJ), x),
        Named(layer(graph.residual), residual),
        Named(layer(names.MTP_POST_FFN), post_ffn),
        Named(names.H_NEXTN, h_nextn_rows),
        Named(names.RESULT_OUTPUT, logits),
        *candidates,
    )
    return MtpPass(logits, h_nextn, other, _named(records, graph.unnamed, il), cache_after)


def _named(records: tuple[Named, ...], unnamed: tuple[str, ...], il: int) -> tuple[Named, ...]:
    """`records` less those of the `unnamed` layer records (and their candidates): what the graph names."""
    left_out = tuple(names.layer_name(base, il) for base in unnamed)
    return tuple(r for r in records if r.name.split(names.CANDIDATE_SEP)[0] not in left_out)


class LayerOut(NamedTuple):
    """The head's decoder layer on one eval's eh_proj rows."""

    residual: torch.Tensor  # the record under the graph's residual name
    post_ffn: torch.Tensor  # mtp_post_ffn's rows
    crossed: torch.Tensor | None  # mtp_post_ffn with a MoE block routed by the other gating function
    other_halves: torch.Tensor | None  # the residual with the attention's rows read the other way (graph.other_halves)
    cache: KvCache  # the cache after the attention


def _decoder_layer(head: MtpHead, x: torch.Tensor, positions: torch.Tensor, cache: KvCache) -> LayerOut:
    """The head's decoder layer on the eh_proj rows `x` `(n_tokens, n_embd)` (LayerOut), with the
    candidates' rows where the block has them (None otherwise): a MoE block routed by the other
    gating function (sigmoid for softmax, and back), the attention's halves read the other way.
    Sequential (the FFN reads ffn_norm of the attention's residual) or parallel (cohere2moe.cpp:
    attention and FFN both read attn_norm's rows, the residual record is the attention's output alone)."""
    hp, b, graph = head.hparams, head.block, GRAPHS[head.hparams.arch]
    attn_in = rms_norm(x, b["attn_norm"], hp.rms_eps)
    attn_out, cache_after = graph.attention(hp, b, attn_in, positions, cache)
    residual = attn_out + x
    ffn_in = attn_in if graph.is_parallel else rms_norm(residual, b[graph.ffn_norm], hp.rms_eps)
    ffn_out, crossed = _ffn(head, ffn_in)
    other = graph.other_halves(hp, b, attn_in, positions, cache)[0] + x if graph.other_halves else None
    return LayerOut(
        attn_out if graph.is_parallel else residual, ffn_out + residual, _plus(crossed, residual), other, cache_after
    )


def _ffn(head: MtpHead, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The block's MoE FFN (head.routing set), else its dense SwiGLU, on `rows` `(n_tokens, n_embd)`;
    and a MoE FFN's output routed by the other gating function (sigmoid for softmax, and back)."""
    b, routing = head.block, head.routing
    if routing is None:
        return swiglu(rows, b["ffn_gate"], b["ffn_up"], b["ffn_down"]), None
    crossed = replace(routing, has_sigmoid_gating=not routing.has_sigmoid_gating)
    return moe_ffn(b, rows, routing), moe_ffn(b, rows, crossed)


def _plus(rows: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor | None:
    return None if rows is None else rows + residual


# --- from the GGUF ----------------------------------------------------------------------------


def mtp_from_gguf(
    path: Path, dtype: torch.dtype, device: torch.device, llama_dir: Path | None = None, offset: int | None = None
) -> MtpHead:
    """The head of a GGUF that carries one (the target's own, or a separate `mtp-*.gguf`),
    dequantized as load_gguf.target_from_gguf does; `offset`: head k of a chain (block n_layer + k,
    llama.cpp's nextn_layer_offset; torchref/mtp/chain.py), None: the file's single head."""
    g = read_gguf_weights(Path(path), llama_dir, ggml_dequant.load)
    il = _head_block(Path(path), g, offset)
    graph = GRAPHS[g.arch]
    read: set[str] = set()

    def tensor(name: str) -> torch.Tensor:
        if name not in g.tensors:
            raise InputError(f"{path}: tensor {name} is missing; re-convert the checkpoint with its MTP block")
        read.add(name)
        return torch.from_numpy(array_from_tensor(g, name)).to(dtype=dtype, device=device)

    def nextn(name: str) -> torch.Tensor | None:
        full = names.T_NEXTN.format(il=il, name=name)
        return tensor(full) if full in g.tensors else None

    prefix = names.GGUF_LAYER_PREFIX.format(il=il)
    block = {k: tensor(_block_tensor(prefix, k, graph.choice_bias)) for k in _block_keys(g, il)}
    if graph.choice_bias in block:  # under the one name moe_ffn reads
        block[MOE_CHOICE_BIAS] = block.pop(graph.choice_bias)
    if MOE_GATE_UP in block:  # the fused experts: gate rows first (build_moe_ffn's views)
        block["ffn_gate_exps"], block["ffn_up_exps"] = block.pop(MOE_GATE_UP).chunk(2, dim=1)
    required = {k: nextn(k) for k in (names.NEXTN_EH_PROJ, "enorm", "hnorm")}
    missing = [k for k, t in required.items() if t is None]
    if missing:
        raise InputError(
            f"{path}: tensor {names.T_NEXTN.format(il=il, name=missing[0])} is missing; re-convert the head"
        )
    head_norm, embd, head_w = nextn("shared_head_norm"), nextn("embed_tokens"), nextn("shared_head_head")
    out_norm = _block_tensor(prefix, graph.head_norm_fallback) if graph.head_norm_fallback else None
    if head_norm is None and out_norm in g.tensors:  # mimo2.cpp: a converted checkpoint's layer_out_norm
        head_norm = tensor(out_norm)
    head = MtpHead(
        source=Source(Path(path), is_gguf=True, dequantized_by=g.dequantized_by),
        hparams=_block_hparams(g, il),
        il=il,
        eh_proj=required[names.NEXTN_EH_PROJ],  # type: ignore[arg-type]
        enorm=required["enorm"],  # type: ignore[arg-type]
        hnorm=required["hnorm"],  # type: ignore[arg-type]
        block=block,
        head_norm=head_norm if head_norm is not None else tensor(names.T_OUTPUT_NORM),
        token_embd=embd if embd is not None else tensor(names.T_TOKEN_EMBD),
        output=head_w
        if head_w is not None
        else tensor(names.T_OUTPUT if names.T_OUTPUT in g.tensors else names.T_TOKEN_EMBD),
        routing=graph.routing(g) if MOE_ROUTER in block else None,
        logit_scale=float(meta(g, graph.logit_scale_key.format(arch=g.arch), 0.0)) if graph.logit_scale_key else 0.0,
    )
    _refuse_unread(Path(path), g, prefix, read)
    return head


def _head_block(path: Path, g: GgufModel, offset: int | None) -> int:
    """The block of the GGUF's MTP head (`offset`: head k of a chain, block n_layer + k); InputError
    for a file without one, a chain read as one head, or an architecture featdiff does not model."""
    il = mtp_head_block(g)
    if il is None:
        raise InputError(
            f"{path}: {names.KEY_NEXTN_LAYERS.format(arch=g.arch)} is missing or 0: no MTP head (converted with "
            "--no-mtp?); re-convert the checkpoint without --no-mtp"
        )
    if offset is None and int_meta(g, names.KEY_NEXTN_LAYERS) != 1:
        raise InputError(f"{path}: {int_meta(g, names.KEY_NEXTN_LAYERS)} MTP blocks; featdiff models a single head")
    refused = refused_head(g)
    if refused is not None:
        raise InputError(f"{path}: {refused}")
    if g.arch not in MTP_ARCHS:
        raise InputError(
            f"{path}: an MTP head of architecture {g.arch!r}; featdiff models the heads of {', '.join(MTP_ARCHS)}"
        )
    return il + (offset or 0)


def _refuse_unread(path: Path, g: GgufModel, prefix: str, read: set[str]) -> None:
    """InputError naming every tensor of the head block and nextn key the reference did not read."""
    unread = [t for t in g.tensors if t.startswith(prefix) and t not in read]  # the head block's, every one read
    unread += unread_nextn_keys(g)
    if unread:
        raise InputError(
            f"{path}: carries {', '.join(unread)} in the MTP block, which featdiff's MTP reference does not read (a "
            "comparison would silently leave it out); model it in src/featdiff/torchref/mtp/head.py, or re-convert"
        )


# The head's GGUF keys the reference reads: any other key of the arch naming nextn or mtp is unread
NEXTN_READ_KEYS = (names.KEY_NEXTN_LAYERS,)


def _block_keys(g: GgufModel, il: int) -> list[str]:
    """The head block's tensors the reference reads, by their name in the block (`attn_q`, ...):
    the arch's attention, the optional ones the file has, and its dense or MoE FFN."""
    prefix = names.GGUF_LAYER_PREFIX.format(il=il)
    in_block = {t[len(prefix) :].removesuffix(".weight") for t in g.tensors if t.startswith(prefix)}
    graph = GRAPHS[g.arch]
    optional = (*ATTENTION_OPTIONAL, *graph.optional_tensors)
    attention = [*graph.attention_tensors, *(k for k in optional if k in in_block)]
    ffn = _moe_tensors(in_block, graph.experts, graph.choice_bias) if MOE_ROUTER in in_block else list(DENSE_FFN)
    return [*attention, *ffn]


def unread_problems(g: GgufModel) -> list[str]:
    """lint's sentences (without the file's name) for each tensor of the head's block and each
    nextn key the reference does not read (DrafterKind.unread): it refuses such a head."""
    il = mtp_head_block(g) if g.arch in MTP_ARCHS else None
    if il is None:
        return []
    return [
        f"{name} is in the MTP head (block {il}) but featdiff's MTP reference does not read it, and refuses this "
        "head (a comparison would leave it out); model it in src/featdiff/torchref/mtp/head.py, or re-convert "
        "without it"
        for name in (*unread_head_tensors(g, il), *unread_nextn_keys(g))
    ]


def unread_head_tensors(g: GgufModel, il: int) -> list[str]:
    """The tensors of the head's block `il` that mtp_from_gguf reads none of, by name alone (lint:
    no weight is read): not the block's attention or FFN, a nextn tensor, or mimo2's head norm."""
    prefix = names.GGUF_LAYER_PREFIX.format(il=il)
    nextn = (names.NEXTN_EH_PROJ, "enorm", "hnorm", "shared_head_norm", "embed_tokens", "shared_head_head")
    bias = GRAPHS[g.arch].choice_bias
    read = {_block_tensor(prefix, k, bias) for k in _block_keys(g, il)} | {
        names.T_NEXTN.format(il=il, name=n) for n in nextn
    }
    fallback = GRAPHS[g.arch].head_norm_fallback
    if fallback and names.T_NEXTN.format(il=il, name="shared_head_norm") not in g.tensors:
        read.add(_block_tensor(prefix, fallback))
    return [t for t in g.tensors if t.startswith(prefix) and t not in read]


def unread_nextn_keys(g: GgufModel) -> list[str]:
    """The arch's GGUF keys naming nextn or mtp that the reference does not read."""
    read = {k.format(arch=g.arch) for k in NEXTN_READ_KEYS}
    mine = [k for k in g.reader.fields if k.startswith(f"{g.arch}.") and ("nextn" in k.lower() or "mtp" in k.lower())]
    return [k for k in mine if k not in read]


def _block_tensor(prefix: str, key: str, bare: str = MOE_CHOICE_BIAS) -> str:
    """The GGUF name of the block's tensor `key`: `<prefix><key>` for a bias or the graph's `bare`
    choice bias (MtpGraph.choice_bias), else `<prefix><key>.weight`."""
    return f"{prefix}{key}" if key.endswith(BIAS_SUFFIX) or key == bare else f"{prefix}{key}.weight"


def _moe_tensors(in_block: set[str], separate: tuple[str, ...], choice_bias: str = MOE_CHOICE_BIAS) -> list[str]:
    """A MoE block's FFN tensors as the file has them: the router, its choice bias where there is
    one, the experts (separate or fused gate and up), and the shared expert and its gate where
    there are."""
    experts = [MOE_GATE_UP, MOE_EXPERTS[2]] if MOE_GATE_UP in in_block else list(separate)
    optional = [k for k in (choice_bias, *MOE_SHARED) if k in in_block]
    return [MOE_ROUTER, *experts, *optional]


def _block_hparams(g: GgufModel, il: int) -> Hparams:
    """The block's dims as the graphs read them: the model's heads (block `il`'s where the file
    counts KV heads per block) and RoPE (NeoX-style pairs on the first rope.dimension_count dims:
    qwen35's M-RoPE with every section at the same text position, glm4moe's plain NeoX RoPE), one
    layer; a block the sliding-window pattern marks (mimo2's) attends within the window, with the
    sliding layers' RoPE base (llama_model::get_rope_freq_base), and mimo2's value scale."""
    n_embd, n_head = int(meta(g, names.KEY_EMBEDDING_LENGTH)), _of_block(meta(g, names.KEY_HEAD_COUNT), il)
    n_embd_head = int(meta(g, names.KEY_KEY_LENGTH, n_embd // n_head))
    n_rot = int(meta(g, names.KEY_ROPE_DIMS, n_embd_head))
    pattern = meta(g, names.KEY_SLIDING_WINDOW_PATTERN_ARCH, None)
    is_swa = isinstance(pattern, list) and il < len(pattern) and bool(pattern[il])
    base = float(meta(g, names.KEY_ROPE_FREQ_BASE, names.ROPE_FREQ_BASE_DEFAULT))
    return Hparams(
        arch=g.arch,
        n_layer=1,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=_of_block(meta(g, names.KEY_HEAD_COUNT_KV, n_head), il),
        n_embd_head=n_embd_head,
        n_ff=_of_block(meta(g, names.KEY_FEED_FORWARD_LENGTH, 0), il),  # per block (nemotron_h); MoE: experts instead
        n_vocab=int(g.tensors[names.T_TOKEN_EMBD].ne[1]),
        rms_eps=float(meta(g, names.KEY_RMS_EPS, None) or meta(g, names.KEY_NORM_EPS)),  # nemotron_h: the latter only
        rope_base=float(meta(g, names.KEY_ROPE_FREQ_BASE_SWA, base)) if is_swa else base,
        rope_type="neox",
        rope_scaling=_rope_scaling(g, n_rot),
        n_rot=n_rot,
        attn_value_scale=float(meta(g, names.KEY_VALUE_SCALE_ARCH, 0.0)),
        n_swa=int(meta(g, names.KEY_SLIDING_WINDOW_ARCH, 0)) if is_swa else 0,
        swa_layers=(True,) if is_swa else (),
    )


def _of_block(value: int | list[int], il: int) -> int:
    """A per-block hparam (an array, one per block) or one for every block, at block `il`."""
    return int(value[il]) if isinstance(value, list) else int(value)


def check_mtp_pair(target: Target, head: MtpHead) -> None:
    """InputError when the head cannot run on this target's hidden states."""
    if target.hparams.n_embd != head.hparams.n_embd:
        raise InputError(
            f"{head.source.path}: the MTP head is {head.hparams.n_embd} wide, the target {target.source.path} "
            f"{target.hparams.n_embd}; pair the head with its own target"
        )
    if target.hparams.n_vocab != head.hparams.n_vocab:
        raise InputError(
            f"{head.source.path}: the MTP head has {head.hparams.n_vocab} tokens, the target {target.hparams.n_vocab}; "
            "pair the head with its own target"
        )
