"""Failover benchmark (issue 10): what a replica costs, and how soon the job steps again after a SIGKILL.

1. **Replication's cost**: the seed's softmax (``examples/mnist_softmax.py``, 2 ps + 2 workers) with
   ``--ps-replicas 2`` against without, async and sync (N = M = 2), in interleaved rounds (order
   reversed every other round); examples/sec from each run's ``summary.json``; the ratio of the
   medians (goal: >= 0.95).
2. **ps failover**: ``psflow chaos --ps 2 --ps-replicas 2 --workers 2 --targets ps --kinds kill``
   SIGKILLs a ps (primary of its own shard, backup of the other) every 2 seconds of training (a ps only
   once every ps has run ``settle_s``: the last one re-synced) under ``--restart on-failure
   --restart-backoff 0``, on ``scripts/failover_steps.py`` (every step's start and end on disk).
   Per kill: from the SIGKILL (the injector's clock) to the end of the first step any worker began
   after it: that step's push was acknowledged by every shard, the dead primary's through its backup
   (an upper bound: it includes that one step's own compute, about a millisecond). Goal: p99 <= 0.5 s.
   And per kill, the longest time in the 10 s after it without any worker finishing a step (a stall
   while the restarted ps loads the state would show here). Goal: no interval over 1 s.
3. **worker restart**: the same with ``--targets worker``: from the SIGKILL to the end of the
   restarted attempt's first step (process start, rendezvous, readiness, its data position, one
   step). Goal: p99 <= 1 s.

4. **Replication's cost on the CNN, with the CPU it takes** (``--parts cnncost``, not in the default
   parts: ~5 minutes): ``examples/mnist_cnn.py`` (Adam, 3.27M values) for 300 global steps, 2 ps + 2
   workers, ``--ps-replicas 1`` against ``2``, async and sync, interleaved rounds. Besides examples/sec,
   each run's busy CPU time over the whole machine (``/proc/stat``: every core's non-idle time, from
   the launch to the exit) and its idle share: on a machine with fewer cores than the job has busy
   processes, a ratio of busy CPU that matches the ratio of throughputs says the replica's cost is
   the CPU it takes (its receive and apply), not a wait.

Every chaos run also reports its ledger: acknowledged updates lost (must be 0).

Run: ``.venv/bin/python benchmarks/bench_failover.py [--quick] [--reps N] [--parts cost,ps,worker]
[--chaos-s S] [--epochs N]`` (``--parts``: which of cost, ps, worker and cnncost to run, the first three by default; ``--chaos-s``: seconds of
faults per chaos run, 90 by default, 30 with ``--quick``; ``--epochs``: of each replication-cost run, 3, 2 with ``--quick``). The markdown report goes
to stdout, progress to stderr. Nothing here asserts on a timing.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import harness
from harness import REPO, log, md_table, median

PSFLOW = str(REPO / ".venv" / "bin" / "psflow")
SOFTMAX = "examples/mnist_softmax.py"
STEPS_SCRIPT = "benchmarks/scripts/failover_steps.py"
CHILD_TIMEOUT_S = 900


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{proc.stdout[-4000:]}")


def throughput(tmp: Path, mode: str, replicas: int, epochs: int) -> tuple[float, float, float]:
    """One softmax run: (examples/sec, busy CPU core-seconds of the whole machine per 1,000 examples, idle share)."""
    logdir = tmp / f"{mode}-{replicas}"
    shutil.rmtree(logdir, ignore_errors=True)
    (all0, idle0) = cpu_ticks()
    run([PSFLOW, "run", "--ps", "2", "--workers", "2", "--ps-replicas", str(replicas), "--mode", mode, "--no-live",
         "--logdir", str(logdir), SOFTMAX, "--", "--epochs", str(epochs), "--init", "zeros", "--print_every", "1000"])
    (all1, idle1) = cpu_ticks()
    summary = json.loads((logdir / "summary.json").read_text())
    busy_s = ((all1 - all0) - (idle1 - idle0)) / os.sysconf("SC_CLK_TCK")
    examples = max(1, int(summary.get("global_step") or 1) * 100)
    return float(summary["examples_per_sec"]), busy_s * 1000 / examples, (idle1 - idle0) / max(1, all1 - all0)


def replication_cost(tmp: Path, reps: int, epochs: int) -> str:
    """The softmax with and without a backup per shard, and the cost split: the busy CPU per example
    (what the backup's receive and apply take from two shared cores) and the rest of the slowdown (the
    hop to the backup: latency, as a share of a step)."""
    cases = {f"{mode}, {r} cop{'ies' if r == 2 else 'y'}": (lambda mode=mode, r=r: throughput(tmp, mode, r, epochs))
             for mode in ("async", "sync") for r in (1, 2)}
    res = harness.interleaved(cases, reps, warmup=0)
    rows = []
    for mode in ("async", "sync"):
        one, two = res[f"{mode}, 1 copy"], res[f"{mode}, 2 copies"]
        eps1, eps2 = [e for e, _, _ in one], [e for e, _, _ in two]
        per_round = [b / a for a, b in zip(eps1, eps2)]  # the two runs of one round, side by side
        cpu1, cpu2 = median([c for _, c, _ in one]), median([c for _, c, _ in two])
        slowdown = median(eps1) / median(eps2)  # a step with a backup takes this many steps without
        latency_share = max(0.0, slowdown - cpu2 / cpu1) / slowdown  # what more CPU per example does not explain
        rows.append([mode, f"{median(eps1):,.0f} ({harness.spread(eps1, ',.0f')})",
                     f"{median(eps2):,.0f} ({harness.spread(eps2, ',.0f')})", f"{median(eps2) / median(eps1):.3f}",
                     f"{median(per_round):.3f} ({harness.spread(per_round, '.3f')})", f"{cpu1:.3f} / {cpu2:.3f}",
                     f"{median([i for _, _, i in one]):.0%} / {median([i for _, _, i in two]):.0%}",
                     f"{latency_share:.0%}"])
    return md_table(["mode", "--ps-replicas 1, examples/s (spread)", "--ps-replicas 2, examples/s (spread)",
                     "ratio of medians 2 / 1 (goal >= 0.95)", "per-round ratio, median (spread)",
                     "busy CPU core-s per 1,000 examples, 1 / 2 copies", "idle share 1 / 2",
                     "latency's share of a replicated step (goal < 10%)"], rows)


def cpu_ticks() -> tuple[int, int]:
    """The machine's (all, idle) CPU time in clock ticks since boot, summed over every core (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]  # idle + iowait


def cnn_run(tmp: Path, mode: str, replicas: int, steps: int) -> tuple[float, float, float]:
    """One CNN run: (examples/sec, busy CPU core-seconds of the whole machine, idle share)."""
    logdir = tmp / f"cnn-{mode}-{replicas}"
    shutil.rmtree(logdir, ignore_errors=True)
    (all0, idle0) = cpu_ticks()
    run([PSFLOW, "run", "--ps", "2", "--workers", "2", "--ps-replicas", str(replicas), "--mode", mode, "--no-live",
         "--logdir", str(logdir), "examples/mnist_cnn.py", "--", "--max_steps", str(steps), "--log_every", "1000",
         "--test_examples", "1000"])
    (all1, idle1) = cpu_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    eps = float(json.loads((logdir / "summary.json").read_text())["examples_per_sec"])
    return eps, ((all1 - all0) - (idle1 - idle0)) / hz, (idle1 - idle0) / max(1, all1 - all0)


def cnn_cost(tmp: Path, reps: int, steps: int) -> str:
    cases = {(mode, r): (lambda mode=mode, r=r: cnn_run(tmp, mode, r, steps)) for mode in ("async", "sync") for r in (1, 2)}
    res = harness.interleaved({f"{m} {r}": fn for (m, r), fn in cases.items()}, reps, warmup=0)
    rows = []
    for mode in ("async", "sync"):
        one, two = res[f"{mode} 1"], res[f"{mode} 2"]
        eps1, eps2 = median([e for e, _, _ in one]), median([e for e, _, _ in two])
        cpu1, cpu2 = median([c for _, c, _ in one]), median([c for _, c, _ in two])
        rows.append([mode, f"{eps1:,.0f}", f"{eps2:,.0f}", f"**{eps2 / eps1:.2f}**", f"{cpu1:.1f}", f"{cpu2:.1f}",
                     f"**{cpu1 / cpu2:.2f}**", f"{median([i for _, _, i in one]):.0%} / {median([i for _, _, i in two]):.0%}"])
    return md_table(["mode", "examples/s, 1 copy", "examples/s, 2 copies", "throughput 2 / 1 (goal >= 0.95)",
                     "busy CPU core-s, 1 copy", "busy CPU core-s, 2 copies", "busy CPU 1 / 2", "idle share 1 / 2"], rows)


def chaos(tmp: Path, name: str, targets: str, every_s: float, duration_s: float, epochs: int) -> tuple[dict[str, Any], Path]:
    logdir = tmp / name
    shutil.rmtree(logdir, ignore_errors=True)
    run([PSFLOW, "chaos", "--ps", "2", "--ps-replicas", "2", "--workers", "2", "--targets", targets, "--kinds", "kill",
         "--every", str(every_s), "--for", str(duration_s), "--seed", "1", "--restart-backoff", "0", "--max-restarts", "1000",
         "--no-live", "--logdir", str(logdir), STEPS_SCRIPT, "--", "--epochs", str(epochs)])
    return json.loads((logdir / "chaos.json").read_text()), logdir


def steps_of(logdir: Path) -> dict[tuple[str, int], list[tuple[float, float]]]:
    """(task, attempt) -> its completed steps' (start, end), from ``LOGDIR/steps``."""
    out = {}
    for path in (logdir / "steps").glob("*.*"):
        stem, _, attempt = path.name.rpartition(".")
        job, _, index = stem.rpartition("-")
        out[(f"{job}:{index}", int(attempt))] = [tuple(map(float, line.split())) for line in path.read_text().splitlines()
                                                 if len(line.split()) == 2]
    return out


def ps_recovery(report: dict[str, Any], steps: dict[tuple[str, int], list[tuple[float, float]]]) -> list[float]:
    """Per ps kill: the SIGKILL to the end of the first step any worker began after it."""
    out = []
    for f in report["faults"]["list"]:
        t = f["time_unix"]
        ends = [end for s in steps.values() for start, end in s if start >= t]
        if ends:
            out.append(min(ends) - t)
    return out


def longest_gaps(report: dict[str, Any], steps: dict[tuple[str, int], list[tuple[float, float]]],
                 window_s: float = 10.0) -> list[float]:
    """Per kill: the longest time without any worker finishing a step, from the SIGKILL through the
    ``window_s`` after it (the first step after it, and any stall later: a restarted copy loading
    the state while the serving one waits for it)."""
    out = []
    for f in report["faults"]["list"]:
        t = f["time_unix"]
        ends = sorted(end for s in steps.values() for _, end in s if t <= end <= t + window_s)
        if ends:
            out.append(max(b - a for a, b in zip([t, *ends], ends)))
    return out


def worker_recovery(report: dict[str, Any], steps: dict[tuple[str, int], list[tuple[float, float]]]) -> list[float]:
    """Per worker kill: the SIGKILL to the end of the restarted attempt's first step."""
    out = []
    for f in report["faults"]["list"]:
        nxt = steps.get((f["task"], f["attempt"] + 1))
        if nxt:
            out.append(nxt[0][1] - f["time_unix"])
    return out


def percentiles(values: list[float]) -> list[str]:
    if not values:
        return ["-"] * 4
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return [f"{statistics.median(values):.3f}", f"{q[98]:.3f}", f"{max(values):.3f}", str(len(values))]


def main() -> None:
    p = harness.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--parts", default="cost,ps,worker",
                   help="which parts to run, comma-separated: cost, ps, worker, cnncost (not in the default)")
    p.add_argument("--chaos-s", type=float, default=None, help="seconds of faults per chaos run (90; 30 with --quick)")
    p.add_argument("--epochs", type=int, default=None, help="epochs of each replication-cost run (3; 2 with --quick)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"cost", "ps", "worker", "cnncost"}:
        raise SystemExit(f"--parts takes cost, ps, worker and cnncost, comma-separated; received {args.parts!r}.")
    reps = harness.reps_of(args, full=3, quick=1)
    epochs = args.epochs if args.epochs is not None else (2 if args.quick else 3)
    if epochs < 1:
        raise SystemExit(f"--epochs must be at least 1; received {epochs}.")
    chaos_s = args.chaos_s if args.chaos_s is not None else (30.0 if args.quick else 90.0)
    chaos_epochs = int(chaos_s)
    print(f"## failover\n\n{harness.machine()}\n\n`{harness.command_line()}`\n")
    with tempfile.TemporaryDirectory(prefix="psflow-bench-failover-") as tmp_s:
        tmp = Path(tmp_s)
        if "cost" in parts:
            log(f"== replication cost: {reps} interleaved round(s), {epochs} epochs each")
            print(f"### Replication's cost (softmax, 2 ps + 2 workers, {epochs} epochs, {reps} interleaved rounds)\n")
            print(replication_cost(tmp, reps, epochs) + "\n")
        if "cnncost" in parts:
            steps = 100 if args.quick else 300
            log(f"== replication cost on the CNN: {reps} interleaved round(s), {steps} steps each")
            print(f"### Replication's cost on the CNN, with the CPU it takes (2 ps + 2 workers, Adam, {steps} global "
                  f"steps, {reps} interleaved rounds; medians)\n")
            print(cnn_cost(tmp, reps, steps) + "\n")
        rows, ledgers = [], []
        for name, targets, every, measure in (("ps failover (SIGKILL of a ps: primary of one shard, backup of the other)",
                                               "ps", 2.0, ps_recovery),
                                              ("worker restart (SIGKILL of a worker)", "worker", 2.0, worker_recovery)):
            if targets not in parts:
                continue
            log(f"== chaos: {name}, one kill every {every:g} s for {chaos_s:g} s")
            load = [f"{x:.1f}" for x in os.getloadavg()]
            report, logdir = chaos(tmp, targets, targets, every, chaos_s, chaos_epochs)
            steps = steps_of(logdir)
            gaps = percentiles(longest_gaps(report, steps))
            rows.append([name, *percentiles(measure(report, steps)), f"{gaps[1]} / {gaps[2]}", "/".join(load)])
            led = report["ledger"]
            ledgers.append([name, report["status"], report["faults"]["injected"], report["faults"]["survived"],
                            led["acknowledged"], led["applied"], led["lost"], led["unacknowledged"]])
        if not rows:
            return
        print(f"### Recovery after a SIGKILL (`psflow chaos`, softmax, 2 ps replicated + 2 workers, {chaos_s:g} s of faults)\n")
        print(md_table(["fault", "p50 s", "p99 s", "max s", "faults measured",
                        "longest time without a step in the 10 s after, p99 / max s", "load average at its start"], rows) + "\n")
        print(md_table(["run", "status", "faults", "survived", "acknowledged", "applied (shard 0)", "lost",
                        "applied, not acknowledged"], ledgers) + "\n")


if __name__ == "__main__":
    main()
