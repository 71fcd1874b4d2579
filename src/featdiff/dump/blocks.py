"""A run's block, read from its dump: the rows `--block` or a run dump's evals ask for (core/blocks.py
holds the rule itself)."""

from __future__ import annotations

from pathlib import Path

from featdiff.core import names
from featdiff.core.blocks import BlockRows
from featdiff.core.errors import InputError
from featdiff.core.phases import ROUND_OPENER, Phase
from featdiff.dump.reader import read_dump
from featdiff.dump.records import Eval


def asked_block_rows(block: int | None, run: Path | None) -> BlockRows | None:
    """`--block N`, or the block length of the run dump `--run`; None when neither is given."""
    if block is not None and run is not None:
        raise InputError(
            f"--block {block} and --run {run} both set the draft block length; pass one of them "
            "(--run takes it from the run's draft evals)"
        )
    if block is not None:
        return BlockRows(block, f"--block {block}")
    if run is None:
        return None
    with read_dump(run) as dump:
        rows = run_block_rows(dump.manifest.evals, str(run))
    if rows is None:
        raise InputError(
            f"{run}: no draft eval that ran, so no block length to follow; "
            "pass --block N (the run's --spec-draft-n-max + 1) instead"
        )
    return BlockRows(rows, str(run))


def run_block_rows(evals: tuple[Eval, ...], source: str, steps: bool = False) -> int | None:
    """The one length (`n_tokens`) of a run's draft blocks; None when it has no draft eval.

    Failed decodes (`rc != 0`) drafted nothing and warm-up decodes are outside the flow: neither
    counts. Blocks of several lengths are refused, naming `source`. A drafter of one-token
    `steps` (EAGLE3, MTP) decodes no block: its block is the longest verify it made (the anchor
    and every draft of a round that drafted its whole budget).
    """
    if steps:
        verified = [e.n_tokens for e in evals if (e.role, e.phase) == (names.ROLE_TARGET, Phase.VERIFY) and e.rc == 0]
        return max((n for n in verified if n > 1), default=None)
    evals_by_rows: dict[int, list[int]] = {}
    for e in evals:
        if (e.role, e.phase) == ROUND_OPENER and e.rc == 0:
            evals_by_rows.setdefault(e.n_tokens, []).append(e.eval)
    if len(evals_by_rows) > 1:
        seen = "; ".join(f"{rows} rows in evals {_listed(ids)}" for rows, ids in sorted(evals_by_rows.items()))
        raise InputError(
            f"{source}: its draft blocks differ in length ({seen}); the reference drafts one length: "
            "pass --block N for the rounds to compare, or capture a run with one --spec-draft-n-max"
        )
    return next(iter(evals_by_rows), None)


def _listed(ids: list[int], shown: int = 3) -> str:
    more = f", ... ({len(ids)} in all)" if len(ids) > shown else ""
    return ", ".join(map(str, ids[:shown])) + more
