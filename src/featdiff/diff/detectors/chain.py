"""Detectors of chained MTP heads (common/speculative.cpp `chain_heads`: a drafter of n_layer_nextn
> 1 trained heads, MiMo-V2's three, Step-3.5's): draft step k runs head k, the graph's layer
n_layer + k (llama_set_nextn_layer_offset(ctx_dft, k)), over the round's rows so far, each row
after the first handed the state the head of the step that drafted its token made (`chain_h`).
`detect_wrong_source_of_chain_head` reads the two manifests (which layer each step's records
name); the other two read one divergent pair's evidence. All pure; each sentence a finding says
is written beside its detector.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np

from featdiff.core import names
from featdiff.core.names import ROLE_DRAFT
from featdiff.core.phases import Phase
from featdiff.diff.batches import Batch, batches
from featdiff.diff.detectors.base import Evidence, error_finding, explains, fix_by_place, same_shape
from featdiff.diff.fields import WhereFields, WrongSourceFields
from featdiff.diff.metrics import row_relative_error
from featdiff.diff.result import Finding
from featdiff.dump import Manifest
from featdiff.kinds.registry import is_step_state

# wrong_source's `source` when a draft step ran another trained head than its own (docs/findings.md)
CHAIN_HEAD_SOURCE = "chain_head"
# wrong_source's `source` when a chained step's rows past the first were handed the pending row
# (the target's hidden the seed read) instead of the states the heads of the earlier steps made
CHAIN_STATE_SOURCE = "chain_state"
# the head's records name its layer: `mtp_enorm-<il>`, il = n_layer + the head (mimo2.cpp, step35.cpp)
_HEAD_RECORD = re.compile(rf"^(?:mtp_\w+|{names.H_NEXTN})-(\d+)$")
_HYP_HEAD = names.HYP_HEAD  # the candidates' key: `<record>@head=<j>`
# the pinned driver's call that selects a step's head, as a fix names it
_SELECT = "llama_set_nextn_layer_offset(ctx_dft, k) before step k's decode (common/speculative.cpp draft())"


# --- which head each step ran: the layer its records name -------------------------------------------


def detect_wrong_source_of_chain_head(ref: Manifest, run: Manifest) -> Finding | None:
    """Hypothesis: the driver ran another head than head k for draft step k of a chained drafter
    (head k for step k + 1, the same head for every step). Evidence, per round in flow order: the
    layer the head's records of each draft eval name (`mtp_*-<il>`) on both sides, the reference's
    step k at n_layer + k; the first round where a step's layer differs, with the whole round's
    mapping for the sentence."""
    ref_batches = batches(ref)
    ref_heads, run_heads = _head_layers(ref), _head_layers(run)
    for key, batch in batches(run).items():
        ref_batch = ref_batches.get(key)
        if key[:2] != (ROLE_DRAFT, Phase.DRAFT) or ref_batch is None:
            continue
        ref_layers, run_layers = _layers(ref_heads, ref_batch), _layers(run_heads, batch)
        if len(set(ref_layers) - {None}) < 2:
            continue  # not a chain: one head for every step
        pairs = [
            (k, a, b)
            for k, (a, b) in enumerate(zip(ref_layers, run_layers, strict=False))
            if a is not None and b is not None
        ]  # (step, the reference's layer, the run's layer) of each step both sides name one for
        wrong = [(k, a, b) for k, a, b in pairs if a != b]
        if wrong:
            return _head_finding(batch, ref_layers[0], pairs, wrong[0])
    return None


def _head_layers(manifest: Manifest) -> dict[int, set[int]]:
    """eval -> the head layers its records name (`mtp_*-<il>`)."""
    out: dict[int, set[int]] = {}
    for r in manifest.records:
        m = _HEAD_RECORD.match(r.name)
        if m:
            out.setdefault(r.eval, set()).add(int(m.group(1)))
    return out


def _layers(heads: dict[int, set[int]], batch: Batch) -> list[int | None]:
    """The head layer each eval of the batch ran (None: no head record, or several layers)."""
    found = [heads.get(ev.eval, set()) for ev in batch.evals]
    return [next(iter(s)) if len(s) == 1 else None for s in found]


def _head_finding(
    batch: Batch, base: int | None, pairs: list[tuple[int, int, int]], first: tuple[int, int, int]
) -> Finding:
    step, ref_il, run_il = first
    base = ref_il - step if base is None else base
    ran = [b - base for _, _, b in pairs]
    rnd = batch.key[2]
    if len(set(ran)) == 1 and len(ran) > 1:
        pattern = f"every step ran head {ran[0]}: the same head for every step"
    elif all(j == max(k - 1, 0) for (k, _, _), j in zip(pairs, ran, strict=True)):
        pattern = "each step past the first ran the head of the step before (head k for step k + 1)"
    else:
        pattern = "the steps ran heads " + ", ".join(map(str, ran))
    f = Finding.of(
        WrongSourceFields(source=CHAIN_HEAD_SOURCE, candidate=f"layer {ref_il} (head {ref_il - base})"),
        tensor=f"{names.MTP_ENORM}-{run_il}",
        message=f"head {run_il - base} ran for draft step {step} of round {rnd} (its records name layer {run_il}, "
        f"the reference's head {ref_il - base} is layer {ref_il}); {pattern}: the pinned driver runs head k for step "
        f"k, set {_SELECT}",
    )
    where = WhereFields("driver", "the head's records name another layer than the step's: the driver chose the head")
    return replace(f, fields={**f.fields, **where.to_json(), "eval": batch.evals[step].eval})


# --- whose weights a head computed with: the reference's candidates of every head ------------------


def detect_wrong_source_of_chain_weights(ev: Evidence) -> Finding | None:
    """Hypothesis: a chained step's head computed with another head's weights (a GGUF whose MTP
    blocks are permuted, or all one head). Evidence: the reference's candidates `<record>@head=<j>`
    (the same step run under head j); the reference's rows equal head k's, the run's head j's, j != k."""
    heads = _head_candidates(ev)
    if not same_shape(ev) or len(heads) < 2:
        return None
    own = next((k for k, arr in heads.items() if explains(arr, ev.ref, ev.tolerance)), None)
    ran = next((j for j, arr in heads.items() if j != own and explains(arr, ev.run, ev.tolerance)), None)
    if own is None or ran is None:
        return None
    export_fix = (
        f"the GGUF's block of head {own} holds head {ran}'s weights: re-convert keeping model.mtp.layers.{own} at "
        f"block n_layer + {own} (conversion/mimo.py, step35's converter)"
    )
    graph_fix = f"the graph reads head {ran}'s tensors for layer n_layer + {own}: check its nextn layer offset"
    return error_finding(
        ev,
        f"{ev.tensor} is what head {ran} computes from these inputs, where layer n_layer + {own} is head {own}'s "
        f"(draft step {own} runs it); " + fix_by_place(ev, export_fix, graph_fix),
        WrongSourceFields(source=CHAIN_HEAD_SOURCE, candidate=names.candidate_name(ev.record, f"{_HYP_HEAD}={ran}")),
    )


def _head_candidates(ev: Evidence) -> dict[int, np.ndarray]:
    """head j -> the reference's candidate rows of this record under head j."""
    prefix = f"{ev.record}{names.CANDIDATE_SEP}{_HYP_HEAD}="
    return {
        int(n[len(prefix) :]): a
        for n, a in ev.candidates.items()
        if n.startswith(prefix) and n[len(prefix) :].isdigit()
    }


# --- the state the chain hands each step ------------------------------------------------------------


def detect_wrong_source_of_chain_state(ev: Evidence) -> Finding | None:
    """Hypothesis: a chained step's rows past the first were handed the pending row (the target's
    hidden the seed read) instead of the states the earlier steps' heads made (`chain_h`).
    Evidence: at a record holding the state a step is fed, one eval of consecutive positions from
    the seed's (step k: k + 1 rows), row 0 agrees, every later row diverges and equals the
    reference's row 0."""
    if not is_step_state(ev.record) or not same_shape(ev) or len(ev.positions) < 2:
        return None
    pos = np.asarray(ev.positions)
    if not np.array_equal(pos, pos[0] + np.arange(len(pos))):
        return None
    bad = row_relative_error(ev.ref, ev.run) > ev.tolerance.row_rel  # (R,)
    if bad[0] or not bad[1:].all():
        return None
    pending = np.repeat(ev.ref[:1], len(pos) - 1, axis=0)  # (R - 1, D)
    if not np.all(row_relative_error(pending, ev.run[1:]) <= ev.tolerance.row_rel):
        return None
    return error_finding(
        ev,
        f"{ev.tensor} of draft step {len(pos) - 1} (positions {int(pos[0])}..{int(pos[-1])}) holds the pending row at "
        f"every position: the chain handed each drafted token the target's hidden (position {int(pos[0])}) instead of "
        "the state the head of the step that drafted it made; hand row t the h_nextn of step t - 1 (chain_h)",
        WrongSourceFields(source=CHAIN_STATE_SOURCE, candidate=f"{ev.record} row 0 (position {int(pos[0])})"),
    )
