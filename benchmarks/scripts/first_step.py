"""Launch to first step: seconds from just before ``psflow run`` starts to a worker's ``(first step)`` line.

Runs ``psflow run --ps 1 --workers 2 examples/mnist_softmax.py -- --epochs 1 --init zeros`` N times
(each in its own logdir), reads the launcher's relayed output as it comes, and prints each time and
the median. The README's softmax job; MNIST is cached by the first run (an untimed warm-up).

Run: ``.venv/bin/python benchmarks/scripts/first_step.py [N]``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def once() -> float:
    """One launch; the seconds to the first ``(first step)`` line (the run is left to finish)."""
    logdir = tempfile.mkdtemp(prefix="first-step-")
    cmd = [str(REPO / ".venv" / "bin" / "psflow"), "run", "--ps", "1", "--workers", "2", "--logdir", logdir,
           str(REPO / "examples" / "mnist_softmax.py"), "--", "--epochs", "1", "--init", "zeros"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    first = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if first is None and "(first step)" in line:
            first = time.perf_counter() - t0
    if proc.wait(timeout=300) != 0 or first is None:
        raise SystemExit(f"the run failed or printed no first step (exit {proc.returncode})")
    return first


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    once()  # warm-up: caches, page cache
    times = []
    for i in range(n):
        times.append(once())
        print(f"run {i + 1}: {times[-1]:.2f} s (load {os.getloadavg()[0]:.2f})", flush=True)
    print(f"median launch to first step: {statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f})")


if __name__ == "__main__":
    main()
