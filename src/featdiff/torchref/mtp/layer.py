"""An MTP head's decoder layer as each architecture's graph_mtp computes it (upstream
`src/models/qwen35.cpp`, `qwen35moe.cpp`, `qwen3next.cpp`, `glm4-moe.cpp`, `mimo2.cpp`), for torchref/mtp/head.py's
decode: the attention (Qwen3.5's gated one, GLM-4.5's with q/k/v biases, MiMo-V2's fused one with
sinks in a sliding window), the dense or MoE FFN (routed as llm_graph_context::build_moe_ffn
routes), and GRAPHS, what each architecture does its own way: which hidden state the head is
handed and recycles (after the norm, or MiMo-V2's before it) among them.

Consumes the block's weights (GGUF names without `blk.<il>.`, `<key>.weight` or a `.bias` key)
and rows `(n_tokens, n_embd)`; produces the layer's outputs and the cache after an attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import GgufModel, int_meta, meta
from featdiff.torchref.attention import KvCache, attend, cache_with, layer_kv
from featdiff.torchref.mla import DSA_INDEXER, MLA_ATTENTION, mla_attention
from featdiff.torchref.numerics import linear, rms_norm, rope
from featdiff.torchref.mtp.bailingmoe3 import (
    BAILINGMOE3_ATTENTION,
    BAILINGMOE3_QUERY,
    bailingmoe3_attention,
    refuse_unmodelled as refuse_bailingmoe3,
)
from featdiff.torchref.mtp.cohere2moe import (
    COHERE2MOE_ATTENTION,
    KEY_LOGIT_SCALE,
    cohere2moe_attention,
    refuse_layer_norm,
)
from featdiff.torchref.mtp.hy_v3 import HY_V3_ATTENTION, HY_V3_CHOICE_BIAS, hy_v3_attention
from featdiff.torchref.mtp.step35 import STEP35_ATTENTION, refuse_unmodelled, step35_attention, trunk_names
from featdiff.torchref.stack import Named, scaled_output, windowed
from featdiff.torchref.weights import Hparams

DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")
# qwen35.cpp's layer (load_block_mtp): q and its output gate interleaved per head in attn_q, q/k norms
QWEN35_ATTENTION = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "attn_q_norm",
    "attn_k_norm",
    "post_attention_norm",
)
# glm4-moe.cpp's layer (load_arch_tensors): q/k/v and their biases (create_tensor_qkv), no output
# gate; its q/k norms (GLM-4.5 355B's) and the biases are read where the file has them
GLM4MOE_ATTENTION = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm")
# mimo2.cpp's layer (graph_mtp asserts the fused attn_qkv): rows [q, k, v], and its FFN norm is
# ffn_norm; its attention sinks (attn_sinks) where the file has them
MIMO2_ATTENTION = ("attn_norm", "attn_qkv", "attn_output", "ffn_norm")
ATTENTION_OPTIONAL = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_q_norm", "attn_k_norm", "attn_sinks")
BIAS_SUFFIX = ".bias"  # a block key naming a bias tensor (`blk.<il>.<key>`); the others name `<key>.weight`
# A MoE block (qwen35moe.cpp, glm4-moe.cpp graph_mtp): the router, the experts, the choice bias
# (glm4moe's `exp_probs_b`) and the shared expert, gated by a sigmoid of its own router row
# (qwen35moe) or not (glm4moe: no ffn_gate_inp_shexp); each optional one where the file has it
MOE_ROUTER = "ffn_gate_inp"  # numpy (n_expert, n_embd)
MOE_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # (n_expert, n_ff, n_embd) x2, (n_expert, n_embd, n_ff)
MOE_GATE_UP = "ffn_gate_up_exps"  # the fused form: (n_expert, 2 * n_ff, n_embd), gate rows first
MOE_SHARED = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
MOE_CHOICE_BIAS = "exp_probs_b.bias"  # (n_expert,): added to the probabilities for the choice only
KEY_EXPERT_USED = "{arch}.expert_used_count"
KEY_EXPERT_SCALE = "{arch}.expert_weights_scale"
KEY_EXPERT_GATING = "{arch}.expert_gating_func"  # llama_expert_gating_func_type
KEY_EXPERT_NORM = "{arch}.expert_weights_norm"  # build_moe_ffn's norm_w
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # LLAMA_EXPERT_GATING_FUNC_TYPE_* (0: unsaid)
WEIGHTS_SUM_MIN = 6.103515625e-5  # build_moe_ffn clamps the top-k weights' sum to the smallest f16 normal


@dataclass(frozen=True)
class MoeRouting:
    """How a MoE block routes: build_moe_ffn's arguments as the architecture's graph passes them."""

    n_expert_used: int  # experts per token
    expert_scale: float = 0.0  # {arch}.expert_weights_scale: scales the routed weights unless 0 or 1
    has_sigmoid_gating: bool = False  # probabilities: sigmoid of the router's logits, else softmax
    has_weights_norm: bool = True  # the chosen weights renormalized to sum 1 (norm_w)
    # the shared expert averaged with the routed ones, (routed + shared) / 2 (cohere2moe.cpp), else added
    is_shared_averaged: bool = False
    # experts and shared expert LLM_FFN_RELU_SQR without a gate (nemotron-h-moe.cpp), else SwiGLU
    is_relu_sqr: bool = False


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """`down(silu(gate x) * up x)` (LLM_FFN_SILU, LLM_FFN_PAR)."""
    g = linear(x, gate)
    return linear(g / (1.0 + torch.exp(-g)) * linear(x, up), down)


def relu_sqr(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """`down(relu(up x)^2)` (LLM_FFN_RELU_SQR, no gate: Nemotron-H's experts)."""
    return linear(torch.relu(linear(x, up)) ** 2, down)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ggml_norm times `weight` (LLM_NORM without a bias): each row less its mean over its RMS."""
    centred = x - x.mean(dim=-1, keepdim=True)
    return centred * torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _expert(
    b: dict[str, torch.Tensor], kind: str, x: torch.Tensor, routing: MoeRouting, e: int | None = None
) -> torch.Tensor:
    """Expert `e` of the block's `kind` ("exps"; "shexp": the shared one, e None) on rows `x`."""
    w = {p: b[f"ffn_{p}_{kind}"] if e is None else b[f"ffn_{p}_{kind}"][e] for p in ("up", "down")}
    if routing.is_relu_sqr:
        return relu_sqr(x, w["up"], w["down"])
    gate = b[f"ffn_gate_{kind}"] if e is None else b[f"ffn_gate_{kind}"][e]
    return swiglu(x, gate, w["up"], w["down"])


def moe_ffn(b: dict[str, torch.Tensor], x: torch.Tensor, routing: MoeRouting) -> torch.Tensor:
    """The block `b`'s MoE FFN as build_moe_ffn computes it: probabilities from the router's
    logits (softmax, or sigmoid), the top n_expert_used experts chosen by them plus the choice
    bias where the block has one (left out of the weights), weighted by their probabilities
    (renormalized to sum 1 where the routing says, scaled by expert_weights_scale unless 0 or 1),
    each a SwiGLU (Nemotron-H's: squared ReLU, is_relu_sqr); plus the shared expert's, gated by
    sigmoid of its own router row where the block has one."""
    logits = linear(x, b[MOE_ROUTER])  # (n_tokens, n_expert)
    probs = torch.sigmoid(logits) if routing.has_sigmoid_gating else torch.softmax(logits, dim=-1)
    choice = probs + b[MOE_CHOICE_BIAS] if MOE_CHOICE_BIAS in b else probs  # (n_tokens, n_expert)
    chosen = torch.topk(choice, routing.n_expert_used, dim=-1).indices  # (n_tokens, n_expert_used)
    weights = probs.gather(-1, chosen)  # (n_tokens, n_expert_used)
    if routing.has_weights_norm:
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=WEIGHTS_SUM_MIN)
    if routing.expert_scale not in (0.0, 1.0):
        weights = weights * routing.expert_scale
    out = torch.zeros_like(x)  # (n_tokens, n_embd)
    for t in range(x.shape[0]):
        row = x[t : t + 1]  # (1, n_embd)
        for k in range(routing.n_expert_used):
            e = int(chosen[t, k])
            out[t] += weights[t, k] * _expert(b, "exps", row, routing, e)[0]
    if "ffn_up_shexp" not in b:
        return out
    shared = _expert(b, "shexp", x, routing)  # (n_tokens, n_embd)
    if "ffn_gate_inp_shexp" in b:  # one logit per token, stored (1, n_embd) or (n_embd,)
        shared = shared * torch.sigmoid(x @ b["ffn_gate_inp_shexp"].reshape(-1))[:, None]
    return (out + shared) * 0.5 if routing.is_shared_averaged else out + shared


def _gated_attention(
    hp: Hparams, b: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor, cache: KvCache
) -> tuple[torch.Tensor, KvCache]:
    """Qwen3.5's gated attention: q and its gate interleaved per head in attn_q's rows, q/k RMS
    norms per head, RoPE, causal attention through the cache, the output gated by sigmoid(gate)
    before attn_output. Returns the output `(n_tokens, n_embd)` and the cache with this eval's K/V."""
    n_tokens, d = x.shape[0], hp.n_embd_head
    q_full = linear(x, b["attn_q"]).reshape(n_tokens, hp.n_head, 2 * d)  # per head [q, gate]
    q = rms_norm(q_full[..., :d], b["attn_q_norm"], hp.rms_eps)  # (n_tokens, n_head, d)
    gate = q_full[..., d:].reshape(n_tokens, hp.n_head * d)
    k = rms_norm(linear(x, b["attn_k"]).reshape(n_tokens, hp.n_head_kv, d), b["attn_k_norm"], hp.rms_eps)
    v = linear(x, b["attn_v"]).reshape(n_tokens, hp.n_head_kv, d)
    kqv, cache_after = _attend_cached(hp, q, k, v, positions, cache)  # (n_tokens, n_head * d)
    return linear(kqv * torch.sigmoid(gate), b["attn_output"]), cache_after


def _biased_attention(
    hp: Hparams, b: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor, cache: KvCache
) -> tuple[torch.Tensor, KvCache]:
    """GLM-4.5's attention (glm4-moe.cpp graph_mtp): q/k/v projections plus their biases
    (build_qkv), q/k RMS norms per head where the block has them, RoPE, causal attention through
    the cache, attn_output. Returns the output `(n_tokens, n_embd)` and the cache with this eval's K/V."""
    n_tokens, d = x.shape[0], hp.n_embd_head
    q = _projected(x, b, "attn_q").reshape(n_tokens, hp.n_head, d)
    k = _projected(x, b, "attn_k").reshape(n_tokens, hp.n_head_kv, d)
    v = _projected(x, b, "attn_v").reshape(n_tokens, hp.n_head_kv, d)
    if "attn_q_norm" in b:
        q = rms_norm(q, b["attn_q_norm"], hp.rms_eps)
    if "attn_k_norm" in b:
        k = rms_norm(k, b["attn_k_norm"], hp.rms_eps)
    kqv, cache_after = _attend_cached(hp, q, k, v, positions, cache)  # (n_tokens, n_head * d)
    return linear(kqv, b["attn_output"]), cache_after


def _fused_sink_attention(
    hp: Hparams, b: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor, cache: KvCache
) -> tuple[torch.Tensor, KvCache]:
    """MiMo-V2's attention (mimo2.cpp graph_mtp): q, k and v as views of one attn_qkv product
    (keys as wide as queries, n_embd_head_k; values n_embd_head_v, attn_output's columns per
    head), RoPE on q and k, attention with the block's sinks where it has them, within the
    sliding window where the layer has one (build_attn_inp_kv_iswa), attn_output, then times
    f_attn_value_scale where the file sets one. Returns the output `(n_tokens, n_embd)` and the
    cache with this eval's K/V."""
    n_tokens, d_k = x.shape[0], hp.n_embd_head
    d_v = b["attn_output"].shape[1] // hp.n_head
    qkv = linear(x, b["attn_qkv"])  # (n_tokens, n_head d_k + n_head_kv (d_k + d_v))
    q_end, k_end = hp.n_head * d_k, (hp.n_head + hp.n_head_kv) * d_k
    q = qkv[:, :q_end].reshape(n_tokens, hp.n_head, d_k)
    k = qkv[:, q_end:k_end].reshape(n_tokens, hp.n_head_kv, d_k)
    v = qkv[:, k_end:].reshape(n_tokens, hp.n_head_kv, d_v)
    q, k = rope(q, positions, hp), rope(k, positions, hp)
    k_all, v_all = layer_kv(cache, 0, k, v)
    kv_pos = torch.cat([cache.positions, positions])  # (n_cells + n_tokens,)
    visible = windowed(positions, kv_pos, hp.n_swa, True, None) if hp.is_swa(0) else None  # (n_tokens, n_cells)
    kqv = attend(q, positions, k_all, v_all, kv_pos, causal=True, visible=visible, sinks=b.get("attn_sinks"))
    return scaled_output(hp, linear(kqv, b["attn_output"])), cache_with(cache, positions, [k_all], [v_all])


def _nope_attention(
    hp: Hparams, b: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor, cache: KvCache
) -> tuple[torch.Tensor, KvCache]:
    """Nemotron-H's attention (nemotron-h-moe.cpp graph_mtp): q/k/v projections (build_qkv, their
    biases where the block has them), no RoPE, causal attention through the cache, attn_output.
    Returns the output `(n_tokens, n_embd)` and the cache with this eval's K/V."""
    n_tokens, d = x.shape[0], hp.n_embd_head
    q = _projected(x, b, "attn_q").reshape(n_tokens, hp.n_head, d)
    k = _projected(x, b, "attn_k").reshape(n_tokens, hp.n_head_kv, d)
    v = _projected(x, b, "attn_v").reshape(n_tokens, hp.n_head_kv, d)
    k_all, v_all = layer_kv(cache, 0, k, v)
    kv_pos = torch.cat([cache.positions, positions])  # (n_cells + n_tokens,)
    kqv = attend(q, positions, k_all, v_all, kv_pos, causal=True)  # (n_tokens, n_head * d)
    return linear(kqv, b["attn_output"]), cache_with(cache, positions, [k_all], [v_all])


def _projected(x: torch.Tensor, b: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """`name`'s projection of `x`, plus its bias where the block has one."""
    y = linear(x, b[name])
    bias = b.get(name + BIAS_SUFFIX)
    return y if bias is None else y + bias


def _attend_cached(
    hp: Hparams, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cache: KvCache
) -> tuple[torch.Tensor, KvCache]:
    """RoPE on q `(n_tokens, n_head, d)` and k `(n_tokens, n_head_kv, d)`, then causal attention
    over the cached cells and this eval's; returns `(n_tokens, n_head * d)` and the cache after."""
    q, k = rope(q, positions, hp), rope(k, positions, hp)
    k_all, v_all = layer_kv(cache, 0, k, v)
    kv_pos = torch.cat([cache.positions, positions])  # (n_cells + n_tokens,)
    kqv = attend(q, positions, k_all, v_all, kv_pos, causal=True)  # (n_tokens, n_head * d)
    return kqv, cache_with(cache, positions, [k_all], [v_all])


def _softmax_renormalized(g: GgufModel) -> MoeRouting:
    """qwen35moe.cpp's routing: build_moe_ffn given softmax gating and norm_w as literals."""
    return MoeRouting(int_meta(g, KEY_EXPERT_USED), float(meta(g, KEY_EXPERT_SCALE, 0.0)))


def _no_routing(g: GgufModel) -> MoeRouting:
    """mimo2.cpp's head has a dense FFN (graph_mtp asserts ffn_gate, ffn_up, ffn_down)."""
    raise InputError(f"{g.path}: the {g.arch} MTP block has a router; its graph runs a dense FFN only")


def _routing_of_file(g: GgufModel, unsaid: int = GATING_SIGMOID) -> MoeRouting:
    """glm4-moe.cpp's routing: the file's gating function (`unsaid` where it says none:
    load_arch_hparams) and its expert_weights_norm (false where absent)."""
    gating = int_meta(g, KEY_EXPERT_GATING, 0) or unsaid
    if gating not in (GATING_SOFTMAX, GATING_SIGMOID):
        raise InputError(
            f"{g.path}: {KEY_EXPERT_GATING.format(arch=g.arch)} = {gating}; featdiff models softmax "
            f"({GATING_SOFTMAX}) and sigmoid ({GATING_SIGMOID}) routing"
        )
    return MoeRouting(
        int_meta(g, KEY_EXPERT_USED),
        float(meta(g, KEY_EXPERT_SCALE, 0.0)),
        has_sigmoid_gating=gating == GATING_SIGMOID,
        has_weights_norm=bool(meta(g, KEY_EXPERT_NORM, False)),
    )


def _nemotron_routing(g: GgufModel) -> MoeRouting:
    """nemotron-h-moe.cpp's routing: sigmoid whatever the file says (build_moe_ffn is given
    LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID), the file's expert_weights_norm and scale, and
    squared-ReLU experts without a gate."""
    return replace(_routing_of_file(g), has_sigmoid_gating=True, is_relu_sqr=True)


def _step35_routing(g: GgufModel) -> MoeRouting:
    """step35.cpp's routing: glm4-moe.cpp's (sigmoid where the file says none), refusing by name what of
    the file the reference does not compute (torchref/mtp/step35.py)."""
    refuse_unmodelled(g)
    return _routing_of_file(g)


def _deepseek2_routing(g: GgufModel) -> MoeRouting:
    """deepseek2.cpp's routing: glm4-moe.cpp's, softmax where the file says none (load_arch_hparams)."""
    return _routing_of_file(g, unsaid=GATING_SOFTMAX)


Attention = Callable[
    [Hparams, dict[str, torch.Tensor], torch.Tensor, torch.Tensor, KvCache], tuple[torch.Tensor, KvCache]
]


@dataclass(frozen=True)
class MtpGraph:
    """What one architecture's graph_mtp computes its own way (upstream src/models/<arch>.cpp)."""

    attention: Attention  # (hparams, block, attn_norm's rows, positions, cache) -> (output, cache after)
    attention_tensors: tuple[str, ...]  # the block's attention tensors it requires (ATTENTION_OPTIONAL: where present)
    residual: str  # the callback name of the attention's output plus its input
    routing: Callable[[GgufModel], MoeRouting]  # a MoE block's routing, from the file
    # The hidden state's convention: the target hands the head its trunk output before the final
    # norm and each draft step recycles the block's output before the head norm (mimo2.cpp: the
    # target's h_nextn is set before output_norm, graph_mtp's is mtp_post_ffn), or both after
    # their norms (qwen35.cpp, glm4-moe.cpp)
    is_prenorm: bool = False
    ffn_norm: str = "post_attention_norm"  # the block's norm before its FFN
    head_norm_fallback: str | None = None  # the block's tensor read as the head norm where nextn has none
    # the output rows taken before the attention's residual (qwen3next.cpp graph_mtp: get_rows on
    # the attention output and its input), so the residual, mtp_post_ffn and h_nextn hold the output
    # rows only; the others take them after h_nextn, for the logits
    has_early_rows: bool = False
    # the target's records under the names its graph gives them where they are not embd / l_out-<il>
    # (step35.cpp's attn_norm_in-<il>: torchref/mtp/step35.py); None: those names
    trunk_names: Callable[[tuple[Named, ...]], tuple[Named, ...]] | None = None
    # the output rows taken after the attention's residual, before the FFN (nemotron-h-moe.cpp
    # graph_mtp's crop_before_ffn in a masked draft context): mtp_post_ffn and h_nextn hold them only
    has_rows_before_ffn: bool = False
    experts: tuple[str, ...] = MOE_EXPERTS  # a MoE block's separate expert tensors
    # a MoE block's choice bias as the file names it in the block (hy-v3.cpp's has no `.bias` suffix)
    choice_bias: str = MOE_CHOICE_BIAS
    head_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm  # (rows, weight, eps)
    # Cohere's parallel block (cohere2moe.cpp graph_mtp): the FFN reads attn_norm's rows, not a norm of
    # the attention's residual, and the layer's output is FFN + input + attention output
    is_parallel: bool = False
    logit_scale_key: str | None = None  # the file's key whose value scales the head's logits (unless 0)
    # the block's attention tensors read where the file has them, beyond ATTENTION_OPTIONAL (bailingmoe3's
    # query: attn_q, or the low-rank attn_q_a / attn_q_a_norm / attn_q_b)
    optional_tensors: tuple[str, ...] = ()
    # the records of the head's layer the graph gives no callback name (bailingmoe3.cpp names mtp_eh_proj
    # alone): left out of the reference, as the run can hold none of them
    unnamed: tuple[str, ...] = ()
    # the attention with the other layout of its rows' halves, recorded as the residual's candidate
    # `@halves=rope_first` (names.HYP_HALVES_ROPE_FIRST): MLA's query and compressed KV read [rope, nope]
    other_halves: Attention | None = None


MLA_ROPE_FIRST = partial(mla_attention, rope_first=True)  # the MLA heads' other_halves
QWEN35_GRAPH = MtpGraph(_gated_attention, QWEN35_ATTENTION, names.MTP_ATTN_RESIDUAL, _softmax_renormalized)
GRAPHS = {
    names.ARCH_QWEN35: QWEN35_GRAPH,
    names.ARCH_QWEN35MOE: QWEN35_GRAPH,
    names.ARCH_GLM4MOE: MtpGraph(_biased_attention, GLM4MOE_ATTENTION, names.MTP_FFN_INP, _routing_of_file),
    # Qwen3-Next's head is Qwen3.5-MoE's layer (gated attention, softmax-routed experts renormalized,
    # sigmoid-gated shared expert), but plain NeoX RoPE (no M-RoPE sections; the same angles on text
    # positions) and its output rows taken before the residual
    names.ARCH_QWEN3NEXT: replace(QWEN35_GRAPH, has_early_rows=True),
    names.ARCH_MIMO2: MtpGraph(
        _fused_sink_attention,
        MIMO2_ATTENTION,
        names.MTP_FFN_INP,
        _no_routing,
        is_prenorm=True,
        ffn_norm="ffn_norm",
        head_norm_fallback="layer_output_norm",
    ),
    # deepseek2.cpp graph_mtp: MLA (torchref/mla.py), ffn_norm, the MoE FFN with its ungated shared expert
    names.ARCH_DEEPSEEK2: MtpGraph(
        mla_attention,
        MLA_ATTENTION,
        names.MTP_FFN_INP,
        _deepseek2_routing,
        ffn_norm="ffn_norm",
        other_halves=MLA_ROPE_FIRST,
    ),
    # deepseek32.cpp graph_mtp: deepseek2's head; the block's indexer is loaded and left unused, as there
    names.ARCH_DEEPSEEK32: MtpGraph(
        mla_attention,
        MLA_ATTENTION + DSA_INDEXER,
        names.MTP_FFN_INP,
        _deepseek2_routing,
        ffn_norm="ffn_norm",
        other_halves=MLA_ROPE_FIRST,
    ),
    # glm-dsa.cpp graph_mtp: deepseek32's head (dense MLA, the block's indexer loaded and unused, the
    # shared-head norm at the end of every step, its output the next step's hidden), except the routing
    # where the file names no gating function: sigmoid (GLM's load_arch_hparams), deepseek2's softmax.
    # The trunk differs beyond the head: GLM-5.2's "shared" indexer layers reuse the previous full
    # layer's top-k (indexer_types); below index_topk cells every layer attends to every cell anyway
    names.ARCH_GLM_DSA: MtpGraph(
        mla_attention,
        MLA_ATTENTION + DSA_INDEXER,
        names.MTP_FFN_INP,
        _routing_of_file,
        ffn_norm="ffn_norm",
        other_halves=MLA_ROPE_FIRST,
    ),
    # nemotron-h-moe.cpp graph_mtp: NoPE attention, the MoE sub-layer's squared-ReLU experts routed by
    # sigmoid + a choice bias and its ungated shared expert, the head's own LayerNorm (LLM_NORM, its eps
    # f_norm_eps: the converter writes layer_norm_epsilon only, which llama.cpp reads for its RMS norms too)
    names.ARCH_NEMOTRON_H_MOE: MtpGraph(
        _nope_attention,
        GLM4MOE_ATTENTION,
        names.MTP_ATTN_RESIDUAL,
        _nemotron_routing,
        has_rows_before_ffn=True,
        experts=MOE_EXPERTS[1:],
        head_norm=layer_norm,
    ),
}
# step35.cpp graph_mtp: one full decoder layer per head (chained: draft step k runs head k), its
# attention gated per head (torchref/mtp/step35.py), the MoE routed by sigmoid plus exp_probs_b with an
# ungated shared expert; the target hands over its trunk output before the final norm and each step
# recycles mtp_post_ffn (the output rows), the shared-head norm (else output_norm) only before the logits
GRAPHS[names.ARCH_STEP35] = MtpGraph(
    step35_attention,
    STEP35_ATTENTION,
    names.MTP_ATTN_RESIDUAL,
    _step35_routing,
    is_prenorm=True,
    ffn_norm="ffn_norm",
    trunk_names=trunk_names,
)
# hy-v3.cpp graph_mtp: a full Hy3 decoder layer (q/k-normed attention, torchref/mtp/hy_v3.py), ffn_norm,
# the MoE routed by sigmoid where the file says none plus its bare `exp_probs_b`, an ungated shared
# expert; handed the target's post-norm rows, each step recycling the shared-head norm's, as GLM-4.5's
GRAPHS[names.ARCH_HY_V3] = MtpGraph(
    hy_v3_attention,
    HY_V3_ATTENTION,
    names.MTP_FFN_INP,
    _routing_of_file,
    ffn_norm="ffn_norm",
    choice_bias=HY_V3_CHOICE_BIAS,
)


def _cohere2moe_routing(g: GgufModel) -> MoeRouting:
    """cohere2moe.cpp's routing: glm4-moe.cpp's (sigmoid where the file says none), the shared expert
    averaged in; a LayerNorm file refused by name (torchref/mtp/cohere2moe.py)."""
    refuse_layer_norm(g)
    return replace(_routing_of_file(g), is_shared_averaged=True)


# cohere2moe.cpp graph_mtp: Cohere's parallel decoder layer (attention with interleaved RoPE on the
# whole head, torchref/mtp/cohere2moe.py, and the MoE both on attn_norm's rows), the shared expert
# averaged in, the logits times the file's logit_scale; handed the target's post-norm rows, each step
# recycling the shared-head norm's, as GLM-4.5's
GRAPHS[names.ARCH_COHERE2MOE] = MtpGraph(
    cohere2moe_attention,
    COHERE2MOE_ATTENTION,
    names.MTP_ATTN_OUT,
    _cohere2moe_routing,
    is_parallel=True,
    logit_scale_key=KEY_LOGIT_SCALE,
)


def _bailingmoe3_routing(g: GgufModel) -> MoeRouting:
    """bailingmoe3.cpp's routing: the file's gating function (load_arch_hparams requires one),
    expert_weights_norm and scale; refusing by name what the reference does not compute
    (torchref/mtp/bailingmoe3.py)."""
    refuse_bailingmoe3(g)
    return _routing_of_file(g)


# bailingmoe3.cpp graph_mtp: the trunk's full-attention layer (MLA with a head-wise sigmoid output gate,
# torchref/mtp/bailingmoe3.py), ffn_norm, the MoE routed plus exp_probs_b with an ungated shared expert;
# the head norm is the block's layer_output_norm on every row, which the next step is handed (the target
# hands its output_norm rows), as GLM-4.5's. Of the layer the graph names mtp_eh_proj alone
GRAPHS[names.ARCH_BAILINGMOE3] = MtpGraph(
    bailingmoe3_attention,
    BAILINGMOE3_ATTENTION,
    names.MTP_FFN_INP,
    _bailingmoe3_routing,
    ffn_norm="ffn_norm",
    head_norm_fallback="layer_output_norm",
    optional_tensors=BAILINGMOE3_QUERY,
    unnamed=(
        names.MTP_TOK_EMBD,
        names.MTP_HNORM,
        names.MTP_ENORM,
        names.MTP_CONCAT,
        names.MTP_FFN_INP,
        names.MTP_POST_FFN,
    ),
)
MTP_ARCHS = tuple(GRAPHS)  # the graph_mtp heads modelled here
