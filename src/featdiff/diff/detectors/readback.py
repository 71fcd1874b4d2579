"""Detectors of what a drafter's sampler read back: the logits of each draft row as the program
read them (`draft_logits`: llama_get_logits_ith, or the backend sampler's top-k candidates) against
the row its own graph computed (`result_output`, as the drafter means it to be read). Consumes one
`draft_logits` pair's `Evidence.sampled`; returns `Finding | None`.
"""

from __future__ import annotations

import numpy as np

from featdiff.core import names
from featdiff.diff.detectors.base import Evidence, error_finding, explains, span
from featdiff.diff.detectors.wiring import detect_wrong_source
from featdiff.diff.fields import WrongSourceFields
from featdiff.diff.result import Finding
from featdiff.diff.tolerance import Tolerance

SOURCE_ANOTHER_OUTPUT_ROW = "another_output_row"  # wrong_source at draft_logits: the sampler read another row


def detect_wrong_source_of_sampled_logits(ev: Evidence) -> Finding | None:
    """Hypothesis: the drafter's sampler read logits its graph did not compute for the row (a
    backend sampler viewing another output row). Evidence: at `draft_logits`, the run's read-back
    values are not its own graph's result_output values at the same token ids on some row: as
    they are for a one-token-a-step drafter (EAGLE3, MTP), plus the Markov bias the reference
    models for a block drafter's row (DSpark; none for DFlash), whose graph rows match the
    reference (rows_read_elsewhere), unless one of the reference's hypotheses explains the block's
    values (detect_wrong_source: a DSpark chain laid out from the other first row). The chain reaches this pair only as a root: the graph's
    result_output rows agree with the reference, so the fault lies between the graph's output
    and the sampler."""
    if ev.sampled is None or (ev.record or ev.tensor) != names.DRAFT_LOGITS:
        return None
    read, graph = ev.sampled  # (R, V) each
    if read.shape != graph.shape or read.ndim != 2 or not np.isfinite(read).any(axis=1).all():
        return None
    if ev.kind.block_flow and detect_wrong_source(ev) is not None:
        return None  # a hypothesis of the drafter's own (DSpark's chain laid out from the other row) explains it
    bias = ev.candidates.get(names.DSPARK_MARKOV_BIAS) if ev.kind.block_flow else None
    if ev.kind.block_flow:
        elsewhere = rows_read_elsewhere(read, graph, bias, ev.ref, ev.tolerance)
    else:
        kept = np.isfinite(read)  # (R, V): a backend sampler's top-k candidates; the rest reads back -inf
        elsewhere = tuple(not _agree(graph[i], read[i], kept[i], ev.tolerance) for i in range(len(read)))
    if not any(elsewhere):
        return None
    where = [ev.positions[i] if ev.positions else i for i, bad in enumerate(elsewhere) if bad]
    head = f" plus the Markov head's bias ({names.DSPARK_MARKOV_BIAS})" if bias is not None else ""
    return error_finding(
        ev,
        f"{ev.tensor}, the logits the drafter's sampler read, are not its graph's own result_output{head} at "
        f"{'positions' if ev.positions else 'rows'} {span(where)} (the graph's rows match the reference): the "
        "sampler took its candidates from another row; llama.cpp's backend sampler (the draft's default) "
        "views each sequence's row of the graph's output, and --no-spec-draft-backend-sampling samples "
        "those rows on the CPU instead",
        WrongSourceFields(source=SOURCE_ANOTHER_OUTPUT_ROW, candidate=names.RESULT_OUTPUT),
    )


def rows_read_elsewhere(
    read: np.ndarray, graph: np.ndarray, bias: np.ndarray | None, ref: np.ndarray, tol: Tolerance
) -> tuple[bool, ...]:
    """Which rows of a block drafter's draft batch the sampler read from elsewhere: row i's read
    values (its finite entries: a backend sampler's top-k) are not `graph[i] + bias[i]`, the graph's
    row as the drafter changes it before sampling (DSpark's Markov head: `bias`, the reference's
    `dspark_markov_bias`; None for DFlash, whose rows are read as computed), nor the graph's row
    unchanged (a run without the head: missing_term's finding). No row, if any graph row so
    changed is not the reference's `ref` row there: the fault is then the graph's, not the sampler's."""
    none = (False,) * len(read)
    if ref.shape != graph.shape or (bias is not None and bias.shape != graph.shape):
        return none  # rows the reference lays out otherwise: nothing to judge
    meant = graph if bias is None else graph + bias  # (R, V): what the sampler should read
    kept = np.isfinite(read)  # (R, V): a backend sampler's top-k candidates; the rest reads back -inf
    if not all(_agree(meant[i], ref[i], kept[i], tol) for i in range(len(read))):
        return none
    return tuple(
        not _agree(meant[i], read[i], kept[i], tol) and (bias is None or not _agree(graph[i], read[i], kept[i], tol))
        for i in range(len(read))
    )


def _agree(expected: np.ndarray, row: np.ndarray, kept: np.ndarray, tol: Tolerance) -> bool:
    """One row's `kept` values are `expected`'s within tolerance."""
    return explains(expected[kept][None], row[kept][None], tol)  # (1, n_kept) each
