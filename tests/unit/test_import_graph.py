"""psflow's modules import each other without a circle, and its layers point one way.

The graph is read from the source (ast), not from a running interpreter, so that it sees every import:
at module level and inside functions (a deferred import still ties two modules together, it only
hides the circle until the function runs). Imports under ``if TYPE_CHECKING:`` never run and are left
out of the circles, not of the layers (a type from a higher layer is a dependency all the same).
Importing ``a.b.c`` runs the packages ``a`` and ``a.b`` first, so those count as imports too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, module: str, is_package: bool, *, type_checking: bool = False) -> set[tuple[str, ...]]:
    """What ``module`` imports, as dotted names split in parts: ``from p import m`` gives (p, m), which
    is the module p.m if there is one, else an attribute of p. ``type_checking``: with the imports
    under ``if TYPE_CHECKING:``."""
    names: set[tuple[str, ...]] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names.update(tuple(a.name.split(".")) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            parent = node.module.split(".") if node.module else []
            if node.level:
                here = module.split(".")
                parent = here[: len(here) - node.level + (1 if is_package else 0)] + parent
            names.update((*parent, a.name) for a in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return names


def import_graph(root: Path = SRC / "psflow", *, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ours that importing it runs.

    Importing ``a.b.c`` runs ``a.b.c`` and, before it, the packages ``a`` and ``a.b``; those implied
    package edges are left out where the package is one of the importer's own (it is initialized, or
    being initialized, before any of its submodules runs), unless the importer takes a name that the
    package's ``__init__`` defines. ``type_checking``: with the imports under ``if TYPE_CHECKING:``.
    """
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        edges: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        for parts in _imported(tree, name, path.name == "__init__.py", type_checking=type_checking):
            dotted = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            target = next((d for d in reversed(dotted) if d in modules), None)
            if target is None:
                continue  # not ours
            edges.add(target)
            edges.update(d for d in dotted if d in modules and d != target and d not in own and len(d) < len(target))
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as a path a -> ... -> a."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_within(graph, set(c)) for c in components]


def _path_within(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle through the component's first module, staying inside the component (BFS)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def test_the_graph_sees_module_level_function_level_relative_and_package_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n")
    (pkg / "a.py").write_text("import json\nfrom pkg.sub import c\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from ..b import f\nimport pkg.sub.d\n")
    (pkg / "sub" / "d.py").write_text("from pkg.sub import VERSION\n")
    assert import_graph(pkg) == {
        "pkg": set(),  # TYPE_CHECKING imports never run
        "pkg.a": {"pkg.sub", "pkg.sub.c"},  # importing pkg.sub.c runs pkg.sub first; pkg is a's own; json is not ours
        "pkg.b": {"pkg.a"},  # inside a function, relative
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg.b", "pkg.sub.d"},  # pkg.sub is c's own package: initialized before c runs
        "pkg.sub.d": {"pkg.sub"},  # a name defined in its own package's __init__: a real dependency
    }
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.sub.c", "pkg.b", "pkg.a"]]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def reaching_up(graph: dict[str, set[str]], lower: str, upper: str) -> list[tuple[str, str]]:
    """The imports of a module of package ``lower`` from one of package ``upper``, sorted."""
    return sorted((m, t) for m, targets in graph.items() if _within(m, lower) for t in targets if _within(t, upper))


def test_reaching_up_sees_deferred_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    for d in ("low", "high"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "store.py").write_text("from pkg.low import run\n")  # down: allowed
    (pkg / "low" / "run.py").write_text("def f():\n    from pkg.high import store\n    return store\n")
    (pkg / "low" / "types.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high.store import X\n")
    (pkg / "lowly.py").write_text("import pkg.high.store\n")  # not inside pkg.low, though its name starts so
    # importing pkg.high.store runs the package pkg.high first: both are reached
    assert reaching_up(import_graph(pkg, type_checking=True), "pkg.low", "pkg.high") == [
        ("pkg.low.run", "pkg.high"), ("pkg.low.run", "pkg.high.store"),
        ("pkg.low.types", "pkg.high"), ("pkg.low.types", "pkg.high.store")]
    assert reaching_up(import_graph(pkg), "pkg.low", "pkg.high") == [("pkg.low.run", "pkg.high"), ("pkg.low.run", "pkg.high.store")]


def test_launch_imports_nothing_from_platform():
    """launch/ lies below platform/: what the platform adds to a run (the job store, alerts) is handed
    in (psflow.platform.recording's store factory), never imported, deferred or for types."""
    found = reaching_up(import_graph(type_checking=True), "psflow.launch", "psflow.platform")
    assert not found, "launch/ imports platform/ (hand the thing in instead):\n" + "\n".join(
        f"  {m} -> {t}" for m, t in found)


def test_cycles_finds_a_circle_and_names_its_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


def test_psflow_has_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles (break each by moving the shared part below both):\n" + "\n".join(
        "  " + " -> ".join(c) for c in found)


# The launcher and what stands on it; every other module is the task's side (or below both).
_LAUNCHER_SIDE = ("psflow.launch", "psflow.platform", "psflow.cli", "psflow.chaos")


def test_the_task_side_imports_nothing_from_launch():
    """A task (psflow.init, its server, trainers, the Supervisor) imports nothing from launch/: what it
    shares with the launcher (its environment, psflow.taskenv; its error report, psflow.errorreport;
    the logdir's lock, psflow.logdirlock) lies below both, deferred or for types alike."""
    graph = import_graph(type_checking=True)
    task_side = [m for m in graph if not any(_within(m, p) for p in _LAUNCHER_SIDE)]
    found = sorted((m, t) for m in task_side for t in graph[m] if _within(t, "psflow.launch"))
    assert not found, "the task's side imports launch/ (move the shared part below both):\n" + "\n".join(
        f"  {m} -> {t}" for m, t in found)
