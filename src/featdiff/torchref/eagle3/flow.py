"""The reference's replay of one EAGLE3 flow, greedy, as `llama-speculative-simple` drives
`common_speculative_impl_draft_eagle3` (common/speculative.cpp): prefill and process, then per
round draft (a seed step and one decode per draft), verify, process and accept.

Consumes loaded models and prompt tokens; produces every eval's manifest entry and records, and
the rounds, in execution order (replay.FlowTrace). `process` runs the encoder over a target
batch's feature rows (an `encode` call, writing no cache), then the decoder over the pairs
(token t+1, g t) at position t; the batch's last row stays pending until the next draft's seed
step pairs it with the target's newest token. `follow` and `guide` are replay.py's. Each encoder
eval also records eagle3.encode_candidates, each draft step `draft_logits@d2t=offsets` beside
`draft_logits` (a drafter with d2t).
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
from featdiff.torchref.eagle3.graph import DecodePass, Eagle3Draft, check_eagle3_pair, decode, encode, encode_candidates
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


@dataclass(frozen=True)
class _State:
    target_cache: KvCache
    draft_cache: KvCache
    n_past: int
    id_last: int
    pending_pos: int  # pending_pos_last: the deferred boundary's position (n_past - 1)
    pending_g: torch.Tensor  # (n_embd,) pending_g_last: its g row


@dataclass(frozen=True)
class _Processed:
    """What `process` left: the draft cache, the batch's g rows, and its evals."""

    cache: KvCache
    g: torch.Tensor  # (n_tokens, n_embd)
    traces: list[EvalTrace]


def run_flow(
    target: Target,
    draft: Eagle3Draft,
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
    """Prefill `prompt[:-1]` and process it, then `rounds` rounds of draft / verify / process; a
    round drafts up to `draft_max` tokens (`--draft-max`) and stops below `p_min` (`--spec-draft-p-min`).
    `follow`, `guide` and `cached` as replay.run_flow takes them. `draft_steps` (round -> the token
    ids of the run's draft decodes, the seed's first): a followed or guided round decodes exactly
    those, as many as the run made (its driver drafts up to its configured n_max, and the loop
    cuts the drafts to its budget after: common_speculative_draft), none where the run made none.
    `draft_cached` (the run's flow: the token each cached drafter row was decoded with): where the
    run's drafter kept its row at the last cached position, the warm-up holds that row as the run
    did, and the prefill does not decode it again (compare names a row kept from another prompt).
    `target_batches`: the first position of each decode call the run prefilled its prompt in
    (llama-server cuts a prompt longer than its n_batch); the reference prefills in one batch, the
    same values, and places its `batch_last` candidate at the run's boundaries."""
    check_eagle3_pair(target, draft)
    if len(prompt) < 2:
        raise InputError(f"prompt of {len(prompt)} tokens: an EAGLE3 flow needs at least 2 (pairs of token t+1, g t)")
    if draft_max < 1:
        raise InputError(f"--draft-max {draft_max}: EAGLE3 drafts at least one token; pass 1 or more")
    state, evals = _prefill(target, draft, prompt, numerics, cached, kept_row(draft_cached, cached), target_batches)

    def one_round(state: _State, r: int, first_eval: int, plan: Round | None) -> tuple[_State, Round, list[EvalTrace]]:
        steps = draft_steps.get(r) if draft_steps is not None and plan is not None else None
        return _round(target, draft, state, r, first_eval, numerics, draft_max, p_min, plan, steps)

    return play_rounds(state, evals, rounds, follow, guide, one_round)


def features(tp: TargetPass, draft: Eagle3Draft) -> torch.Tensor:
    """Feature rows, token-major: slot k = input of target layer `target_layers[k]`, shape
    `(n_tokens, 3 * n_embd_tgt)` as process() interleaves them into features_buf."""
    return torch.cat([tp.layer_inputs[il] for il in draft.target_layers], dim=1)  # (n_tokens, 3 * n_embd_tgt)


def normed_taps(target: Target, tp: TargetPass, draft: Eagle3Draft) -> tuple[Named, ...]:
    """`inp_target_features@tap=attn_norm`: the feature rows were each slot its layer's attention
    norm output (rms_norm of the layer's input with its attn_norm weight) in place of the layer's
    input; none where a slot taps the trunk's output (no layer norm there) or the target runs
    through transformers (no per-layer weights here)."""
    layers = getattr(target, "layers", None)
    if layers is None or any(il >= len(layers) for il in draft.target_layers):
        return ()
    eps = target.hparams.rms_eps
    normed = [rms_norm(tp.layer_inputs[il], layers[il].attn_norm, eps) for il in draft.target_layers]
    name = names.candidate_name(names.INP_TARGET_FEATURES, names.HYP_TAP_ATTN_NORM)
    return (Named(name, torch.cat(normed, dim=1)),)  # (n_tokens, 3 * n_embd_tgt)


def kept_row(draft_cached: tuple[int, ...] | None, cached: int) -> int | None:
    """The token the run's drafter row at the last cached position was decoded with, where it
    kept one (upstream's process() leaves a held row be: its bridge writes only where no cell
    holds the position); None where it held none there."""
    if not cached or draft_cached is None or len(draft_cached) < cached or draft_cached[cached - 1] < 0:
        return None
    return draft_cached[cached - 1]


def _prefill(
    target: Target,
    draft: Eagle3Draft,
    prompt: tuple[int, ...],
    numerics: Numerics,
    cached: int,
    kept: int | None = None,
    target_batches: tuple[int, ...] = (),
) -> tuple[_State, list[EvalTrace]]:
    """The prompt but its last token through the target, each batch processed: positions
    0 .. cached-1 as warm-up evals (the run's prompt cache), the rest as the prefill. `kept`: the
    token of the row the run's drafter kept at position cached-1, which the warm-up writes there
    (with that position's g) in place of leaving it pending; the run's batches (`target_batches`,
    first positions) bound the `batch_last` candidate."""
    n = len(prompt) - 1
    t_cache, d_cache = _empty(target.hparams, numerics), _empty(draft.hparams, numerics)
    pending: tuple[int, torch.Tensor] | None = None
    evals: list[EvalTrace] = []
    for phase, tokens, positions in prefill_batches(prompt, cached):
        tp = forward_target(target, _ids(tokens, numerics), _ids(positions, numerics), t_cache, has_outputs=False)
        evals.append(
            EvalTrace(_eval(len(evals), names.ROLE_TARGET, phase, positions, tokens, PREFILL_ROUND), tp.records)
        )
        done = _process(
            target,
            draft,
            tp,
            tokens,
            positions,
            d_cache,
            pending,
            len(evals),
            inject_after(phase),
            PREFILL_ROUND,
            numerics,
            kept if phase == Phase.WARMUP else None,
            target_batches,
        )
        evals += done.traces
        t_cache, d_cache, pending = tp.cache, done.cache, (positions[-1], done.g[-1])
    if pending is None:
        raise ValueError("a prompt of at least 2 tokens prefills at least one row")
    return _State(t_cache, d_cache, n, prompt[n], pending[0], pending[1]), evals


def _process(
    target: Target,
    draft: Eagle3Draft,
    tp: TargetPass,
    tokens: tuple[int, ...],
    positions: tuple[int, ...],
    cache: KvCache,
    pending: tuple[int, torch.Tensor] | None,
    first_eval: int,
    phase: Phase,
    r: int,
    numerics: Numerics,
    kept: int | None = None,
    run_batches: tuple[int, ...] = (),
) -> _Processed:
    """process() of one target batch: the encoder eval, then the decoder eval of the rows
    (token k+1, g k) at position k, after the cross-ubatch bridge row (the first token with the
    pending g) when the pending position is the one before the batch and no cell holds it; `kept`
    adds the last row (that token with the last g), as a run that kept it there holds it. The
    decoder eval also records the `batch_last` candidate of its g norm (each batch's first token
    paired with that batch's last g; the batches: this one, cut where the run's `run_batches`
    begin inside it), where it differs from the rows'."""
    rows = features(tp, draft)  # (n_tokens, 3 * n_embd_tgt)
    g, enc_records = encode(draft, rows)
    enc_records += encode_candidates(draft, rows) + normed_taps(target, tp, draft)
    # the encoder uses no positions: process() numbers its rows on from the draft cache's last one
    start = int(cache.positions.max()) + 1 if cache.positions.numel() else 0
    enc_positions = tuple(range(start, start + len(tokens)))
    traces = [
        EvalTrace(_eval(first_eval, names.ROLE_DRAFT, phase, enc_positions, (), r, call=names.CALL_ENCODE), enc_records)
    ]
    last = batch_last_rows(positions, run_batches)  # token k's g row under `batch_last`
    row_tokens, row_positions, row_g = list(tokens[1:]), list(positions[:-1]), [g[:-1]]
    last_g = [g[last[1:]]]  # (n_tokens - 1, n_embd)
    if kept is not None:
        row_tokens, row_positions, row_g = [*row_tokens, kept], [*row_positions, positions[-1]], [g]
        last_g = [*last_g, g[-1:]]
    if pending is not None and pending[0] + 1 == positions[0] and pending[0] >= start:
        row_tokens, row_positions = [tokens[0], *row_tokens], [pending[0], *row_positions]
        row_g, last_g = [pending[1][None, :], *row_g], [g[last[:1]], *last_g]
    if not row_tokens:
        return _Processed(cache, g, traces)
    dp = decode(
        draft,
        target,
        _ids(tuple(row_tokens), numerics),
        torch.cat(row_g),  # (n_rows, n_embd)
        _ids(tuple(row_positions), numerics),
        cache,
    )
    ev = _eval(first_eval + 1, names.ROLE_DRAFT, phase, tuple(row_positions), tuple(row_tokens), r)
    records = dp.records + _batch_last_records(draft, torch.cat(row_g), torch.cat(last_g))
    return _Processed(dp.cache, g, traces + [EvalTrace(ev, records)])


def _batch_last_records(draft: Eagle3Draft, g: torch.Tensor, last_g: torch.Tensor) -> tuple[Named, ...]:
    """`g_norm-0@g=batch_last`: the decoder's g norm of the rows `last_g` (each batch's first token
    paired with that batch's last g), where any row differs from the rows' own `g`."""
    if torch.equal(g, last_g):
        return ()
    g_norm = rms_norm(last_g, draft.attn_norm_2, draft.hparams.rms_eps)  # (n_rows, n_embd)
    return (Named(names.candidate_name(names.layer_name(names.EAGLE3_G_NORM, 0), names.HYP_G_BATCH_LAST), g_norm),)


def _round(
    target: Target,
    draft: Eagle3Draft,
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
    own, d_cache, traces = _draft(target, draft, state, r, first_eval, numerics, draft_max, p_min, plan, steps)
    drafts = own if plan is None else tuple(plan.drafts)
    verify = (state.id_last,) + drafts
    positions = tuple(range(state.n_past, state.n_past + len(verify)))
    tp = forward_target(target, _ids(verify, numerics), _ids(positions, numerics), state.target_cache, True)
    traces.append(
        EvalTrace(_eval(first_eval + len(traces), names.ROLE_TARGET, Phase.VERIFY, positions, verify, r), tp.records)
    )
    pending = (state.pending_pos, state.pending_g)
    done = _process(
        target, draft, tp, verify, positions, d_cache, pending, first_eval + len(traces), Phase.INJECT, r, numerics
    )
    traces += done.traces
    accepted, best = accept(r, plan, own, drafts, tp.logits)
    i_g = min(accepted, len(verify) - 1)  # accept(): the verify row whose g is the new boundary's
    n_past = state.n_past + accepted + 1
    after = _State(
        truncated(tp.cache, n_past),
        truncated(done.cache, n_past),
        n_past,
        best[accepted],
        state.n_past + i_g,
        done.g[i_g],
    )
    return after, played_round(r, state, drafts, accepted, best), traces


def _draft(
    target: Target,
    draft: Eagle3Draft,
    state: _State,
    r: int,
    first_eval: int,
    numerics: Numerics,
    draft_max: int,
    p_min: float,
    plan: Round | None,
    steps: tuple[int, ...] | None = None,
) -> tuple[tuple[int, ...], KvCache, list[EvalTrace]]:
    """draft(): the seed step (id_last, pending g) at the pending position, then one step per
    draft (the draft, the row's eagle3_prenorm) at the next position, each its own eval. Returns
    the reference's own drafts (following a run: its own picks up to where they part from the
    run's), and the draft cache cut back to positions < n_past, as the loop leaves it."""
    if steps is not None and not steps:  # the run drafted nothing this round (no budget left)
        return (), truncated(state.draft_cache, state.n_past), []
    cache = truncated(state.draft_cache, state.pending_pos)  # seq_rm(pending_pos, -1)
    token, g, pos = state.id_last, state.pending_g[None, :], state.pending_pos
    picks: list[tuple[int, bool]] = []  # each row's top candidate, and whether p_min stops at it
    traces: list[EvalTrace] = []
    hyp: DecodePass | None = None  # the same steps recycling result_norm (g=after_norm), from the seed on
    while True:
        dp = decode(draft, target, _ids((token,), numerics), g, _ids((pos,), numerics), cache)
        cache = dp.cache
        hyp = _after_norm_step(draft, target, token, pos, numerics, dp, hyp)
        ev = _eval(first_eval + len(traces), names.ROLE_DRAFT, Phase.DRAFT, (pos,), (token,), r)
        traces.append(EvalTrace(ev, dp.records + _draft_logits(dp) + _after_norm_records(hyp)))
        picks.append((int(dp.logits[0].argmax()), top1_probability(dp.logits[0]) < p_min))
        following = next_token(picks, plan, steps, draft_max)
        if following is None:
            break
        token, g, pos = following, dp.prenorm, pos + 1
    own = own_drafts(picks, plan.drafts if plan is not None else None, draft_max)
    return own, truncated(cache, state.n_past), traces


def _after_norm_step(
    draft: Eagle3Draft, target: Target, token: int, pos: int, numerics: Numerics, dp: DecodePass, hyp: DecodePass | None
) -> DecodePass:
    """One step of the round's chain under the hypothesis that the driver recycles each step's
    result_norm, not its eagle3_prenorm: the seed as decoded (it reads the pending encoder row
    either way), then each step fed the chain's previous result_norm, through the chain's own
    cache (its rows of earlier steps differ too)."""
    if hyp is None:
        return dp
    norm = next(n.array for n in hyp.records if n.name == names.RESULT_NORM)  # (1, n_embd)
    return decode(draft, target, _ids((token,), numerics), norm, _ids((pos,), numerics), hyp.cache)


def _after_norm_records(hyp: DecodePass) -> tuple[Named, ...]:
    """`g_norm-0@g=after_norm`: the step's g norm in the chain of _after_norm_step."""
    g_norm = names.layer_name(names.EAGLE3_G_NORM, 0)
    return (
        Named(
            names.candidate_name(g_norm, names.HYP_G_AFTER_NORM), next(n.array for n in hyp.records if n.name == g_norm)
        ),
    )


def _draft_logits(dp: DecodePass) -> tuple[Named, ...]:
    """The step's `draft_logits` (the sampler's read-back), and its `draft_logits@d2t=offsets`
    candidate beside `result_output`'s when the drafter has d2t."""
    logits = (Named(names.DRAFT_LOGITS, dp.logits),)
    if dp.offsets_logits is None:
        return logits
    return logits + (Named(names.candidate_name(names.DRAFT_LOGITS, names.HYP_D2T_OFFSETS), dp.offsets_logits),)
