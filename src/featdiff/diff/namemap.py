"""Name maps: plain-data tables (TOML) that translate a fork's callback names into the names the
reference writes. align.py applies one to every run record name; the dump is never rewritten.

A map file holds `fork`, `doc`, a `[names]` table (run name -> ref name, `<il>` standing for a
layer index) and `[fork_only] names`, run names with no reference counterpart (never reported).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from featdiff.core.errors import InputError

MAPS_DIR = Path(__file__).with_name("maps")
LAYER_PLACEHOLDER = "<il>"


@dataclass(frozen=True)
class NameMap:
    """run name -> ref name rules of one fork, in file order."""

    fork: str = ""
    path: str = ""
    rules: tuple[tuple[str, str], ...] = ()
    fork_only: tuple[str, ...] = ()

    def ref_name(self, run_name: str) -> str:
        """The reference's name for `run_name`: the first matching rule, else the name itself."""
        for run_pattern, ref_pattern in self.rules:
            il = _match(run_pattern, run_name)
            if il is not None:
                return ref_pattern.replace(LAYER_PLACEHOLDER, il)
        return run_name

    def is_fork_only(self, run_name: str) -> bool:
        return any(_match(p, run_name) is not None for p in self.fork_only)

    def pairing_name(self, run_name: str) -> str | None:
        """The name a run record pairs under; None for fork-only names, which never pair."""
        return None if self.is_fork_only(run_name) else self.ref_name(run_name)


def _match(pattern: str, name: str) -> str | None:
    """The layer index `<il>` binds to ("" when the pattern has none), or None on no match."""
    regex = re.escape(pattern).replace(re.escape(LAYER_PLACEHOLDER), r"(\d+)")
    m = re.fullmatch(regex, name)
    if m is None:
        return None
    return m.group(1) if m.groups() else ""


def builtin_map(fork: str) -> Path:
    """The path of a map shipped with featdiff (`maps/<fork>.toml`)."""
    return MAPS_DIR / f"{fork}.toml"


def read_name_map(path: Path | None) -> NameMap:
    """Load a name map; `None` gives the identity map. Raises InputError naming the file."""
    if path is None:
        return NameMap()
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise InputError(
            f"{path}: not a readable TOML name map ({e}); see src/featdiff/diff/maps/dspark.toml for the format"
        ) from None
    names = raw.get("names", {})
    fork_only = raw.get("fork_only", {}).get("names", [])
    if not isinstance(names, dict) or not all(isinstance(v, str) for v in names.values()):
        raise InputError(f"{path}: [names] must map run names to ref names (strings); fix the table")
    if not isinstance(fork_only, list) or not all(isinstance(v, str) for v in fork_only):
        raise InputError(f"{path}: [fork_only] names must be a list of strings; fix the table")
    return NameMap(
        fork=str(raw.get("fork", Path(path).stem)),
        path=str(path),
        rules=tuple(names.items()),
        fork_only=tuple(fork_only),
    )
