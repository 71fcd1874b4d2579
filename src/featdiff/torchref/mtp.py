"""An MTP head (multi-token prediction, llama.cpp's "nextn" block) as the pinned qwen35 graph
computes it (upstream `src/models/qwen35.cpp` graph_mtp), and its loaders:

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
halves as [h, e]), and `mtp_h_input@h=prenorm` / `mtp_hnorm-<il>@h=prenorm` (the head handed the
target's hidden before its final norm) or `@h=chain_prenorm` (a step handed the previous step's
`mtp_post_ffn`, before the head norm), given those rows.

Weights are held in the GGUF's convention (norm weights as llama.cpp multiplies them: a Qwen3.5
checkpoint's zero-centred norms plus one, as the converter writes them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from featdiff import names
from featdiff.errors import InputError
from featdiff.gguf_reader import GgufModel, array_from_tensor, int_meta, meta, read_gguf_weights
from featdiff.llama import ggml_dequant
from featdiff.preflight import mtp_head_block
from featdiff.torchref.attention import KvCache, attend, cache_with, layer_kv
from featdiff.torchref.load_gguf import _rope_scaling
from featdiff.torchref.numerics import linear, rms_norm, rope
from featdiff.torchref.stack import Named
from featdiff.torchref.weights import Hparams, Source, Target

# the MTP block's decoder tensors (blk.<il>.<name>.weight) and the HF names the converter maps
# them from (mtp.layers.0.<hf>.weight); a Qwen3.5 block's post-attention norm is
# `post_attention_norm` in GGUF (LLM_TENSOR_ATTN_POST_NORM)
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",  # (2 * n_head * head_dim, n_embd): per head [q, gate]
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")
# qwen35moe's head (qwen35moe.cpp graph_mtp): a routed MoE (softmax over the experts, the top
# n_expert_used renormalized: build_moe_ffn's norm_w) and a shared expert gated by a sigmoid
MOE_ROUTER = "ffn_gate_inp"  # numpy (n_expert, n_embd)
MOE_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # (n_expert, n_ff, n_embd) x2, (n_expert, n_embd, n_ff)
MOE_GATE_UP = "ffn_gate_up_exps"  # the fused form: (n_expert, 2 * n_ff, n_embd), gate rows first
MOE_SHARED = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
KEY_EXPERT_USED = "{arch}.expert_used_count"
KEY_EXPERT_SCALE = "{arch}.expert_weights_scale"
WEIGHTS_SUM_MIN = 6.103515625e-5  # build_moe_ffn clamps the top-k weights' sum to the smallest f16 normal
# nextn tensors (blk.<il>.nextn.<name>.weight) and their HF names (mtp.<hf>.weight)
NEXTN_TENSORS = {
    names.NEXTN_EH_PROJ: "fc",
    "enorm": "pre_fc_norm_embedding",
    "hnorm": "pre_fc_norm_hidden",
    "shared_head_norm": "norm",
}
NEXTN_OPTIONAL = ("shared_head_norm", "embed_tokens", "shared_head_head")
HF_MTP_PREFIX = "mtp."
HF_MTP_LAYER = "mtp.layers.0."
HF_MTP_LAYERS = "mtp_num_hidden_layers"
# norms a Qwen3.5 checkpoint stores zero-centred (x * (1 + w)); the converter adds one
# (conversion/qwen.py Qwen3NextModel.modify_tensors: every `norm.weight` but the linear attention's)
HF_NORM_SUFFIX = "norm"
MTP_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
MOE_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")  # their head's MoE block is read from the GGUF
MTP_ARCHS = (names.ARCH_QWEN35, names.ARCH_QWEN35MOE)  # the graph_mtp heads modelled here


@dataclass(frozen=True)
class MtpHead:
    """One MTP head: its block and the tables it reads (the model's own where the block has none)."""

    source: Source
    hparams: Hparams  # the block's attention dims and RoPE; n_layer 1 (its cache has one layer)
    il: int  # the block's index in the GGUF (the trunk's layer count): its graph names' suffix
    eh_proj: torch.Tensor  # (n_embd, 2 * n_embd)
    enorm: torch.Tensor  # (n_embd,)
    hnorm: torch.Tensor  # (n_embd,)
    block: dict[str, torch.Tensor]  # BLOCK_TENSORS' GGUF names -> weights
    head_norm: torch.Tensor  # (n_embd,): nextn.shared_head_norm, else the model's output_norm
    token_embd: torch.Tensor  # (n_vocab, n_embd): nextn.embed_tokens, else the model's table
    output: torch.Tensor  # (n_vocab, n_embd): nextn.shared_head_head, else the model's head
    n_expert_used: int = 0  # a MoE block's (block holds MOE_ROUTER): experts per token
    expert_scale: float = 0.0  # {arch}.expert_weights_scale: scales the routed weights unless 0 or 1


@dataclass(frozen=True)
class MtpPass:
    """One decode of the head: its logits and h_nextn rows, the records, the cache after it."""

    logits: torch.Tensor  # (n_outputs, n_vocab)
    h_nextn: torch.Tensor  # (n_tokens, n_embd): the next step's hidden
    post_ffn: torch.Tensor  # (n_tokens, n_embd): the block's output before the head norm
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
    hp, b, il = head.hparams, head.block, head.il
    e = head.token_embd[tokens]  # (n_tokens, n_embd)
    h_norm = rms_norm(h, head.hnorm, hp.rms_eps)
    e_norm = rms_norm(e, head.enorm, hp.rms_eps)
    concat = torch.cat([e_norm, h_norm], dim=1)  # (n_tokens, 2 * n_embd): ggml_concat(e_norm, h_norm, 0)
    x = linear(concat, head.eh_proj)  # (n_tokens, n_embd)
    attn_out, cache_after = _attention(hp, b, rms_norm(x, b["attn_norm"], hp.rms_eps), positions, cache)
    residual = attn_out + x
    post = rms_norm(residual, b["post_attention_norm"], hp.rms_eps)
    ffn = _moe_ffn(head, post) if MOE_ROUTER in b else _swiglu(post, b["ffn_gate"], b["ffn_up"], b["ffn_down"])
    post_ffn = ffn + residual
    h_nextn = rms_norm(post_ffn, head.head_norm, hp.rms_eps)
    logits = linear(h_nextn if outputs else h_nextn[:0], head.output)  # (n_outputs, n_vocab)
    layer = lambda base: names.layer_name(base, il)  # noqa: E731
    candidates = [Named(names.candidate_name(layer(names.MTP_CONCAT), names.slots_hypothesis((1, 0))),
                        torch.cat([h_norm, e_norm], dim=1))]  # fmt: skip
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
        Named(layer(names.MTP_ATTN_RESIDUAL), residual),
        Named(layer(names.MTP_POST_FFN), post_ffn),
        Named(names.H_NEXTN, h_nextn),
        Named(names.RESULT_OUTPUT, logits),
        *candidates,
    )
    return MtpPass(logits, h_nextn, post_ffn, records, cache_after)


def _swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """`down(silu(gate x) * up x)` (LLM_FFN_SILU, LLM_FFN_PAR)."""
    g = linear(x, gate)
    return linear(g / (1.0 + torch.exp(-g)) * linear(x, up), down)


def _moe_ffn(head: MtpHead, x: torch.Tensor) -> torch.Tensor:
    """qwen35moe's FFN (llm_graph_context::build_moe_ffn, softmax gating, norm_w): softmax over the
    router's logits, the top n_expert_used experts weighted by their probabilities renormalized
    to sum 1 (and scaled by expert_weights_scale unless 0 or 1), each a SwiGLU; plus the shared
    expert's SwiGLU gated by sigmoid of its own router row."""
    b = head.block
    probs = torch.softmax(linear(x, b[MOE_ROUTER]), dim=-1)  # (n_tokens, n_expert)
    weights, chosen = torch.topk(probs, head.n_expert_used, dim=-1)  # (n_tokens, n_expert_used) each
    weights = weights / weights.sum(-1, keepdim=True).clamp(min=WEIGHTS_SUM_MIN)
    if head.expert_scale not in (0.0, 1.0):
        weights = weights * head.expert_scale
    out = torch.zeros_like(x)  # (n_tokens, n_embd)
    for t in range(x.shape[0]):
        row = x[t : t + 1]  # (1, n_embd)
        for k in range(head.n_expert_used):
            e = int(chosen[t, k])
            expert = _swiglu(row, b["ffn_gate_exps"][e], b["ffn_up_exps"][e], b["ffn_down_exps"][e])
            out[t] += weights[t, k] * expert[0]
    if "ffn_up_shexp" in b:
        shared = _swiglu(x, b["ffn_gate_shexp"], b["ffn_up_shexp"], b["ffn_down_shexp"])  # (n_tokens, n_embd)
        gate = x @ b["ffn_gate_inp_shexp"].reshape(
            -1
        )  # (n_tokens,): one logit per token (stored (1, n_embd) or (n_embd,))
        out = out + shared * torch.sigmoid(gate)[:, None]
    return out


def _attention(
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
    q, k = rope(q, positions, hp), rope(k, positions, hp)
    k_all, v_all = layer_kv(cache, 0, k, v)
    kv_pos = torch.cat([cache.positions, positions])  # (n_cells + n_tokens,)
    kqv = attend(q, positions, k_all, v_all, kv_pos, causal=True)  # (n_tokens, n_head * d)
    out = linear(kqv * torch.sigmoid(gate), b["attn_output"])
    return out, cache_with(cache, positions, [k_all], [v_all])


# --- from the GGUF ----------------------------------------------------------------------------


def mtp_from_gguf(path: Path, dtype: torch.dtype, device: torch.device, llama_dir: Path | None = None) -> MtpHead:
    """The head of a GGUF that carries one (the target's own, or a separate `mtp-*.gguf`),
    dequantized as load_gguf.target_from_gguf does."""
    g = read_gguf_weights(Path(path), llama_dir, ggml_dequant.load)
    il = mtp_head_block(g)
    if il is None:
        raise InputError(
            f"{path}: {names.KEY_NEXTN_LAYERS.format(arch=g.arch)} is missing or 0: no MTP head (converted with "
            "--no-mtp?); re-convert the checkpoint without --no-mtp"
        )
    if int_meta(g, names.KEY_NEXTN_LAYERS) != 1:
        raise InputError(f"{path}: {int_meta(g, names.KEY_NEXTN_LAYERS)} MTP blocks; featdiff models a single head")
    if g.arch not in MTP_ARCHS:
        raise InputError(
            f"{path}: an MTP head of architecture {g.arch!r}; featdiff models {' and '.join(map(repr, MTP_ARCHS))}'s"
        )

    def tensor(name: str) -> torch.Tensor:
        if name not in g.tensors:
            raise InputError(f"{path}: tensor {name} is missing; re-convert the checkpoint with its MTP block")
        return torch.from_numpy(array_from_tensor(g, name)).to(dtype=dtype, device=device)

    def nextn(name: str) -> torch.Tensor | None:
        full = names.T_NEXTN.format(il=il, name=name)
        return tensor(full) if full in g.tensors else None

    prefix = names.GGUF_LAYER_PREFIX.format(il=il)
    in_block = {t[len(prefix) :].removesuffix(".weight") for t in g.tensors if t.startswith(prefix)}
    attention = [k for k in BLOCK_TENSORS if k not in DENSE_FFN]
    ffn = _moe_tensors(in_block) if MOE_ROUTER in in_block else list(DENSE_FFN)
    block = {k: tensor(f"{prefix}{k}.weight") for k in (*attention, *ffn)}
    if MOE_GATE_UP in block:  # the fused experts: gate rows first (build_moe_ffn's views)
        block["ffn_gate_exps"], block["ffn_up_exps"] = block.pop(MOE_GATE_UP).chunk(2, dim=1)
    required = {k: nextn(k) for k in (names.NEXTN_EH_PROJ, "enorm", "hnorm")}
    missing = [k for k, t in required.items() if t is None]
    if missing:
        raise InputError(
            f"{path}: tensor {names.T_NEXTN.format(il=il, name=missing[0])} is missing; re-convert the head"
        )
    head_norm, embd, head_w = nextn("shared_head_norm"), nextn("embed_tokens"), nextn("shared_head_head")
    return MtpHead(
        source=Source(Path(path), is_gguf=True, dequantized_by=g.dequantized_by),
        hparams=_block_hparams(g),
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
        n_expert_used=int_meta(g, KEY_EXPERT_USED) if MOE_ROUTER in block else 0,
        expert_scale=float(meta(g, KEY_EXPERT_SCALE, 0.0)),
    )


def _moe_tensors(in_block: set[str]) -> list[str]:
    """A MoE block's FFN tensors as the file has them: the router, the experts (separate or fused
    gate and up), and the shared expert where there is one."""
    experts = [MOE_GATE_UP, MOE_EXPERTS[2]] if MOE_GATE_UP in in_block else list(MOE_EXPERTS)
    return [MOE_ROUTER, *experts, *(MOE_SHARED if MOE_SHARED[0] in in_block else ())]


def _block_hparams(g: GgufModel) -> Hparams:
    """The block's dims as the qwen35 graph reads them: the model's heads and RoPE (NeoX-style
    pairs on the first rope.dimension_count dims: M-RoPE with every section at the same text
    position), one layer."""
    n_embd, n_head = int(meta(g, names.KEY_EMBEDDING_LENGTH)), int(meta(g, names.KEY_HEAD_COUNT))
    n_embd_head = int(meta(g, names.KEY_KEY_LENGTH, n_embd // n_head))
    n_rot = int(meta(g, names.KEY_ROPE_DIMS, n_embd_head))
    return Hparams(
        arch=g.arch,
        n_layer=1,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(meta(g, names.KEY_HEAD_COUNT_KV, n_head)),
        n_embd_head=n_embd_head,
        n_ff=int(meta(g, names.KEY_FEED_FORWARD_LENGTH, 0)),  # a MoE model writes its experts' widths instead
        n_vocab=int(g.tensors[names.T_TOKEN_EMBD].ne[1]),
        rms_eps=float(meta(g, names.KEY_RMS_EPS)),
        rope_base=float(meta(g, names.KEY_ROPE_FREQ_BASE, names.ROPE_FREQ_BASE_DEFAULT)),
        rope_type="neox",
        rope_scaling=_rope_scaling(g, n_rot),
        n_rot=n_rot,
    )


# --- from the Hugging Face checkpoint -----------------------------------------------------------


def is_mtp_checkpoint(config: dict[str, Any]) -> bool:
    """A Qwen3.5 checkpoint that declares MTP layers (config.json `mtp_num_hidden_layers`)."""
    text = config.get("text_config", config)
    return text.get(names.HF_MODEL_TYPE) in MTP_MODEL_TYPES and int(text.get(HF_MTP_LAYERS, 0) or 0) > 0


def mtp_from_hf(path: Path, dtype: torch.dtype, device: torch.device) -> MtpHead:
    """The head of a Qwen3.5 checkpoint (`mtp.*` tensors), held as the converter writes it:
    `mtp.fc` -> eh_proj, `pre_fc_norm_embedding` / `_hidden` -> enorm / hnorm, `mtp.norm` ->
    the head norm, `mtp.layers.0.*` -> the block; every norm plus one."""
    path = Path(path)
    config = json.loads((path / names.HF_CONFIG).read_text())
    text = config.get("text_config", config)
    if not is_mtp_checkpoint(config):
        raise InputError(
            f"{path}: config.json declares no MTP layers ({HF_MTP_LAYERS}); pass a checkpoint with its MTP head"
        )
    if text.get(names.HF_MODEL_TYPE) in MOE_MODEL_TYPES:
        raise InputError(
            f"{path}: the reference reads a Qwen3.5-MoE head (its routed experts) from the converted GGUF; pass "
            "--model the GGUF that carries the head, with --target this checkpoint"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob(names.HF_WEIGHTS_GLOB)):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is no mapping)
                tensors[k] = st.get_tensor(k)

    def hf(name: str) -> torch.Tensor:
        if name not in tensors:
            raise InputError(f"{path}: tensor {name} is missing; the checkpoint's MTP head is incomplete")
        return tensors[name].to(dtype=dtype, device=device)

    def model_tensor(suffix: str) -> torch.Tensor:
        name = next((k for k in tensors if k.endswith(suffix) and not k.startswith(HF_MTP_PREFIX)), suffix)
        return hf(name)

    n_vocab, n_embd = int(text[names.HF_VOCAB_SIZE]), int(text[names.HF_HIDDEN_SIZE])
    n_head = int(text[names.HF_NUM_HEADS])
    head_dim = int(text.get(names.HF_HEAD_DIM) or n_embd // n_head)
    rope = text.get("rope_parameters") or {}
    hp = Hparams(
        arch=names.ARCH_QWEN35,
        n_layer=1,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(text.get(names.HF_NUM_KV_HEADS, n_head)),
        n_embd_head=head_dim,
        n_ff=int(text[names.HF_INTERMEDIATE_SIZE]),
        n_vocab=n_vocab,
        rms_eps=float(text[names.HF_RMS_EPS]),
        rope_base=float(rope.get(names.HF_ROPE_THETA, text.get(names.HF_ROPE_THETA, names.ROPE_FREQ_BASE_DEFAULT))),
        rope_type="neox",
        n_rot=int(head_dim * float(rope.get("partial_rotary_factor", 0.25))),
    )
    tied = bool(text.get(names.HF_TIE_EMBEDDINGS, config.get(names.HF_TIE_EMBEDDINGS, False)))
    embd = model_tensor(names.HF_EMBED_TOKENS)
    return MtpHead(
        source=Source(path, is_gguf=False),
        hparams=hp,
        il=int(text[names.HF_NUM_LAYERS]),
        **hf_head_tensors(hf),
        token_embd=embd,
        output=embd if tied else model_tensor(names.HF_LM_HEAD),
    )


def hf_head_tensors(hf: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    """The head's own fields (eh_proj, the norms, the block) from a checkpoint's `mtp.*` tensors,
    `hf(name)` each, as the converter writes them: `mtp.fc` -> eh_proj, `pre_fc_norm_embedding` /
    `_hidden` -> enorm / hnorm, `mtp.norm` -> the head norm, `mtp.layers.0.*` -> the block, every
    norm plus one (a Qwen3.5 checkpoint's norms are zero-centred)."""
    block = {
        k: _plus_one(hf(f"{HF_MTP_LAYER}{v}.weight"), k.endswith(HF_NORM_SUFFIX)) for k, v in BLOCK_TENSORS.items()
    }
    nextn = {k: _plus_one(hf(f"{HF_MTP_PREFIX}{v}.weight"), k != names.NEXTN_EH_PROJ) for k, v in NEXTN_TENSORS.items()}
    return {
        "eh_proj": nextn[names.NEXTN_EH_PROJ],
        "enorm": nextn["enorm"],
        "hnorm": nextn["hnorm"],
        "block": block,
        "head_norm": nextn["shared_head_norm"],
    }


def _plus_one(t: torch.Tensor, is_norm: bool) -> torch.Tensor:
    return t + 1.0 if is_norm else t


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
