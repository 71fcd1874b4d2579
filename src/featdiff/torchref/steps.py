"""The draft steps of the kinds that draft one token per decode (featdiff.kinds: EAGLE3, MTP), as
their replays (eagle3_flow.py, mtp_flow.py) pick them: the sampler's top-1 and its probability,
the token the next step decodes (the reference's own pick, the run's own decodes, or a followed
round's drafts), and the drafts a round makes of its picks."""

from __future__ import annotations

import torch

from featdiff.dump.records import Round

SAMPLER_TOP_K = 10  # the drafters' samplers: top_k 10, then dist (common_speculative_impl_draft_eagle3, _mtp)


def top1_probability(row: torch.Tensor) -> float:
    """The top candidate's probability as the drafter's sampler has it: softmax over the top
    SAMPLER_TOP_K logits of the row (top_k, then dist's softmax; sorted by p)."""
    top = torch.topk(row.float(), min(SAMPLER_TOP_K, row.shape[0])).values  # (k,) descending
    return float(1.0 / torch.exp(top - top[0]).sum())


def next_token(
    picks: list[tuple[int, bool]], plan: Round | None, steps: tuple[int, ...] | None, draft_max: int
) -> int | None:
    """The token the next draft step decodes after `picks` (each step's top candidate, and whether
    p_min stops at it), None when the round's steps are done: the reference's own pick up to p_min
    or `draft_max`; the run's own decodes (`steps`, past the drafts its loop kept too); else a
    followed round's drafts, as many steps as the run made for them."""
    if plan is None:
        return None if picks[-1][1] or len(picks) >= draft_max else picks[-1][0]
    if steps is not None:
        return None if len(picks) >= len(steps) else steps[len(picks)]
    return None if len(picks) > followed_steps(plan, draft_max) else plan.drafts[len(picks) - 1]


def own_drafts(picks: list[tuple[int, bool]], run_drafts: tuple[int, ...] | None, draft_max: int) -> tuple[int, ...]:
    """The drafts the reference makes of its rows' picks: up to p_min's stop or `draft_max`;
    following a run, up to and with the first pick that parts from the run's drafts."""
    own: list[int] = []
    for j, (pick, stop) in enumerate(picks):
        if stop or len(own) >= draft_max:
            break
        own.append(pick)
        if run_drafts is not None and (j >= len(run_drafts) or pick != run_drafts[j]):
            break
    return tuple(own)


def followed_steps(plan: Round | None, draft_max: int) -> int:
    """The step evals a run made for its drafts: one per draft but the last when it stopped at
    `draft_max` (the last draft is never decoded), one per draft when p_min stopped it."""
    if plan is None:
        return 0
    n = len(plan.drafts)
    return n - 1 if n >= draft_max else n
