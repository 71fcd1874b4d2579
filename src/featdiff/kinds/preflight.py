"""A drafter GGUF's problems, alone or against its target GGUF, each with its severity, read
without running anything: `featdiff lint` (featdiff.verdict.lint) lists them all, and
`preflight` refuses the fatal ones before llama.cpp loads a pair (capture and probe call it).
Below the stages, so capture and the reference both read it.
"""

from __future__ import annotations

from pathlib import Path

from featdiff.core import names
from featdiff.core.blocks import DEFAULT_BLOCK_SIZE, DEFAULT_DRAFT_MAX, block_rows, check_rounds_fit, clamped_draft_max
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import GgmlLoader, GgufModel, int_meta, read_gguf, trained_context
from featdiff.kinds import registry as kinds
from featdiff.kinds.problems import FATAL, Problem


def preflight(
    model: Path,
    target: Path,
    *,
    rounds: int | None = None,
    draft_max: int = DEFAULT_DRAFT_MAX,
    ggml: GgmlLoader | None = None,
) -> None:
    """Refuse, before llama.cpp sees them, a pair it would abort on, refuse or misrun from the
    first decode: lint's fatal problems (InputError, the first problem, one line). With `rounds`,
    also a flow whose positions reach past the target's trained context (`draft_max` drafts per
    block, as capture's `--draft-max`; the prompt is not known yet: the shortest). `ggml`: the
    build's loader, which teaches the reader tensor types newer than gguf-py (gguf_reader)."""
    d, t = read_gguf(Path(model), ggml), read_gguf(Path(target), ggml)
    fatal = [p.text for p in drafter_problems(d, t) if p.severity == FATAL]
    if fatal:
        more = f" ({len(fatal) - 1} more: `featdiff lint {model} --target {target}`)" if len(fatal) > 1 else ""
        raise InputError(f"{model}: {fatal[0]}{more}")
    if rounds is not None:
        check_rounds_fit(rounds, _capture_block_rows(d, draft_max), trained_context(t), Path(target))


def drafter_problems(d: GgufModel, t: GgufModel | None) -> list[Problem]:
    """Every problem of the drafter `d` (and its fit to the target `t`), each with its severity:
    the checks of its kind's architecture (featdiff.kinds); an MTP head featdiff does not model,
    named (kinds.mtp.UNMODELLED_HEADS)."""
    refused = kinds.refused(d)
    if refused is not None:
        return [Problem(refused, FATAL)]
    if d.arch not in kinds.ALL_DRAFTER_ARCHS:
        return [
            Problem(
                f"{names.KEY_ARCH} = {d.arch!r}, expected one of {', '.join(kinds.ALL_DRAFTER_ARCHS)}; pass the "
                "drafter GGUF as the model and its target with --target",
                FATAL,
            )
        ]
    checks = kinds.kind_of(d.arch, d.tensors, str(d.path)).check_table()
    return [Problem(text, severity) for check, severity in checks for text in check(d, t)]


def _capture_block_rows(d: GgufModel, draft_max: int) -> int:
    """The positions a round of an in-process capture reaches with `draft_max` drafts: a DFlash
    block's rows (featdiff.core.blocks), EAGLE3's anchor and drafts."""
    if not kinds.kind_of(d.arch, d.tensors).block_flow:  # EAGLE3, MTP: the anchor and its drafts
        return draft_max + 1
    block_size = int_meta(d, names.KEY_BLOCK_SIZE, DEFAULT_BLOCK_SIZE)
    first_row = _first_draft_row(d)
    return block_rows(clamped_draft_max(draft_max, block_size, first_row), first_row)


def _first_draft_row(d: GgufModel) -> int:
    """The block row llama.cpp reads the drafter's first draft from: its block kind's rule
    (DrafterKind.first_draft_row); 1 where a kind has none."""
    rule = kinds.kind_of(d.arch, d.tensors, str(d.path)).first_draft_row
    return rule(d) if rule is not None else 1
