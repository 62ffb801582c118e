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
the integration tests' ``from conftest import ...`` still reads theirs. Keep helpers out of here:
only fixtures, which pytest hands to every test below tests/ without an import (``webhook_receiver``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@pytest.fixture
def webhook_receiver() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A real HTTP server on 127.0.0.1 that records each POST: ``(url, got)``, ``got`` holding each
    body's JSON object with the request's ``path`` and ``type`` (its Content-Type) added. Answers 204."""
    got: list[dict[str, Any]] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append({"path": self.path, "type": self.headers["Content-Type"], **json.loads(body)})
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", got
    server.shutdown()
    server.server_close()


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
