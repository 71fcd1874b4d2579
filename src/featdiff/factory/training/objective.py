"""The DFlash objective on packed blocks: many `[anchor, mask x (B-1)]` blocks, each over its own
context, in one call of the reference's drafter forward (`inject`, then `draft_block` with a
visibility mask), and the loss on the block rows' target tokens.

A block row sees its own block (non-causally) and the context rows of its sequence before its
anchor, as in the flow (docs/flow.md), where the anchor's own row is not injected yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from featdiff.factory.pairs import BLOCK_SIZE
from featdiff.torchref.dflash.drafter import draft_block, inject
from featdiff.torchref.weights import Draft, Target
from featdiff.factory.training.corpus import Corpus, f32_cache

ROW_DECAY = 2.0  # block row j weighs exp(-(j-1)/ROW_DECAY): draft j counts only once drafts 0..j-1 are accepted


@dataclass(frozen=True)
class Batch:
    """Every context row of some sequences and blocks anchored in them, as one draft eval."""

    features: torch.Tensor  # (n_seq * n_tokens, n_extract * n_embd_tgt)
    ctx_positions: torch.Tensor  # (n_seq * n_tokens,)
    tokens: torch.Tensor  # (n_rows,) = (n_blocks * B,): [anchor, mask x (B-1)] per block
    positions: torch.Tensor  # (n_rows,): anchor position + 0 .. B-1
    visible: torch.Tensor  # (n_rows, n_seq * n_tokens + n_rows) bool: context cells, then block rows
    labels: torch.Tensor  # (n_rows,): the sequence's token at each block row
    weights: torch.Tensor  # (n_rows,): loss weight, 0 on anchor rows


def packed_batch(
    corpus: Corpus, seqs: torch.Tensor, anchors: torch.Tensor, mask_token_id: int, n_block: int = BLOCK_SIZE
) -> Batch:
    """Blocks of `n_block` rows at `anchors` `(n_seq, n_anchor)` in the sequences `seqs` `(n_seq,)`
    of the corpus."""
    n_seq, n_tokens = len(seqs), corpus.tokens.shape[1]
    row = torch.arange(n_block)
    positions = anchors[:, :, None] + row  # (n_seq, n_anchor, B)
    labels = torch.gather(corpus.tokens[seqs], 1, positions.reshape(n_seq, -1))  # (n_seq, n_anchor * B)
    tokens = torch.where(row == 0, labels.reshape(positions.shape), mask_token_id)  # (n_seq, n_anchor, B)
    weights = torch.where(row == 0, 0.0, torch.exp(-(row - 1) / ROW_DECAY))  # (B,)
    return Batch(
        features=corpus.features[seqs].reshape(n_seq * n_tokens, -1),  # (n_seq * n_tokens, n_extract * n_embd_tgt)
        ctx_positions=torch.arange(n_tokens).repeat(n_seq),
        tokens=tokens.reshape(-1),
        positions=positions.reshape(-1),
        visible=_visibility(anchors, n_tokens, n_block),
        labels=labels.reshape(-1),
        weights=weights.repeat(anchors.numel()),
    )


def _visibility(anchors: torch.Tensor, n_tokens: int, n_block: int) -> torch.Tensor:
    """`(n_rows, n_seq * n_tokens + n_rows)`: each block row sees its sequence's context before
    its anchor, then its own block's rows."""
    n_seq, n_anchor = anchors.shape
    row_seq = torch.arange(n_seq).repeat_interleave(n_anchor * n_block)  # (n_rows,)
    row_anchor = anchors.repeat_interleave(n_block, dim=1).reshape(-1)  # (n_rows,)
    row_block = torch.arange(n_seq * n_anchor).repeat_interleave(n_block)  # (n_rows,)
    cell_seq, cell_pos = torch.arange(n_seq).repeat_interleave(n_tokens), torch.arange(n_tokens).repeat(n_seq)
    sees_context = (row_seq[:, None] == cell_seq[None, :]) & (cell_pos[None, :] < row_anchor[:, None])
    sees_block = row_block[:, None] == row_block[None, :]  # (n_rows, n_rows)
    return torch.cat([sees_context, sees_block], dim=1)  # (n_rows, n_seq * n_tokens + n_rows)


def block_logits(draft: Draft, target: Target, batch: Batch) -> torch.Tensor:
    """The reference drafter on a packed batch: inject every context row, draft every block,
    `(n_rows, n_vocab)`."""
    ctx = inject(draft, batch.features, batch.ctx_positions, f32_cache(draft.hparams))
    return draft_block(draft, target, batch.tokens, batch.positions, ctx.cache, batch.visible).logits


def block_loss(draft: Draft, target: Target, batch: Batch) -> torch.Tensor:
    """The DFlash objective: cross-entropy of each mask row against the token at its position."""
    ce = torch.nn.functional.cross_entropy(block_logits(draft, target, batch), batch.labels, reduction="none")
    return (ce * batch.weights).sum() / batch.weights.sum()


def mean_accepted_length(draft: Draft, target: Target, corpus: Corpus) -> float:
    """Greedy accepted drafts + 1 per block, over every block anchored in the continuations
    (from the longest prompt's end on).

    The target's greedy tokens are the sequence itself, so a block's accepted drafts are the
    prefix of its drafts (rows 1 .. B-1) that equals the sequence.
    """
    n_seq, n_tokens = corpus.tokens.shape
    anchors = torch.arange(int(corpus.first_anchor.max()), n_tokens - BLOCK_SIZE + 1).expand(n_seq, -1)
    batch = packed_batch(corpus, torch.arange(n_seq), anchors, draft.mask_token_id)
    with torch.no_grad():
        drafts = block_logits(draft, target, batch).argmax(-1).reshape(-1, BLOCK_SIZE)[:, 1:]  # (n_blocks, B-1)
    return accepted_length(drafts, batch.labels.reshape(-1, BLOCK_SIZE)[:, 1:])


def accepted_length(drafts: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean accepted drafts + 1 per block (greedy verify): the prefix of each block's drafts
    `(n_blocks, n_draft)` that equals the sequence's tokens there `(n_blocks, n_draft)`, plus the
    target's own token."""
    hits = (drafts == labels).int().cumprod(dim=1)  # (n_blocks, n_draft)
    return 1.0 + float(hits.sum(dim=1).float().mean())
