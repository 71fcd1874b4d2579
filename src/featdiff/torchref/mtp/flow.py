"""The reference's replay of one MTP flow, greedy, as `llama-speculative-simple` drives
`common_speculative_impl_draft_mtp` (common/speculative.cpp) for a single head: prefill and
process, then per round draft (one decode per step), verify, process and accept.

Consumes the loaded target and head and the prompt tokens; produces every eval's manifest entry
and records, and the rounds, in execution order (replay.FlowTrace). `process` decodes a target
batch's tokens into the head's cache, token k with the target's hidden of row k - 1 and the
first with the pending row (zeros before the first batch); the batch's last hidden row stays
pending, and after a verify the row at the accepted length does. Which hidden is the
architecture's (mtp_layer.MtpGraph.is_prenorm): the target's post-norm one (qwen35, glm4moe) or
its trunk output before the final norm (mimo2); the other is each row's wrong-norm candidate
(`@h=prenorm`, mimo2's `@h=postnorm`). Each target eval records its `h_nextn` (every row, as
llama.cpp hands them over unmasked). `follow`, `guide` and `draft_steps`
are eagle3_flow's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from featdiff.core import names
from featdiff.dump.records import Round
from featdiff.core.errors import InputError
from featdiff.core.phases import PREFILL_ROUND, Phase, inject_after
from featdiff.torchref.attention import KvCache, truncated
from featdiff.torchref.hf_target import HfTarget, final_norm
from featdiff.torchref.hf_taps import layer_out_name
from featdiff.torchref.mtp.head import MtpHead, MtpPass, check_mtp_pair, decode
from featdiff.torchref.mtp.layer import GRAPHS
from featdiff.torchref.numerics import Numerics, rms_norm
from featdiff.torchref.rounds import (
    EvalTrace,
    FlowTrace,
    _empty,
    _eval,
    _ids,
    accept,
    batch_last_rows,
    check_plan,
    play_rounds,
    prefill_batches,
    played_round,
)
from featdiff.torchref.stack import Named
from featdiff.torchref.steps import next_token, own_drafts, top1_probability
from featdiff.torchref.target import TargetPass, forward_target
from featdiff.torchref.weights import Target


# the wrong-norm hypotheses of an arch's convention (MtpGraph.is_prenorm): what the target would
# hand the head, and what a draft step would recycle, under the other norm
WRONG_NORM = {
    False: (names.HYP_H_PRENORM, names.HYP_CHAIN_PRENORM),
    True: (names.HYP_H_POSTNORM, names.HYP_CHAIN_POSTNORM),
}


# the handed-layer hypotheses (`h=l_out-<il>`): every layer before the trunk's last, nearest first, as
# long as they add at most this many values per handed row; a wide trunk keeps the nearest that fit
# (at least MIN_SHALLOWER), so a real model's reference does not grow by n_layer rows per state row
SHALLOWER_VALUES = 1 << 16
MIN_SHALLOWER = 2


def shallower_layers(n_layer: int, n_embd: int) -> range:
    """The layers whose output the reference hands the head as `h=l_out-<il>` hypotheses, nearest
    the trunk's last first: all n_layer - 1 of them where they fit in SHALLOWER_VALUES per row."""
    count = min(n_layer - 1, max(MIN_SHALLOWER, SHALLOWER_VALUES // max(n_embd, 1)))
    return range(n_layer - 2, n_layer - 2 - count, -1)


@dataclass(frozen=True)
class _Hidden:
    """A row the head is handed, the one the wrong-norm hypothesis would hand in its place, and the
    rows the layers before the trunk's last would hand (its `h=l_out-<il>` hypotheses)."""

    handed: torch.Tensor  # (n, n_embd): as the arch's target graph hands it (its h_nextn)
    other: torch.Tensor  # (n, n_embd): on the other side of the final norm
    shallower: tuple[tuple[int, torch.Tensor], ...] = ()  # (il, (n, n_embd)): layer il's output, handed alike

    def rows(self, at: slice) -> _Hidden:
        return _Hidden(self.handed[at], self.other[at], tuple((il, h[at]) for il, h in self.shallower))


@dataclass(frozen=True)
class _State:
    target_cache: KvCache
    draft_cache: KvCache
    n_past: int
    id_last: int
    pending: _Hidden  # (1, n_embd) each: pending_h, and its wrong-norm twin


def run_flow(
    target: Target,
    head: MtpHead,
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
    """Prefill `prompt[:-1]` and process it, then `rounds` rounds of draft / verify / process.
    `draft_cached` (the run's kept head rows) changes nothing: a head row pairs token p with the
    hidden of p - 1, both inside a kept prefix, so the warm-up writes every kept row as the run held it.
    `target_batches`: the first position of each decode call the run prefilled its prompt in
    (llama-server splits a prompt, e.g. 25 + 4 tokens); the reference decodes the prompt in one
    batch, the same values, and places its `batch_last` candidate at the run's boundaries."""
    check_mtp_pair(target, head)
    if len(prompt) < 2:
        raise InputError(f"prompt of {len(prompt)} tokens: an MTP flow needs at least 2 (a prefill and its next token)")
    if draft_max < 1:
        raise InputError(f"--draft-max {draft_max}: MTP drafts at least one token; pass 1 or more")
    state, evals = _prefill(target, head, prompt, numerics, cached, target_batches)

    def one_round(state: _State, r: int, first_eval: int, plan: Round | None) -> tuple[_State, Round, list[EvalTrace]]:
        steps = draft_steps.get(r) if draft_steps is not None and plan is not None else None
        return _round(target, head, state, r, first_eval, numerics, draft_max, p_min, plan, steps)

    return play_rounds(state, evals, rounds, follow, guide, one_round)


def target_hidden(target: Target, tp: TargetPass, is_prenorm: bool) -> _Hidden:
    """Every row's hidden as the target's graph hands it to the head (`h_nextn`: after the final
    norm, or before it where `is_prenorm`), and on the other side of that norm."""
    n = target.hparams.n_layer
    norm = final_norm(target) if isinstance(target, HfTarget) else None

    def normed(x: torch.Tensor) -> torch.Tensor:
        return norm(x) if norm is not None else rms_norm(x, target.output_norm, target.hparams.rms_eps)

    pre = tp.layer_inputs[n]  # (n_tokens, n_embd): the final norm's input
    post = normed(pre)
    # layer il's output is layer il + 1's input, handed over under the arch's convention
    shallower = tuple(
        (il, tp.layer_inputs[il + 1] if is_prenorm else normed(tp.layer_inputs[il + 1]))
        for il in shallower_layers(n, pre.shape[-1])
    )
    return _Hidden(pre, post, shallower) if is_prenorm else _Hidden(post, pre, shallower)


def _target_eval(
    target: Target,
    tokens: tuple[int, ...],
    positions: tuple[int, ...],
    cache: KvCache,
    outputs: bool,
    numerics: Numerics,
    is_prenorm: bool,
) -> tuple[TargetPass, _Hidden, tuple[Named, ...]]:
    tp = forward_target(target, _ids(tokens, numerics), _ids(positions, numerics), cache, has_outputs=outputs)
    hidden = target_hidden(target, tp, is_prenorm)
    # a graph that hands over the trunk output names that very tensor h_nextn (mimo2.cpp's cb on the
    # last layer's output): its l_out-<n_layer - 1> is no node of its own
    renamed = layer_out_name(target.hparams.arch, target.hparams.n_layer - 1) if is_prenorm else None
    records = tuple(r for r in tp.records if r.name != renamed)
    return tp, hidden, (*records, Named(names.H_NEXTN, hidden.handed))


def _prefill(
    target: Target,
    head: MtpHead,
    prompt: tuple[int, ...],
    numerics: Numerics,
    cached: int,
    target_batches: tuple[int, ...],
) -> tuple[_State, list[EvalTrace]]:
    """The prompt but its last token through the target, each batch processed: positions
    0 .. cached-1 as warm-up evals (the run's prompt cache), the rest as the prefill; the
    run's batches (`target_batches`, first positions) bound the `batch_last` candidate."""
    n = len(prompt) - 1
    t_cache, d_cache = _empty(target.hparams, numerics), _empty(head.hparams, numerics)
    zeros = torch.zeros((1, head.hparams.n_embd), dtype=numerics.dtype, device=numerics.device)
    pending = _Hidden(zeros, zeros)
    evals: list[EvalTrace] = []
    for phase, tokens, positions in prefill_batches(prompt, cached):
        tp, hidden, records = _target_eval(target, tokens, positions, t_cache, False, numerics, _is_prenorm(head))
        evals.append(EvalTrace(_eval(len(evals), names.ROLE_TARGET, phase, positions, tokens, PREFILL_ROUND), records))
        d_cache, trace = _process(
            head, tokens, positions, hidden, pending, d_cache, len(evals), inject_after(phase), PREFILL_ROUND, numerics,
            target_batches,
        )  # fmt: skip
        evals.append(trace)
        t_cache, pending = tp.cache, hidden.rows(slice(-1, None))
    return _State(t_cache, d_cache, n, prompt[n], pending), evals


def _process(
    head: MtpHead,
    tokens: tuple[int, ...],
    positions: tuple[int, ...],
    hidden: _Hidden,
    pending: _Hidden,
    cache: KvCache,
    index: int,
    phase: Phase,
    r: int,
    numerics: Numerics,
    run_batches: tuple[int, ...] = (),
) -> tuple[KvCache, EvalTrace]:
    """process() of one target batch: (token k, hidden k-1) at position k, the first token with
    the pending row; the candidates of the wrong-norm hand-over and of each batch's first token
    paired with that batch's last hidden (the batches: this one, cut where the run's
    `run_batches` begin inside it)."""
    handed = torch.cat([pending.handed, hidden.handed[:-1]])  # (n_tokens, n_embd)
    other = torch.cat([pending.other, hidden.other[:-1]])  # (n_tokens, n_embd)
    batch_last = hidden.handed[batch_last_rows(positions, run_batches)]  # (n_tokens, n_embd)
    alternatives = {WRONG_NORM[_is_prenorm(head)][0]: other, names.HYP_H_BATCH_LAST: batch_last}
    before = dict(pending.shallower)  # the pending row's own layers (zeros before the first batch)
    for il, rows in hidden.shallower:
        first = before.get(il, pending.handed)  # (1, n_embd)
        alternatives[names.h_layer_hypothesis(il)] = torch.cat([first, rows[:-1]])  # (n_tokens, n_embd)
    mp = decode(head, _ids(tokens, numerics), handed, _ids(positions, numerics), cache, alternatives, outputs=False)
    return mp.cache, EvalTrace(_eval(index, names.ROLE_DRAFT, phase, positions, tokens, r), mp.records)


def _round(
    target: Target,
    head: MtpHead,
    state: _State,
    r: int,
    first_eval: int,
    numerics: Numerics,
    draft_max: int,
    p_min: float,
    plan: Round | None,
    steps: tuple[int, ...] | None = None,
) -> tuple[_State, Round, list[EvalTrace]]:
    """One round: draft, verify, process, accept (speculative-simple's loop body)."""
    check_plan(plan, state, r)
    own, d_cache, traces = _draft(head, state, r, first_eval, numerics, draft_max, p_min, plan, steps)
    drafts = own if plan is None else tuple(plan.drafts)
    verify = (state.id_last,) + drafts
    positions = tuple(range(state.n_past, state.n_past + len(verify)))
    tp, hidden, records = _target_eval(target, verify, positions, state.target_cache, True, numerics, _is_prenorm(head))
    traces.append(
        EvalTrace(_eval(first_eval + len(traces), names.ROLE_TARGET, Phase.VERIFY, positions, verify, r), records)
    )
    d_cache, trace = _process(
        head, verify, positions, hidden, state.pending, d_cache, first_eval + len(traces), Phase.INJECT, r, numerics
    )
    traces.append(trace)
    accepted, best = accept(r, plan, own, drafts, tp.logits)
    i_h = min(accepted, len(verify) - 1)  # accept(): the verify row at the accepted length
    n_past = state.n_past + accepted + 1
    after = _State(
        truncated(tp.cache, n_past),
        truncated(d_cache, n_past),
        n_past,
        best[accepted],
        hidden.rows(slice(i_h, i_h + 1)),
    )
    return after, played_round(r, state, drafts, accepted, best), traces


def _draft(
    head: MtpHead,
    state: _State,
    r: int,
    first_eval: int,
    numerics: Numerics,
    draft_max: int,
    p_min: float,
    plan: Round | None,
    steps: tuple[int, ...] | None = None,
) -> tuple[tuple[int, ...], KvCache, list[EvalTrace]]:
    """draft(): (id_last, pending row) at n_past, then one step per draft (the draft, the previous
    step's h_nextn) at the next position, each its own eval. Returns the reference's own drafts
    (following a run: its own picks up to where they part from the run's), and the head's cache
    cut back to positions < n_past, as the loop leaves it."""
    if steps is not None and not steps:  # the run drafted nothing this round (no budget left)
        return (), truncated(state.draft_cache, state.n_past), []
    cache = state.draft_cache
    token, row, pos = state.id_last, state.pending.handed, state.n_past
    picks: list[tuple[int, bool]] = []  # each step's top candidate, and whether p_min stops at it
    traces: list[EvalTrace] = []
    chain: MtpPass | None = None  # the same steps each handed the previous one's state under the other norm
    while True:
        ids, at = _ids((token,), numerics), _ids((pos,), numerics)
        mp = decode(head, ids, row, at, cache)
        cache = mp.cache
        chain = mp if chain is None else decode(head, ids, chain.other_norm, at, chain.cache)
        ev = _eval(first_eval + len(traces), names.ROLE_DRAFT, Phase.DRAFT, (pos,), (token,), r)
        traces.append(EvalTrace(ev, (*mp.records, Named(names.DRAFT_LOGITS, mp.logits), *_chain_records(head, chain))))
        picks.append((int(mp.logits[0].argmax()), top1_probability(mp.logits[0]) < p_min))
        following = next_token(picks, plan, steps, draft_max)
        if following is None:
            break
        token, row, pos = following, mp.h_nextn, pos + 1  # the chain recycles h_nextn
    own = own_drafts(picks, plan.drafts if plan is not None else None, draft_max)
    return own, truncated(cache, state.n_past), traces


def _chain_records(head: MtpHead, chain: MtpPass) -> tuple[Named, ...]:
    """`mtp_h_input@h=chain_prenorm` and `mtp_hnorm-<il>@h=chain_prenorm` (mimo2's
    `@h=chain_postnorm`): the step's input and its norm in the chain of draft steps each handed
    the previous step's state on the other side of the head norm (the first step reads the
    pending row either way), through the chain's own cache."""
    wanted = (names.MTP_H_INPUT, names.layer_name(names.MTP_HNORM, head.il))
    hypothesis = WRONG_NORM[_is_prenorm(head)][1]
    return tuple(Named(names.candidate_name(n.name, hypothesis), n.array) for n in chain.records if n.name in wanted)


def _is_prenorm(head: MtpHead) -> bool:
    """The head's architecture hands and recycles the hidden state before the norms (mtp_layer.GRAPHS)."""
    return GRAPHS[head.hparams.arch].is_prenorm
