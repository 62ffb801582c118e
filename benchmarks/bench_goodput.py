"""Goodput benchmark (issue 10): useful steps per second with a fault every 60 s against fault-free.

The job: 2 ps replicated (``--ps-replicas 2``) + 3 workers, async, on the MNIST CNN
(``examples/mnist_cnn.py``, the default) or the seed's softmax (``--job softmax``). Each round runs it
twice through the same ``psflow chaos`` command (the same launcher, restart policy, push ledger and
injector), in an order reversed every other round:

- **faulted**: ``--every 60`` (default) with faults during ``--window`` seconds from the job's first
  step: kills and stops (``--kinds kill=3,stop=1``) of a random chief, worker or ps task (ps
  primaries included). The window must end before the job's training does: a chief killed after the
  ps exited (in its final evaluation) cannot be restarted into the job (its restarts cannot reach the
  ps; seen here with faults for as long as the job ran: the run never ended);
- **fault-free**: the same command with ``--for`` shorter than ``--every``, so that no fault falls due.

Goodput of a run: the batches its shard 0 applied (useful steps: every batch of every epoch applied
exactly once, so the same in both runs; the benchmark checks it) over its wall time (``summary.json``'s ``wall_s``: from the
launch to the last task's exit, start-up and the chief's final evaluation included). The figure is
the ratio faulted / fault-free per round, and of the medians (goal: >= 0.90). Every faulted run's
ledger (acknowledged updates lost: must be 0) and faults are reported with it.

Run: ``.venv/bin/python benchmarks/bench_goodput.py [--quick] [--reps ROUNDS] [--job cnn|softmax]
[--every S] [--epochs N]``. Not part of ``make bench`` (a CNN round is 10-20 minutes on 2 shared
cores). The markdown report goes to stdout, progress to stderr. Nothing here asserts on a timing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import harness
from harness import REPO, log, md_table, median

PSFLOW = str(REPO / ".venv" / "bin" / "psflow")
CHILD_TIMEOUT_S = 3600
# job -> (script, its arguments less --epochs, default epochs)
JOBS: dict[str, tuple[str, list[str], int]] = {
    "cnn": ("examples/mnist_cnn.py", ["--log_every", "100"], 1),
    "softmax": ("examples/mnist_softmax.py", ["--init", "zeros", "--print_every", "1000"], 120),
}


def one_run(tmp: Path, name: str, job: str, epochs: int, every_s: float, window_s: float, faulted: bool,
            seed: int) -> dict[str, Any]:
    """One ``psflow chaos`` run of the job; its figures from ``chaos.json``."""
    script, script_args, _ = JOBS[job]
    logdir = tmp / name
    shutil.rmtree(logdir, ignore_errors=True)
    window = f"{window_s:g}s" if faulted else f"{every_s / 2:g}s"  # fault-free: no fault falls due
    cmd = [PSFLOW, "chaos", "--ps", "2", "--ps-replicas", "2", "--workers", "3", "--every", f"{every_s:g}", "--for", window,
           "--kinds", "kill=3,stop=1", "--seed", str(seed), "--logdir", str(logdir), "--no-live",
           script, "--", "--epochs", str(epochs), *script_args]
    load_at = "/".join(f"{x:.1f}" for x in os.getloadavg())
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: {' '.join(cmd)} failed with exit code {proc.returncode}:\n{proc.stdout[-4000:]}")
    report = json.loads((logdir / "chaos.json").read_text())
    faults = report["faults"]
    return {"name": name, "faulted": faulted, "load": load_at, "global_step": int(report["global_step"]),
            "wall_s": float(report["wall_s"]), "rate": int(report["batches_applied"]) / float(report["wall_s"]),
            "faults": faults["injected"], "by_kind": faults["by_kind"], "survived": faults["survived"],
            "restarts": {t: n for t, n in report["restarts"].items() if n}, "lost": report["ledger"]["lost"],
            "redone": report["steps_redone"], "batches": report["batches_applied"], "accuracy": report["test_accuracy"]}


def main() -> None:
    p = harness.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--job", choices=sorted(JOBS), default="cnn", help="the job (default cnn)")
    p.add_argument("--every", type=float, default=60.0, help="seconds between faults in the faulted runs (default 60)")
    p.add_argument("--epochs", type=int, default=None, help="the job's epochs (default: cnn 1, softmax 120)")
    p.add_argument("--window", type=float, default=200.0, help="seconds of faults from the job's first step; must end "
                   "before its training does (default 200: the CNN's epoch takes ~5 minutes on 2 loaded cores)")
    p.add_argument("--seed", type=int, default=60, help="the faulted runs' chaos seed (round r uses seed + r)")
    args = p.parse_args()
    rounds = harness.reps_of(args, full=2, quick=1)
    epochs = args.epochs if args.epochs is not None else JOBS[args.job][2]
    print(f"## goodput\n\n{harness.machine()}\n\n`{harness.command_line()}`\n")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="psflow-bench-goodput-") as tmp_s:
        tmp = Path(tmp_s)
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for faulted in order:
                name = f"{'faulted' if faulted else 'fault-free'}-{r}"
                log(f"== round {r + 1}/{rounds}: {name} ({args.job}, {epochs} epoch(s))")
                res = one_run(tmp, name, args.job, epochs, args.every, args.window, faulted, args.seed + r)
                res["round"] = r
                runs.append(res)
                log(f"  {name}: {res['batches']} batches in {res['wall_s']:.1f} s = {res['rate']:.2f} steps/s; "
                    f"{res['faults']} faults, lost {res['lost']}, load {res['load']}")
    free = [x for x in runs if not x["faulted"]]
    hit = [x for x in runs if x["faulted"]]
    batches = {x["batches"] for x in runs}
    print(f"### Goodput ({args.job}, {epochs} epoch(s), 2 ps replicated + 3 workers, async; a fault every "
          f"{args.every:g} s for {args.window:g} s: kill=3,stop=1 of chief, worker or ps; {rounds} round(s), order "
          "reversed every other round)\n")
    rows = [[x["round"] + 1, x["name"].rsplit("-", 1)[0], x["global_step"], f"{x['wall_s']:.1f}", f"{x['rate']:.3f}",
             f"{x['faults']} ({', '.join(f'{n} {k}' for k, n in sorted(x['by_kind'].items())) or 'none'})",
             ", ".join(f"{t} {n}" for t, n in sorted(x["restarts"].items())) or "none",
             x["lost"], x["redone"], x["batches"], "-" if x["accuracy"] is None else f"{x['accuracy']:.4f}", x["load"]]
            for x in runs]
    print(md_table(["round", "run", "global step", "wall s", "useful steps/s", "faults", "restarts", "acknowledged lost",
                    "steps redone", "batches on shard 0", "test accuracy", "load average at its start"], rows) + "\n")
    ratios = []
    for r in range(rounds):
        a = next(x for x in hit if x["round"] == r)
        b = next(x for x in free if x["round"] == r)
        ratios.append(a["rate"] / b["rate"])
    ratio_of_medians = median([x["rate"] for x in hit]) / median([x["rate"] for x in free])
    print(md_table(["figure", "value"], [
        ["goodput ratio per round (faulted / fault-free steps per second)", ", ".join(f"{v:.3f}" for v in ratios)],
        ["ratio of the medians (goal >= 0.90)", f"{ratio_of_medians:.3f}"],
        ["the same batches applied in every run (each batch once)", "yes" if len(batches) == 1 else f"no: {sorted(batches)}"],
        ["acknowledged updates lost in the faulted runs", sum(int(x["lost"] or 0) for x in hit)],
    ]) + "\n")


if __name__ == "__main__":
    main()
