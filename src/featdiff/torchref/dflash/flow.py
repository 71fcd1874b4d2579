"""The reference's replay of one flow: the DFlash / DSpark greedy protocol of docs/flow.md
(featdiff.core.phases), prefill, inject, then per round draft, verify and inject, with both KV caches
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
from dataclasses import dataclass

import torch

from featdiff.core import names
from featdiff.dump.records import Round
from featdiff.torchref.attention import KvCache, truncated
from featdiff.kinds.dflash.dflash2 import lattice_drafts
from featdiff.torchref.dflash.drafter import DraftPass, draft_block, inject
from featdiff.torchref.hf_target import HfTarget, kept_rejected_candidates, kept_rejected_state
from featdiff.torchref.dflash.dspark import drafted, first_draft_row, sampled
from featdiff.torchref.numerics import Numerics
from featdiff.torchref.stack import Named
from featdiff.torchref.target import TargetPass, forward_target
from featdiff.torchref.weights import Draft, Target
from featdiff.core.phases import PREFILL_ROUND, Phase, inject_after
from featdiff.torchref.rounds import (
    EvalTrace,
    FlowTrace,
    _empty,
    _eval,
    _ids,
    accept,
    check_plan,
    play_rounds,
    played_round,
    prefill_batches,
)

log = logging.getLogger(__name__)


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
    each draft block `block_rows` rows long (featdiff.core.blocks); a DSpark drafter with a confidence
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


def _chosen(
    draft: Draft, dp: DraftPass, anchor: int, n_rows: int, p_min: float
) -> tuple[tuple[int, ...], tuple[Named, ...]]:
    """The block's drafts as the driver picks them, and the records of what it picks from:
    DFlash and DSpark sample `draft_logits` (dspark.py); DFlash2 walks its lattice
    (featdiff.kinds.dflash.dflash2) and reads no logits, so it has no `draft_logits` record."""
    if draft.dflash2 is not None and dp.lattice is not None:
        return tuple(lattice_drafts(dp.lattice.tolist(), draft.dflash2.top_k, n_rows, p_min)), ()
    sp = sampled(draft, dp.logits, dp.norm, anchor)
    return drafted(sp, first_draft_row(draft), p_min), sp.records


def features(tp: TargetPass, draft: Draft) -> torch.Tensor:
    """Feature rows, token-major: slot k = input of target layer `target_layers[k]`.

    Shape `(n_tokens, n_extract * n_embd_tgt)`, as common/speculative.cpp stages them.
    """
    return torch.cat([tp.layer_inputs[il] for il in draft.target_layers], dim=1)  # (n_tokens, n_extract * n_embd_tgt)
