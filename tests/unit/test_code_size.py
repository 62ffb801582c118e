"""The size rules of the code under src/: no function over 80 lines, no module docstring over 30.

A function's length runs from its ``def`` line to its last line (decorators left out; a nested
function counts inside its parent, and on its own); a module docstring's, from its first quote to its
last. Read with ``ast``, so nothing is imported. A long design note belongs in ``docs/design/``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
MAX_FUNCTION_LINES = 80
MAX_DOCSTRING_LINES = 30


def offenders(root: Path, *, skip: Path | None = None) -> Iterator[str]:
    """``path:line name: N lines`` for each function and module docstring over its limit."""
    for path in sorted(root.rglob("*.py")):
        if skip is not None and skip in path.parents:
            continue
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(root.parent)
        first = tree.body[0] if tree.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            lines = first.end_lineno - first.lineno + 1  # type: ignore[operator]
            if lines > MAX_DOCSTRING_LINES:
                yield f"{where}:{first.lineno} module docstring: {lines} lines (at most {MAX_DOCSTRING_LINES})"
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    yield f"{where}:{node.lineno} {node.name}(): {lines} lines (at most {MAX_FUNCTION_LINES})"


def test_offenders_names_long_functions_nested_ones_and_long_module_docstrings_only(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    (pkg / "ok.py").write_text(f'"""{"line" + chr(10) * 29}"""\n\n@staticmethod\ndef f():\n{body}\n')  # 30 and 80: at the limits
    inner = "\n".join(f"            y{i} = {i}" for i in range(80))
    (pkg / "long.py").write_text(
        f'"""{"line" + chr(10) * 30}"""\n\n\nclass C:\n    """{"c" + chr(10) * 40}"""\n\n'
        f"    def outer(self):\n        def inner():\n{inner}\n        return inner\n")
    assert list(offenders(pkg)) == [
        "pkg/long.py:1 module docstring: 31 lines (at most 30)",
        "pkg/long.py:77 outer(): 83 lines (at most 80)",  # a class docstring is not a module's
        "pkg/long.py:78 inner(): 81 lines (at most 80)",
    ]
    assert list(offenders(pkg, skip=pkg)) == []


def test_no_function_or_module_docstring_under_src_is_over_its_size():
    found = list(offenders(SRC))
    assert not found, "over the size rules (split the function; move the design note to docs/design/):\n" + "\n".join(
        "  " + f for f in found)
