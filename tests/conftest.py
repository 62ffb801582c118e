"""The suite's shape under pytest-xdist (``make test`` runs it with ``-n N --dist loadgroup``).

- A test that uses a module-scoped fixture of its own module (a trained run, a started cluster, a
  Slurm or namespace-host setup, a fork server) joins that fixture's xdist group, so that the
  fixture is set up once, on one worker, and its tests share it as they do in a serial run. The
  module's other tests are spread over the workers like any.
- Tests marked ``long`` (the benchmarks' smoke runs and the longest end-to-end runs) are left to
  ``make test-long``; CI runs both targets. Tests marked ``serial`` (timing-sensitive under the
  parallel run's load, each with its reason) run after the parallel part, alone.

Without xdist (``pytest tests/unit/...``) nothing changes: the groups are only read by ``--dist loadgroup``.

This file is a conftest outside any package, as tests/integration/conftest.py is: pytest loads this
one first and replaces ``sys.modules["conftest"]`` with the integration one when it gets there, so
the integration tests' ``from conftest import ...`` still reads theirs. Keep helpers out of here.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        groups = sorted(_module_fixtures(item))
        if groups:
            # One group per test: xdist keeps one. A test using two module fixtures of its module
            # joins the first; its other fixture is set up again where it runs (correct, only slower).
            item.add_marker(pytest.mark.xdist_group(groups[0]))


def _module_fixtures(item: pytest.Item) -> set[str]:
    """``"path::fixture"`` for each module-scoped fixture defined in the item's own module that it uses."""
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(item, "module", None)
    if info is None or module is None:
        return set()
    found = set()
    for name, defs in info.name2fixturedefs.items():
        for d in defs:
            if d.scope == "module" and getattr(d.func, "__module__", None) == module.__name__:
                found.add(f"{item.nodeid.split('::')[0]}::{name}")
    return found
