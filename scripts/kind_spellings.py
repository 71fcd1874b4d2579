"""How many modules outside a drafter kind's own spell its name in code (issue 43 item 2): a module
counts when a NAME or STRING token (not a comment, not a docstring) matches the kind's pattern. Left
out: the kind's own modules (kinds/, torchref/ and driver/ of its family), factory/ (the test
models), core/names.py (the vocabulary) and kinds/registry.py (the one entry a kind adds).

    python scripts/kind_spellings.py [src/featdiff]
"""

from __future__ import annotations

import io
import re
import sys
import tokenize
from pathlib import Path

KINDS = {
    "DSpark": (r"dspark", ("kinds/dflash", "torchref/dflash", "driver/dflash")),
    "DFlash2": (r"dflash2|lattice", ("kinds/dflash", "torchref/dflash", "driver/dflash")),
    "EAGLE3": (r"eagle3", ("kinds/eagle3", "torchref/eagle3", "driver/eagle3")),
    "MTP": (r"\bmtp|mtp_|_mtp", ("kinds/mtp", "torchref/mtp", "driver/mtp")),
}
LEFT_OUT = ("factory/", "core/names.py", "kinds/registry.py")
STARTS = (None, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.NL)  # a docstring follows one


def code_tokens(source: str) -> list[str]:
    """The NAME and STRING tokens of `source`, docstrings left out."""
    out, before = [], None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING and before not in STARTS:
            out.append(tok.string)
        elif tok.type == tokenize.NAME:
            out.append(tok.string)
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            before = tok.type
    return out


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "src/featdiff")
    for kind, (pattern, own) in KINDS.items():
        spelled = re.compile(pattern, re.IGNORECASE)
        found = []
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(own) or rel.startswith(LEFT_OUT):
                continue
            if any(spelled.search(t) for t in code_tokens(path.read_text())):
                found.append(rel)
        print(f"{kind}: {len(found)}  {' '.join(found)}")


if __name__ == "__main__":
    main()
