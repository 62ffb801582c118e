"""The benchmark harness: interleaved repetitions, medians, ratios, markdown tables, the machine.

Owns how psflow's benchmarks measure, so every script measures the same way. The rule it enforces:
things that are compared run side by side in one process tree, their repetitions interleaved
(A, B, B, A, A, B, ...) so that a burst of load from a neighbour hits all of them alike, and a result
is a median over repetitions and a ratio between cases, never an absolute figure on its own.

Invariants: a case is run ``reps`` times after ``warmup`` untimed runs; the order of the cases is
reversed every other repetition; nothing here asserts on a timing.

Called by ``bench_transport.py``, ``bench_training.py`` and ``run_all.py`` (the scripts put this
directory on ``sys.path`` by being run as ``python benchmarks/<script>.py``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def interleaved(
    cases: Mapping[str, Callable[[], T]], reps: int, *, warmup: int = 1, progress: bool = True
) -> dict[str, list[T]]:
    """Run every case ``reps`` times, interleaved, and return each case's results in run order.

    Args:
        cases: name -> a callable that runs the case once and returns its measurement.
        reps: timed repetitions of each case.
        warmup: untimed runs of each case first (connections, page faults, caches).
        progress: print one line per repetition to stderr.

    Returns:
        name -> the ``reps`` measurements.

    Example:
        >>> res = interleaved({"a": lambda: 1.0, "b": lambda: 2.0}, reps=3, warmup=0, progress=False)
        >>> res["b"]
        [2.0, 2.0, 2.0]
    """
    names = list(cases)
    for _ in range(warmup):
        for name in names:
            cases[name]()
    out: dict[str, list[T]] = {name: [] for name in names}
    for r in range(reps):
        # Alternate the order so neither case always runs right after the other's warm cache.
        for name in names if r % 2 == 0 else reversed(names):
            out[name].append(cases[name]())
        if progress:
            log(f"  rep {r + 1}/{reps} done")
    return out


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (NaN when empty)."""
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float], fmt: str = ".3g") -> str:
    """``min-max`` of the values (each formatted with ``fmt``), for showing the noise next to a median."""
    return f"{min(values):{fmt}}-{max(values):{fmt}}" if values else "-"


def time_each(fn: Callable[[], object], iters: int) -> float:
    """The median of ``iters`` calls of ``fn``, each timed alone: one repetition's figure that a
    burst of load from a neighbour during a few of the calls does not move."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table."""
    def cell(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    """One line describing where the figures were taken (they mean nothing without it)."""
    import torch

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"load average {load} at the start, Python {platform.python_version()}, torch {torch.__version__}, "
        f"commit {git_commit()}"
    )


def git_commit() -> str:
    """The checkout's short commit and whether it has local changes (read-only git calls)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha or 'unknown'}{' (with local changes)' if dirty else ''}"


def command_line() -> str:
    """The command that produced these figures, relative to the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script_s = str(script.relative_to(REPO))
    except ValueError:
        script_s = str(script)
    return " ".join([".venv/bin/python", script_s, *sys.argv[1:]])


def arg_parser(description: str) -> argparse.ArgumentParser:
    """The flags every benchmark script takes: ``--quick`` and ``--reps``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a ~1 minute smoke run (fewer repetitions, smaller work)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions of each case (default: the script's own; fewer with --quick)")
    return p


def reps_of(args: argparse.Namespace, full: int, quick: int) -> int:
    """The repetitions to run: ``--reps`` if given, else the full or quick default. Raises SystemExit on < 1."""
    reps = args.reps if args.reps is not None else (quick if args.quick else full)
    if reps < 1:
        raise SystemExit(f"--reps must be at least 1; received {reps}.")
    return reps


def log(message: str) -> None:
    """Progress goes to stderr; stdout carries only the markdown report."""
    print(message, file=sys.stderr, flush=True)
