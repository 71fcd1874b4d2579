"""DSpark's heads on a draft block (upstream `build_dspark_markov_head`, src/models/dflash.cpp),
and which rows of a block are drafts under each layout.

Consumes the block's base logits (`result_output`, `(n_rows, n_vocab)`), its final-norm rows
(`result_norm`) and its anchor token; produces the logits the sampler reads (`draft_logits`), the
Markov bias (`dspark_markov_bias`) and the confidences (`dspark_conf`).

* Markov head: row i gets `scale * markov_w2 @ markov_w1[prev]`; `prev` is the anchor for the
  first biased row, then the argmax of the row before (greedy, in the graph).
* Confidence head: `sigmoid(conf_proj @ [result_norm(i); markov_w1[prev]] + b)`.
* Anchor-first (`dflash.sample_from_anchor` true or absent): every row is biased and read, row 0
  included. Bonus anchor: row 0 passes through unbiased (its confidence column is
  `sigmoid(base[0, 0])`, padding nobody reads) and drafts are rows 1.. like DFlash.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from featdiff.core import blocks, names
from featdiff.torchref.stack import Named
from featdiff.torchref.weights import Draft, DSpark


@dataclass(frozen=True)
class Sampled:
    """What the driver samples a block from, and the records saying so."""

    logits: torch.Tensor  # (n_rows, n_vocab): `draft_logits`
    conf: torch.Tensor | None  # (n_rows, 1): `dspark_conf`
    records: tuple[Named, ...]


@dataclass(frozen=True)
class HeadPass:
    """The heads' output on one block."""

    logits: torch.Tensor  # (n_rows, n_vocab): what the sampler reads
    bias: torch.Tensor  # (n_rows, n_vocab): logits - base
    conf: torch.Tensor | None  # (n_rows, 1); None without a confidence head


def first_draft_row(draft: Draft) -> int:
    """The block row llama.cpp reads `draft`'s first draft from (featdiff.core.blocks.first_draft_row)."""
    return blocks.first_draft_row(
        draft.dspark is not None, draft.dspark is not None and draft.dspark.sample_from_anchor
    )


def sampled(draft: Draft, base: torch.Tensor, norm: torch.Tensor, anchor: int) -> Sampled:
    """The block's `draft_logits` (base for DFlash; with the Markov bias for DSpark), and for
    DSpark the bias, the confidences and the candidate of the other anchor layout
    (`draft_logits@anchor=bonus` / `@anchor=first`: what a GGUF with the flag flipped samples)."""
    dsp = draft.dspark
    if dsp is None:
        return Sampled(base, None, (Named(names.DRAFT_LOGITS, base),))
    own = heads(dsp, base, norm, anchor, draft.d2t, anchor_first=dsp.sample_from_anchor)
    flipped = heads(dsp, base, norm, anchor, draft.d2t, anchor_first=not dsp.sample_from_anchor)
    hyp = names.HYP_ANCHOR_BONUS if dsp.sample_from_anchor else names.HYP_ANCHOR_FIRST
    records = [
        Named(names.DRAFT_LOGITS, own.logits),
        Named(names.DSPARK_MARKOV_BIAS, own.bias),
        Named(names.candidate_name(names.DRAFT_LOGITS, hyp), flipped.logits),
    ]
    if own.conf is not None and flipped.conf is not None:
        records += [
            Named(names.DSPARK_CONF, own.conf),
            Named(names.candidate_name(names.DSPARK_CONF, hyp), flipped.conf),
        ]
    return Sampled(own.logits, own.conf, tuple(records))


def heads(
    dsp: DSpark, base: torch.Tensor, norm: torch.Tensor, anchor: int, d2t: torch.Tensor | None, anchor_first: bool
) -> HeadPass:
    """The Markov (and confidence) head on one block laid out `anchor_first` or bonus-anchor."""
    n_rows = base.shape[0]
    prev = anchor
    rows, biases, confs = [], [], []
    if not anchor_first:
        rows.append(base[0])
        biases.append(torch.zeros_like(base[0]))
        confs.append(torch.sigmoid(base[0, :1]))
    for i in range(0 if anchor_first else 1, n_rows):
        w1_prev = dsp.markov_w1[prev]  # (rank,)
        bias = dsp.markov_w2 @ w1_prev  # (n_vocab_draft,)
        if dsp.markov_w2_scale is not None:
            bias = bias * dsp.markov_w2_scale
        bias = _scattered(bias, d2t, base.shape[1])  # (n_vocab,)
        col = base[i] + bias
        rows.append(col)
        biases.append(bias)
        if dsp.conf_w is not None:
            feat = torch.cat([norm[i], w1_prev])  # (n_embd + rank,)
            z = dsp.conf_w @ feat  # (1,)
            confs.append(torch.sigmoid(z + dsp.conf_b if dsp.conf_b is not None else z))
        prev = int(col.argmax())
    conf = torch.stack(confs) if dsp.conf_w is not None else None  # (n_rows, 1)
    return HeadPass(torch.stack(rows), torch.stack(biases), conf)


def _scattered(bias: torch.Tensor, d2t: torch.Tensor | None, n_vocab: int) -> torch.Tensor:
    """A draft-vocabulary row on the target vocabulary (zeros off the `d2t` rows)."""
    if d2t is None:
        return bias
    full = torch.zeros(n_vocab, dtype=bias.dtype, device=bias.device)  # (n_vocab,)
    full[d2t] = bias
    return full


def drafted(s: Sampled, first_row: int, p_min: float) -> tuple[int, ...]:
    """The greedy drafts of a sampled block (featdiff.core.blocks.read_drafts)."""
    conf = s.conf[:, 0].tolist() if s.conf is not None else None
    return tuple(blocks.read_drafts(s.logits.argmax(-1).tolist(), conf, first_row, p_min))
