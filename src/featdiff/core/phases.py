"""The speculative protocol of docs/flow.md, owned once: the phases an eval has, the role that runs
each, their order in a round, which batches carry tokens, and which phase's evals feed which.

Upstream `common/speculative.cpp` (DFlash): round 0 is the prefill and its inject; each round
after it decodes a draft block, verifies it on the target and injects the verified rows. Capture,
exec inference, the reference, compare and report read the protocol here, nowhere else (a "flow"
is one stream of it in a dump: `Eval.flow`, docs/dump.md). Plain Python that imports only
`featdiff.core.names` (the roles). A phase is a `str` enum: dumps and findings JSON carry its value
(`Eval.phase`, a finding's `phase` field), unchanged. (The C preload names no phase.)
"""

from __future__ import annotations

from enum import StrEnum

from featdiff.core.names import ROLE_DRAFT, ROLE_TARGET, Role


class Phase(StrEnum):
    """An eval's phase (`Eval.phase`, `Record.phase`): its value is what the dump writes."""

    PREFILL = "prefill"  # round 0: the prompt (but its last token) through the target
    INJECT = "inject"  # target feature rows into the drafter's KV cache (after a prefill or verify)
    DRAFT = "draft"  # a draft block [anchor, mask x (B-1)] through the drafter: opens a round
    VERIFY = "verify"  # the target decodes [anchor, drafts...]; the accepted prefix stays
    WARMUP = "warmup"  # decodes outside the flow: warm-up, probes, throwaway contexts, a cached prefix


PHASES: tuple[Phase, ...] = tuple(Phase)  # every phase a dump may carry, in declaration order
PREFILL_ROUND = 0  # the prefill and its inject carry round 0; speculative rounds count from 1
FIRST_ROUND = PREFILL_ROUND + 1
# The role whose context runs each flow phase (a warm-up decode may run on either).
ROLE_OF: dict[Phase, Role] = {
    Phase.PREFILL: ROLE_TARGET,
    Phase.INJECT: ROLE_DRAFT,
    Phase.DRAFT: ROLE_DRAFT,
    Phase.VERIFY: ROLE_TARGET,
}
# Round order: prefill first (round 0), then each round draft, verify, inject (docs/flow.md).
ROUND_ORDER: tuple[Phase, ...] = (Phase.PREFILL, Phase.DRAFT, Phase.VERIFY, Phase.INJECT)
ROUND_OPENER: tuple[Role, Phase] = (ROLE_DRAFT, Phase.DRAFT)  # (role, phase) of the eval opening a round
TARGET_PHASES: tuple[Phase, ...] = (Phase.PREFILL, Phase.VERIFY)  # the target's flow decodes
TOKEN_PHASES: tuple[Phase, ...] = (Phase.PREFILL, Phase.VERIFY, Phase.DRAFT)  # batches of token ids
# The drafter's phases in data order: inject fills the cache the draft eval reads.
DRAFTER_PHASES: tuple[Phase, ...] = (Phase.INJECT, Phase.DRAFT)
# The batches that carry a round's verified rows: a run may cut them short of the reference's.
VERIFY_PHASES: tuple[Phase, ...] = (Phase.VERIFY, Phase.INJECT)
# The evals whose logits choose tokens: a draft block its drafts, a verify the target's tokens.
CHOOSING_PHASES: tuple[Phase, ...] = (Phase.DRAFT, Phase.VERIFY)
# Which phases' evals feed an eval of each phase: a target eval reads the earlier target evals
# (KV cache), an inject the target evals (features), a draft block the inject evals (KV cache).
FEEDERS: dict[Phase, tuple[Phase, ...]] = {
    Phase.PREFILL: TARGET_PHASES,
    Phase.VERIFY: TARGET_PHASES,
    Phase.INJECT: TARGET_PHASES,
    Phase.DRAFT: (Phase.INJECT,),
}
# What a batch of each phase is called in a sentence ("the draft block of round 2").
BATCH_NOUNS: dict[str, str] = {
    Phase.DRAFT: "draft block",
    Phase.INJECT: "inject batch",
    Phase.VERIFY: "verify batch",
}

# Whose eval it is and what it does, in a sentence ("drafter's draft", "target's verify"): the
# dump's role and phase values read as English (a role value is "draft" for the drafter).
ROLE_OWNERS: dict[str, str] = {ROLE_TARGET: "target's", ROLE_DRAFT: "drafter's"}
PHASE_WORDS: dict[str, str] = {Phase.WARMUP: "warm-up"}


_RANK: dict[str, int] = {p: i for i, p in enumerate(ROUND_ORDER)}


def phrase(role: str, phase: str) -> str:
    """An eval's role and phase as words: phrase("draft", "draft") == "drafter's draft"."""
    return f"{ROLE_OWNERS.get(role, role)} {PHASE_WORDS.get(phase, phase)}"


def role_of(phase: str) -> Role:
    """The role whose context runs a flow phase; a warm-up (either role) raises KeyError."""
    return ROLE_OF[Phase(phase)]


def feeders(role: str, phase: str) -> tuple[tuple[str, str], ...] | None:
    """The (role, phase) eval groups that feed an eval of (`role`, `phase`); None off the flow
    (a warm-up decode, a role that does not run the phase): anything earlier may feed it."""
    if phase not in FEEDERS or ROLE_OF[Phase(phase)] != role:
        return None
    return tuple((ROLE_OF[p], p) for p in FEEDERS[Phase(phase)])


def inject_after(phase: Phase) -> Phase:
    """The phase of the inject that carries a target decode's rows: `inject` after the prefill or
    a verify, a warm-up's own `warmup` after a warm-up decode."""
    return Phase.WARMUP if phase == Phase.WARMUP else Phase.INJECT


def phase_order(phase: str, rnd: int) -> tuple[int, int, int]:
    """Sort key of an eval group (`phase`, round `rnd`) in protocol order: warm-up first, then by
    round, then the phase's place in its round (ROUND_ORDER)."""
    return (phase != Phase.WARMUP, rnd, _RANK.get(phase, len(_RANK)))
