"""The detectors: one pure function per hypothesis, `detect_<kind>[_<what it looks at>]`, returning
`Finding | None` (`detect_divergence`: always a finding). Each docstring states the hypothesis and
the evidence it needs; each sentence a finding says is written beside its detector; each kind's
fields are its record in diff/fields.py. No I/O, no randomness, no printing.

One module per family: numeric.py (values: NaN, zeros, stale rows, scale, RoPE angles, divergence,
noise), rows.py (shifted or misplaced rows, layouts, a record's positions), wiring.py (feature
slots, terms, sources), readback.py (the logits a drafter's sampler read), choices.py (tokens and
experts chosen on a near-tie), positions.py (token ids and positions of the run's batches),
kvcache.py (the draft KV cache), chain.py (chained MTP heads), vocabulary.py (a reduced head's d2t
map), handover.py (the layer an MTP head's hidden comes from), pairing.py (what was not compared,
and why); base.py holds the `Evidence` the value detectors share. Which detector runs when is the
orchestration's: diagnose.py, positions.py, comparison.py.
"""

from featdiff.diff.detectors.base import Evidence, Rope, explains, rotate, same_shape
from featdiff.diff.detectors.chain import (
    detect_wrong_source_of_chain_head,
    detect_wrong_source_of_chain_state,
    detect_wrong_source_of_chain_weights,
)
from featdiff.diff.detectors.choices import (
    detect_chain_choice,
    detect_divergence_by_margin,
    detect_expert_choice,
    detect_near_tie,
    detect_position_offset_after_accept,
    detect_unmodelled_sampler,
    detect_wrong_source_of_drafts,
    detect_wrong_source_of_sampled_draft,
)
from featdiff.diff.detectors.handover import detect_layer_offset_of_handed_state
from featdiff.diff.detectors.kvcache import (
    detect_duplicate_rows,
    detect_not_conditioned_restored,
    detect_stale_cache,
    detect_wrong_source_kept_row,
    detect_wrong_source_restored,
)
from featdiff.diff.detectors.numeric import (
    detect_divergence,
    detect_divergence_in_rope,
    detect_nonfinite,
    detect_numeric_noise,
    detect_scale,
    detect_scale_per_channel,
    detect_stale_rows,
    detect_wrong_source_of_pending_row,
    detect_wrong_source_of_zero_rows,
    detect_zeros,
)
from featdiff.diff.detectors.pairing import (
    detect_missing_tensor,
    detect_not_conditioned,
    detect_unexpected_tensor,
    detect_unexpected_tensor_outside_wiring,
    detect_unmodelled,
    detect_unpaired,
)
from featdiff.diff.detectors.positions import (
    detect_block_token,
    detect_flow_note,
    detect_position_offset_of_batch,
    detect_unpaired_prompt,
)
from featdiff.diff.detectors.readback import (
    detect_wrong_source_of_sampled_block_rows,
    detect_wrong_source_of_sampled_logits,
)
from featdiff.diff.detectors.rows import (
    detect_layout_transpose,
    detect_misplaced_rows,
    detect_position_offset_of_record,
    detect_row_shift,
)
from featdiff.diff.detectors.steps import (
    detect_position_offset_of_steps,
    detect_wrong_source_of_another_sequence,
    detect_wrong_source_of_step_state,
    detect_zeros_of_step_state,
)
from featdiff.diff.detectors.vocabulary import detect_wrong_source_of_vocabulary_map
from featdiff.diff.detectors.wiring import (
    best_assignment,
    detect_extra_term,
    detect_layer_offset,
    detect_missing_term,
    detect_slot_permutation,
    detect_wrong_source,
    detect_wrong_source_of_vocabulary,
)

__all__ = [
    "Evidence",
    "Rope",
    "best_assignment",
    "detect_block_token",
    "detect_divergence",
    "detect_divergence_by_margin",
    "detect_divergence_in_rope",
    "detect_duplicate_rows",
    "detect_expert_choice",
    "detect_chain_choice",
    "detect_extra_term",
    "detect_flow_note",
    "detect_layer_offset",
    "detect_layer_offset_of_handed_state",
    "detect_layout_transpose",
    "detect_misplaced_rows",
    "detect_missing_tensor",
    "detect_missing_term",
    "detect_position_offset_after_accept",
    "detect_near_tie",
    "detect_nonfinite",
    "detect_not_conditioned",
    "detect_numeric_noise",
    "detect_position_offset_of_batch",
    "detect_position_offset_of_record",
    "detect_position_offset_of_steps",
    "detect_row_shift",
    "detect_scale",
    "detect_scale_per_channel",
    "detect_slot_permutation",
    "detect_not_conditioned_restored",
    "detect_stale_cache",
    "detect_wrong_source_kept_row",
    "detect_wrong_source_restored",
    "detect_stale_rows",
    "detect_unexpected_tensor",
    "detect_unexpected_tensor_outside_wiring",
    "detect_unmodelled",
    "detect_unmodelled_sampler",
    "detect_unpaired",
    "detect_unpaired_prompt",
    "detect_wrong_source",
    "detect_wrong_source_of_pending_row",
    "detect_wrong_source_of_zero_rows",
    "detect_wrong_source_of_drafts",
    "detect_wrong_source_of_sampled_draft",
    "detect_wrong_source_of_sampled_block_rows",
    "detect_wrong_source_of_sampled_logits",
    "detect_wrong_source_of_another_sequence",
    "detect_wrong_source_of_step_state",
    "detect_wrong_source_of_chain_head",
    "detect_wrong_source_of_chain_state",
    "detect_wrong_source_of_chain_weights",
    "detect_wrong_source_of_vocabulary",
    "detect_wrong_source_of_vocabulary_map",
    "detect_zeros",
    "detect_zeros_of_step_state",
    "explains",
    "rotate",
    "same_shape",
]
