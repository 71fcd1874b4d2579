"""The anchor-first DSpark objective and its held-out drafting: the DFlash body of objective.py
plus DSpark's Markov and confidence heads, on blocks laid out as llama.cpp's draft-dspark runs
them (common/speculative.cpp draft(), `dflash.sample_from_anchor` true): n rows
`[anchor, mask x (n-1)]` at positions p .. p+n-1, row i predicting the token at p + i + 1.

The heads (src/models/dflash.cpp `build_dspark_markov_head`): row i's logits get
`markov_w2 @ markov_w1[prev_i]`, prev_0 the anchor and prev_{i+1} the argmax of row i; its
confidence is `sigmoid(conf_proj @ [result_norm(i); markov_w1[prev_i]] + conf_proj_b)`.
`chained` is a batched copy of that chain for training and the held-out metric; the flow's own
is `reference.dspark.heads`, one block at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import binary_cross_entropy_with_logits, cross_entropy

from featdiff.core import names
from featdiff.torchref.dflash.drafter import draft_block, inject
from featdiff.torchref.weights import Draft, DSpark, Target, present
from featdiff.factory.training.corpus import Corpus, f32_cache
from featdiff.factory.training.objective import ROW_DECAY, Batch, accepted_length, packed_batch

N_DRAFT = 3  # llama.cpp's --spec-draft-n-max default: the held-out metric's drafts per block
NO_DRAFT = -1  # a draft slot the confidence cut-off left empty (no token id is negative)


@dataclass(frozen=True)
class AnchorFirstBatch:
    """Packed anchor-first blocks of one length, with their next-token labels."""

    block: Batch  # `[anchor, mask x (n_block-1)]`; block.labels: each row's own token (teacher-forced prev)
    n_block: int
    labels: torch.Tensor  # (n_rows,): the sequence's token at each row's position + 1
    weights: torch.Tensor  # (n_rows,): row i (draft i) weighs exp(-i / ROW_DECAY)


@dataclass(frozen=True)
class Chain:
    """The heads chained greedily over blocks, as the graph chains them."""

    drafts: torch.Tensor  # (n_blocks, n_read) int64: argmax of each read row's biased logits
    conf_logits: torch.Tensor  # (n_blocks, n_read): the confidence head before its sigmoid


@dataclass(frozen=True)
class Drafted:
    """Held-out blocks drafted greedily: each block's drafts, the sequence's tokens there, and
    the confidence of each draft."""

    drafts: torch.Tensor  # (n_blocks, n_draft)
    labels: torch.Tensor  # (n_blocks, n_draft)
    conf: torch.Tensor  # (n_blocks, n_draft), in (0, 1)


def anchor_first_batch(
    corpus: Corpus, seqs: torch.Tensor, anchors: torch.Tensor, mask_token_id: int, n_block: int
) -> AnchorFirstBatch:
    """Blocks of `n_block` rows at `anchors` `(n_seq, n_anchor)`; every anchor + n_block must be
    inside its sequence (the last row's label)."""
    block = packed_batch(corpus, seqs, anchors, mask_token_id, n_block)
    following = block.positions.reshape(len(seqs), -1) + 1  # (n_seq, n_anchor * n_block)
    labels = torch.gather(corpus.tokens[seqs], 1, following).reshape(-1)  # (n_rows,)
    weights = torch.exp(-torch.arange(n_block) / ROW_DECAY).repeat(anchors.numel())  # (n_rows,)
    return AnchorFirstBatch(block=block, n_block=n_block, labels=labels, weights=weights)


def body(draft: Draft, target: Target, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The DFlash body on packed blocks: base logits `(n_rows, n_vocab)` (result_output) and the
    final-norm rows `(n_rows, n_embd)` (result_norm, what the confidence head reads)."""
    ctx = inject(draft, batch.features, batch.ctx_positions, f32_cache(draft.hparams))
    dp = draft_block(draft, target, batch.tokens, batch.positions, ctx.cache, batch.visible)
    (norm,) = (r.array for r in dp.records if r.name == names.RESULT_NORM)
    return dp.logits, norm


def markov_bias(dsp: DSpark, prev: torch.Tensor) -> torch.Tensor:
    """`markov_w2 @ markov_w1[prev]` for each row, `(n_rows, n_vocab)`."""
    return dsp.markov_w1[prev] @ dsp.markov_w2.T  # (n_rows, rank) @ (rank, n_vocab)


def chained(dsp: DSpark, base: torch.Tensor, norm: torch.Tensor, anchors: torch.Tensor, first_row: int) -> Chain:
    """The heads on blocks of base logits `(n_blocks, n_block, n_vocab)` and final-norm rows
    `(n_blocks, n_block, n_embd)`, reading rows `first_row ..` (0: anchor-first; 1: bonus anchor,
    whose row 0 is no draft); prev starts at each block's anchor `(n_blocks,)`."""
    prev, drafts, conf_logits = anchors, [], []
    conf_w, conf_b = present(dsp.conf_w, "conf_proj"), present(dsp.conf_b, "conf_proj_b")
    for i in range(first_row, base.shape[1]):
        w1_prev = dsp.markov_w1[prev]  # (n_blocks, rank)
        col = base[:, i] + w1_prev @ dsp.markov_w2.T  # (n_blocks, n_vocab)
        feat = torch.cat([norm[:, i], w1_prev], dim=1)  # (n_blocks, n_embd + rank)
        conf_logits.append((feat @ conf_w.T + conf_b)[:, 0])
        prev = col.argmax(dim=-1)
        drafts.append(prev)
    return Chain(drafts=torch.stack(drafts, dim=1), conf_logits=torch.stack(conf_logits, dim=1))


def _chained_blocks(
    dsp: DSpark, base: torch.Tensor, norm: torch.Tensor, batch: Batch, n_block: int, first_row: int
) -> Chain:
    """`chained` on a packed batch's rows: base `(n_rows, n_vocab)`, norm `(n_rows, n_embd)`."""
    anchors = batch.tokens.reshape(-1, n_block)[:, 0]  # (n_blocks,): each block's row 0 token
    base = base.reshape(-1, n_block, base.shape[1])  # (n_blocks, n_block, n_vocab)
    norm = norm.reshape(-1, n_block, norm.shape[1])  # (n_blocks, n_block, n_embd)
    return chained(dsp, base, norm, anchors, first_row)


def dspark_loss(draft: Draft, dsp: DSpark, target: Target, batch: AnchorFirstBatch) -> torch.Tensor:
    """Cross-entropy of each row's logits under the teacher-forced Markov bias (prev = the true
    token at the row's own position), plus the confidence head's binary cross-entropy against
    whether the row's greedy draft under the chained bias is right.

    The confidence term sees the body's rows detached: it trains the confidence head (and the
    Markov rows it reads), never what is drafted.
    """
    base, norm = body(draft, target, batch.block)
    ce = cross_entropy(base + markov_bias(dsp, batch.block.labels), batch.labels, reduction="none")
    chain = _chained_blocks(dsp, base.detach(), norm.detach(), batch.block, batch.n_block, first_row=0)
    is_right = (chain.drafts == batch.labels.reshape(-1, batch.n_block)).float()  # (n_blocks, n_block)
    markov = (ce * batch.weights).sum() / batch.weights.sum()
    return markov + binary_cross_entropy_with_logits(chain.conf_logits, is_right)


def draft_held_out(
    draft: Draft, dsp: DSpark, target: Target, corpus: Corpus, n_draft: int = N_DRAFT, anchor_first: bool = True
) -> Drafted:
    """Every block anchored in the continuations (from the longest prompt's end on) drafted
    greedily with `n_draft` drafts, laid out anchor-first, or bonus-anchor (`n_draft + 1` rows,
    drafts from row 1: what a GGUF with `dflash.sample_from_anchor` false makes llama.cpp run)."""
    n_seq, n_tokens = corpus.tokens.shape
    first_row = 0 if anchor_first else 1
    anchors = torch.arange(int(corpus.first_anchor.max()), n_tokens - n_draft).expand(n_seq, -1)  # (n_seq, n_anchor)
    batch = packed_batch(corpus, torch.arange(n_seq), anchors, draft.mask_token_id, n_draft + first_row)
    following = anchors.reshape(-1, 1) + 1 + torch.arange(n_draft)  # (n_blocks, n_draft)
    labels = torch.gather(corpus.tokens.repeat_interleave(anchors.shape[1], dim=0), 1, following)  # (n_blocks, n_draft)
    with torch.no_grad():
        base, norm = body(draft, target, batch)
        chain = _chained_blocks(dsp, base, norm, batch, n_draft + first_row, first_row)
    return Drafted(drafts=chain.drafts, labels=labels, conf=torch.sigmoid(chain.conf_logits))


def mean_accepted_length(drafted: Drafted) -> float:
    """Greedy accepted drafts + 1 per held-out block."""
    return accepted_length(drafted.drafts, drafted.labels)


def truncated(drafted: Drafted, p_min: float) -> Drafted:
    """The drafts llama.cpp keeps with --spec-draft-p-min `p_min`: each block's drafts up to its
    first confidence below `p_min`; the rest become NO_DRAFT."""
    is_kept = (drafted.conf >= p_min).int().cumprod(dim=1).bool()  # (n_blocks, n_draft)
    return Drafted(drafts=torch.where(is_kept, drafted.drafts, NO_DRAFT), labels=drafted.labels, conf=drafted.conf)


def confidence_auc(drafted: Drafted) -> float | None:
    """How well the confidences rank right drafts above wrong ones: the chance that a random
    right draft's confidence is above a random wrong one's (ties count half), over the drafts
    llama.cpp reaches (every draft before them right). None when either kind is absent."""
    is_right = drafted.drafts == drafted.labels  # (n_blocks, n_draft)
    is_reached = torch.cat([torch.ones_like(is_right[:, :1]), is_right.int().cumprod(dim=1)[:, :-1].bool()], dim=1)
    right, wrong = drafted.conf[is_right & is_reached], drafted.conf[~is_right & is_reached]
    if not len(right) or not len(wrong):
        return None
    above = (right[:, None] > wrong[None, :]).float()  # (n_right, n_wrong)
    tied = (right[:, None] == wrong[None, :]).float()  # (n_right, n_wrong)
    return float((above + 0.5 * tied).mean())
