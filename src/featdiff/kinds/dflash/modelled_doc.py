"""The DFlash graph's section of docs/modelled.md, rendered from its table (kinds/dflash/modelled.py);
featdiff.kinds.registry.render_markdown joins it with the other kinds' sections."""

from __future__ import annotations

from featdiff.kinds.dflash.modelled import TABLE


def markdown_section() -> list[str]:
    """The DFlash graph's lines of docs/modelled.md: what its table says and the table."""
    lines = [
        "Every GGUF key and tensor the pinned llama.cpp's `dflash` graph or its loader reads, and the",
        "HF `config.json` fields the pinned converter (`conversion/qwen.py`, DFlashModel / DSparkModel)",
        "writes them from. **modelled**: the reference computes it as `src/models/dflash.cpp` does.",
        "**refused**: `featdiff reference` exits 2 naming it, `featdiff lint` lists it, capture records it",
        "in the manifest (`models.draft.unmodelled`, docs/dump.md) and `compare` reports one `info`",
        "finding naming it instead of a wiring fault. An unmodelled key at an inert value (llama.cpp's",
        "default) is not refused; a `dflash.*` key or tensor missing from this table is refused as unknown.",
        "",
        "| name | kind | status | what llama.cpp computes | HF config.json | inert values |",
        "|---|---|---|---|---|---|",
    ]
    for e in TABLE:
        status = "modelled" if e.modelled else "refused"
        hf = ", ".join(f"`{h}`" for h in e.hf)
        inert = ", ".join(f"`{v!r}`" for v in e.inert)
        lines.append(f"| `{e.name}` | {e.kind} | {status} | {e.how} | {hf} | {inert} |")
    return lines
