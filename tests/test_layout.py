"""House rules that hold for the whole package: no import circles (issue 13: no module imports
one that imports it back, directly or through others, at any depth, lazy imports included), and
imports go down the layers, never up (issue 25): a lower layer never imports a higher one, and the
rooms of one floor never import each other (issue 43: `ACROSS` is empty), lazy imports included.

`python tests/test_layout.py` prints every upward import and their count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for path in (PACKAGE / "featdiff").rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        out[name] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The featdiff modules `name` imports anywhere in its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("featdiff"):
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            }
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("featdiff")}
    return {m for m in found if m in known and m != name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


# The floors of the house, bottom first (HOUSE.md §3.1): a module is on the floor of its longest
# matching prefix. Vocabulary, then the kinds' pure facts, the dump format, the build under test, the
# four stages, the report, what judges and inspects a run (`check` writes the report, so the report is
# the floor below it), the test-model factory, and the faces.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("featdiff.core", "featdiff.version")),
    ("kinds", ("featdiff.kinds",)),
    ("dump", ("featdiff.dump",)),
    ("llama", ("featdiff.llama",)),
    (
        "driver|programs|reference|compare",
        ("featdiff.driver", "featdiff.programs", "featdiff.torchref", "featdiff.diff"),
    ),
    ("report", ("featdiff.html",)),
    ("check|inspect", ("featdiff.verdict", "featdiff.inspect")),
    ("factory", ("featdiff.factory",)),
    ("faces", ("featdiff", "featdiff.api", "featdiff.cli", "featdiff.pytest_plugin")),
)
# The rooms of a floor never import each other: what two stages share lives on a floor below them.
ROOMS = (
    "featdiff.driver",
    "featdiff.programs",
    "featdiff.torchref",
    "featdiff.diff",
    "featdiff.html",
    "featdiff.verdict",
    "featdiff.inspect",
)
ACROSS: set[tuple[str, str]] = set()


def _prefix(name: str, prefixes) -> str | None:
    """The longest of `prefixes` that is `name` or a package holding it (the package `featdiff`
    itself holds nothing here: it is the API, on the top floor)."""
    matches = [p for p in prefixes if name == p or (p != "featdiff" and name.startswith(p + "."))]
    return max(matches, key=len) if matches else None


def _floor(name: str) -> int:
    """The index in LAYERS of the floor `name` is on; KeyError for a module no floor names."""
    found = [(len(p), i) for i, (_, prefixes) in enumerate(LAYERS) if (p := _prefix(name, prefixes))]
    if not found:
        raise KeyError(f"{name}: on no floor of LAYERS; add it to the floor it belongs to")
    return max(found)[1]


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports (importer, imported) that climb to a higher floor, or cross between two middle
    rooms where ACROSS does not allow it."""
    out = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            fa, fb = _floor(a), _floor(b)
            ra, rb = _prefix(a, ROOMS), _prefix(b, ROOMS)
            across = fa == fb and ra is not None and rb is not None and ra != rb and (ra, rb) not in ACROSS
            if fb > fa or across:
                out.append((a, b))
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(m, p, known) for m, p in known.items()}


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules `start` imports, at any depth, itself included."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    return seen


def test_no_import_circles():
    known = _modules()
    assert _circles({m: _imports(m, p, known) for m, p in known.items()}) == []


def test_the_circle_finder_finds_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_is_on_a_floor():
    for m in _modules():
        _floor(m)


def test_imports_go_down_the_floors():
    assert upward(_graph()) == []


def test_an_upward_import_is_found():
    """A synthetic graph: the dump importing compare, the in-process driver importing the wrapping of
    programs (two rooms of one floor), and the reference importing the build's tokenizer (a floor below)."""
    graph = {
        "featdiff.dump.records": {"featdiff.core.names", "featdiff.diff.align"},
        "featdiff.driver.capture": {"featdiff.programs.exec", "featdiff.dump"},
        "featdiff.torchref.dflash.run": {"featdiff.llama.tokenize"},
        "featdiff.core.names": set(),
    }
    assert upward(graph) == [
        ("featdiff.driver.capture", "featdiff.programs.exec"),
        ("featdiff.dump.records", "featdiff.diff.align"),
    ]


def test_a_lazy_import_is_seen(tmp_path):
    source = tmp_path / "dump.py"
    source.write_text("def f():\n    from featdiff.diff import align\n    import featdiff.html\n")
    known = {"featdiff.dump": source, "featdiff.diff.align": source, "featdiff.html": source}
    found = _imports("featdiff.dump", source, known)
    assert found == {"featdiff.diff.align", "featdiff.html"}
    assert upward({"featdiff.dump": found}) == [
        ("featdiff.dump", "featdiff.diff.align"),
        ("featdiff.dump", "featdiff.html"),
    ]


def test_a_module_on_no_floor_is_named():
    with pytest.raises(KeyError, match="featdiff.attic: on no floor"):
        _floor("featdiff.attic")


if __name__ == "__main__":
    graph = _graph()
    found = upward(graph)
    from_check = _reached(graph, "featdiff.verdict")
    for a, b in found:
        print(f"{a} -> {b}" + ("  (reached from featdiff.verdict)" if a in from_check else ""))
    print(f"{len(found)} upward imports; {sum(a in from_check for a, _ in found)} reached from featdiff.verdict")
