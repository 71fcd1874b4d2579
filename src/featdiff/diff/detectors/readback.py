"""Detectors of what a drafter's sampler read back: the logits of each draft row as the program
read them (`draft_logits`: llama_get_logits_ith, or the backend sampler's top-k candidates) against
the row its own graph computed (`result_output`, as the drafter means it to be read). Consumes one
`draft_logits` pair's `Evidence.sampled`; returns `Finding | None`.
"""

from __future__ import annotations

from dataclasses import replace

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
    elsewhere = tuple(not _agree(graph[i], read[i], kept[i], ev.tolerance) for i in range(len(read)))
    return _read_elsewhere(ev, elsewhere, ids_taken_from(read, graph, ev.tolerance))


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
    elsewhere = rows_read_elsewhere(read, graph, bias, ev.ref, ev.tolerance)
    meant = graph if bias is None or bias.shape != graph.shape else graph + bias  # (R, V)
    return _read_elsewhere(ev, elsewhere, ids_taken_from(read, meant, ev.tolerance), bias is not None)


def _sampled(ev: Evidence) -> tuple[np.ndarray, np.ndarray] | None:
    """The (read, graph) rows of a `draft_logits` pair, (R, V) each, where every row read something."""
    if ev.sampled is None or (ev.record or ev.tensor) != names.DRAFT_LOGITS:
        return None
    read, graph = ev.sampled
    if read.shape != graph.shape or read.ndim != 2 or not np.isfinite(read).any(axis=1).all():
        return None
    return read, graph


def _read_elsewhere(
    ev: Evidence, elsewhere: tuple[bool, ...], ids_from: tuple[int | None, ...], biased: bool = False
) -> Finding | None:
    """The finding for the rows a sampler read from elsewhere; None if there are none. Where each
    of those rows read its own top-k values under another row's token ids (`ids_from`), it says so."""
    if not any(elsewhere):
        return None
    at = [i for i, bad in enumerate(elsewhere) if bad]
    where = [_position(ev, i) for i in at]
    head = f" plus the Markov head's bias ({names.DSPARK_MARKOV_BIAS})" if biased else ""
    took = "the sampler took its candidates from another row"
    fields = WrongSourceFields(source=SOURCE_ANOTHER_OUTPUT_ROW, candidate=names.RESULT_OUTPUT)
    owners = [ids_from[i] for i in at]
    if all(j is not None for j in owners):
        sources = tuple(_position(ev, j) for j in owners if j is not None)
        took = (
            "the sampler read each row's own top-k values under the token ids of another row's top-k "
            f"({_said_pairs(where, sources)})"
        )
        fields = replace(fields, ids_from=sources)
    return error_finding(
        ev,
        f"{ev.tensor}, the logits the drafter's sampler read, are not its graph's own result_output{head} at "
        f"{'positions' if ev.positions else 'rows'} {span(where)} (the graph's rows match the reference): "
        f"{took}; llama.cpp's backend sampler (the draft's default) views each sequence's row of the "
        "graph's output, and --no-spec-draft-backend-sampling samples those rows on the CPU instead",
        fields,
    )


def _position(ev: Evidence, row: int) -> int:
    return ev.positions[row] if ev.positions else row


def _said_pairs(where: list[int], sources: tuple[int, ...]) -> str:
    """'6, 7 under 8's' or '6 under 8's, 7 under 9's'."""
    if len(set(sources)) == 1:
        return f"{', '.join(map(str, where))} under {sources[0]}'s"
    return ", ".join(f"{w} under {s}'s" for w, s in zip(where, sources))


def ids_taken_from(read: np.ndarray, meant: np.ndarray, tol: Tolerance) -> tuple[int | None, ...]:
    """Per row of a read-back draft batch (`read`: a backend sampler's top-k, -inf elsewhere; `meant`:
    what the sampler should have read, (R, V) each): the other row j whose top-k token ids row i
    was read under while its values are row i's own top-k (sorted, within tolerance), the ids
    and values of the sampled candidates read from two rows; None where that is not so. Measured on
    the pinned llama-server (DSpark, five requests on -np 4, a loaded machine): rows 0 and 1 of a
    block held their own top-10 values under row 2's ids, and drafted row 2's token."""
    out: list[int | None] = []
    kept = np.isfinite(read)  # (R, V)
    for i in range(len(read)):
        n = int(kept[i].sum())
        own = np.sort(meant[i])[::-1][:n] if n else meant[i][:0]  # (n,): row i's own top-k values
        values_own = n > 0 and explains(own[None], np.sort(read[i][kept[i]])[::-1][None], tol)
        owner = None
        if values_own and not _agree(meant[i], read[i], kept[i], tol):
            ids = set(np.flatnonzero(kept[i]).tolist())
            owner = next((j for j in range(len(read)) if j != i and set(_top_ids(meant[j], n)) == ids), None)
        out.append(owner)
    return tuple(out)


def _top_ids(row: np.ndarray, n: int) -> list[int]:
    return np.argsort(row)[::-1][:n].tolist()


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
