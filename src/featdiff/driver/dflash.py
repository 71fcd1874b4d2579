"""The in-process DFlash / DSpark flow through the real llama.cpp library (docs/flow.md).

Mirrors upstream `examples/speculative-simple` with `--spec-type draft-dflash` / `draft-dspark`
and `common_speculative_impl_draft_dflash`: prefill the target with layer-input taps on, inject
the features token-major into the drafter's KV cache, draft a block `[anchor, mask ...]`
(featdiff.core.blocks: `draft_max` drafts, llama.cpp's `--spec-draft-n-max`), verify on the target,
inject the verified rows, keep the accepted ones. On a build of the older batch API generation
(llama_batch + llama_decode) an injection is two evals, as that generation's speculative.cpp
makes it: llama_encode of the features, then llama_decode of the rows the encoder made. The
logits each draft row is sampled from (and a DSpark drafter's confidences) are read back through
the API and recorded: no graph node holds DSpark's Markov-biased logits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from featdiff.core import names
from featdiff.core.blocks import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DRAFT_MAX,
    accepted_length,
    block_rows,
    clamped_draft_max,
    first_draft_row,
    read_drafts,
)
from featdiff.core.errors import InputError
from featdiff.core.phases import PREFILL_ROUND, Phase
from featdiff.driver.rounds import Recorder, close_round, each_round, features, open_eval, rollback
from featdiff.dump.model_info import model_info
from featdiff.dump.records import Round
from featdiff.kinds.dflash.dflash2 import lattice_drafts
from featdiff.llama import ggml_dequant
from featdiff.llama.runtime import Context, Model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlowConfig:
    target_layers: tuple[int, ...]  # input-of-layer ids, slot k = target_layers[k]
    draft_max: int  # drafts per block: --spec-draft-n-max, clamped (featdiff.core.blocks)
    mask_token_id: int
    first_draft_row: int = 1  # 0: anchor-first DSpark (drafts from the anchor's row); else 1
    confidence: bool = False  # a DSpark confidence head: its value per row is read back
    p_min: float = 0.0  # --spec-draft-p-min: DSpark stops drafting below this confidence
    causal: bool = False  # dflash.attention.causal: block rows attend causally
    selector_top_k: int = 0  # dflash.selector_top_k: > 0 for DFlash2, whose drafts walk its lattice
    kind: str = "dflash"  # featdiff.kinds: the kind whose driver runs this flow

    @property
    def block_rows(self) -> int:
        """Rows of a draft block (featdiff.core.blocks.block_rows)."""
        return block_rows(self.draft_max, self.first_draft_row)

    @property
    def noncausal_rows(self) -> int:
        """Rows decoded non-causally in one batch (a draft block): they must fit one ubatch."""
        return self.block_rows


def flow_config(draft: Model, draft_max: int = DEFAULT_DRAFT_MAX, p_min: float = 0.0) -> FlowConfig:
    """The DFlash / DSpark settings the upstream driver reads from the drafter, with `draft_max`
    drafts per block (`--spec-draft-n-max`) and `p_min` (`--spec-draft-p-min`). Like llama.cpp's
    automatic type, a drafter GGUF with `markov_w1.weight` runs as draft-dspark."""
    layers = tuple(draft.target_layer_ids())  # their range against the target: preflight, before loading
    block_size = int(draft.meta(names.KEY_BLOCK_SIZE) or DEFAULT_BLOCK_SIZE)
    dspark = model_info(draft.path, with_hash=False, ggml=ggml_dequant.load).dspark
    first_row = first_draft_row(dspark is not None, bool(dspark and dspark["sample_from_anchor"]))
    confidence = bool(dspark and dspark["confidence_head"])
    if p_min > 0.0 and not confidence:
        raise InputError(
            f"{draft.path}: --p-min {p_min} but this drafter has no DSpark confidence head "
            "(llama.cpp refuses it for DSpark; featdiff's driver implements p_min for that head only): "
            "pass --p-min 0"
        )
    return FlowConfig(
        layers,
        _draft_max(draft.path, draft_max, block_size, first_row),
        int(draft.rt.lib.llama_vocab_mask(draft.vocab)),
        first_draft_row=first_row,
        confidence=confidence,
        p_min=p_min,
        causal=draft.meta(names.KEY_CAUSAL) == "true",
        selector_top_k=int(draft.meta(names.KEY_SELECTOR_TOP_K) or 0),
    )


def _draft_max(path: Path, draft_max: int, block_size: int, first_row: int) -> int:
    """`--draft-max` clamped to what a block drafts (featdiff.core.blocks) with a warning, as
    common_speculative_impl_draft_dflash clamps n_max."""
    if draft_max < 1:
        raise InputError(
            f"--draft-max {draft_max}: expected >= 1 draft per block (llama.cpp's "
            f"--spec-draft-n-max, default {DEFAULT_DRAFT_MAX})"
        )
    clamped = clamped_draft_max(draft_max, block_size, first_row)
    if clamped != draft_max:
        log.warning(
            "%s: --draft-max %d exceeds the trained block size (%s = %d); clamping to %d, as llama.cpp does",
            path,
            draft_max,
            names.KEY_BLOCK_SIZE,
            block_size,
            clamped,
        )
    return clamped


def enable(tgt: Context, dft: Context, cfg: FlowConfig) -> None:
    """What common_speculative_impl_draft_dflash's constructor switches on."""
    lib = tgt.rt.lib
    for layer in cfg.target_layers:
        lib.fd_set_embeddings_layer_inp(tgt.ptr, layer, True)
    lib.fd_set_embeddings_nextn(dft.ptr, True, True)
    lib.llama_set_causal_attn(dft.ptr, cfg.causal)


@dataclass
class _State:
    n_past: int
    id_last: int
    n_evals: int = 0


def run_flow(
    tgt: Context, dft: Context, prompt: list[int], rounds: int, cfg: FlowConfig, rec: Recorder, on_round=None
) -> list[Round]:
    """Prefill, then `rounds` x (draft, verify, inject); return the rounds."""
    st = _State(n_past=len(prompt) - 1, id_last=prompt[-1])
    positions = list(range(st.n_past))
    _decode_target(tgt, st, rec, prompt[:-1], positions, Phase.PREFILL, PREFILL_ROUND, outputs=False)
    _inject(tgt, dft, st, rec, cfg, positions, PREFILL_ROUND)
    return each_round(rounds, lambda r: _round(tgt, dft, st, rec, cfg, r), on_round)


def _decode_target(
    tgt: Context,
    st: _State,
    rec: Recorder,
    tokens: list[int],
    positions: list[int],
    phase: Phase,
    rnd: int,
    outputs: bool,
) -> None:
    open_eval(st, rec, phase, rnd, positions, tokens)
    tgt.decode_tokens(tokens, positions, outputs)


def _inject(
    tgt: Context, dft: Context, st: _State, rec: Recorder, cfg: FlowConfig, positions: list[int], rnd: int
) -> None:
    """The target batch's feature rows into the draft KV cache, in chunks of the drafter's n_ubatch,
    one decode each (common/speculative.cpp DFlash process(): the fused decode of a chunk must fit
    one ubatch)."""
    rows = features(tgt, cfg.target_layers, len(positions))  # (n_tokens, n_extract * n_embd_tgt)
    for start in range(0, len(positions), dft.n_ubatch):
        end = min(start + dft.n_ubatch, len(positions))
        _inject_chunk(dft, st, rec, rows[start:end], positions[start:end], rnd)  # (n_chunk, n_extract * n_embd_tgt)


def _inject_chunk(dft: Context, st: _State, rec: Recorder, rows: np.ndarray, positions: list[int], rnd: int) -> None:
    if dft.inject_encodes_first:  # the older generation: encode (fc, enc norm), then decode its rows
        open_eval(st, rec, Phase.INJECT, rnd, positions, [], call=names.CALL_ENCODE)
        rows = dft.encode_embd(rows)
    open_eval(st, rec, Phase.INJECT, rnd, positions, [])
    dft.decode_embd(rows, positions)


def _round(tgt: Context, dft: Context, st: _State, rec: Recorder, cfg: FlowConfig, rnd: int) -> Round:
    pos0, anchor, B = st.n_past, st.id_last, cfg.block_rows
    block, block_positions = [anchor] + [cfg.mask_token_id] * (B - 1), list(range(pos0, pos0 + B))
    open_eval(st, rec, Phase.DRAFT, rnd, block_positions, block)
    dft.decode_tokens(block, block_positions, outputs=True)
    drafts = _drafts(dft, rec, cfg, B)
    dft.seq_rm(pos0)  # the draft block leaves the draft KV cache
    verify = [anchor] + drafts
    positions = list(range(pos0, pos0 + len(verify)))
    _decode_target(tgt, st, rec, verify, positions, Phase.VERIFY, rnd, outputs=True)
    target_tokens = [int(np.argmax(tgt.logits(i))) for i in range(len(verify))]
    _inject(tgt, dft, st, rec, cfg, positions, rnd)
    accepted = accepted_length(drafts, target_tokens)
    st.n_past = pos0 + accepted + 1
    st.id_last = target_tokens[accepted]
    rollback(tgt, st.n_past, len(verify) - (accepted + 1))
    dft.seq_rm(st.n_past)
    return close_round(rec, rnd, pos0, anchor, drafts, accepted, target_tokens)


def _drafts(dft: Context, rec: Recorder, cfg: FlowConfig, n_rows: int) -> list[int]:
    """The greedy drafts of the block just decoded (featdiff.core.blocks.read_drafts); every row's
    logits (and confidence) are recorded first. DFlash2 drafts walk the candidate lattice its
    graph writes to the nextn rows, as upstream's driver does (featdiff.kinds.dflash.dflash2); no logits are read."""
    if cfg.selector_top_k > 0:
        rows = [dft.nextn_row(i).tolist() for i in range(n_rows)]
        return lattice_drafts(rows, cfg.selector_top_k, n_rows, cfg.p_min)
    logits = np.stack([dft.logits(i) for i in range(n_rows)])  # (n_rows, n_vocab)
    rec.readback(names.DRAFT_LOGITS, logits)
    conf = (
        np.array([[dft.nextn_value(i)] for i in range(n_rows)], dtype=np.float32) if cfg.confidence else None
    )  # (n_rows, 1)
    if conf is not None:
        rec.readback(names.DSPARK_CONF, conf)
    return read_drafts(
        logits.argmax(axis=1).tolist(),
        conf[:, 0].tolist() if conf is not None else None,
        cfg.first_draft_row,
        cfg.p_min,
    )
