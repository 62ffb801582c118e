"""The multi-host benchmark still runs end to end (a smoke run, no timing asserted): namespace hosts
with sshd, 100 Mbit/s tc limits, 1 and 2 ps over ``psflow run --hosts``, and the ratio reported.
Skipped, saying why, where the benchmark itself finds no namespace hosts (not root, no iproute2)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, task_env

pytestmark = [pytest.mark.timeout(180), pytest.mark.long]  # a benchmark's smoke run: make test-long


def test_multihost_benchmark_throughput_part_runs_one_and_two_ps_across_hosts_and_reports_the_ratio():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_multihost.py"), "--quick", "--parts", "throughput",
                          "--workers", "1", "--warmup", "0", "--steps", "1", "--reps", "1"],
                         capture_output=True, text=True, timeout=170, env=task_env(), cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    if "Skipped: no network-namespace hosts here" in out.stdout:
        pytest.skip(out.stdout.split("Skipped: ", 1)[1].splitlines()[0])
    for line in ("| 1 ps, 1 worker |", "| 2 ps, 1 worker |", "| 1 worker: 2 ps / 1 ps |", "every link at 100mbit"):
        assert line in out.stdout, out.stdout[-3000:]
    assert "tbf" in out.stderr and "rate 100Mbit" in out.stderr, out.stderr[-3000:]  # the links really were limited
