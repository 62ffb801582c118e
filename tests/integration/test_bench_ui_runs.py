"""The dashboard benchmark still runs against today's store and API (a smoke run, no timing asserted)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, task_env

pytestmark = pytest.mark.long  # a benchmark's smoke run: make test-long


def test_ui_benchmark_quick_run_reports_every_request():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ui.py"), "--quick", "--runs", "20",
                          "--points", "4000", "--requests", "3"], capture_output=True, text=True, timeout=180,
                         env=task_env(), cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    for case in ("runs list (100 rows, as the page asks)", "runs list, search", "heavy run: page data",
                 "heavy run: chart data", "live-update poll", "`psflow runs`", "task log tail"):
        assert case in out.stdout, out.stdout[-3000:]
