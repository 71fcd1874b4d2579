"""Prompt token ids as both producers take them (`--tokens 1,2,3` or `--prompt TEXT`), parsed
and checked in one place so capture and reference refuse the same inputs the same way."""

from __future__ import annotations

from pathlib import Path

from featdiff.core.errors import InputError

MIN_PROMPT_TOKENS = 2  # the prefill takes P[0:N-1] and the last token anchors the first block


def require_one(prompt: str | None, tokens: str | None) -> None:
    """InputError unless exactly one of `--prompt` / `--tokens` is given."""
    if (prompt is None) == (tokens is None):
        raise InputError("give exactly one of --prompt TEXT or --tokens 1,2,3")


def parse_tokens(tokens: str) -> tuple[int, ...]:
    """`--tokens 1,2,3` as token ids."""
    try:
        return tuple(int(t) for t in tokens.replace(" ", "").split(",") if t)
    except ValueError:
        raise InputError(f"--tokens {tokens!r}: expected comma-separated integers like 1,2,3") from None


def check_prompt(ids: tuple[int, ...] | list[int], n_vocab: int, vocab_of: Path) -> None:
    """InputError for a prompt too short for the flow, or with ids outside the vocabulary."""
    if len(ids) < MIN_PROMPT_TOKENS:
        raise InputError(
            f"{vocab_of}: the prompt needs >= {MIN_PROMPT_TOKENS} token ids (the flow needs at least "
            f"{MIN_PROMPT_TOKENS}: a prefill and an anchor); got {len(ids)}"
        )
    bad = [t for t in ids if not 0 <= t < n_vocab]
    if bad:
        raise InputError(
            f"{vocab_of}: token ids {bad[:5]} are out of range: outside the target vocabulary of "
            f"{n_vocab} tokens (0..{n_vocab - 1})"
        )
