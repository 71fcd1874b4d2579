"""Which records depend on a feature the reference left out (docs/findings.md, `unmodelled`).

Consumes the two manifests' `models.<role>.unmodelled` lists (docs/dump.md) and record keys;
produces a `Gap`: the features, where the drafter graph first reads each (featdiff.kinds.dflash.modelled), and
the rule that says whether a record is computed after that first read. compare gives no verdict on
such a record: its difference from the reference may be the feature itself.

The rule, in the pinned graph's order (src/models/dflash.cpp): a drafter record depends on a
feature when it sits at or after the feature's first read in the same phase, or in a later drafter
phase (inject writes the cache the draft eval reads, so a feature first read at inject reaches every
draft record). A drafter record whose place in the graph is unknown counts as after everything. A
target feature reaches every record of both models. Token ids and positions never depend on one.
"""

from __future__ import annotations

from dataclasses import dataclass

from featdiff.core import names
from featdiff.core.names import ROLE_DRAFT, Role
from featdiff.core.phases import DRAFTER_PHASES, Phase
from featdiff.dump.manifest import Manifest
from featdiff.kinds.dflash import modelled

ALL_RECORDS: modelled.Use = ("*", "*")  # a target feature's reach: everything either model computes
# Graph order of the records each drafter eval names (src/models/dflash.cpp, llama-graph.cpp)
_HEAD: dict[str, tuple[str, ...]] = {
    Phase.INJECT: (names.INP_TARGET_FEATURES, names.ENC_INP_EMBD, names.INP_G_EMBEDDINGS),
    Phase.DRAFT: (names.INP_NOISE_EMBD, *names.LOG_SNR_RECORDS),
}
_LAYER: dict[str, tuple[str, ...]] = {
    Phase.INJECT: (names.KCUR_INJECTED, names.VCUR_INJECTED),
    Phase.DRAFT: (
        names.NOISE_NORM,
        names.QCUR,
        names.KCUR,
        names.VCUR,
        names.KQV_OUT,
        names.FFN_INP,
        names.FFN_OUT,
        names.L_OUT,
    ),
}
_TAIL: dict[str, tuple[str, ...]] = {Phase.INJECT: (), Phase.DRAFT: (names.RESULT_NORM, names.RESULT_OUTPUT)}
_UNKNOWN_RANK = (3, 0, 0)  # after everything: a record of unknown place depends on any feature of its phase


@dataclass(frozen=True)
class Gap:
    """The features the reference left out, by role, and where the drafter first reads each."""

    draft: tuple[str, ...]
    target: tuple[str, ...]
    uses: tuple[modelled.Use, ...]  # one per feature, draft's then target's

    def depends(self, role: str, phase: str, name: str) -> bool:
        """Whether the record (role, phase, name) is computed after a feature's first read."""
        return any(_after(use, role, phase, name) for use in self.uses)


def gap_of(ref: Manifest, run: Manifest) -> Gap | None:
    """The features either manifest records as unmodelled (that this featdiff still does not
    model); None when there is none."""
    draft = _unmodelled(ref, run, "draft")
    target = _unmodelled(ref, run, "target")
    if not draft and not target:
        return None
    uses = tuple(modelled.first_use(n) for n in draft) + (ALL_RECORDS,) * len(target)
    return Gap(draft=draft, target=target, uses=uses)


def _unmodelled(ref: Manifest, run: Manifest, role: Role) -> tuple[str, ...]:
    found: dict[str, None] = {}
    for m in (run, ref):
        info = m.model(role)
        if info is not None:
            found.update(dict.fromkeys(modelled.still_unmodelled(info.unmodelled)))
    return tuple(found)


def _after(use: modelled.Use, role: str, phase: str, name: str) -> bool:
    if use == ALL_RECORDS:
        return True
    if role != ROLE_DRAFT:
        return False
    use_phase, use_name = use
    if phase not in DRAFTER_PHASES:  # warm-up decodes: computed with the feature throughout
        return True
    if DRAFTER_PHASES.index(phase) != DRAFTER_PHASES.index(use_phase):
        return DRAFTER_PHASES.index(phase) > DRAFTER_PHASES.index(use_phase)
    return graph_rank(phase, name) >= graph_rank(use_phase, use_name)


def graph_rank(phase: str, name: str) -> tuple[int, int, int]:
    """Where a record sits in its drafter eval's graph: (stage, layer, step); unknown names last."""
    name = names.current_name(name)
    if name in _HEAD.get(phase, ()):
        return (0, _HEAD[phase].index(name), 0)
    base, _, il = name.rpartition("-")
    if il.isdigit() and base in _LAYER.get(phase, ()):
        return (1, int(il), _LAYER[phase].index(base))
    if name in _TAIL.get(phase, ()):
        return (2, _TAIL[phase].index(name), 0)
    return _UNKNOWN_RANK
