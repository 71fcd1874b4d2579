"""A side's eval groups as batches of the flow (docs/flow.md): the evals of one (role, phase,
round) joined in order, their positions and token ids, what the flow calls them in a sentence,
and whether two sides decoded a batch alike. Pure functions of a `Manifest`; the token and
position detectors (detectors/positions.py) and the order they run in (positions.py) read them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from featdiff.core.phases import BATCH_NOUNS, Phase
from featdiff.diff.align import GroupKey, group_key, is_cut_short
from featdiff.dump.manifest import Manifest
from featdiff.dump.records import Eval


@dataclass(frozen=True)
class Batch:
    """The evals of one eval group (role, phase, round) of one side, joined in order."""

    key: GroupKey
    evals: tuple[Eval, ...]

    @property
    def positions(self) -> tuple[int, ...]:
        """The positions the batch placed: an inject's encoder step (the older generation encodes
        the features, then decodes the rows it made: docs/flow.md) places none of its own."""
        return tuple(p for ev in self.evals if ev.writes_cache for p in ev.positions)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t for ev in self.evals for t in ev.token_ids)

    @property
    def eval(self) -> int:
        return self.evals[0].eval

    @property
    def label(self) -> str:
        return batch_label(self.key)


def batch_label(key: GroupKey) -> str:
    """`the draft block of round 2`, `the prefill`: an eval group as the flow names it."""
    role, phase, rnd = key
    if phase == Phase.PREFILL:
        return "the prefill"
    return f"the {BATCH_NOUNS.get(phase, f'{role} {phase} batch')} of round {rnd}"


def batches(manifest: Manifest) -> dict[GroupKey, Batch]:
    """Each eval group of the flow, in the order the side decoded it (warm-up left out)."""
    groups: dict[GroupKey, list[Eval]] = defaultdict(list)
    for ev in manifest.evals:
        if ev.phase != Phase.WARMUP:
            groups[group_key(ev)].append(ev)
    return {k: Batch(k, tuple(evs)) for k, evs in groups.items()}


def _cut_short(batch: Batch, ref_batch: Batch) -> bool:
    return is_cut_short(batch.key[1], len(batch.positions), len(ref_batch.positions))


def same_token_ids(batch: Batch, ref_batch: Batch) -> bool:
    """Same tokens; a verify (or its inject) may be the reference's cut short (align.is_cut_short)."""
    if _cut_short(batch, ref_batch):
        return batch.token_ids == ref_batch.token_ids[: len(batch.token_ids)]
    return batch.token_ids == ref_batch.token_ids


def decoded_alike(batch: Batch, ref_batch: Batch) -> bool:
    """Same tokens at the same positions (a verify possibly cut short, as `same_token_ids`)."""
    n = len(batch.positions)
    expected = ref_batch.positions[:n] if _cut_short(batch, ref_batch) else ref_batch.positions
    return same_token_ids(batch, ref_batch) and batch.positions == expected
