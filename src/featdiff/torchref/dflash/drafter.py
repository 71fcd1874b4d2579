"""The DFlash drafter's two kinds of eval (upstream `src/models/dflash.cpp`, decoder graph):

* inject: target features `(n_tokens, n_extract * n_embd_tgt)` -> `fc` -> encoder norm
  (`inp_g_embeddings`) -> per layer K = RoPE(k_norm(wk g)) and V = wv g, written to the cache;
* draft: the noise block `[anchor, mask x (B-1)]` -> embeddings `inp_noise_embd` (+ the log-SNR
  term: `dspark_draft_embd_snr`) -> layers with non-causal attention (causal with
  `dflash.attention.causal`) over the cache and the block -> final norm -> logits (scattered to
  the target vocabulary through `d2t` for a reduced head); DSpark's heads follow (dspark.py).

Besides the graph's names it records the reference-only candidates of docs/records.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from featdiff.core import names
from featdiff.torchref.attention import KvCache, cache_with, layer_kv
from featdiff.torchref.dflash import dflash2
from featdiff.torchref.dflash.log_snr import log_snr_embed
from featdiff.torchref.numerics import f32_scalar, linear, rms_norm, rope
from featdiff.torchref.stack import Named, layer_forward
from featdiff.torchref.weights import Draft, Hparams, Layer, Target, present

MAX_PERMUTED_SLOTS = 4  # slot-order candidates for n_extract <= 4 (at most 23 of them)


@dataclass(frozen=True)
class InjectPass:
    """One inject eval: the draft cache with the context rows written, and the records."""

    cache: KvCache
    records: tuple[Named, ...]


@dataclass(frozen=True)
class DraftPass:
    """One draft eval: the base logits and final-norm rows of every block row, and the records."""

    logits: torch.Tensor  # (n_tokens, n_vocab): result_output
    norm: torch.Tensor  # (n_tokens, n_embd): result_norm, what DSpark's confidence head reads
    records: tuple[Named, ...]
    lattice: torch.Tensor | None = None  # (n_rows, n_embd): DFlash2's dflash2_lattice (featdiff.kinds.dflash.dflash2)


def encode(draft: Draft, features: torch.Tensor) -> torch.Tensor:
    """`inp_g_embeddings`: enc_norm(fc features), `(n_tokens, n_embd)`; with `fc.scale`, fc's
    product times it first (llama-graph.cpp build_lora_mm: ggml_mul(mul_mat(w, x), w_s))."""
    fused = linear(features, draft.fc)  # (n_tokens, n_embd)
    if draft.fc_scale is not None:
        fused = fused * draft.fc_scale
    return rms_norm(fused, draft.enc_norm, draft.hparams.rms_eps)


def _context_kv(
    hp: Hparams, layer: Layer, g: torch.Tensor, positions: torch.Tensor, il: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's context K (k_norm, RoPE) and V of the fused features `g`."""
    n_tokens = g.shape[0]
    k = linear(g, layer.wk).reshape(n_tokens, hp.n_head_kv, hp.n_embd_head)  # (n_tokens, n_head_kv, n_embd_head)
    v = linear(g, layer.wv).reshape(n_tokens, hp.n_head_kv, hp.n_embd_head)  # (n_tokens, n_head_kv, n_embd_head)
    return rope(rms_norm(k, present(layer.k_norm, f"blk.{il}.attn_k_norm.weight"), hp.rms_eps), positions, hp), v


def inject(draft: Draft, features: torch.Tensor, positions: torch.Tensor, cache: KvCache) -> InjectPass:
    """Write the context K/V of `features` at `positions` into the draft cache."""
    hp = draft.hparams
    g = encode(draft, features)
    records = [Named(names.INP_TARGET_FEATURES, features), Named(names.INP_G_EMBEDDINGS, g)]
    ks, vs = [], []
    for il in range(len(draft.layers)):
        k, v = _context_kv(hp, draft.layers[il], g, positions, il)
        records += [
            Named(names.layer_name(names.KCUR_INJECTED, il), k),
            Named(names.layer_name(names.VCUR_INJECTED, il), v),
        ]
        k_cache, v_cache = layer_kv(cache, il, k, v)
        ks.append(k_cache)
        vs.append(v_cache)
    records += slot_candidates(draft, features)
    return InjectPass(cache_with(cache, positions, ks, vs), tuple(records))


def slot_candidates(draft: Draft, features: torch.Tensor) -> list[Named]:
    """`inp_g_embeddings@slots=<perm>` for every non-identity slot order (n_extract <= 4).

    Under `perm`, slot k of the staged row carries reference slot perm[k]; a GGUF whose fc
    column blocks are permuted the inverse way produces exactly this row.
    """
    n = draft.n_extract
    if n > MAX_PERMUTED_SLOTS:
        return []
    n_tokens, width = features.shape[0], features.shape[1] // n
    slots = features.reshape(n_tokens, n, width)  # (n_tokens, n_extract, n_embd_tgt)
    out = []
    for perm in itertools.permutations(range(n)):
        if perm != tuple(range(n)):
            staged = slots[:, list(perm), :].reshape(n_tokens, n * width)  # (n_tokens, n_extract * n_embd_tgt)
            name = names.candidate_name(names.INP_G_EMBEDDINGS, names.slots_hypothesis(perm))
            out.append(Named(name, encode(draft, staged)))
    return out


def draft_block(
    draft: Draft,
    target: Target,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    cache: KvCache,
    visible: torch.Tensor | None = None,
) -> DraftPass:
    """Run the noise block non-causally over the cached context; the cache is left unchanged.

    `visible` `(n_tokens, n_cells + n_tokens)`, when given, says which cells and block rows each
    row sees: training packs many blocks, each over its own context, into one call.
    """
    hp = draft.hparams
    x, records = noise_embeddings(draft, target, tokens)
    for il in range(len(draft.layers)):
        # indexed in the call: a streamed layer is freed before the next one is built
        conv_records: list[Named] = []
        if draft.dflash2 is not None:  # DFlash2: the layer with its local convs (dflash2.py)
            t, conv_records = dflash2.layer_forward(
                hp, draft.dflash2, draft.layers[il], x, positions, cache, il, draft.causal
            )
        else:
            t = layer_forward(hp, draft.layers[il], x, positions, cache, il, causal=draft.causal, visible=visible)
        records += [
            Named(names.layer_name(name, il), a)
            for name, a in (
                (names.NOISE_NORM, t.attn_norm),
                (names.QCUR, t.q),
                (names.KCUR, t.k),
                (names.VCUR, t.v),
                (names.KQV_OUT, t.kqv_out),
                (names.FFN_INP, t.ffn_inp),
                (names.FFN_OUT, t.ffn_out),
                (names.L_OUT, t.l_out),
            )
        ]
        records += conv_records
        records += _full_attention_candidates(draft, x, positions, cache, il, visible)
        x = t.l_out
    norm = rms_norm(x, draft.output_norm, hp.rms_eps)
    logits = linear(norm, draft.output if draft.output is not None else target.output)
    if draft.dflash2 is not None:  # the selector's logit transforms, before the d2t scatter
        logits = dflash2.selector_logits(draft.dflash2, logits)
    if draft.d2t is not None:  # a reduced head: its rows land on their target ids, -inf elsewhere
        full = torch.full(
            (logits.shape[0], target.hparams.n_vocab), float("-inf"), dtype=logits.dtype, device=logits.device
        )  # (n_tokens, n_vocab)
        full[:, draft.d2t] = logits
        logits = full
    records += [Named(names.RESULT_NORM, norm), Named(names.RESULT_OUTPUT, logits)]
    lattice = dflash2.lattice(draft.dflash2, logits, norm, int(tokens[0])) if draft.dflash2 is not None else None
    if lattice is not None:
        records.append(Named(dflash2.LATTICE, lattice))
    return DraftPass(logits, norm, tuple(records), lattice)


def _full_attention_candidates(
    draft: Draft, x: torch.Tensor, positions: torch.Tensor, cache: KvCache, il: int, visible: torch.Tensor | None
) -> list[Named]:
    """`l_out-<il>@attention=full` of a sliding-window layer: the layer over the whole context, as
    llama.cpp runs a GGUF whose window keys a converter left out (none for other layers)."""
    hp = draft.hparams
    if not hp.is_swa(il) or draft.dflash2 is not None:
        return []
    full = layer_forward(replace(hp, n_swa=0), draft.layers[il], x, positions, cache, il, draft.causal, visible=visible)
    return [Named(names.candidate_name(names.layer_name(names.L_OUT, il), names.HYP_FULL_ATTENTION), full.l_out)]


def _scaled(draft: Draft, rows: torch.Tensor) -> torch.Tensor:
    """The embedding rows times `dflash.embedding_scale` (dflash.cpp: ggml_scale after get_rows,
    before the `inp_noise_embd` callback); unchanged when the scale is 0 (absent)."""
    return rows * f32_scalar(draft.embedding_scale) if draft.embedding_scale != 0.0 else rows


def noise_embeddings(draft: Draft, target: Target, tokens: torch.Tensor) -> tuple[torch.Tensor, list[Named]]:
    """The first layer's input `(n_tokens, n_embd)` and its records.

    `inp_noise_embd` is the embedding rows (the drafter's own table, else the target's). A
    log-SNR conditioned drafter adds its term `dspark_log_snr_fc2` to them: the sum
    `dspark_draft_embd_snr` is what the layers consume (names as the graph that computes them
    has them, docs/records.md).
    """
    table = draft.token_embd if draft.token_embd is not None else target.token_embd
    looked_up = table[tokens]  # (n_tokens, n_embd)
    if draft.mask_row is not None:
        looked_up = torch.where((tokens == draft.mask_token_id)[:, None], draft.mask_row, looked_up)
    rows = _scaled(draft, looked_up)  # (n_tokens, n_embd)
    records = [Named(names.INP_NOISE_EMBD, rows)]
    if draft.token_embd is not None and target.hparams.n_embd == draft.hparams.n_embd:
        borrowed = _scaled(draft, target.token_embd[tokens])  # (n_tokens, n_embd)
        records.append(Named(names.candidate_name(names.INP_NOISE_EMBD, names.HYP_TABLE_TARGET), borrowed))
    if draft.log_snr is None:
        return rows, records
    is_mask = tokens == draft.mask_token_id
    snr = log_snr_embed(draft.log_snr, is_mask)
    x = rows + snr.term  # (n_tokens, n_embd)
    swapped = log_snr_embed(draft.log_snr, ~is_mask).feat  # (n_tokens, LOG_SNR_N_FREQ): the levels swapped
    after_norm = rms_norm(rows, draft.layers[0].attn_norm, draft.hparams.rms_eps) + snr.term  # (n_tokens, n_embd)
    records += [
        Named(names.DSPARK_LOG_SNR_FEAT, snr.feat),
        Named(names.DSPARK_LOG_SNR_FC1, snr.fc1),
        Named(names.DSPARK_LOG_SNR_FC2, snr.term),
        Named(names.DSPARK_DRAFT_EMBD_SNR, x),
        Named(names.candidate_name(names.DSPARK_DRAFT_EMBD_SNR, names.HYP_NO_LOG_SNR), rows),
        Named(names.candidate_name(names.DSPARK_LOG_SNR_FEAT, names.HYP_LEVELS_SWAPPED), swapped),
        Named(names.candidate_name(names.DSPARK_DRAFT_EMBD_SNR, names.HYP_TERM_AFTER_NORM), after_norm),
    ]
    return x, records
