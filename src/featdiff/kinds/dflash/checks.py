"""The DFlash family's checks of a drafter GGUF that need no model run: the log-SNR head's terms."""

from __future__ import annotations

import logging

from featdiff.core import names

log = logging.getLogger(__name__)


def log_snr_problems(
    flag_key: str, flag: bool, min_log_snr: float | None, max_log_snr: float | None, present: set[str]
) -> list[str]:
    """The log-SNR flag, its range and its four tensors must come together.

    `present` is the set of tensor names the file holds; the tensor names are the same in GGUF
    and HF checkpoints (`log_snr_fc1.weight`, ...).
    """
    have = [t for t in names.LOG_SNR_TENSORS if t in present]
    missing = [t for t in names.LOG_SNR_TENSORS if t not in present]
    if not flag:
        if have:
            return [
                f"carries {', '.join(have)} but {flag_key} is not set, so a run ignores the "
                f"conditioning; set {flag_key} (with the log-SNR range) or drop the tensors"
            ]
        return []
    problems = []
    if missing:
        problems.append(
            f"{flag_key} = true but {', '.join(missing)} are missing; re-export the "
            f"drafter with its log-SNR MLP or clear the flag"
        )
    if min_log_snr is None or max_log_snr is None:
        problems.append(
            f"{flag_key} = true but the log-SNR range (min/max) is missing; "
            "re-export with the trained min_log_snr and max_log_snr"
        )
    elif not min_log_snr < max_log_snr:
        problems.append(f"log-SNR range min {min_log_snr} >= max {max_log_snr}; expected min < max")
    return problems
