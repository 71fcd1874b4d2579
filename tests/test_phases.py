"""The flow protocol has one owner (featdiff.core.phases): its phase names are spelled nowhere else in
the package, and its values are the strings dumps and findings JSON have always carried."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from featdiff.core import phases
from featdiff.core.phases import Phase, feeders, phase_order

PACKAGE = Path(phases.__file__).parents[1]
VALUES = {p.value for p in Phase}
# "draft" is also a role (names.ROLE_DRAFT, the drafter): a role literal is no phase, so "draft"
# counts only where the code treats it as a phase (see _phase_context).
ROLE_TOO = "draft"
# (module, value): literals that spell a phase's value but mean another thing, each said why.
NOT_PHASES = {
    ("core/names.py", "draft"),  # the role Literal and names.ROLE_DRAFT
    ("diff/result.py", "warmup"),  # the skip reason `warmup` (SkipReason, docs/findings.md)
}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose may name a phase)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _is_phase_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in VALUES


def _phase_context(parents: dict[int, ast.AST], node: ast.Constant) -> bool:
    """Whether a `"draft"` literal is used as a phase: compared with something named phase, passed
    as `phase=`, or written beside another phase literal (a (role, phase) pair, a phase table)."""
    parent = parents.get(id(node))
    if isinstance(parent, ast.Compare):
        return "phase" in ast.unparse(parent)
    if isinstance(parent, ast.keyword):
        return parent.arg == "phase"
    if isinstance(parent, (ast.Tuple, ast.List, ast.Set, ast.Call)):
        items = parent.elts if not isinstance(parent, ast.Call) else parent.args
        return sum(_is_phase_literal(x) for x in items) > 1
    if isinstance(parent, ast.Dict):
        return sum(_is_phase_literal(k) for k in parent.keys if k is not None) > 1
    return False


def phase_literals(source: str) -> list[tuple[int, str]]:
    """(line, value) of each phase-name literal in a module's source, docstrings left out."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if not _is_phase_literal(node) or id(node) in docs:
            continue
        assert isinstance(node, ast.Constant)
        if node.value != ROLE_TOO or _phase_context(parents, node):
            out.append((node.lineno, node.value))
    return sorted(out)


def test_no_phase_name_is_spelled_outside_the_phases_module():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "core/phases.py":
            continue
        found += [
            f"{rel}:{line}: {value!r}"
            for line, value in phase_literals(path.read_text())
            if (rel, value) not in NOT_PHASES
        ]
    assert found == [], "use featdiff.core.phases.Phase instead of these literals:\n" + "\n".join(found)


def test_the_scan_finds_phase_literals_and_tells_the_role_apart():
    """The scan above could pass by finding nothing: planted literals of each kind are found."""
    source = (
        'def f(e):\n    """the prefill"""\n    return e.phase == "verify" or (e.role, e.phase) == ("draft", "draft")\n'
        'ROLE = "draft"\nm = {"draft": 1, "inject": 2}\ng(role="draft", phase="draft")\n'
    )
    assert phase_literals(source) == [
        (3, "draft"),
        (3, "draft"),
        (3, "verify"),
        (5, "draft"),
        (5, "inject"),
        (6, "draft"),
    ]


def test_phases_write_the_strings_dumps_have_always_carried():
    assert [p.value for p in Phase] == ["prefill", "inject", "draft", "verify", "warmup"]
    assert json.dumps({"phase": Phase.DRAFT}) == '{"phase": "draft"}'
    assert f"{Phase.VERIFY} batch" == "verify batch" and Phase("inject") is Phase.INJECT
    assert {"draft": 1}[Phase.DRAFT] == 1 and {Phase.DRAFT: 1}["draft"] == 1  # dict keys mix


def test_the_protocol_rules():
    assert feeders("draft", "draft") == (("draft", Phase.INJECT),)
    assert feeders("draft", "inject") == (("target", Phase.PREFILL), ("target", Phase.VERIFY))
    assert feeders("target", "inject") is None and feeders("target", "warmup") is None
    order = sorted(
        [("inject", 1), ("verify", 1), ("draft", 1), ("inject", 0), ("prefill", 0), ("warmup", 3)],
        key=lambda k: phase_order(*k),
    )
    assert order == [("warmup", 3), ("prefill", 0), ("inject", 0), ("draft", 1), ("verify", 1), ("inject", 1)]
    assert phases.inject_after(Phase.PREFILL) is Phase.INJECT and phases.inject_after(Phase.WARMUP) is Phase.WARMUP
