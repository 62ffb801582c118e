"""Visits per batch of a finished ``psflow chaos`` run, worker by worker, from what the run left in LOGDIR.

``psflow chaos`` compares the batches shard 0 applied with the fault-free run's (a count). This
script checks each worker's shard itself, batch by batch of its order, across its attempts:

- each attempt's pushes applied on shard 0 (``chaos.json``'s ledger rows: ``applied``, and ``sent``;
  ``applied > sent`` would be a push applied twice);
- where each restarted attempt resumed its data (its log's ``resuming its data at epoch E, batch B``
  lines, in attempt order; an attempt killed before it was ready prints none and applied nothing);
- the worker's final data position in the final checkpoint's manifest (``meta.data_position``: the
  position shard 0 recorded with the worker's last applied gradient; with ``num_examples`` and
  ``batch_size``, the batches per epoch).

A worker's batches were applied exactly once when every resume position is the count of batches its
earlier attempts had applied (a restart neither skipped nor repeated a batch), and its final position
(``epochs x batches per epoch``: the shard's end) equals its total applied (each applied push moved
the position by one batch). Async mode (each worker's pushes go one at a time, in order).

Run: ``.venv/bin/python benchmarks/chaos_visits.py LOGDIR`` (after ``psflow chaos ... --logdir LOGDIR``).
Prints a markdown table; exits 1 if a worker's batches were not each applied once.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from psflow import checkpoint
from psflow.rundir import RunDir

RESUME = re.compile(r"resuming its data at epoch (\d+), batch (\d+)")


def worker_visits(logdir: Path) -> list[dict[str, Any]]:
    """One row per worker task: its attempts' applied pushes, resume positions and final position, and the verdict."""
    report = json.loads((logdir / "chaos.json").read_text())
    ckpt = checkpoint.latest_checkpoint(RunDir(logdir).checkpoints)
    if ckpt is None:
        raise SystemExit(f"no whole checkpoint under {logdir / 'checkpoints'}: the final data positions are in it")
    positions: dict[str, Any] = ckpt.meta.get("data_position") or {}
    rows = []
    for task, pos in sorted(positions.items()):
        per_epoch = math.ceil(int(pos["num_examples"]) / int(pos["batch_size"]))
        final = int(pos["epoch"]) * per_epoch + int(pos["batch_index"])
        attempts = sorted((r for r in report["ledger"]["attempts"] if r["task"] == task), key=lambda r: r["attempt"])
        applied = [int(r["applied"]) for r in attempts]
        twice = sum(max(0, int(r["applied"]) - int(r["sent"])) for r in attempts)
        log = RunDir(logdir).log(task).read_text(errors="replace")
        resumed = [int(e) * per_epoch + int(b) for e, b in RESUME.findall(log)]
        resumes_ok = _resumes_match(applied, resumed)
        ok = resumes_ok and final == sum(applied) and twice == 0
        rows.append({"task": task, "attempts": len(attempts), "applied": applied, "total": sum(applied), "final": final,
                     "per_epoch": per_epoch, "resumed": resumed, "twice": twice, "ok": ok})
    return rows


def _resumes_match(applied: list[int], resumed: list[int]) -> bool:
    """Whether the resume lines, in order, are where each restarted attempt had to resume: the batches its
    earlier attempts applied. An attempt that applied a batch after others had must have said where it
    resumed; one killed before it was ready may not have (it applied nothing)."""
    # Attempts that followed ones which applied nothing resume at the same place: one group per place.
    groups: list[tuple[int, int, bool]] = []  # (place, attempts, whether one of them applied a batch)
    for k in range(1, len(applied)):
        before = sum(applied[:k])
        if before == 0:
            continue  # nothing applied yet: it starts at the shard's beginning, silently
        if groups and groups[-1][0] == before:
            place, n, any_applied = groups[-1]
            groups[-1] = (place, n + 1, any_applied or applied[k] > 0)
        else:
            groups.append((before, 1, applied[k] > 0))
    i = 0
    for place, n, any_applied in groups:
        lines = 0
        while i < len(resumed) and resumed[i] == place:
            i, lines = i + 1, lines + 1
        if lines > n or (any_applied and lines == 0):
            return False  # a line too many here, or batches applied without resuming where the others ended
    return i == len(resumed)  # every line belongs to an attempt


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: chaos_visits.py LOGDIR (the --logdir of a finished psflow chaos run)")
    rows = worker_visits(Path(sys.argv[1]))
    print("| worker | attempts | applied per attempt | total applied | final position (batches) | resumed at (batches) "
          "| applied twice | each batch once |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['attempts']} | {' + '.join(map(str, r['applied']))} | {r['total']} | {r['final']} "
              f"({r['final'] // r['per_epoch']} epochs x {r['per_epoch']}) | {', '.join(map(str, r['resumed'])) or '-'} "
              f"| {r['twice']} | {'yes' if r['ok'] else 'NO'} |")
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
