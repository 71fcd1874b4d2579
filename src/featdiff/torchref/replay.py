"""The reference's replay of one flow: the DFlash / DSpark greedy protocol of docs/flow.md
(featdiff.phases), prefill, inject, then per round draft, verify and inject, with both KV caches
trimmed to the accepted prefix.

Consumes loaded models and prompt tokens; produces every eval's manifest entry and records,
and the rounds, in execution order. Following a run (`follow`: the run dump's rounds), each round
verifies the run's own drafts and keeps the run's accepted prefix and next anchor, so the
reference decodes the very tokens the run decoded, even where its own choices would differ (a
quantized target, a server's own loop); its records still hold what it computes on them.
Guided by a run (`guide`, `reference --run`), the reference decides each round itself and, where
its choice parts from the run's round that starts at the same place, takes the run's tokens for
it: compare judges the parting from the reference's own logits (diff/partings.py), and the
rounds after it still pair with the run's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from featdiff import names, progress
from featdiff.blocks import accepted_length
from featdiff.dump import Eval, Round
from featdiff.torchref.attention import KvCache, empty_cache, truncated
from featdiff.lattice import lattice_drafts
from featdiff.torchref.drafter import DraftPass, draft_block, inject
from featdiff.torchref.hf_target import HfTarget, kept_rejected_candidates, kept_rejected_state
from featdiff.torchref.dspark import drafted, first_draft_row, sampled
from featdiff.torchref.numerics import Numerics
from featdiff.torchref.stack import Named
from featdiff.torchref.target import TargetPass, forward_target
from featdiff.torchref.weights import Draft, Hparams, Target
from featdiff.phases import FIRST_ROUND, PREFILL_ROUND, Phase, inject_after

log = logging.getLogger(__name__)


class FollowError(ValueError):
    """The run's rounds do not chain (a round starts where the earlier ones do not lead), so the
    reference cannot decode what the run decoded; the caller names the run dump."""


@dataclass(frozen=True)
class EvalTrace:
    """One eval's manifest entry and its records."""

    eval: Eval
    records: tuple[Named, ...]


@dataclass(frozen=True)
class FlowTrace:
    """Everything the flow produced, in execution order."""

    evals: tuple[EvalTrace, ...]
    rounds: tuple[Round, ...]


@dataclass(frozen=True)
class _State:
    target_cache: KvCache
    draft_cache: KvCache
    n_past: int
    id_last: int
    # the cache a hybrid target would hold had its recurrent state kept the last verify's rejected
    # rows (hf_target.kept_rejected_state): the next verify's `@recurrent=kept_rejected` candidates
    kept_rejected: KvCache | None = None


def run_flow(
    target: Target,
    draft: Draft,
    prompt: tuple[int, ...],
    rounds: int,
    numerics: Numerics,
    *,
    block_rows: int,
    p_min: float = 0.0,
    follow: tuple[Round, ...] | None = None,
    guide: tuple[Round, ...] | None = None,
    cached: int = 0,
) -> FlowTrace:
    """Prefill `prompt[:-1]`, inject its features, then `rounds` rounds of draft / verify / inject,
    each draft block `block_rows` rows long (featdiff.blocks); a DSpark drafter with a confidence
    head stops drafting below `p_min` (`--spec-draft-p-min`). With `follow` (a run's rounds, one
    per round), each round decodes the run's drafts and keeps the run's accepted prefix. With
    `guide` (a run's rounds), each round the run's round chains onto decodes the run's tokens,
    the others the reference's own (the module docstring). The first `cached` prompt positions
    are decoded as warm-up evals before the prefill: a run that found them in its prompt cache
    (docs/flow.md "Several flows") decoded them in an earlier flow."""
    state, evals = _prefill(target, draft, prompt, numerics, cached)

    def one_round(state: _State, r: int, first_eval: int, plan: Round | None) -> tuple[_State, Round, list[EvalTrace]]:
        return _round(target, draft, state, r, first_eval, numerics, block_rows, p_min, plan)

    return play_rounds(state, evals, rounds, follow, guide, one_round)


class FlowState(Protocol):
    """Where a replayed flow stands between rounds: what a run's round must start from."""

    @property
    def n_past(self) -> int: ...

    @property
    def id_last(self) -> int: ...


S = TypeVar("S", bound=FlowState)


def play_rounds(
    state: S,
    evals: list[EvalTrace],
    rounds: int,
    follow: tuple[Round, ...] | None,
    guide: tuple[Round, ...] | None,
    one_round: Callable[[S, int, int, Round | None], tuple[S, Round, list[EvalTrace]]],
) -> FlowTrace:
    """`rounds` rounds after the prefill's `evals`, each by `one_round(state, r, first eval, plan)`:
    the plan is the followed run's round, else the guiding run's round that chains onto `state`
    (guided_round), else None (the reference decides). One progress step a round."""
    done: list[Round] = []
    with progress.steps(rounds, "rounds") as on_round:
        for r in range(FIRST_ROUND, FIRST_ROUND + rounds):
            plan = follow[r - FIRST_ROUND] if follow is not None else guided_round(guide, r, state)
            state, played, traces = one_round(state, r, len(evals), plan)
            evals += traces
            done.append(played)
            if on_round is not None:
                on_round()
    return FlowTrace(tuple(evals), tuple(done))


def guided_round(guide: tuple[Round, ...] | None, r: int, state: FlowState) -> Round | None:
    """The run's round `r` when it starts where the reference stands and drafted (a round the
    reference can decode as the run did), else None: the reference decides that round itself."""
    plan = next((g for g in guide or () if g.round == r), None)
    if plan is None or (plan.pos0, plan.anchor) != (state.n_past, state.id_last) or not plan.drafts:
        return None
    return plan if 0 <= plan.accepted <= len(plan.drafts) else None


def check_plan(plan: Round | None, state: FlowState, r: int) -> None:
    """FollowError when the run's round `r` does not start where its earlier rounds lead, or
    accepts more drafts than it has."""
    if plan is None:
        return
    if (plan.pos0, plan.anchor) != (state.n_past, state.id_last):
        raise FollowError(
            f"round {r} of the run starts at position {plan.pos0} from token {plan.anchor}, but "
            f"following its earlier rounds leads to position {state.n_past}, token {state.id_last}"
        )
    if not 0 <= plan.accepted <= len(plan.drafts):
        raise FollowError(f"round {r} of the run accepts {plan.accepted} of {len(plan.drafts)} drafts")


def prefill_batches(prompt: tuple[int, ...], cached: int) -> list[tuple[Phase, tuple[int, ...], tuple[int, ...]]]:
    """The target batches that prefill `prompt` but its last token, each as (phase, tokens,
    positions): positions 0 .. cached-1 as a warm-up (the run's prompt cache), the rest as the
    prefill; an empty part is left out."""
    n = len(prompt) - 1
    parts = ((Phase.WARMUP, 0, min(cached, n)), (Phase.PREFILL, min(cached, n), n))
    return [(phase, prompt[start:end], tuple(range(start, end))) for phase, start, end in parts if end > start]


def _prefill(
    target: Target, draft: Draft, prompt: tuple[int, ...], numerics: Numerics, cached: int = 0
) -> tuple[_State, list[EvalTrace]]:
    """The prompt but its last token through the target, its features into the drafter's cache:
    positions 0 .. cached-1 as warm-up evals (the run's prompt cache), the rest as the prefill."""
    n = len(prompt) - 1
    caches = (_empty(target.hparams, numerics), _empty(draft.hparams, numerics))
    evals: list[EvalTrace] = []
    for phase, batch, at in prefill_batches(prompt, cached):
        tokens, positions = _ids(batch, numerics), _ids(at, numerics)
        tp = forward_target(target, tokens, positions, caches[0], has_outputs=False)
        ip = inject(draft, features(tp, draft), positions, caches[1])
        evals += [
            EvalTrace(_eval(len(evals), names.ROLE_TARGET, phase, positions, batch, PREFILL_ROUND), tp.records),
            EvalTrace(
                _eval(len(evals) + 1, names.ROLE_DRAFT, inject_after(phase), positions, (), PREFILL_ROUND), ip.records
            ),
        ]
        caches = (tp.cache, ip.cache)
    return _State(caches[0], caches[1], n, prompt[n]), evals


def _round(
    target: Target,
    draft: Draft,
    state: _State,
    r: int,
    first_eval: int,
    numerics: Numerics,
    b: int,
    p_min: float,
    plan: Round | None = None,
) -> tuple[_State, Round, list[EvalTrace]]:
    check_plan(plan, state, r)
    traces: list[EvalTrace] = []
    own: tuple[int, ...] = ()
    if plan is None or plan.drafts:  # a followed round of no drafts (llama-server's last) decodes no block
        block_positions = _ids(tuple(range(state.n_past, state.n_past + b)), numerics)
        block = (state.id_last,) + (draft.mask_token_id,) * (b - 1)
        dp = draft_block(draft, target, _ids(block, numerics), block_positions, state.draft_cache)
        own, chosen_from = _chosen(draft, dp, state.id_last, b, p_min)
        traces.append(
            EvalTrace(
                _eval(first_eval, names.ROLE_DRAFT, Phase.DRAFT, block_positions, block, r), dp.records + chosen_from
            )
        )
    drafts = own if plan is None else tuple(plan.drafts)
    verify = (state.id_last,) + drafts
    positions = _ids(tuple(range(state.n_past, state.n_past + len(verify))), numerics)
    tp = forward_target(target, _ids(verify, numerics), positions, state.target_cache, has_outputs=True)
    kept: tuple[Named, ...] = ()
    if state.kept_rejected is not None and isinstance(target, HfTarget):
        kept = kept_rejected_candidates(target, _ids(verify, numerics), positions, state.kept_rejected)
    ip = inject(draft, features(tp, draft), positions, state.draft_cache)
    accepted, best = accept(r, plan, own, drafts, tp.logits)
    n_past = state.n_past + accepted + 1
    kept_state = kept_rejected_state(target, tp.cache, n_past) if isinstance(target, HfTarget) else None
    after = _State(truncated(tp.cache, n_past), truncated(ip.cache, n_past), n_past, best[accepted], kept_state)
    n = first_eval + len(traces)
    traces += [
        EvalTrace(_eval(n, names.ROLE_TARGET, Phase.VERIFY, positions, verify, r), tp.records + kept),
        EvalTrace(_eval(n + 1, names.ROLE_DRAFT, Phase.INJECT, positions, (), r), ip.records),
    ]
    return after, played_round(r, state, drafts, accepted, best), traces


def accept(
    r: int, plan: Round | None, own: tuple[int, ...], drafts: tuple[int, ...], logits: torch.Tensor
) -> tuple[int, tuple[int, ...]]:
    """A verify's accepted drafts and the target's greedy token of each row (`logits`): the
    reference's own, or following a run (`plan`) the run's accept and next anchor where its dump
    holds it, with where the reference's own choice parts from the run's logged."""
    best = tuple(int(t) for t in logits.argmax(-1))
    if plan is None:
        return accepted_length(drafts, best), best
    own_took = best[: accepted_length(drafts, best) + 1]  # the reference's own choice
    accepted = plan.accepted
    if len(plan.target_tokens) > accepted:
        best = tuple(plan.target_tokens[: accepted + 1]) + best[accepted + 1 :]
    _note_parting(r, own, own_took, drafts, best[: accepted + 1])
    return accepted, best


def played_round(r: int, state: FlowState, drafts: tuple[int, ...], accepted: int, best: tuple[int, ...]) -> Round:
    """Round `r` as played from `state`: its drafts, how many the target accepted and its tokens."""
    return Round(
        round=r,
        pos0=state.n_past,
        anchor=state.id_last,
        drafts=drafts,
        accepted=accepted,
        target_tokens=best[: accepted + 1],
    )


def _note_parting(
    r: int, own: tuple[int, ...], own_took: tuple[int, ...], drafts: tuple[int, ...], took: tuple[int, ...]
) -> None:
    """Log where the reference's own choice (its drafts, the target tokens it would take after
    the run's drafts) parts from the run's, which it decodes instead."""
    if (own, own_took) != (drafts, took):  # per-round detail: on stderr with -v (DEBUG)
        log.debug(
            "round %d: the reference would draft %s and take %s after the run's drafts %s, the run took %s; "
            "it decodes the run's tokens (compare judges the parting)",
            r,
            list(own),
            list(own_took),
            list(drafts),
            list(took),
        )


def _chosen(
    draft: Draft, dp: DraftPass, anchor: int, n_rows: int, p_min: float
) -> tuple[tuple[int, ...], tuple[Named, ...]]:
    """The block's drafts as the driver picks them, and the records of what it picks from:
    DFlash and DSpark sample `draft_logits` (dspark.py); DFlash2 walks its lattice
    (featdiff.lattice) and reads no logits, so it has no `draft_logits` record."""
    if draft.dflash2 is not None and dp.lattice is not None:
        return tuple(lattice_drafts(dp.lattice.tolist(), draft.dflash2.top_k, n_rows, p_min)), ()
    sp = sampled(draft, dp.logits, dp.norm, anchor)
    return drafted(sp, first_draft_row(draft), p_min), sp.records


def features(tp: TargetPass, draft: Draft) -> torch.Tensor:
    """Feature rows, token-major: slot k = input of target layer `target_layers[k]`.

    Shape `(n_tokens, n_extract * n_embd_tgt)`, as common/speculative.cpp stages them.
    """
    return torch.cat([tp.layer_inputs[il] for il in draft.target_layers], dim=1)  # (n_tokens, n_extract * n_embd_tgt)


def _ids(values: tuple[int, ...], numerics: Numerics) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=numerics.device)


def _empty(hp: Hparams, numerics: Numerics) -> KvCache:
    return empty_cache(hp.n_layer, hp.n_head_kv, hp.n_embd_head, numerics.kv_dtype, numerics.device)


def _eval(
    index: int,
    role: names.Role,
    phase: Phase,
    positions: Iterable[int] | torch.Tensor,
    token_ids: tuple[int, ...],
    r: int,
    call: str = names.CALL_DECODE,
) -> Eval:
    """A replayed eval's manifest entry: one sequence, at `positions` (a tensor or ints)."""
    pos = tuple(int(p) for p in positions)
    return Eval(
        eval=index,
        role=role,
        phase=phase,
        n_tokens=len(pos),
        positions=pos,
        token_ids=tuple(token_ids),
        seq_ids=(0,) * len(pos),
        round=r,
        call=call,
    )
