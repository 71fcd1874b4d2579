"""How many rows a draft block has: llama.cpp's rule, shared by both producers.

upstream `common_speculative_impl_draft_dflash` (common/speculative.cpp) decodes
`[anchor, mask x ...]` and reads `n_max` drafts (`--spec-draft-n-max`) from it: DFlash and
bonus-anchor DSpark from rows 1.., so `n_max + 1` rows and `n_max` clamped to `block_size - 1`;
anchor-first DSpark (`dflash.sample_from_anchor` true or absent) from row 0, so `n_max` rows and
`n_max` clamped to `block_size`. Block attention is bidirectional, so a reference block of another
length differs on every row.

Consumes `--block`, a run dump's draft evals or llama.cpp's default; produces a checked
`BlockRows`. Plain Python only: the in-process driver imports it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from featdiff import names
from featdiff.dump import Eval, read_dump
from featdiff.errors import InputError

DEFAULT_DRAFT_MAX = 3    # llama.cpp's `--spec-draft-n-max` default (common/common.h, speculative.draft.n_max)
DEFAULT_BLOCK_SIZE = 16  # common/speculative.cpp falls back to 16 without dflash.block_size
MIN_BLOCK_ROWS = 2       # a DFlash block: the anchor plus one mask (anchor-first DSpark: 1 row)
DRAFT_PHASE = "draft"    # the flow's draft evals (docs/flow.md); warm-up decodes carry phase `warmup`


@dataclass(frozen=True)
class BlockRows:
    """Rows per draft block (the anchor and `rows - 1` masks), and what chose them."""

    rows: int
    origin: str  # `--block N`, the run dump's path, or llama.cpp's default


def first_draft_row(is_dspark: bool, sample_from_anchor: bool) -> int:
    """The block row llama.cpp reads the first draft from: 0 for anchor-first DSpark, else 1."""
    return 0 if is_dspark and sample_from_anchor else 1


def read_drafts(best: list[int], conf: list[float] | None, first_row: int, p_min: float) -> list[int]:
    """The drafts of a block, as common_speculative_impl_draft_dflash reads them: the greedy token
    `best[i]` of rows `first_row..`, a DSpark drafter with a confidence head (`conf`, one value per
    row) stopping at the first row below `p_min` when `p_min` > 0."""
    out = []
    for i in range(first_row, len(best)):
        if p_min > 0.0 and conf is not None and conf[i] < p_min:
            break
        out.append(best[i])
    return out


def accepted_length(drafts: tuple[int, ...] | list[int], best: tuple[int, ...] | list[int]) -> int:
    """Greedy acceptance: the length of the longest prefix on which the drafts equal the target's
    greedy tokens `best` (a verify's argmax rows; a shorter `best` bounds it)."""
    n = 0
    while n < len(drafts) and n < len(best) and drafts[n] == best[n]:
        n += 1
    return n


def block_rows(draft_max: int, first_draft_row: int) -> int:
    """Rows of a block drafting `draft_max` tokens from row `first_draft_row` (0 or 1) on."""
    return draft_max + first_draft_row


def clamped_draft_max(draft_max: int, block_size: int, first_draft_row: int = 1) -> int:
    """`draft_max` as llama.cpp uses it: at most `block_size - first_draft_row` (what the block's
    trained rows can draft)."""
    return min(draft_max, block_size - first_draft_row)


def default_block_rows(block_size: int, first_draft_row: int = 1) -> BlockRows:
    """What llama.cpp drafts out of the box: its default `--spec-draft-n-max`, clamped."""
    rows = block_rows(clamped_draft_max(DEFAULT_DRAFT_MAX, block_size, first_draft_row), first_draft_row)
    return BlockRows(rows, f"llama.cpp's default --spec-draft-n-max {DEFAULT_DRAFT_MAX}")


def asked_block_rows(block: int | None, run: Path | None) -> BlockRows | None:
    """`--block N`, or the block length of the run dump `--run`; None when neither is given."""
    if block is not None and run is not None:
        raise InputError(f"--block {block} and --run {run} both set the draft block length; pass one of them "
                         "(--run takes it from the run's draft evals)")
    if block is not None:
        return BlockRows(block, f"--block {block}")
    if run is None:
        return None
    with read_dump(run) as dump:
        rows = run_block_rows(dump.manifest.evals, str(run))
    if rows is None:
        raise InputError(f"{run}: no draft eval that ran, so no block length to follow; "
                         "pass --block N (the run's --spec-draft-n-max + 1) instead")
    return BlockRows(rows, str(run))


def run_block_rows(evals: tuple[Eval, ...], source: str) -> int | None:
    """The one length (`n_tokens`) of a run's draft blocks; None when it has no draft eval.

    Failed decodes (`rc != 0`) drafted nothing and warm-up decodes are outside the flow: neither
    counts. Blocks of several lengths are refused, naming `source`.
    """
    evals_by_rows: dict[int, list[int]] = {}
    for e in evals:
        if e.role == "draft" and e.phase == DRAFT_PHASE and e.rc == 0:
            evals_by_rows.setdefault(e.n_tokens, []).append(e.eval)
    if len(evals_by_rows) > 1:
        seen = "; ".join(f"{rows} rows in evals {_listed(ids)}" for rows, ids in sorted(evals_by_rows.items()))
        raise InputError(f"{source}: its draft blocks differ in length ({seen}); the reference drafts one length: "
                         "pass --block N for the rounds to compare, or capture a run with one --spec-draft-n-max")
    return next(iter(evals_by_rows), None)


def checked_block_rows(asked: BlockRows | None, block_size: int, model: Path, first_draft_row: int = 1) -> BlockRows:
    """`asked` (else llama.cpp's default) within what the drafter `model` of `block_size` drafts
    from row `first_draft_row` on."""
    key = f"{names.KEY_BLOCK_SIZE} = {block_size}"
    least = block_rows(1, first_draft_row)  # one draft
    clamp = f"block_size - {first_draft_row}" if first_draft_row else "block_size"
    if block_size < least:
        raise InputError(f"{model}: {key} leaves no row to draft; expected >= {least}: "
                         "re-export the drafter with its trained block size (see `featdiff lint`)")
    chosen = asked or default_block_rows(block_size, first_draft_row)
    if chosen.rows > block_size:
        raise InputError(f"{chosen.origin}: draft blocks of {chosen.rows} rows, more than {model} was trained on "
                         f"({key}); llama.cpp clamps --spec-draft-n-max to {clamp}, so a block has "
                         f"{least} .. {block_size} rows: pass --block in that range")
    if chosen.rows < least:
        raise InputError(f"{chosen.origin}: draft blocks of {chosen.rows} rows; a block holds at least one draft, "
                         f"so expected {least} .. {block_size} rows ({model}: {key}): pass --block in that range")
    return chosen


def _listed(ids: list[int], shown: int = 3) -> str:
    more = f", ... ({len(ids)} in all)" if len(ids) > shown else ""
    return ", ".join(map(str, ids[:shown])) + more
