"""Token ids and positions as evidence: the order compare meets them in. `check_batches` runs the
token, position and draft KV cache detectors (detectors/positions.py, detectors/kvcache.py) on the
two manifests before any value is compared and lists what they found in the order the run met it;
`history_divergence` says where the two token histories part (the batches: batches.py).
"""

from __future__ import annotations

from featdiff.core.phases import Phase, phase_order
from featdiff.diff.align import drafter_arch
from featdiff.diff.batches import batches, decoded_alike
from featdiff.diff.detectors.base import span
from featdiff.diff.detectors.chain import detect_wrong_source_of_chain_head
from featdiff.diff.detectors.kvcache import (
    detect_duplicate_rows,
    detect_not_conditioned_restored,
    detect_stale_cache,
    detect_wrong_source_kept_row,
    detect_wrong_source_restored,
)
from featdiff.diff.detectors.positions import (
    detect_block_token,
    detect_flow_note,
    detect_position_offset_of_batch,
    detect_unpaired_prompt,
)
from featdiff.diff.detectors.steps import detect_position_offset_of_steps
from featdiff.diff.result import Finding
from featdiff.dump.manifest import Manifest
from featdiff.kinds import registry as kinds


def check_batches(ref: Manifest, run: Manifest) -> tuple[Finding, ...]:
    """Every token and position finding, in the order the run met it (the prompt first), then the
    run's flow notes."""
    kind = kinds.of_arch(drafter_arch(run) or drafter_arch(ref))
    if not kind.block_flow:  # another kind's rounds: the reference's batches only
        found = [detect_unpaired_prompt(ref, run), detect_position_offset_of_batch(ref, run, by_flow=False)]
        if kind.row_token is not None:  # one-token draft steps (EAGLE3, MTP): each step's position
            found.append(detect_position_offset_of_steps(ref, run))
            found.append(detect_wrong_source_of_chain_head(ref, run))  # chained heads: which head each step ran
        if kind.row_token:  # a row pairing a token past its position (EAGLE3) can outlive its prompt
            found.append(detect_wrong_source_kept_row(run, kind.row_token))
    else:
        found = [
            detect_unpaired_prompt(ref, run),
            detect_block_token(ref, run),
            detect_position_offset_of_batch(ref, run),
            detect_stale_cache(run),
            detect_duplicate_rows(run),
            detect_wrong_source_restored(run),
            detect_not_conditioned_restored(run),
        ]
    # by the run's eval each is about (`eval` of every kind here); the prompt, which has none, first
    ordered = sorted((f for f in found if f is not None), key=lambda f: f.fields.get("eval", -1))
    note = detect_flow_note(run)
    return tuple(ordered + ([note] if note is not None else []))


def history_divergence(ref: Manifest, run: Manifest) -> str | None:
    """Where the run first decoded other tokens, or at other positions, than the reference (a
    target or draft batch, in the reference's flow order), as a phrase; None when nowhere."""
    run_batches = batches(run)
    for key, ref_batch in sorted(batches(ref).items(), key=lambda kv: (phase_order(kv[0][1], kv[0][2]), kv[1].eval)):
        if key[1] == Phase.INJECT:
            continue
        batch = run_batches.get(key)
        if batch is None:
            return None
        if not decoded_alike(batch, ref_batch):
            return (
                f"{batch.label}: the run decoded {list(batch.token_ids)} at {span(batch.positions)}, the "
                f"reference {list(ref_batch.token_ids)} at {span(ref_batch.positions)}"
            )
    return None
