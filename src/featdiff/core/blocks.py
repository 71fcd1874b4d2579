"""How many rows a draft block has: llama.cpp's rule, shared by both producers.

upstream `common_speculative_impl_draft_dflash` (common/speculative.cpp) decodes
`[anchor, mask x ...]` and reads `n_max` drafts (`--spec-draft-n-max`) from it: DFlash and
bonus-anchor DSpark from rows 1.., so `n_max + 1` rows and `n_max` clamped to `block_size - 1`;
anchor-first DSpark (`dflash.sample_from_anchor` true or absent) from row 0, so `n_max` rows and
`n_max` clamped to `block_size`. Block attention is bidirectional, so a reference block of another
length differs on every row.

Consumes `--block`, a run dump's draft evals or llama.cpp's default; produces a checked
`BlockRows`, and the bounds both producers and `featdiff lint` hold a drafter's `block_size` and a
flow's positions to. Plain Python only: the in-process driver imports it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.tokens import MIN_PROMPT_TOKENS

DEFAULT_DRAFT_MAX = 3  # llama.cpp's `--spec-draft-n-max` default (common/common.h, speculative.draft.n_max)
DEFAULT_BLOCK_SIZE = 16  # common/speculative.cpp falls back to 16 without dflash.block_size
# The most rows a trained block may have: llama.cpp decodes a draft block in one batch, and a
# non-causal batch must fit one ubatch (src/llama-context.cpp decode: GGML_ASSERT "non-causal
# attention requires n_ubatch >= n_tokens"). The draft context inherits the main context's
# n_ubatch (common/speculative.cpp common_base_params_to_speculative), whose default is 512
# (common/common.h common_params.n_ubatch; llama_context_default_params agrees), so a block of
# block_size rows (--spec-draft-n-max block_size - 1) aborts past it.
MAX_BLOCK_SIZE = 512
# The positions a flow may reach when the target states no trained context (an HF config without
# max_position_embeddings; llama.cpp refuses a GGUF without {arch}.context_length). A chosen bound,
# not llama.cpp's: wiring faults show in the first rounds, 32768 positions are thousands of rounds
# of a 4-row block, and a runaway --rounds stops here instead of running for days.
UNSTATED_N_CTX_TRAIN = 32768


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


def block_size_problem(block_size: int, first_draft_row: int = 1) -> str | None:
    """Why llama.cpp cannot draft with a trained `block_size` whose drafts start at row
    `first_draft_row`, as a sentence without the file name; None when it can."""
    least = block_rows(1, first_draft_row)  # one draft
    key = f"{names.KEY_BLOCK_SIZE} = {block_size}"
    fix = f"expected {least} .. {MAX_BLOCK_SIZE}: re-export the drafter with its trained block size"
    if block_size < least:
        return f"{key} leaves no row to draft; {fix}"
    if block_size > MAX_BLOCK_SIZE:
        return (
            f"{key} is more rows than llama.cpp's draft batch holds in one ubatch (n_ubatch {MAX_BLOCK_SIZE}; a "
            f"larger non-causal block aborts it); {fix}"
        )
    return None


def flow_positions(n_prompt: int, rounds: int, rows: int) -> int:
    """The positions a flow of `rounds` rounds of `rows`-row blocks after an `n_prompt`-token
    prompt may reach: one block more than the rounds (featdiff.driver.capture.new_contexts sizes
    its contexts by it)."""
    return n_prompt + (rounds + 1) * rows


def max_rounds(n_ctx: int, n_prompt: int, rows: int) -> int:
    """The most rounds whose `flow_positions` fit `n_ctx`; -1 when not even zero rounds do."""
    return max((n_ctx - n_prompt) // max(rows, 1) - 1, -1)  # a block has a row at least


def check_rounds_fit(
    rounds: int, rows: int, n_ctx_train: int | None, target: Path, n_prompt: int | None = None
) -> None:
    """InputError when a flow of `rounds` rounds of `rows`-row blocks after an `n_prompt`-token
    prompt (None: not known yet, the shortest prompt) reaches past the context the target file
    `target` was trained on (`n_ctx_train`; None: it states none, UNSTATED_N_CTX_TRAIN bounds it)."""
    n_ctx = n_ctx_train if n_ctx_train is not None else UNSTATED_N_CTX_TRAIN
    least = n_prompt if n_prompt is not None else MIN_PROMPT_TOKENS
    need = flow_positions(least, rounds, rows)
    if need <= n_ctx:
        return
    prompt = f"{least} prompt tokens" if n_prompt is not None else f"a prompt of {least} tokens at least"
    trained = (
        f"{target} was trained on {n_ctx} positions"
        if n_ctx_train is not None
        else f"{target} states no trained context length, so featdiff allows {n_ctx} positions"
    )
    fit = max_rounds(n_ctx, least, rows)
    fix = f"pass --rounds {fit} or fewer" if fit >= 0 else "shorten the prompt"
    raise InputError(
        f"--rounds {rounds}: the flow reaches position {need} ({prompt} + ({rounds} + 1) blocks of "
        f"{rows} rows) but {trained}; {fix}"
    )


def checked_block_rows(asked: BlockRows | None, block_size: int, model: Path, first_draft_row: int = 1) -> BlockRows:
    """`asked` (else llama.cpp's default) within what the drafter `model` of `block_size` drafts
    from row `first_draft_row` on."""
    key = f"{names.KEY_BLOCK_SIZE} = {block_size}"
    least = block_rows(1, first_draft_row)  # one draft
    clamp = f"block_size - {first_draft_row}" if first_draft_row else "block_size"
    problem = block_size_problem(block_size, first_draft_row)
    if problem is not None:
        raise InputError(f"{model}: {problem} (see `featdiff lint`)")
    chosen = asked or default_block_rows(block_size, first_draft_row)
    if chosen.rows > block_size:
        raise InputError(
            f"{chosen.origin}: draft blocks of {chosen.rows} rows, more than {model} was trained on "
            f"({key}); llama.cpp clamps --spec-draft-n-max to {clamp}, so a block has "
            f"{least} .. {block_size} rows: pass --block in that range"
        )
    if chosen.rows < least:
        raise InputError(
            f"{chosen.origin}: draft blocks of {chosen.rows} rows; a block holds at least one draft, "
            f"so expected {least} .. {block_size} rows ({model}: {key}): pass --block in that range"
        )
    return chosen
