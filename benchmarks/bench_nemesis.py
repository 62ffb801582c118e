"""Nemesis benchmark (issue 22): a long `psflow chaos` run against every task, ps copies included, and
what it lost, counted from the run's own ledgers.

1. **nemesis**: the softmax (``examples/mnist_softmax.py``, async), 2 ps with a backup each and 3
   workers, under ``psflow chaos --kinds kill=1,stop=1,partition=1 --targets chief,worker,ps --every
   15 --stall 2-9`` (a SIGKILL, a SIGSTOP of 2-9 s, or a ps cut off from the other ps for 2-9 s, every
   15 s, on any task) for ``--for`` seconds (600 by default), with a fault-free baseline of the same
   epochs first. From ``chaos.json`` and ``summary.json``: acknowledged updates lost (the workers'
   push ledgers against every shard's serving copy), updates applied twice (any shard or copy above
   the baseline's batches), whether every copy of every shard agrees, and the accuracy against the
   baseline (goal: within 0.5 point). Goodput with a fault a minute is ``bench_goodput.py``'s.

Run: ``.venv/bin/python benchmarks/bench_nemesis.py [--for S] [--seed N] [--epochs N] [--pipeline]``. Not part of
``make bench`` (twice ``--for`` and more).
The markdown report goes to stdout, progress to stderr. Nothing here asserts on a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness

SOFTMAX = str(harness.REPO / "examples" / "mnist_softmax.py")
STEPS_PER_EPOCH = 600  # 60,000 examples in batches of 100, over every worker's shard


def chaos(logdir: Path, seconds: float, epochs: int, seed: int, *args: str) -> tuple[dict[str, Any], dict[str, Any], float]:
    cmd = [str(harness.REPO / ".venv" / "bin" / "psflow"), "chaos", "--ps", "2", "--ps-replicas", "2", "--workers", "3",
           "--for", f"{seconds:g}", "--seed", str(seed), "--baseline", "--logdir", str(logdir), "--no-live", *args,
           SOFTMAX, "--", "--epochs", str(epochs), "--init", "zeros"]
    harness.log(" ".join(cmd[1:]))
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=6 * seconds + 900)
    wall = time.monotonic() - t0
    if not (logdir / "chaos.json").exists():
        raise SystemExit(f"psflow chaos wrote no report (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads((logdir / "chaos.json").read_text()), json.loads((logdir / "summary.json").read_text()), wall


def copies_row(summary: dict[str, Any], base_batches: int | None) -> tuple[str, int]:
    """Every copy of every shard: 'shard s: version/applied per copy', and the updates above the baseline's."""
    copies = (summary.get("ledger") or {}).get("copies") or []
    twice = sum(max(0, int(c.get("applied", 0)) - base_batches) for c in copies) if base_batches else 0
    text = "; ".join(f"{c['task']} shard {c['shard']} {c['role']} {c.get('applied')}" for c in copies)
    return text, twice


def main() -> None:
    p = harness.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--for", dest="seconds", type=float, default=600.0, help="seconds of faults (600)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--epochs", type=int, default=None, help="the job's epochs (default: enough to outlast --for)")
    p.add_argument("--pipeline", action="store_true",
                   help="the workers run --pipeline (two pushes in flight per connection when a fault lands)")
    args = p.parse_args()
    # About 1,000 replicated steps a second on two cores: enough epochs that faults run for --for.
    epochs = args.epochs or max(4, int(args.seconds * 1000 / STEPS_PER_EPOCH) + 2)
    print(f"## nemesis\n\n{harness.machine()}\n\n`{harness.command_line()}`\n")
    rows = []
    with tempfile.TemporaryDirectory(prefix="psflow-bench-nemesis-") as tmp_s:
        tmp = Path(tmp_s)
        for part, extra in (("nemesis", ("--kinds", "kill=1,stop=1,partition=1", "--targets", "chief,worker,ps",
                                         "--every", "15", "--stall", "2-9",
                                         *(["--pipeline"] if args.pipeline else []))),):
            load = "/".join(f"{x:.1f}" for x in os.getloadavg())
            report, summary, wall = chaos(tmp / part, args.seconds, epochs, args.seed, *extra)
            base = report.get("baseline") or {}
            copies, twice = copies_row(summary, base.get("batches_applied"))
            led = report["ledger"]
            rows.append([part, report["status"], f"{report['faults']['injected']} ({report['faults']['by_kind']})",
                         report["faults"]["survived"], led["lost"], twice, "yes" if (summary.get("ledger") or {}).get("agree")
                         else "NO", report.get("visits_per_batch", "-"), report.get("test_accuracy"),
                         base.get("test_accuracy"), report.get("accuracy_delta"), report.get("goodput_ratio"),
                         f"{wall:.0f}", load])
            harness.log(f"{part}: {copies}")
    print(f"### `psflow chaos` on the softmax, 2 ps x 2 copies + 3 workers{' (--pipeline)' if args.pipeline else ''}, "
          f"{args.seconds:g} s of faults, "
          f"{epochs} epochs, seed {args.seed}\n")
    print(harness.md_table(["part", "status", "faults", "survived", "acknowledged lost", "applied twice",
                            "every copy agrees", "batches", "accuracy", "baseline accuracy", "delta",
                            "goodput (steps/s vs baseline)", "wall s (both runs)", "load average at start"], rows))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
