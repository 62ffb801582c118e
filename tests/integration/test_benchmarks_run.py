"""The transport and apply benchmarks still run against today's ps and wire (a smoke run, no timing asserted):
benchmarks construct servers and clients by hand, so an API change that leaves them behind fails here,
not in the next `make bench`."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, task_env

pytestmark = pytest.mark.long  # benchmarks' smoke runs: make test-long


def test_transport_benchmark_quick_run_completes_and_reports_every_size():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_transport.py"), "--quick", "--reps", "1",
                          "--placement", "one-core"],
                         capture_output=True, text=True, timeout=150, env=task_env(), cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "### Placement one-core: client on core [" in out.stdout, out.stdout[-3000:]
    assert "Placement two-cores" not in out.stdout, out.stdout[-3000:]
    for size in ("1 MiB", "16 MiB", "64 MiB", "small round trip"):
        assert size in out.stdout, out.stdout[-3000:]
    assert "| push_pull / (raw echo + step) |" in out.stdout, out.stdout[-3000:]


def test_transport_benchmark_refuses_two_cores_on_one():
    """Pinned to one core, the two-core placement cannot be measured: one clear error, nothing run."""
    out = subprocess.run(["taskset", "-c", "0", sys.executable, str(ROOT / "benchmarks" / "bench_transport.py"),
                          "--quick", "--placement", "two-cores"],
                         capture_output=True, text=True, timeout=60, env=task_env(), cwd=ROOT)
    assert out.returncode != 0
    assert "--placement two-cores needs two cores; this process may use 1." in out.stderr, out.stderr[-2000:]
    assert "bulk" not in out.stderr, out.stderr[-2000:]


def test_overlap_benchmark_quick_run_reports_every_mode_at_every_size():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_overlap.py"), "--quick", "--reps", "1"],
                         capture_output=True, text=True, timeout=120, env=task_env(), cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "terminate called" not in out.stderr, out.stderr[-2000:]
    assert "| raw ms | after ms | send-overlap ms | receive-overlap ms |" in out.stdout, out.stdout[-3000:]
    rows = [line.split("|")[1].strip() for line in out.stdout.splitlines() if line.startswith("| ") and "MiB |" in line]
    assert rows == ["1 MiB", "16 MiB", "64 MiB"], out.stdout[-3000:]


def test_apply_benchmark_quick_run_times_every_optimizer_fused_and_not():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_apply.py"), "--quick", "--reps", "1"],
                         capture_output=True, text=True, timeout=120, env=task_env(), cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and line.endswith("x |")]
    assert [r.split("|")[1].strip() for r in rows] == ["SGD", "SGD momentum=0.9", "Adagrad", "Adam"], out.stdout
