"""Gemma 4's assistant drafter (llama.cpp's `gemma4-assistant`, src/models/gemma4-assistant.cpp) and
its flow (common/speculative.cpp `is_mem_shared`), replayed on the target the reference runs.

The assistant keeps no KV cache: its layers have queries only and attend over the target's own
cache, a sliding layer over target layer n_layer - 2's cells, a full one over n_layer - 1's
(llama-model.cpp's `share`; transformers' Gemma 4 hands them over as `shared_kv_states`), the
sliding ones within the window. Its input is `pre_projection` over [the target's token row times
sqrt(target n_embd), the hidden it is handed]; per layer an RMS norm, the query (its norm, NeoX
RoPE: `rope_freqs` on the full layers) at attention scale 1, the post-attention norm and residual,
a gated tanh-GELU FFN between `ffn_norm` and `post_ffw_norm`, the residual, times
`layer_output_scale`; then `output_norm`, the logits through its own tied `token_embd` and
`h_nextn` = `post_projection` of the norm, at the target's width.

The flow decodes no catch-up rows: after each target batch the last hidden row is pending, after a
verify the row at the accepted length; a round's first step is (the last token, that row) at
n_past, each later one (its draft, the previous step's h_nextn), every step at n_past, over the
target's cells below it (the target's verify rows are rolled back before the next round).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import GgufModel, array_from_tensor, int_meta, meta, read_gguf_weights
from featdiff.core.phases import PREFILL_ROUND, Phase
from featdiff.dump.records import Round
from featdiff.llama import ggml_dequant
from featdiff.torchref.attention import KvCache, attend, truncated
from featdiff.torchref.mtp.flow import _target_eval
from featdiff.torchref.numerics import Numerics, f32_scalar, linear, rms_norm, rope_cache
from featdiff.torchref.rope_params import RopeScaling
from featdiff.torchref.rounds import (
    EvalTrace,
    FlowTrace,
    _empty,
    _eval,
    _ids,
    accept,
    check_plan,
    play_rounds,
    played_round,
    prefill_batches,
)
from featdiff.torchref.stack import Named
from featdiff.torchref.steps import next_token, own_drafts, top1_probability
from featdiff.torchref.weights import Source, Target

ARCH = names.ARCH_GEMMA4_ASSISTANT
# the target layer whose cache an assistant layer reads, counted back from the target's last:
# llama-model.cpp create_memory's `share` for LLM_ARCH_GEMMA4_ASSISTANT
SHARED_FROM_END = {True: 2, False: 1}  # is_swa -> n_layer - this
GELU_TABLE_LIMIT = 10.0  # ggml_vec_geglu_f32 (GGML_GELU_FP16): gate <= -10 gives 0, >= 10 the gate itself
LAYER_TENSORS = (
    "attn_norm",
    "attn_q",
    "attn_q_norm",
    "attn_output",
    "post_attention_norm",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "post_ffw_norm",
    "layer_output_scale",
)


@dataclass(frozen=True)
class AssistantLayer:
    is_swa: bool
    n_head: int
    n_embd_head: int
    n_rot: int
    rope_base: float
    scaling: RopeScaling  # the full layers' `rope_freqs`
    w: Mapping[str, torch.Tensor]  # LAYER_TENSORS


@dataclass(frozen=True)
class Assistant:
    source: Source
    n_embd: int
    n_embd_out: int  # the target's width: what it is handed and hands back
    n_vocab: int
    rms_eps: float
    n_swa: int
    layers: tuple[AssistantLayer, ...]
    token_embd: torch.Tensor  # (n_vocab, n_embd): the tied output too
    output_norm: torch.Tensor  # (n_embd,)
    pre_proj: torch.Tensor  # (n_embd, 2 * n_embd_out)
    post_proj: torch.Tensor  # (n_embd_out, n_embd)


@dataclass(frozen=True)
class StepPass:
    records: tuple[Named, ...]
    logits: torch.Tensor  # (1, n_vocab)
    h_nextn: torch.Tensor  # (1, n_embd_out)


@dataclass(frozen=True)
class _State:
    target_cache: KvCache
    n_past: int
    id_last: int
    pending: torch.Tensor  # (1, n_embd_out): the target's hidden row the next round starts from


def is_assistant_gguf(model: Path) -> bool:
    """A GGUF of Gemma 4's assistant (not a directory: its checkpoint is refused, kinds.mtp)."""
    from featdiff.core.gguf_reader import read_gguf

    return Path(model).is_file() and read_gguf(Path(model), ggml_dequant.load).arch == ARCH


def load_assistant(path: Path, dtype: torch.dtype, device: torch.device, llama_dir: Path | None = None) -> Assistant:
    """The assistant of a `gemma4-assistant` GGUF, dequantized as the other heads are."""
    g = read_gguf_weights(Path(path), llama_dir, ggml_dequant.load)

    def tensor(name: str) -> torch.Tensor:
        if name not in g.tensors:
            raise InputError(f"{path}: tensor {name} is missing; re-convert the assistant")
        return torch.from_numpy(array_from_tensor(g, name)).to(dtype=dtype, device=device)

    pattern = list(meta(g, f"{ARCH}.attention.sliding_window_pattern"))
    factors = tuple(float(x) for x in array_from_tensor(g, names.T_ROPE_FREQS).reshape(-1))
    layers = tuple(_layer(g, il, bool(swa), factors, tensor) for il, swa in enumerate(pattern))
    embd = tensor("token_embd.weight")
    return Assistant(
        source=Source(Path(path), is_gguf=True, dequantized_by=g.dequantized_by),
        n_embd=int_meta(g, f"{ARCH}.embedding_length"),
        n_embd_out=int_meta(g, f"{ARCH}.embedding_length_out"),
        n_vocab=embd.shape[0],
        rms_eps=float(meta(g, f"{ARCH}.attention.layer_norm_rms_epsilon")),
        n_swa=int_meta(g, f"{ARCH}.attention.sliding_window"),
        layers=layers,
        token_embd=embd,
        output_norm=tensor("output_norm.weight"),
        pre_proj=tensor("nextn.pre_projection.weight"),
        post_proj=tensor("nextn.post_projection.weight"),
    )


def _layer(g: GgufModel, il: int, is_swa: bool, factors: tuple[float, ...], tensor) -> AssistantLayer:
    """Layer `il`'s weights and attention shape: a sliding layer's head width, RoPE dims and base
    are the `_swa` keys' (llama_hparams n_embd_head_k(il), n_rot(il)); a full one's RoPE divides
    by `rope_freqs`."""
    suffix = "_swa" if is_swa else ""
    n_rot = int_meta(g, f"{ARCH}.rope.dimension_count{suffix}")
    return AssistantLayer(
        is_swa=is_swa,
        n_head=int_meta(g, f"{ARCH}.attention.head_count"),
        n_embd_head=int_meta(g, f"{ARCH}.attention.key_length{suffix}"),
        n_rot=n_rot,
        rope_base=float(meta(g, f"{ARCH}.rope.freq_base{suffix}")),
        scaling=RopeScaling() if is_swa else RopeScaling(freq_factors=factors[: n_rot // 2]),
        w={k: tensor(f"blk.{il}.{k}.weight") for k in LAYER_TENSORS},
    )


def check_assistant_pair(target: Target, assistant: Assistant) -> None:
    """InputError when the assistant cannot draft for this target."""
    if target.hparams.n_embd != assistant.n_embd_out or target.hparams.n_vocab != assistant.n_vocab:
        raise InputError(
            f"{assistant.source.path}: the assistant is handed {assistant.n_embd_out} wide rows over "
            f"{assistant.n_vocab} tokens, the target {target.source.path} has {target.hparams.n_embd} and "
            f"{target.hparams.n_vocab}; pair the assistant with its own target"
        )


def step(
    a: Assistant, target: Target, cache: KvCache, token: int, row: torch.Tensor, pos: int, numerics: Numerics
) -> StepPass:
    """One draft step: `token` with the handed `row` (1, n_embd_out) at `pos`, over the target's
    `cache` (its cells below `pos`)."""
    x = target.token_embd[_ids((token,), numerics)] * f32_scalar(math.sqrt(a.n_embd_out))  # (1, n_embd_out)
    xh = torch.cat([x, row.to(x.dtype)], dim=-1)  # (1, 2 * n_embd_out)
    cur = linear(xh, a.pre_proj)  # (1, n_embd)
    records = [Named("inp_embd_target", x), Named("inp_xh", xh), Named("pre_proj", cur)]
    n_layer = target.hparams.n_layer
    for il, layer in enumerate(a.layers):
        src = n_layer - SHARED_FROM_END[layer.is_swa]
        cur, named = _layer_step(a, layer, il, cur, cache, src, pos, numerics)
        records += named
    norm = rms_norm(cur, a.output_norm, a.rms_eps)  # (1, n_embd)
    logits = linear(norm, a.token_embd)  # (1, n_vocab)
    h_nextn = linear(norm, a.post_proj)  # (1, n_embd_out)
    records += [Named(names.RESULT_NORM, norm), Named(names.RESULT_OUTPUT, logits), Named(names.H_NEXTN, h_nextn)]
    return StepPass(tuple(records), logits, h_nextn)


def _layer_step(
    a: Assistant,
    layer: AssistantLayer,
    il: int,
    inp: torch.Tensor,
    cache: KvCache,
    src: int,
    pos: int,
    numerics: Numerics,
) -> tuple[torch.Tensor, list[Named]]:
    """Assistant layer `il` on its one row `inp` (1, n_embd), attending over target layer `src`'s cells."""
    w, eps = layer.w, a.rms_eps
    h = rms_norm(inp, w["attn_norm"], eps)
    q = linear(h, w["attn_q"]).reshape(1, layer.n_head, layer.n_embd_head)
    q = rms_norm(q, w["attn_q_norm"], eps)  # (1, n_head, n_embd_head)
    q_pos = _ids((pos,), numerics)
    qr = _neox(q, q_pos, layer)
    kv_pos = cache.positions
    visible = kv_pos[None, :] < pos  # (1, n_cells): the target's cells below pos0
    if layer.is_swa:
        visible = visible & (pos - kv_pos[None, :] < a.n_swa)  # llama_hparams::is_masked_swa (standard)
    kqv = attend(qr, q_pos, cache.k[src], cache.v[src], kv_pos, causal=True, visible=visible, scale=1.0)
    attn = rms_norm(linear(kqv, w["attn_output"]), w["post_attention_norm"], eps)  # (1, n_embd)
    attn_out = attn + inp
    f = rms_norm(attn_out, w["ffn_norm"], eps)
    ffn_out = linear(_geglu(linear(f, w["ffn_gate"]), linear(f, w["ffn_up"])), w["ffn_down"])  # (1, n_embd)
    post = rms_norm(ffn_out, w["post_ffw_norm"], eps)
    out = (post + attn_out) * w["layer_output_scale"]
    named = [
        Named(names.layer_name("attn_norm", il), h),
        Named(names.layer_name("Qcur_normed", il), q),
        Named(names.layer_name("Qcur_pos", il), qr),
        Named(names.layer_name("kqv_out", il), kqv),
        Named(names.layer_name("attn_post_norm", il), attn),
        Named(names.layer_name("attn_out", il), attn_out),
        Named(names.layer_name("ffn_norm", il), f),
        Named(names.layer_name("ffn_out", il), ffn_out),
        Named(names.layer_name("ffn_post_norm", il), post),
        Named(names.layer_name("out_scaled", il), out),
    ]
    return out, named


def _neox(x: torch.Tensor, positions: torch.Tensor, layer: AssistantLayer) -> torch.Tensor:
    """ggml_rope_ext NeoX on the first `n_rot` dims of `(n_tokens, n_head, d)`, pairs (i, i + n_rot/2)."""
    n_rot = layer.n_rot
    cos_np, sin_np = rope_cache(positions, n_rot, layer.rope_base, layer.scaling)
    cos = torch.from_numpy(cos_np).to(x)[:, None, :]  # (n_tokens, 1, n_rot/2)
    sin = torch.from_numpy(sin_np).to(x)[:, None, :]  # (n_tokens, 1, n_rot/2)
    x0, x1, rest = x[..., : n_rot // 2], x[..., n_rot // 2 : n_rot], x[..., n_rot:]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos, rest], dim=-1)


def _geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """ggml_vec_geglu_f32 on CPU (GGML_GELU_FP16): tanh-GELU looked up at the gate rounded to f16,
    the result stored as f16, times `up`; 0 at or below -10, the gate itself at or above 10."""
    g16 = gate.to(torch.float16).to(torch.float32)
    c = f32_scalar(math.sqrt(2.0 / math.pi))
    table = (0.5 * g16 * (1.0 + torch.tanh(c * g16 * (1.0 + 0.044715 * g16 * g16)))).to(torch.float16)
    gelu = torch.where(gate >= GELU_TABLE_LIMIT, gate, table.to(gate.dtype))
    gelu = torch.where(gate <= -GELU_TABLE_LIMIT, torch.zeros_like(gate), gelu)
    return gelu * up


def run_flow(
    target: Target,
    a: Assistant,
    prompt: tuple[int, ...],
    rounds: int,
    numerics: Numerics,
    *,
    draft_max: int,
    p_min: float = 0.0,
    follow: tuple[Round, ...] | None = None,
    guide: tuple[Round, ...] | None = None,
    cached: int = 0,
    draft_steps: Mapping[int, tuple[int, ...]] | None = None,
    draft_cached: tuple[int, ...] | None = None,
    target_batches: tuple[int, ...] = (),
) -> FlowTrace:
    """Prefill `prompt[:-1]` on the target, then `rounds` rounds of draft / verify / accept
    (torchref/mtp/flow.py's signature; the assistant keeps no cache, so `draft_cached` and
    `target_batches` change nothing)."""
    check_assistant_pair(target, a)
    if len(prompt) < 2:
        raise InputError(f"prompt of {len(prompt)} tokens: an MTP flow needs at least 2 (a prefill and its next token)")
    if draft_max < 1:
        raise InputError(f"--draft-max {draft_max}: MTP drafts at least one token; pass 1 or more")
    cache = _empty(target.hparams, numerics)
    evals: list[EvalTrace] = []
    hidden = torch.zeros((1, a.n_embd_out), dtype=numerics.dtype, device=numerics.device)
    for phase, tokens, positions in prefill_batches(prompt, cached):
        tp, rows, records = _target_eval(target, tokens, positions, cache, False, numerics, False)
        evals.append(EvalTrace(_eval(len(evals), names.ROLE_TARGET, phase, positions, tokens, PREFILL_ROUND), records))
        cache, hidden = tp.cache, rows.handed[-1:]
    state = _State(cache, len(prompt) - 1, prompt[-1], hidden)

    def one_round(state: _State, r: int, first_eval: int, plan: Round | None) -> tuple[_State, Round, list[EvalTrace]]:
        steps = draft_steps.get(r) if draft_steps is not None and plan is not None else None
        return _round(target, a, state, r, first_eval, numerics, (draft_max, p_min), plan, steps)

    return play_rounds(state, evals, rounds, follow, guide, one_round)


def _round(
    target: Target,
    a: Assistant,
    state: _State,
    r: int,
    first_eval: int,
    numerics: Numerics,
    limits: tuple[int, float],
    plan: Round | None,
    steps: tuple[int, ...] | None,
) -> tuple[_State, Round, list[EvalTrace]]:
    """One round: the draft steps at n_past, the verify, accept (speculative-simple's loop body)."""
    check_plan(plan, state, r)
    own, traces = _draft(target, a, state, r, first_eval, numerics, limits, plan, steps)
    drafts = own if plan is None else tuple(plan.drafts)
    verify = (state.id_last,) + drafts
    positions = tuple(range(state.n_past, state.n_past + len(verify)))
    tp, hidden, records = _target_eval(target, verify, positions, state.target_cache, True, numerics, False)
    ev = _eval(first_eval + len(traces), names.ROLE_TARGET, Phase.VERIFY, positions, verify, r)
    traces.append(EvalTrace(ev, records))
    accepted, best = accept(r, plan, own, drafts, tp.logits)
    i_h = min(accepted, len(verify) - 1)  # accept(): the verify row at the accepted length
    n_past = state.n_past + accepted + 1
    after = _State(truncated(tp.cache, n_past), n_past, best[accepted], hidden.handed[i_h : i_h + 1])
    return after, played_round(r, state, drafts, accepted, best), traces


def _draft(
    target: Target,
    a: Assistant,
    state: _State,
    r: int,
    first_eval: int,
    numerics: Numerics,
    limits: tuple[int, float],
    plan: Round | None,
    steps: tuple[int, ...] | None,
) -> tuple[tuple[int, ...], list[EvalTrace]]:
    """draft(): (id_last, pending row), then (each draft, the previous step's h_nextn), every step
    at n_past, each its own eval; the reference's own drafts (following a run: up to where they part)."""
    draft_max, p_min = limits
    if steps is not None and not steps:  # the run drafted nothing this round
        return (), []
    token, row, pos = state.id_last, state.pending, state.n_past
    picks: list[tuple[int, bool]] = []
    traces: list[EvalTrace] = []
    while True:
        sp = step(a, target, state.target_cache, token, row, pos, numerics)
        ev = _eval(first_eval + len(traces), names.ROLE_DRAFT, Phase.DRAFT, (pos,), (token,), r)
        traces.append(EvalTrace(ev, (*sp.records, Named(names.DRAFT_LOGITS, sp.logits))))
        picks.append((int(sp.logits[0].argmax()), top1_probability(sp.logits[0]) < p_min))
        following = next_token(picks, plan, steps, draft_max)
        if following is None:
            break
        token, row = following, sp.h_nextn
    return own_drafts(picks, plan.drafts if plan is not None else None, draft_max), traces


def assistant_entry(a: Assistant) -> dict:
    """The manifest's `models` entry of the assistant, as capture describes its GGUF."""
    from dataclasses import replace

    from featdiff.dump.model_info import model_info

    return replace(model_info(a.source.path), dequantized_by=a.source.dequantized_by).to_json()
