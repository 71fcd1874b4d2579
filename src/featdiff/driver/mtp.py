"""The in-process MTP flow through the real llama.cpp library (docs/flow.md, "MTP").

Mirrors upstream `examples/speculative-simple` with `--spec-type draft-mtp` and
`common_speculative_impl_draft_mtp` (common/speculative.cpp) for a model with one trained head
(qwen35: neither shared memory nor chained heads), greedy, one sequence:

* the draft context is an MTP context (LLAMA_CONTEXT_TYPE_MTP) of the target's own model when the
  heads are inside its GGUF, else of the separate `mtp-*.gguf` (capture.load_models);
* after each target decode (the prefill, a verify) `process()`: one catch-up decode of the batch's
  tokens into the head's KV cache, token k paired with the target's post-final-norm hidden
  (`h_nextn`, every row: llama_set_embeddings_nextn unmasked) of row k - 1, the batch's first
  token with the pending row (zeros before the first batch); the batch's hidden rows are kept
  and the last one becomes pending;
* `draft()`: the freshest target token with the pending row at n_past, then one decode per
  draft, each fed the previous step's `h_nextn` (the head's own post-norm state) at the next
  position, top-1 of the sampler's top 10, stopping below `p_min` or at `draft_max`;
* `accept()`: the pending row becomes the verify's hidden row at the accepted length.

Gemma 4's assistant (`gemma4-assistant`, `MtpConfig.shares_memory`: its context's memory is the
target's, `ctx_other`; common/speculative.cpp `is_mem_shared`) decodes no catch-up rows and drafts
every step at n_past, its own h_nextn (the target's width) recycled.

Evals carry the DFlash phases (featdiff.core.phases): the steps are the round's `draft` evals, the
catch-up decodes its `inject` evals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from featdiff.core import names
from featdiff.core.blocks import accepted_length
from featdiff.core.errors import InputError
from featdiff.core.phases import FIRST_ROUND, PREFILL_ROUND, Phase
from featdiff.driver.mtp_chain import MtpState, run_chain_flow
from featdiff.driver.rounds import Recorder, close_round, each_round, open_eval, rollback, step_drafts
from featdiff.dump.records import Round
from featdiff.llama.runtime import Context, Model


@dataclass(frozen=True)
class MtpConfig:
    draft_max: int  # drafts per round: --spec-draft-n-max
    p_min: float = 0.0  # --spec-draft-p-min: drafting stops below this top-1 probability
    n_heads: int = 1  # llama_model_n_layer_nextn: more than one are chained (driver/mtp_chain.py)
    kind: str = "mtp"
    shares_memory: bool = False  # Gemma 4's assistant: attends over the target's KV cache (is_mem_shared)

    @property
    def target_layers(self) -> tuple[int, ...]:
        return ()  # the head reads the target's final hidden state, no layer inputs

    @property
    def block_rows(self) -> int:
        """The positions one round may reach past n_past: the verify's anchor and drafts."""
        return self.draft_max + 1

    @property
    def noncausal_rows(self) -> int:
        return 0  # every MTP batch is causal


def nextn_layers(model: Model) -> int:
    """The MTP blocks the GGUF declares (`<arch>.nextn_predict_layers`; 0 when absent)."""
    arch = model.meta(names.KEY_ARCH) or ""
    value = model.meta(names.KEY_NEXTN_LAYERS.format(arch=arch))
    return int(value) if value is not None and value.isdigit() else 0


def flow_config(draft: Model, draft_max: int, p_min: float = 0.0) -> MtpConfig:
    """The settings common_speculative_impl_draft_mtp reads from the head's model."""
    n_heads = nextn_layers(draft)
    shared = draft.meta(names.KEY_ARCH) == names.ARCH_GEMMA4_ASSISTANT  # all its layers in one graph
    if n_heads < 1:
        raise InputError(
            f"{draft.path}: {n_heads} MTP blocks; featdiff models a trained head (re-convert without --no-mtp to "
            "keep it)"
        )
    if draft_max < 1:
        raise InputError(f"--draft-max {draft_max}: expected >= 1 draft per round (llama.cpp's --spec-draft-n-max)")
    return MtpConfig(draft_max, p_min, 1 if shared else n_heads, shares_memory=shared)


def enable(tgt: Context, dft: Context, cfg: MtpConfig) -> None:
    """What common_speculative_impl_draft_mtp's constructor switches on: every target row's
    post-norm hidden (unmasked), the head's output rows' own (masked)."""
    lib = tgt.rt.lib
    lib.fd_set_embeddings_nextn(tgt.ptr, True, False)
    lib.fd_set_embeddings_nextn(dft.ptr, True, True)


def run_flow(
    tgt: Context, dft: Context, prompt: list[int], rounds: int, cfg: MtpConfig, rec: Recorder, on_round=None
) -> list[Round]:
    """Prefill, then `rounds` x (draft, verify, process); return the rounds."""
    if cfg.n_heads > 1:  # chained heads (common/speculative.cpp chain_heads): driver/mtp_chain.py
        return run_chain_flow(tgt, dft, prompt, rounds, cfg, rec, on_round)
    n_embd = tgt.model.n_embd
    st = MtpState(n_past=len(prompt) - 1, id_last=prompt[-1], n_embd=n_embd)
    st.pending_h = np.zeros(n_embd, dtype=np.float32)  # the first token of a sequence is paired with zeros
    positions = list(range(st.n_past))
    open_eval(st, rec, Phase.PREFILL, PREFILL_ROUND, positions, prompt[:-1])
    tgt.decode_tokens(prompt[:-1], positions, outputs=False)
    _process(tgt, dft, st, rec, prompt[:-1], positions, PREFILL_ROUND, catch_up=not cfg.shares_memory)
    last = FIRST_ROUND + rounds - 1
    return each_round(rounds, lambda r: _round(tgt, dft, st, rec, cfg, r, r == last), on_round)


def _process(
    tgt: Context,
    dft: Context,
    st: MtpState,
    rec: Recorder,
    tokens: list[int],
    positions: list[int],
    rnd: int,
    catch_up: bool,
) -> None:
    """common_speculative_impl_draft_mtp::process of one target batch: the catch-up decode of
    (token k, hidden k-1), the first token with the pending row (none where the head shares the
    target's memory: `catch_up` false); keep the batch's hidden rows, the last one pending."""
    hidden = tgt.nextn_rows(len(positions))  # (n_tokens, n_embd): unmasked, one per batch row
    if catch_up:  # Gemma 4's assistant reads the target's own cache: nothing to catch up
        rows = np.concatenate([st.pending_h[None, :], hidden[:-1]])  # (n_tokens, n_embd)
        open_eval(st, rec, Phase.INJECT, rnd, positions, tokens)
        dft.decode_tokens_embd(tokens, rows, positions, outputs=False)
    st.verify_h, st.pending_h = hidden, hidden[-1].copy()


def _round(
    tgt: Context, dft: Context, st: MtpState, rec: Recorder, cfg: MtpConfig, rnd: int, is_last: bool = False
) -> Round:
    pos0, anchor = st.n_past, st.id_last
    drafts = _draft(dft, st, rec, cfg, rnd)
    dft.seq_rm(pos0)  # speculative-simple: the head's cache back to the target's n_past
    verify = [anchor] + drafts
    positions = list(range(pos0, pos0 + len(verify)))
    open_eval(st, rec, Phase.VERIFY, rnd, positions, verify)
    tgt.decode_tokens(verify, positions, outputs=True)
    target_tokens = [int(np.argmax(tgt.logits(i))) for i in range(len(verify))]
    _process(tgt, dft, st, rec, verify, positions, rnd, catch_up=not cfg.shares_memory)
    accepted = accepted_length(drafts, target_tokens)
    st.pending_h = st.verify_h[min(accepted, len(verify) - 1)].copy()  # accept(): the row at the accepted length
    st.n_past, st.id_last = pos0 + accepted + 1, target_tokens[accepted]
    if not is_last:  # only a later verify reads the target's memory (qwen3next's cannot roll back: rounds.rollback)
        rollback(tgt, st.n_past, len(verify) - (accepted + 1))
    dft.seq_rm(st.n_past)
    return close_round(rec, rnd, pos0, anchor, drafts, accepted, target_tokens)


def _draft(dft: Context, st: MtpState, rec: Recorder, cfg: MtpConfig, rnd: int) -> list[int]:
    """draft(): the freshest target token with the pending row at n_past, then one decode per
    draft with the previous step's h_nextn (driver.step_drafts); the capture records the rows handed
    over as the graph's input `mtp_h_input`. Gemma 4's assistant drafts every step at n_past."""
    if cfg.shares_memory:
        return step_drafts(dft, st, rec, cfg, rnd, st.id_last, st.pending_h, st.n_past, advance=0, width=st.n_embd)
    return step_drafts(dft, st, rec, cfg, rnd, st.id_last, st.pending_h, st.n_past)
