"""A real `psflow ui` for tests: a process on 127.0.0.1, port 0, over a real job store; its URL read
from what it prints (every wait with a deadline)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from conftest import PSFLOW, ROOT, task_env

TOKEN = "test-token-0123456789abcdef"
EXAMPLES = ROOT / "examples"


@dataclass
class Dashboard:
    proc: subprocess.Popen
    url: str
    home: Path
    output: list[str]

    def client(self, *, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def start_dashboard(home: Path, runs_dir: Path, *, timeout_s: float = 60.0, extra: tuple[str, ...] = ()) -> Dashboard:
    """`psflow ui --port 0` serving ``home``'s job store; returns once it printed its URL."""
    proc = subprocess.Popen([PSFLOW, "ui", "--port", "0", "--scripts", str(EXAMPLES), "--runs-dir", str(runs_dir), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True,
                            env=task_env(PSFLOW_HOME=str(home), PSFLOW_UI_TOKEN=TOKEN))
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        m = re.search(r"the dashboard is at (http://127\.0\.0\.1:\d+/)", line)
        if m:
            return Dashboard(proc, m.group(1), home, output)
    proc.kill()
    raise AssertionError(f"psflow ui did not print its URL within {timeout_s} s:\n{''.join(output)}")


def wait_for(fetch, check, *, what: str, timeout_s: float = 120.0, context=lambda: ""):
    """Call ``fetch()`` until ``check(value)`` holds; return that value (deadline ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = fetch()
        if check(value):
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout_s} s; last seen {str(value)[:2000]}\n{context()}")


# Chromium's own line for every answer that is not 2xx and every refused connection: the tests check
# the answers themselves (a refused form is a 422 on purpose), so these are not the page's errors.
NETWORK_LINE = "Failed to load resource:"


class WatchedBrowser:
    """A Playwright browser whose every page reports its console errors and uncaught errors into
    ``errors`` (the ``browser`` fixture fails the test on any at teardown); otherwise the browser."""

    def __init__(self, browser) -> None:  # noqa: ANN001
        self._browser = browser
        self.errors: list[str] = []

    def new_page(self, **kwargs):  # noqa: ANN003, ANN201
        page = self._browser.new_page(**kwargs)
        page.on("console", lambda m: self._console(page, m))
        page.on("pageerror", lambda e: self.errors.append(f"{page.url}: uncaught {e}"))
        return page

    def _console(self, page, message) -> None:  # noqa: ANN001
        if message.type == "error" and not message.text.startswith(NETWORK_LINE):
            self.errors.append(f"{page.url}: console error: {message.text}")

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._browser, name)
