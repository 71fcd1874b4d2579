"""The in-process flow of chained MTP heads through the real llama.cpp library (docs/flow.md,
"MTP"): `common_speculative_impl_draft_mtp` (common/speculative.cpp) with `chain_heads` (n_layer_nextn
> 1, the drafter's own memory: MiMo-V2's three heads), greedy, one sequence. As driver/mtp.py, but:

* `process()` decodes each target batch once per head k (llama_set_nextn_layer_offset(k), the
  batch's cells removed first so each head writes its own layer there), then restores offset 0;
* `draft()`: step k runs head k over the round's rows so far, (id_last, pending row) at n_past and
  each draft t with the `h_nextn` of the step that drafted it (`chain_h`), the draft region removed
  first, the last row the only output; at most as many steps as heads (n_max capped at the count).

Evals carry the phases of driver/mtp.py: the head decodes of process() are `inject`, the steps `draft`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from featdiff.core import names
from featdiff.core.blocks import accepted_length
from featdiff.core.phases import PREFILL_ROUND, Phase
from featdiff.driver.rounds import Recorder, StepConfig, close_round, each_round, open_eval, rollback, top1
from featdiff.dump.records import Round
from featdiff.llama.runtime import Context


class ChainConfig(StepConfig, Protocol):
    """What the chain reads of driver/mtp.py's MtpConfig (which dispatches here)."""

    @property
    def n_heads(self) -> int: ...


@dataclass
class MtpState:
    """The MTP driver's flow state, single head (driver/mtp.py) or chained: n_past, the last token,
    the pending hidden row (pending_h) and the last verify's rows (verify_h)."""

    n_past: int
    id_last: int
    n_embd: int
    pending_h: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    verify_h: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))
    n_evals: int = 0


def run_chain_flow(
    tgt: Context, dft: Context, prompt: list[int], rounds: int, cfg: ChainConfig, rec: Recorder, on_round=None
) -> list[Round]:
    """Prefill, then `rounds` x (chained draft, verify, process under every head); return the rounds."""
    st = MtpState(n_past=len(prompt) - 1, id_last=prompt[-1], n_embd=tgt.model.n_embd)
    st.pending_h = np.zeros(st.n_embd, dtype=np.float32)  # the first token of a sequence is paired with zeros
    positions = list(range(st.n_past))
    open_eval(st, rec, Phase.PREFILL, PREFILL_ROUND, positions, prompt[:-1])
    tgt.decode_tokens(prompt[:-1], positions, outputs=False)
    _process(tgt, dft, st, rec, cfg, prompt[:-1], positions, PREFILL_ROUND)
    return each_round(rounds, lambda r: _round(tgt, dft, st, rec, cfg, r), on_round)


def _process(
    tgt: Context,
    dft: Context,
    st: MtpState,
    rec: Recorder,
    cfg: ChainConfig,
    tokens: list[int],
    positions: list[int],
    rnd: int,
) -> None:
    """process() of one target batch under every head: (token j, hidden j - 1), the first token
    with the pending row; the batch's hidden rows kept, the last one pending."""
    hidden = tgt.nextn_rows(len(positions))  # (n_tokens, n_embd): unmasked, one per batch row
    rows = np.concatenate([st.pending_h[None, :], hidden[:-1]])  # (n_tokens, n_embd)
    for k in range(cfg.n_heads):
        dft.seq_rm(positions[0])
        dft.set_nextn_layer_offset(k)
        open_eval(st, rec, Phase.INJECT, rnd, positions, tokens)
        dft.decode_tokens_embd(tokens, rows, positions, outputs=False)
    dft.set_nextn_layer_offset(0)  # the default for non-draft decodes
    st.verify_h, st.pending_h = hidden, hidden[-1].copy()


def _round(tgt: Context, dft: Context, st: MtpState, rec: Recorder, cfg: ChainConfig, rnd: int) -> Round:
    pos0, anchor = st.n_past, st.id_last
    drafts = _draft(dft, st, rec, cfg, rnd)
    dft.seq_rm(pos0)  # speculative-simple: the head's cache back to the target's n_past
    verify = [anchor] + drafts
    positions = list(range(pos0, pos0 + len(verify)))
    open_eval(st, rec, Phase.VERIFY, rnd, positions, verify)
    tgt.decode_tokens(verify, positions, outputs=True)
    target_tokens = [int(np.argmax(tgt.logits(i))) for i in range(len(verify))]
    _process(tgt, dft, st, rec, cfg, verify, positions, rnd)
    accepted = accepted_length(drafts, target_tokens)
    st.pending_h = st.verify_h[min(accepted, len(verify) - 1)].copy()  # accept(): the row at the accepted length
    st.n_past, st.id_last = pos0 + accepted + 1, target_tokens[accepted]
    rollback(tgt, st.n_past, len(verify) - (accepted + 1))
    dft.seq_rm(st.n_past)
    return close_round(rec, rnd, pos0, anchor, drafts, accepted, target_tokens)


def _draft(dft: Context, st: MtpState, rec: Recorder, cfg: ChainConfig, rnd: int) -> list[int]:
    """draft(): step k under head k over (id_last, pending) and each draft with its step's
    h_nextn, the round's rows from n_past re-decoded; top-1 of the sampler's top 10, stopping
    below p_min or at min(draft_max, the head count)."""
    tokens, chain_h = [st.id_last], [st.pending_h]
    drafts: list[int] = []
    n_max = min(cfg.draft_max, cfg.n_heads)
    while True:
        k = len(drafts)
        positions = list(range(st.n_past, st.n_past + k + 1))
        rows = np.stack(chain_h)  # (k + 1, n_embd)
        dft.seq_rm(st.n_past)
        dft.set_nextn_layer_offset(k)
        open_eval(st, rec, Phase.DRAFT, rnd, positions, tokens)
        dft.decode_tokens_embd(tokens, rows, positions, outputs=True, last_only=True)
        logits = dft.logits(-1)  # the last row: the step's only output
        rec.readback(names.DRAFT_LOGITS, logits[None, :])  # (1, n_vocab)
        token, p = top1(logits)
        if p < cfg.p_min:
            break
        drafts.append(token)
        if len(drafts) >= n_max:
            break
        tokens.append(token)
        chain_h.append(dft.nextn_row(-1))  # chain_h: the state this step's head made for its last row
    dft.set_nextn_layer_offset(0)
    return drafts
