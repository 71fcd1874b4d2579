"""The DFlash / DSpark greedy flow of docs/flow.md, in the reference: prefill, inject, then per
round draft, verify and inject, with both KV caches trimmed to the accepted prefix.

Consumes loaded models and prompt tokens; produces every eval's manifest entry and records,
and the rounds, in execution order. Following a run (`follow`: the run dump's rounds), each round
verifies the run's own drafts and keeps the run's accepted prefix and next anchor, so the
reference decodes the very tokens the run decoded, even where its own choices would differ (a
quantized target, a server's own loop); its records still hold what it computes on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from featdiff import names, progress
from featdiff.blocks import accepted_length
from featdiff.dump import Eval, Round
from featdiff.reference.attention import KvCache, empty_cache, truncated
from featdiff.reference.drafter import draft_block, inject
from featdiff.reference.dspark import drafted, first_draft_row, sampled
from featdiff.reference.numerics import Numerics
from featdiff.reference.stack import Named
from featdiff.reference.target import TargetPass, forward_target
from featdiff.reference.weights import Draft, Hparams, Target

PREFILL_ROUND = 0  # the prefill and its inject carry round 0; speculative rounds count from 1


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
) -> FlowTrace:
    """Prefill `prompt[:-1]`, inject its features, then `rounds` rounds of draft / verify / inject,
    each draft block `block_rows` rows long (featdiff.blocks); a DSpark drafter with a confidence
    head stops drafting below `p_min` (`--spec-draft-p-min`). With `follow` (a run's rounds, one
    per round), each round decodes the run's drafts and keeps the run's accepted prefix."""
    state, evals = _prefill(target, draft, prompt, numerics)
    done: list[Round] = []
    with progress.steps(rounds, "rounds") as on_round:
        for r in range(PREFILL_ROUND + 1, PREFILL_ROUND + 1 + rounds):
            plan = follow[r - PREFILL_ROUND - 1] if follow is not None else None
            state, one_round, traces = _round(target, draft, state, r, len(evals), numerics, block_rows, p_min, plan)
            evals += traces
            done.append(one_round)
            if on_round is not None:
                on_round()
    return FlowTrace(tuple(evals), tuple(done))


def _prefill(
    target: Target, draft: Draft, prompt: tuple[int, ...], numerics: Numerics
) -> tuple[_State, list[EvalTrace]]:
    n = len(prompt) - 1
    tokens, positions = _ids(prompt[:n], numerics), _ids(tuple(range(n)), numerics)
    tp = forward_target(target, tokens, positions, _empty(target.hparams, numerics), has_outputs=False)
    ip = inject(draft, features(tp, draft), positions, _empty(draft.hparams, numerics))
    evals = [
        EvalTrace(_eval(0, "target", "prefill", positions, prompt[:n], PREFILL_ROUND), tp.records),
        EvalTrace(_eval(1, "draft", "inject", positions, (), PREFILL_ROUND), ip.records),
    ]
    return _State(tp.cache, ip.cache, n, prompt[n]), evals


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
    if plan is not None and (plan.pos0, plan.anchor) != (state.n_past, state.id_last):
        raise FollowError(
            f"round {r} of the run starts at position {plan.pos0} from token {plan.anchor}, but "
            f"following its earlier rounds leads to position {state.n_past}, token {state.id_last}"
        )
    if plan is not None and not 0 <= plan.accepted <= len(plan.drafts):
        raise FollowError(f"round {r} of the run accepts {plan.accepted} of {len(plan.drafts)} drafts")
    block_positions = _ids(tuple(range(state.n_past, state.n_past + b)), numerics)
    block = (state.id_last,) + (draft.mask_token_id,) * (b - 1)
    dp = draft_block(draft, target, _ids(block, numerics), block_positions, state.draft_cache)
    sp = sampled(draft, dp.logits, dp.norm, state.id_last)
    drafts = drafted(sp, first_draft_row(draft), p_min) if plan is None else tuple(plan.drafts)
    verify = (state.id_last,) + drafts
    positions = _ids(tuple(range(state.n_past, state.n_past + len(verify))), numerics)
    tp = forward_target(target, _ids(verify, numerics), positions, state.target_cache, has_outputs=True)
    ip = inject(draft, features(tp, draft), positions, state.draft_cache)
    best = tuple(int(t) for t in tp.logits.argmax(-1))
    if plan is None:
        accepted = accepted_length(drafts, best)
    else:  # the run's accept, and its next anchor where the run dump holds it
        accepted = plan.accepted
        if len(plan.target_tokens) > accepted:
            best = tuple(plan.target_tokens[: accepted + 1]) + best[accepted + 1 :]
    n_past = state.n_past + accepted + 1
    after = _State(truncated(tp.cache, n_past), truncated(ip.cache, n_past), n_past, best[accepted])
    traces = [
        EvalTrace(_eval(first_eval, "draft", "draft", block_positions, block, r), dp.records + sp.records),
        EvalTrace(_eval(first_eval + 1, "target", "verify", positions, verify, r), tp.records),
        EvalTrace(_eval(first_eval + 2, "draft", "inject", positions, (), r), ip.records),
    ]
    one_round = Round(
        round=r,
        pos0=state.n_past,
        anchor=state.id_last,
        drafts=drafts,
        accepted=accepted,
        target_tokens=best[: accepted + 1],
    )
    return after, one_round, traces


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
    index: int, role: names.Role, phase: names.Phase, positions: torch.Tensor, token_ids: tuple[int, ...], r: int
) -> Eval:
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
    )
