"""Detectors of what a drafter's sampler read back: the logits of each draft row as the program
read them (`draft_logits`: llama_get_logits_ith, or the backend sampler's top-k candidates) against
the row its own graph computed (`result_output`, as the drafter means it to be read). Consumes one
`draft_logits` pair's `Evidence.sampled`; returns `Finding | None`.
"""

from __future__ import annotations

import numpy as np

from featdiff.core import names
from featdiff.diff.detectors.base import Evidence, error_finding, explains, span
from featdiff.diff.fields import WrongSourceFields
from featdiff.diff.result import Finding
from featdiff.diff.tolerance import Tolerance

SOURCE_ANOTHER_OUTPUT_ROW = "another_output_row"  # wrong_source at draft_logits: the sampler read another row


def detect_wrong_source_of_sampled_logits(ev: Evidence) -> Finding | None:
    """Hypothesis: a one-token-a-step drafter's sampler (EAGLE3, MTP) read logits its graph did not
    compute for the row (a backend sampler viewing another output row). Evidence: at `draft_logits`,
    the run's read-back values (a backend sampler's top-k; the rest reads back -inf) are not its
    own graph's result_output values at the same token ids on some row. The chain reaches this pair
    only as a root: the graph's result_output rows agree with the reference, so the fault lies
    between the graph's output and the sampler."""
    sampled = _sampled(ev)
    if sampled is None or ev.kind.block_flow:
        return None
    read, graph = sampled
    kept = np.isfinite(read)  # (R, V)
    return _read_elsewhere(ev, tuple(not _agree(graph[i], read[i], kept[i], ev.tolerance) for i in range(len(read))))


def detect_wrong_source_of_sampled_block_rows(ev: Evidence) -> Finding | None:
    """Hypothesis: a block drafter's sampler (DFlash, DSpark) read another row of its draft batch.
    Evidence: row i's read-back values are not the graph's row plus the Markov bias the reference
    models for it (DSpark's `dspark_markov_bias`; none for DFlash), while the graph's rows match the
    reference (rows_read_elsewhere). It sits after detect_wrong_source in the chain: a hypothesis of
    the drafter's own (a DSpark chain laid out from the other first row) explains such values first."""
    sampled = _sampled(ev)
    if sampled is None or not ev.kind.block_flow:
        return None
    read, graph = sampled
    bias = ev.candidates.get(names.DSPARK_MARKOV_BIAS)
    return _read_elsewhere(ev, rows_read_elsewhere(read, graph, bias, ev.ref, ev.tolerance), bias is not None)


def _sampled(ev: Evidence) -> tuple[np.ndarray, np.ndarray] | None:
    """The (read, graph) rows of a `draft_logits` pair, (R, V) each, where every row read something."""
    if ev.sampled is None or (ev.record or ev.tensor) != names.DRAFT_LOGITS:
        return None
    read, graph = ev.sampled
    if read.shape != graph.shape or read.ndim != 2 or not np.isfinite(read).any(axis=1).all():
        return None
    return read, graph


def _read_elsewhere(ev: Evidence, elsewhere: tuple[bool, ...], biased: bool = False) -> Finding | None:
    """The finding for the rows a sampler read from elsewhere; None if there are none."""
    if not any(elsewhere):
        return None
    where = [ev.positions[i] if ev.positions else i for i, bad in enumerate(elsewhere) if bad]
    head = f" plus the Markov head's bias ({names.DSPARK_MARKOV_BIAS})" if biased else ""
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
