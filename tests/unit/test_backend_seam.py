"""One backend seam: every backend class under launch/ derives from the one base, and none runs a plan
itself (the runner is the only loop; a backend is driven by it). Read from the source (ast), so a new
backend module is checked as soon as it exists."""

from __future__ import annotations

import ast
from pathlib import Path

LAUNCH = Path(__file__).resolve().parents[2] / "src" / "psflow" / "launch"
BASE = "Backend"
LOOPS = ("run", "_run", "_follow", "_loop")  # a method by these names would be a loop of its own


def _classes() -> dict[str, tuple[Path, ast.ClassDef]]:
    out = {}
    for path in sorted(LAUNCH.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out[node.name] = (path, node)
    return out


def _bases(node: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, ast.Name | ast.Attribute)]


def _derives(name: str, classes: dict[str, tuple[Path, ast.ClassDef]]) -> bool:
    seen: set[str] = set()
    todo = [name]
    while todo:
        n = todo.pop()
        if n == BASE:
            return True
        if n in seen or n not in classes:
            continue
        seen.add(n)
        todo += _bases(classes[n][1])
    return False


def test_every_backend_class_derives_from_the_one_base_and_defines_no_run_loop():
    classes = _classes()
    backends = {n: v for n, v in classes.items() if n.endswith("Backend") and n != BASE}
    assert {"LocalBackend", "SlurmBackend", "SshBackend", "K8sBackend"} <= set(backends), sorted(backends)
    outside = [f"{n} ({p.name})" for n, (p, _) in backends.items() if not _derives(n, classes)]
    assert not outside, f"backend classes not derived from launch.backend.{BASE}: {outside}"
    loops = [f"{n}.{f.name} ({p.name}:{f.lineno})" for n, (p, c) in backends.items() if _derives(n, classes)
             for f in c.body if isinstance(f, ast.FunctionDef) and f.name in LOOPS]
    assert not loops, f"backends with a run loop of their own (the Runner drives them): {loops}"
