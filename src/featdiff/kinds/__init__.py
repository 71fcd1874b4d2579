"""The drafter kinds: the registry (`kinds/registry.py`) and each kind's pure facts (`kinds/<kind>.py`,
`kinds/dflash/`). This face keeps `from featdiff import kinds` and `featdiff.kinds.KINDS` working."""

from __future__ import annotations

from featdiff.kinds.eagle3 import EAGLE3_WIRING
from featdiff.kinds.mtp import MTP, MTP_TARGET_WIRING, MTP_WIRING
from featdiff.kinds.registry import (
    ALL_DRAFT_WIRING,
    ALL_DRAFTER_ARCHS,
    DRAFTER_ARCHS,
    KINDS,
    DrafterKind,
    by_name,
    is_drafter_arch,
    kind_of,
    of_arch,
    of_checkpoint,
    wiring_names,
)

__all__ = [
    "ALL_DRAFTER_ARCHS",
    "ALL_DRAFT_WIRING",
    "DRAFTER_ARCHS",
    "DrafterKind",
    "EAGLE3_WIRING",
    "KINDS",
    "MTP",
    "MTP_TARGET_WIRING",
    "MTP_WIRING",
    "by_name",
    "is_drafter_arch",
    "kind_of",
    "of_arch",
    "of_checkpoint",
    "wiring_names",
]
