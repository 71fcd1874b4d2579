"""The capture filter: which callback names a capture keeps, per role.

Consumes the `--filter` specs of the CLI (`[!][role:]glob`, repeatable) or a manifest's
`build.filters`; produces one `FilterSet` (include and exclude globs per role) and its three
serial forms: the manifest's (docs/dump.md), the in-process shim's and the preload's environment.
The C shim (`native/featdiff_shim.c`) is the only matcher at run time; `FilterSet.keeps` answers
the same question afterwards, for compare (was a name absent from the run, or filtered out?).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.names import ROLES, Role

# The shim's role ids: a role's index in names.ROLES, as featdiff_shim.h's enum numbers them
# (FD_ROLE_TARGET, FD_ROLE_DRAFT; tests/llama/test_capture.py holds the two equal through the binding).
ROLE_IDS: dict[Role, int] = {role: i for i, role in enumerate(ROLES)}
NOT = "!"  # a glob's prefix that makes it an exclusion
ROLE_SEP = ":"  # `draft:GLOB` limits a glob to one role
ROLE_WORD = re.compile(r"[A-Za-z]+")  # a prefix before ROLE_SEP spelled like a role: a role or a typo of one
DERIVED_MARK = "("  # ggml's derived names are "x (view)", "x (permuted)" ...: kept only when a glob names "("
MAX_GLOBS = 64  # per role, includes and exclusions together (featdiff_shim.c FD_MAX_FILTERS)


def _matches(name: str, globs: tuple[str, ...]) -> bool:
    """fnmatch, case-sensitive, as the shim's fnmatch(3) with no flags."""
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


@dataclass(frozen=True)
class RoleFilter:
    """The globs of one role: a name is kept when an include matches it and no exclude does."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def keeps(self, name: str) -> bool:
        return _matches(name, self.include) and not _matches(name, self.exclude)

    def globs(self) -> list[str]:
        """The shim's (and the manifest's) form: the includes, then each exclusion as `!glob`."""
        return [*self.include, *(NOT + g for g in self.exclude)]

    @staticmethod
    def from_globs(globs: Iterable[str]) -> RoleFilter:
        """The inverse of `globs`: `!glob` entries are exclusions."""
        globs = list(globs)
        return RoleFilter(
            include=tuple(dict.fromkeys(g for g in globs if not g.startswith(NOT))),
            exclude=tuple(dict.fromkeys(g[1:] for g in globs if g.startswith(NOT))),
        )


@dataclass(frozen=True)
class FilterSet:
    """What a capture keeps, per role (docs/dump.md `build.filters`)."""

    target: RoleFilter = RoleFilter()
    draft: RoleFilter = RoleFilter()

    def role(self, role: Role) -> RoleFilter:
        return self.target if role == "target" else self.draft

    def keeps(self, role: Role, name: str) -> bool:
        """Whether a capture under these filters keeps callback `name` of `role`."""
        return self.role(role).keeps(name)

    def to_json(self) -> dict[str, list[str]]:
        """The manifest's form: per role, the includes, then each exclusion as `!glob`."""
        return {role: self.role(role).globs() for role in sorted(ROLES)}

    @staticmethod
    def from_json(value: Any) -> FilterSet:
        """A manifest's `build.filters`: per role (`{"target": [...], "draft": [...]}`; dumps before
        issue 13 hold no exclusions), or one list for both roles (the first form); absent: every
        name (nothing is known to be filtered out)."""
        if not value:
            return KEEP_ALL
        if isinstance(value, dict):
            return FilterSet(**{role: RoleFilter.from_globs(value.get(role, ())) for role in ROLES})
        both = RoleFilter.from_globs(value)
        return FilterSet(target=both, draft=both)

    def shim_globs(self) -> dict[int, list[str]]:
        """The in-process shim's form (`fd_capture_add_filter`): globs per role id."""
        return {ROLE_IDS[role]: self.role(role).globs() for role in ROLES}

    def env_lines(self) -> str:
        """The preload's form (`FEATDIFF_FILTERS`, read by native/featdiff_preload.c): one line
        `<role id>\\t<glob>` per glob, exclusions as `!glob`."""
        return "\n".join(f"{i}\t{g}" for i, globs in self.shim_globs().items() for g in globs)


KEEP_ALL = FilterSet(target=RoleFilter(("*",)), draft=RoleFilter(("*",)))


def parse_filters(specs: Iterable[str]) -> FilterSet:
    """The `--filter` specs as a FilterSet: `[!][role:]glob`, `role` one of `target`, `draft`;
    without a role a glob applies to both (`_split_role`)."""
    per_role: dict[Role, list[str]] = {role: [] for role in ROLES}
    for spec in specs:
        role, glob = _split_role(spec)
        for r in (role,) if role is not None else ROLES:
            per_role[r].append(glob)
    for role, globs in per_role.items():
        if len(set(globs)) > MAX_GLOBS:
            raise InputError(
                f"--filter: {len(set(globs))} globs on the {role}, a capture takes at most {MAX_GLOBS} "
                "per role; merge some into one glob"
            )
    return FilterSet(**{role: RoleFilter.from_globs(globs) for role, globs in per_role.items()})


def _split_role(spec: str) -> tuple[Role | None, str]:
    """A `--filter` spec's role (None: both) and its glob, `!` kept. A prefix of letters only that
    is no role (`drafter:*`) is refused: read as a glob it would match nothing on both roles, and
    no llama.cpp callback name has such a prefix (upstream names are `<base>-<il>` and ggml's
    derived `x (view)`); any other prefix is part of the glob."""
    bang = NOT if spec.startswith(NOT) else ""
    head, sep, glob = spec.removeprefix(NOT).partition(ROLE_SEP)
    if not sep:
        return None, spec
    role = next((r for r in ROLES if r == head), None)
    if role is not None:
        return role, bang + glob
    if ROLE_WORD.fullmatch(head):
        raise InputError(
            f"--filter {spec!r}: unknown role {head!r}; roles are {', '.join(ROLES)} (or drop the prefix for both)"
        )
    return None, spec


def default_specs(
    tapped: tuple[int, ...] | None = None,
    wiring: tuple[str, ...] = names.DRAFT_WIRING,
    target_wiring: tuple[str, ...] | None = None,
) -> list[str]:
    """The wiring a capture keeps unless told otherwise: the drafter's wiring names (`wiring`, its
    kind's: featdiff.kinds), and on the target the inputs of the `tapped` layers and what the kind
    reads of it besides (`target_wiring`, default the logits; an MTP head's hidden rows too); when
    the tapped layers are unknown (None: around a program), every target layer, what the kind reads
    and the positions as the graphs saw them."""
    draft = [f"draft{ROLE_SEP}{g}" for g in wiring]
    extra = tuple(target_wiring or names.TARGET_WIRING)
    if tapped is not None:
        target = [names.tapped_layer_name(L) for L in tapped] + list(extra)
        return draft + [f"target{ROLE_SEP}{g}" for g in target]
    every = dict.fromkeys(names.TARGET_ALL_LAYERS + extra)
    return draft + [f"target{ROLE_SEP}{g}" for g in every] + [names.INP_POS]


def capture_filters(
    specs: Iterable[str] | None,
    tapped: tuple[int, ...] | None = None,
    wiring: tuple[str, ...] = names.DRAFT_WIRING,
    target_wiring: tuple[str, ...] | None = None,
) -> FilterSet:
    """What a capture keeps: the `--filter` specs, else `default_specs(tapped, wiring,
    target_wiring)`; ggml's derived names ("x (view)") are excluded unless a spec names "("."""
    chosen = list(specs or ()) or default_specs(tapped, wiring, target_wiring)
    if not any(DERIVED_MARK in s for s in chosen):
        chosen.append(names.EXCLUDE_DERIVED)
    return parse_filters(chosen)
