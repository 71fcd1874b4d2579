"""A step drafter (EAGLE3's decoder, an MTP head) attends to the rows its earlier injects wrote:
a row gone wrong in one inject (upstream's pending hidden of another request) is inherited by
every later inject, never a root of its own; a block drafter's inject (features projected to K/V)
reads no earlier inject. And a row shift on a step drafter is worded by its row pairing, not a
DFlash block's anchor and offset (issue 46)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from featdiff.diff import detectors as d
from featdiff.diff.align import Pair
from featdiff.diff.detectors import Evidence
from featdiff.diff.diagnose import find_roots
from featdiff.diff.tolerance import Tolerance
from featdiff.kinds import registry as kinds


def _pair(phase: str, rnd: int, eval_: int, name: str, srcs: tuple[str, ...]) -> Pair:
    """A pair of one drafter record of `eval_` whose node reads `srcs` (the walk reads no array)."""
    side = SimpleNamespace(evals=(SimpleNamespace(eval=eval_),), records=(SimpleNamespace(op="ADD"),))
    return Pair(("draft", phase, rnd), name, name, 0, side, side, None, (eval_, 0), srcs)  # type: ignore[arg-type]


# round 0's inject: the head's input row wrong, its attention inherits it; round 1's inject:
# the input right, the attention (over the cache round 0 wrote, an uncaptured node between) off
PAIRS = (
    _pair("inject", 0, 3, "mtp_hnorm-6", ()),
    _pair("inject", 0, 3, "mtp_attn_residual-6", ("node_12",)),
    _pair("inject", 1, 9, "mtp_hnorm-6", ()),
    _pair("inject", 1, 9, "mtp_attn_residual-6", ("node_12",)),
)
WITHIN = [False, False, True, False]


def test_a_later_inject_of_a_step_drafter_inherits_the_row_an_earlier_inject_wrote():
    assert find_roots(PAIRS, WITHIN, reads_own_cache=True).roots == (0,)


def test_a_block_drafters_later_inject_is_a_root_of_its_own():
    assert find_roots(PAIRS, WITHIN).roots == (0, 3)


def _shifted(kind: str, kept: int = 0) -> Evidence:
    ref = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    run = np.roll(ref, 1, axis=0)  # run row i = ref row i - 1
    positions = tuple(range(10, 18))
    return Evidence(
        tensor="inp_embd", ref=ref, run=run, tolerance=Tolerance(rel=1e-3, sources=("test",)), positions=positions,
        ref_all=ref, ref_all_positions=positions, record="inp_embd", kind=kinds.by_name(kind), kept=kept,
    )  # fmt: skip


def test_a_row_shift_on_an_eagle3_run_names_its_row_pairing_not_a_block():
    f = d.detect_row_shift(_shifted("eagle3", kept=9))
    assert f is not None and f.fields["shift"] == -1
    assert "anchor" not in f.message and "block" not in f.message, f.message
    assert "token of p + 1 with the encoder row of p" in f.message and "9 positions kept" in f.message


def test_a_row_shift_on_a_dflash_run_keeps_the_block_advice():
    f = d.detect_row_shift(_shifted("dflash"))
    assert f is not None and "check the anchor row and the block offset" in f.message


def test_rows_decoded_with_other_sequences_are_judged_with_the_batched_term():
    from featdiff.diff.tolerance import REL_BATCHED, REL_F32, REL_KV_F16, SAFETY, TypeInfo, tolerance_for

    alone = TypeInfo(kv_type="f16", quant_types=(), ref_dtype="float32")
    batched = TypeInfo(kv_type="f16", quant_types=(), ref_dtype="float32", seqs_per_decode=2)
    assert tolerance_for("ffn_inp-0", False, alone).rel == SAFETY * (REL_F32**2 + REL_KV_F16**2) ** 0.5
    t = tolerance_for("ffn_inp-0", False, batched)
    assert t.rel == SAFETY * (REL_F32**2 + REL_KV_F16**2 + REL_BATCHED**2) ** 0.5
    assert "2 sequences per decode" in t.sources
    # issue 46's EAGLE3 -np 2 report: ffn_inp-0 at NMSE 1.97e-05, over the one-sequence bound, within this one
    assert tolerance_for("ffn_inp-0", False, alone).nmse < 1.97e-5 < t.nmse
    assert tolerance_for("inp_embd", False, batched).rel == tolerance_for("inp_embd", False, alone).rel  # pre-attention


def test_eagle3_rows_before_the_last_kept_one_of_another_prompt_are_a_restore_without_the_drafters_state():
    """A `/slots` restore brings back the target's rows alone: the drafter's rows, decoded with
    the slot's other prompt, differ before the last kept row too (not upstream's bridge row)."""
    from featdiff.diff.detectors import detect_wrong_source_kept_row
    from featdiff.dump.manifest import Manifest
    from featdiff.dump.records import FlowInfo

    restored = FlowInfo(2, 0, (10, 11, 12, 13, 14), 3, draft_cached=(40, 41, 42))  # another prompt's tokens
    found = detect_wrong_source_kept_row(Manifest("llama.cpp", {}, {}, (), (), flows=(restored,)), row_token=1)
    assert found is not None and found.fields["source"] == "another_saved_prompt", found
    assert "positions 0" in found.message and "/slots" in found.message and "flow 2" in found.message


# one inject of an MTP head: the handed row wrong (a graph fault), the head norm bringing the
# difference back under the tolerance for the concat, the projection after it over the tolerance
# again; and a branch that reads nothing of the wrong row
CHAIN = (
    _pair("inject", 0, 3, "mtp_h_input", ()),
    _pair("inject", 0, 3, "mtp_hnorm-6", ("mtp_h_input",)),
    _pair("inject", 0, 3, "mtp_concat-6", ("mtp_hnorm-6",)),
    _pair("inject", 0, 3, "mtp_eh_proj-6", ("mtp_concat-6",)),
    _pair("inject", 0, 3, "mtp_enorm-6", ()),
    _pair("inject", 0, 3, "mtp_embd_scaled-6", ("mtp_enorm-6",)),
)


def test_a_record_computed_from_a_divergent_one_through_one_within_tolerance_inherits_it():
    walk = find_roots(CHAIN, [False, False, True, False, True, False])
    assert walk.roots == (0, 5) and walk.inherited == (1, 3)  # the branch that reads none of it is its own root
