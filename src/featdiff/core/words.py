"""English for the counts featdiff prints: "1 row", "2 rows". A leaf module (no featdiff import),
so every stage's messages read the same."""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """`n` and its noun, singular for exactly one: plural(1, "row") == "1 row", plural(3, "row")
    == "3 rows"; `nouns` for an irregular plural."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"
