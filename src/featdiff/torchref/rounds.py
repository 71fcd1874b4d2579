"""The reference's round machinery every kind's replayed flow shares: the trace, playing rounds after a
guide (a run's dump), prefill batches, acceptance."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar
import torch
from featdiff.core import names, progress
from featdiff.core.blocks import accepted_length
from featdiff.dump.records import Eval, Round
from featdiff.torchref.attention import KvCache, empty_cache
from featdiff.torchref.numerics import Numerics
from featdiff.torchref.stack import Named
from featdiff.torchref.weights import Hparams
from featdiff.core.phases import FIRST_ROUND, Phase

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


def batch_last_rows(positions: tuple[int, ...], run_batches: tuple[int, ...]) -> list[int]:
    """Which hidden (MTP) or g (EAGLE3) row the token of each row of a batch at `positions` is
    paired with under the `batch_last` hypothesis: row k - 1's, but a batch's first token its last
    row's (a later position's). The batches are the one at `positions`, cut where a run's batch
    begins inside it (`run_batches`, first positions: the pairing goes by the run's decode calls,
    common/speculative.cpp's i_batch_beg/i_batch_end)."""
    n = len(positions)
    firsts = sorted({0} | {p - positions[0] for p in run_batches if 0 < p - positions[0] < n})
    rows = list(range(-1, n - 1))  # row k reads k - 1; every batch's first row is set below
    for first, end in zip(firsts, [*firsts[1:], n]):
        rows[first] = end - 1
    return rows


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
