"""Placement benchmark: the seed's CNN on 1 ps against 2 ps, round-robin against the balanced default.

With ``--ps 2`` TensorFlow's round-robin puts every weight of the third seed's CNN on ps:0 and every
bias on ps:1 (6.65 MB against 2.5 KB), so the second ps idles; psflow's default (``balanced``)
cuts the model into two equal byte runs, splitting ``fc1.weight`` where the cut falls. This script
shows what that is worth: the same network, loop and figures as ``bench_cnn.py`` (its task script
``scripts/cnn_steps.py``: batch 100 per worker, Adam lr 1e-3, ``warmup`` untimed then ``steps``
timed steps per worker, examples/sec = examples of every worker / the span of their timed windows),
2 workers, in interleaved rounds (order reversed every other round):

1. 1 ps (``psflow run --ps 1 --workers 2``; placement is moot with one shard);
2. 2 ps, ``--placement round_robin`` (TensorFlow's layout);
3. 2 ps, ``--placement greedy`` with ``split_bytes`` 1 MiB (the task script's ``--split_bytes``):
   balanced by size, but sorted by size, so both shards hold conv parameters, whose gradients
   backward produces last: the alternative default, balanced without model order;
4. 2 ps, the default (``balanced``): model order cut in two equal byte runs, so ps:1 holds only
   the fc layers' gradients and can receive them while backward still runs through the convs;

in async mode and, unless ``--quick``, in sync mode (N = M = 2). Reported with each: the bytes each
ps holds (computed by the same ``place()`` the job runs, on the same model) and the share of a
worker's steps whose push to some shard left while backward was still running (the trainer's
``early_pushes`` / local steps: the overlap that model-order placement buys).

Run: ``.venv/bin/python benchmarks/bench_placement.py [--quick] [--reps N] [--steps S]``. The
markdown report goes to stdout, progress to stderr. Nothing here asserts on a timing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
from harness import REPO, log, md_table, median

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import cnn_steps  # the shared measuring loop and the example's CNN (a sibling directory, not a package)
from bench_cnn import throughput

from psflow.ps.placement import DEFAULT_STRATEGY, ParamInfo, place

TASK_SCRIPT = "benchmarks/scripts/cnn_steps.py"
CHILD_TIMEOUT_S = 300
ONE_PS = "1 ps"
ROUND_ROBIN = "2 ps, round_robin (TensorFlow's)"
GREEDY = "2 ps, greedy + split_bytes 1 MiB"
BALANCED = f"2 ps, {DEFAULT_STRATEGY} (default)"
GREEDY_SPLIT_BYTES = 1 << 20
# name -> (number of ps, --placement flag or None for the default, split_bytes or None)
CONFIGS: dict[str, tuple[int, str | None, int | None]] = {
    ONE_PS: (1, None, None), ROUND_ROBIN: (2, "round_robin", None), GREEDY: (2, "greedy", GREEDY_SPLIT_BYTES),
    BALANCED: (2, None, None),
}


def run_config(num_ps: int, placement: str | None, split_bytes: int | None, mode: str, warmup: int, steps: int,
               workdir: Path) -> dict[str, Any]:
    """One ``psflow run`` of the CNN task script; its throughput and the workers' early-push share."""
    logdir = Path(tempfile.mkdtemp(prefix="psflow-placement-", dir=workdir))
    cmd = [str(Path(sys.executable).with_name("psflow")), "run", "--no-live", "--ps", str(num_ps), "--workers", "2",
           "--mode", mode, "--logdir", str(logdir)]
    if placement:
        cmd += ["--placement", placement]
    cmd += [TASK_SCRIPT, "--", "--warmup", str(warmup), "--steps", str(steps)]
    if split_bytes is not None:
        cmd += ["--split_bytes", str(split_bytes)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    summary_path = logdir / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"`{' '.join(cmd)}` failed with code {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    reports = json.loads(summary_path.read_text())["reports"]
    shutil.rmtree(logdir, ignore_errors=True)
    workers = [r for r in reports.values() if isinstance(r.get("bench"), dict)]
    out = throughput([r["bench"] for r in workers])
    trainers = [r["trainer"] for r in workers if isinstance(r.get("trainer"), dict)]
    out["early_share"] = sum(t["early_pushes"] for t in trainers) / max(1, sum(t["local_step"] for t in trainers))
    return out


def shard_bytes(num_ps: int, placement: str | None, split_bytes: int | None) -> list[int]:
    """Bytes per ps of the CNN under this configuration: the job's own ``place()`` on the same model."""
    infos = ParamInfo.from_module(cnn_steps.cnn())
    return place(infos, num_ps, strategy=placement or DEFAULT_STRATEGY, split_bytes=split_bytes).shard_bytes()


def logged(name: str, fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """``fn`` that also logs its figure and its cost in wall time to stderr."""
    def run() -> dict[str, Any]:
        t0 = time.monotonic()
        r = fn()
        log(f"  {name}: {r['examples_per_sec']:,.1f} ex/s ({time.monotonic() - t0:.0f} s)")
        return r

    return run


def report(results: dict[str, dict[str, list[dict[str, Any]]]], settings: dict[str, Any], header: str) -> str:
    """The markdown report: one table per mode, then the ratios of the same run."""
    lines = [
        "## Placement: the CNN on 1 ps vs 2 ps, round_robin vs the balanced default",
        "",
        f"`{harness.command_line()}`  ",
        header,
        "",
        (f"{settings['reps']} interleaved round(s); 2 workers, 1 torch thread each; per worker {settings['warmup']} warm-up + "
         f"{settings['steps']} timed steps of batch 100; Adam lr 1e-3. examples/sec = examples of both workers / span of their "
         "timed windows; \"median step\" = sum over workers of 100 / the worker's median step time; medians over rounds. "
         "\"pushes during backward\": the share of a worker's steps in which a shard's gradients left before backward ended."),
        "",
    ]
    ratio_rows = []
    for mode, res in results.items():
        eps = {name: median([r["examples_per_sec"] for r in runs]) for name, runs in res.items()}
        rows = []
        for name, runs in res.items():
            loads = " / ".join(f"{b:,}" for b in shard_bytes(*CONFIGS[name]))
            rows.append([
                name, f"{eps[name]:,.0f}", harness.spread([r["examples_per_sec"] for r in runs], ",.0f"),
                f"{median([r['median_step_ex_per_sec'] for r in runs]):,.0f}",
                f"{median([r['per_worker_step_s'] for r in runs]) * 1000:.0f}", f"{eps[name] / eps[ONE_PS]:.2f}",
                loads, f"{median([r['early_share'] for r in runs]):.0%}",
            ])
        lines += [
            f"### {mode}",
            "",
            md_table(["configuration", "examples/sec", "spread", "ex/s (median step)", "median ms/step per worker",
                      "vs 1 ps", "bytes per ps (ps:0 / ps:1)", "pushes during backward"], rows),
            "",
        ]
        ratio_rows += [
            [f"{mode}: balanced 2 ps / round_robin 2 ps", f"{eps[BALANCED] / eps[ROUND_ROBIN]:.2f}"],
            [f"{mode}: balanced 2 ps / greedy + split 2 ps", f"{eps[BALANCED] / eps[GREEDY]:.2f}"],
            [f"{mode}: balanced 2 ps / 1 ps", f"{eps[BALANCED] / eps[ONE_PS]:.2f}"],
            [f"{mode}: round_robin 2 ps / 1 ps", f"{eps[ROUND_ROBIN] / eps[ONE_PS]:.2f}"],
        ]
    lines += [md_table(["ratio (same run, examples/sec)", "value"], ratio_rows), ""]
    return "\n".join(lines)


def main() -> None:
    """Parse the flags, run the interleaved rounds of each mode, print the report."""
    p = harness.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per worker (default 10, quick 3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per worker (default 40, quick 10)")
    p.add_argument("--modes", default=None, help="comma list of async,sync (default both; quick: async)")
    args = p.parse_args()
    warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    steps = args.steps if args.steps is not None else (10 if args.quick else 40)
    if warmup < 0 or steps < 1:
        raise SystemExit(f"--warmup must be >= 0 and --steps >= 1; received {warmup} and {steps}.")
    modes = [m.strip() for m in (args.modes or ("async" if args.quick else "async,sync")).split(",") if m.strip()]
    if not modes or set(modes) - {"async", "sync"}:
        raise SystemExit(f"--modes takes a comma list of async and sync; received {args.modes!r}.")
    reps = harness.reps_of(args, full=3, quick=1)
    header = harness.machine()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="psflow-bench-placement-") as d:
        workdir = Path(d)
        for mode in modes:
            log(f"placement, {mode}: {reps} interleaved round(s) of {len(CONFIGS)} configurations, {warmup} + {steps} steps")
            cases = {
                name: logged(name, lambda c=config, mode=mode: run_config(*c, mode, warmup, steps, workdir))
                for name, config in CONFIGS.items()
            }
            results[mode] = harness.interleaved(cases, reps, warmup=0)
    print(report(results, {"reps": reps, "warmup": warmup, "steps": steps}, header))


if __name__ == "__main__":
    main()
