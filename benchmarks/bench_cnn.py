"""CNN benchmark: the third seed's convolutional network on psflow and on PyTorch's own ways.

Every configuration trains the same network (``examples/mnist_cnn.py``: conv 5x5x32, pool, conv
5x5x64, pool, fc 512, fc 10), batch 100 per process, Adam lr 1e-3, and is timed by the same loop
(``scripts/cnn_steps.py``): ``warmup`` untimed steps, then ``steps`` timed steps per process;
examples/sec = the examples of every process / the wall-clock span from the first process's
window start to the last one's end (process start-up, imports and the first connections are
outside the window).

Throughput (the configurations run in interleaved rounds, order reversed every other round):

1. PyTorch single process, ``torch.set_num_threads(2)``, a plain ``torch.optim.Adam`` loop (the
   reference), and the same with 1 thread (context: on 2 cores shared with other jobs, two intra-op
   threads often run slower than one);
2. psflow async, 1 ps + 2 workers (``psflow run --ps 1 --workers 2``);
3. psflow sync, N = M = 2 (``--mode sync``);
4. psflow all-reduce, 2 workers (``--strategy allreduce --workers 2``);
5. raw DDP (gloo), 2 processes via ``torch.multiprocessing``, no psflow.

psflow workers and DDP ranks use one torch thread each (the example's default; 2 cores).

Slow worker: 3 workers, ``worker:2`` slowed by ``--fail-at worker:2@step=0:delay=D`` (it sleeps D
seconds before each of its steps). D defaults to twice the per-worker median step time of the sync
N = M = 2 rounds above (the same contention as the two fast workers here: two busy workers and a
ps on the machine's cores), so the slow worker's step takes about three of the others'; the report
gives the slowdown actually measured (it moves with the machine's load; ``--delay`` fixes D). Compared, interleaved: sync with
one backup worker (``--replicas-to-aggregate 2 --total-num-replicas 3``) against sync without
(N = M = 3). Measured: the chief's time from global step ``start`` to global step ``target`` (a
fixed number of steps, not time to 0.98: that takes several minutes per run on 2 shared cores),
and the test accuracy of the parameters at ``target``.

Run: ``.venv/bin/python benchmarks/bench_cnn.py [--quick]``. The markdown report goes to stdout,
progress to stderr. Nothing here asserts on a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import torch
from harness import REPO, log, md_table, median

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import cnn_steps  # the shared measuring loop (a sibling directory, not a package)

TASK_SCRIPT = "benchmarks/scripts/cnn_steps.py"
CHILD_TIMEOUT_S = 300
# Orientation figures from the issue (TensorFlow 1.x / PyTorch on the issue author's machine): NOT measured here.
ISSUE_SINGLE_EX_PER_SEC = 1_007
ISSUE_DDP_EX_PER_SEC = 1_010
ISSUE_TF_ASYNC_EX_PER_SEC = 784

SINGLE = "PyTorch single process, 2 threads (reference)"
SINGLE1 = "PyTorch single process, 1 thread"
ASYNC = "psflow async, 1 ps + 2 workers"
SYNC = "psflow sync, N = M = 2"
ALLREDUCE = "psflow all-reduce, 2 workers"
DDP = "raw DDP (gloo), 2 processes"
NO_BACKUP = "sync N = M = 3 (no backup)"
BACKUP = "sync N = 2 of M = 3 (1 backup)"


# --------------------------------------------------------------------------- psflow through the launcher


def psflow_run(launch: list[str], script_args: list[str], workdir: Path, *, fail_at: str | None = None) -> dict[str, Any]:
    """One ``psflow run`` of the task script; returns ``{task: its bench report}`` and the wall time."""
    logdir = Path(tempfile.mkdtemp(prefix="psflow-cnn-", dir=workdir))
    exe = Path(sys.executable).with_name("psflow")
    cmd = [str(exe), "run", *launch, "--logdir", str(logdir)]
    if fail_at:
        cmd += ["--fail-at", fail_at]
    cmd += [TASK_SCRIPT, "--", *script_args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    summary_path = logdir / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"`{' '.join(cmd)}` failed with code {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    s = json.loads(summary_path.read_text())
    shutil.rmtree(logdir, ignore_errors=True)
    benches = {t: r["bench"] for t, r in s["reports"].items() if isinstance(r.get("bench"), dict)}
    return {"workers": benches, "wall_s": float(s["wall_s"])}


def throughput(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Two figures from the processes' timed windows.

    ``examples_per_sec``: examples of every process / the span from the first window's start to the
    last one's end (what the job delivered). ``median_step_ex_per_sec``: the sum over processes of
    batch / median step time (the processes run concurrently, so their rates add up; robust to a
    neighbour's burst of load during a few steps).
    """
    span = max(w["end_unix"] for w in windows) - min(w["start_unix"] for w in windows)
    examples = sum(w["examples"] for w in windows)
    return {
        "examples_per_sec": examples / span,
        "median_step_ex_per_sec": sum(w["examples"] / w["steps"] / w["median_step_s"] for w in windows),
        "per_worker_step_s": median([w["median_step_s"] for w in windows]),
    }


def psflow_throughput(launch: list[str], warmup: int, steps: int, workdir: Path) -> dict[str, Any]:
    """One throughput run of the task script under ``psflow run LAUNCH``; see :func:`throughput`."""
    run = psflow_run(launch, ["--warmup", str(warmup), "--steps", str(steps)], workdir)
    return throughput(list(run["workers"].values()))


# --------------------------------------------------------------------------- baselines (child processes)


def child_single(warmup: int, steps: int, threads: int = 2) -> dict[str, Any]:
    """Single-process PyTorch, ``threads`` intra-op threads, a plain torch.optim.Adam loop."""
    import psflow as pf

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    model = cnn_steps.cnn()
    opt = torch.optim.Adam(model.parameters(), lr=cnn_steps.LR)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = cnn_steps.loss_fn(model, x, y)
        loss.backward()
        opt.step()
        return loss.item()

    batches = pf.data.mnist("train", flatten=False).batches(cnn_steps.BATCH, epochs=cnn_steps.EPOCHS, seed=0)
    return throughput([cnn_steps.timed_steps(step, batches, warmup, steps)])


def _ddp_rank(rank: int, init_file: str, out_dir: str, warmup: int, steps: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import psflow as pf

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model = DistributedDataParallel(cnn_steps.cnn())
    opt = torch.optim.Adam(model.parameters(), lr=cnn_steps.LR)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = cnn_steps.loss_fn(model, x, y)
        loss.backward()
        opt.step()
        return loss.item()

    train = pf.data.mnist("train", flatten=False).shard(rank, 2)
    window = cnn_steps.timed_steps(step, train.batches(cnn_steps.BATCH, epochs=cnn_steps.EPOCHS, seed=rank), warmup, steps)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(window))
    dist.destroy_process_group()


def child_ddp(warmup: int, steps: int) -> dict[str, Any]:
    """Raw DDP: 2 spawned ranks (gloo, file rendezvous), 1 thread each, each its half of the data."""
    import torch.multiprocessing as tmp

    with tempfile.TemporaryDirectory(prefix="psflow-bench-ddp-") as d:
        tmp.spawn(_ddp_rank, args=(os.path.join(d, "rendezvous"), d, warmup, steps), nprocs=2)
        windows = [json.loads(p.read_text()) for p in sorted(Path(d).glob("*.json"))]
    return throughput(windows)


CHILDREN: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "single": child_single,
    "single1": lambda warmup, steps: child_single(warmup, steps, threads=1),
    "ddp": child_ddp,
}


def baseline_run(kind: str, warmup: int, steps: int, workdir: Path) -> dict[str, Any]:
    """Run one baseline in a fresh process (each configuration starts from the same state)."""
    out = workdir / f"{kind}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind,
           "--warmup", str(warmup), "--steps", str(steps), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"baseline {kind} failed with code {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


# --------------------------------------------------------------------------- the slow worker


def slow_worker_run(backup: bool, delay_s: float, start: int, target: int, test_examples: int, workdir: Path) -> dict[str, Any]:
    """3 workers, worker:2 delayed; returns the chief's time start -> target, accuracy, slowdown."""
    launch = ["--ps", "1", "--workers", "3", "--mode", "sync"]
    if backup:
        launch += ["--replicas-to-aggregate", "2", "--total-num-replicas", "3"]
    args = ["--target_step", str(target), "--start_step", str(start), "--test_examples", str(test_examples)]
    run = psflow_run(launch, args, workdir, fail_at=f"worker:2@step=0:delay={delay_s:.3f}")
    w = run["workers"]
    fast = median([w[t]["median_step_s"] for t in ("worker:0", "worker:1")])
    return {
        "time_s": float(w["worker:0"]["time_s"]),
        "test_accuracy": float(w["worker:0"]["test_accuracy"]),
        "global_step": int(w["worker:0"]["global_step"]),
        "slow_steps": int(w["worker:2"]["local_steps"]),
        "slowdown": w["worker:2"]["median_step_s"] / fast,
        "wall_s": run["wall_s"],
    }


def logged(name: str, fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """``fn`` that also logs its figure and its cost in wall time to stderr."""
    def run() -> dict[str, Any]:
        t0 = time.monotonic()
        r = fn()
        figure = r.get("examples_per_sec", r.get("time_s"))
        log(f"  {name}: {figure:,.1f} ({time.monotonic() - t0:.0f} s)")
        return r

    return run


# --------------------------------------------------------------------------- the report


def report(
    res: dict[str, list[dict[str, Any]]], slow: dict[str, list[dict[str, Any]]], settings: dict[str, Any], header: str
) -> str:
    """The markdown report: throughput table and ratios, then the slow-worker table (if it ran)."""
    eps = {name: median([r["examples_per_sec"] for r in runs]) for name, runs in res.items()}
    med = {name: median([r["median_step_ex_per_sec"] for r in runs]) for name, runs in res.items()}
    rows = [
        [name, f"{eps[name]:,.0f}", harness.spread([r["examples_per_sec"] for r in runs], ",.0f"), f"{med[name]:,.0f}",
         f"{median([r['per_worker_step_s'] for r in runs]) * 1000:.0f}", f"{eps[name] / eps[SINGLE]:.2f}",
         f"{eps[name] / eps[SINGLE1]:.2f}"]
        for name, runs in res.items()
    ]

    def ratio(label: str, a: str, b: str, target: str) -> list[str]:
        return [label, f"{eps[a] / eps[b]:.2f}", f"{med[a] / med[b]:.2f}", target]

    ratios = [
        ratio("psflow async / single process (2 threads)", ASYNC, SINGLE, ">= 0.90"),
        ratio("psflow sync / single process (2 threads)", SYNC, SINGLE, ">= 0.90"),
        ratio("psflow all-reduce / raw DDP", ALLREDUCE, DDP, "0.95 - 1.05"),
        ratio("psflow async / raw DDP", ASYNC, DDP, "(context: cost beyond splitting into 2 processes)"),
        ratio("psflow sync / raw DDP", SYNC, DDP, "(context)"),
        ratio("psflow async / single process (1 thread)", ASYNC, SINGLE1, "(context)"),
        ratio("psflow sync / single process (1 thread)", SYNC, SINGLE1, "(context)"),
        ratio("raw DDP / single process (2 threads)", DDP, SINGLE, "(context)"),
    ]
    lines = [
        "## CNN (third seed): examples/sec",
        "",
        f"`{harness.command_line()}`  ",
        header,
        "",
        (f"{settings['reps']} interleaved round(s); per process {settings['warmup']} warm-up + {settings['steps']} timed "
        "steps of batch 100; Adam lr 1e-3, "
        "no schedule, no moving averages; psflow workers and DDP ranks 1 torch thread each. examples/sec = examples of "
        "every process / span from the first timed step's start to the last one's end; \"median step\" = sum over "
        "processes of 100 / the process's median step time (robust to a neighbour's burst of load); medians over rounds."),
        "",
        md_table(["configuration", "examples/sec", "spread", "ex/s (median step)", "median ms/step per process",
                  "vs single 2 threads", "vs single 1 thread"], rows),
        "",
        md_table(["ratio (same run)", "examples/sec", "median step", "target"], ratios),
        "",
        (f"Orientation, from the issue, NOT measured here (another machine): PyTorch single process ~{ISSUE_SINGLE_EX_PER_SEC:,} "
        f"ex/s, DDP ~{ISSUE_DDP_EX_PER_SEC:,}, TensorFlow 1.x runtime async 1 ps + 2 workers ~{ISSUE_TF_ASYNC_EX_PER_SEC:,}. "
        f"Measured psflow async / the issue's TF figure: {eps[ASYNC] / ISSUE_TF_ASYNC_EX_PER_SEC:.2f} (machines differ: "
        "read the ratios above, not this one)."),
        "",
    ]
    if slow:
        srows = []
        for name, runs in slow.items():
            srows.append([
                name, f"{median([r['time_s'] for r in runs]):.1f}", harness.spread([r["time_s"] for r in runs], ".1f"),
                f"{median([r['test_accuracy'] for r in runs]):.4f}", f"{median([r['slowdown'] for r in runs]):.1f}x",
                f"{median([r['slow_steps'] for r in runs]):.0f}", f"{median([r['wall_s'] for r in runs]):.1f}",
            ])
        t_no, t_yes = (median([r["time_s"] for r in slow[k]]) for k in (NO_BACKUP, BACKUP))
        lines += [
            "## Slow worker: sync with and without a backup worker (CNN, 3 workers + 1 ps)",
            "",
            (f"`worker:2` slowed by `--fail-at worker:2@step=0:delay={settings['delay_s']:.3f}` "
            f"({settings['delay_source']}). Measured: the chief's time from global step {settings['start']} to global "
            f"step {settings['target']} (a fixed number of steps, NOT time to 0.98 accuracy), and the test accuracy "
            f"of the parameters at step {settings['target']} on {settings['test_examples']:,} test images. "
            f"{settings['reps_slow']} interleaved round(s), medians."),
            "",
            md_table(["configuration", f"time to step {settings['target']} (s)", "spread", "test accuracy",
                      "slow worker step / fast", "slow worker's steps", "launcher wall (s)"], srows),
            "",
            (f"Backup worker speed-up (no-backup time / backup time): {t_no / t_yes:.2f}x. \"slow worker step / fast\": "
            "worker:2's median step time over workers 0-1's in the same run; without a backup every worker waits for "
            "worker:2 each step, so it reads ~1x there, and the backup run shows how much slower worker:2 is."),
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    """Parse the flags, run the interleaved rounds (or one ``--child`` baseline), print the report."""
    p = harness.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per process (default 10, quick 3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per process (default 40, quick 10)")
    p.add_argument("--delay", type=float, default=None, help="slow worker's delay per step, s (default: 2x the sync N = M = 2 step)")
    p.add_argument("--target-step", type=int, default=None, help="slow worker: global step to reach (default 60, quick 10)")
    p.add_argument("--no-slow-worker", action="store_true", help="skip the slow-worker comparison")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    steps = args.steps if args.steps is not None else (10 if args.quick else 40)
    if warmup < 0 or steps < 1:
        raise SystemExit(f"--warmup must be >= 0 and --steps >= 1; received {warmup} and {steps}.")
    if args.child:
        Path(args.out).write_text(json.dumps(CHILDREN[args.child](warmup, steps)))
        return
    reps = harness.reps_of(args, full=2, quick=1)
    target = args.target_step if args.target_step is not None else (10 if args.quick else 60)
    start = 2 if args.quick else 5
    if target <= start:
        raise SystemExit(f"--target-step must be above {start} (the step the timing starts at); received {target}.")
    header = harness.machine()
    with tempfile.TemporaryDirectory(prefix="psflow-bench-cnn-") as d:
        workdir = Path(d)
        cases: dict[str, Callable[[], dict[str, Any]]] = {
            SINGLE: lambda: baseline_run("single", warmup, steps, workdir),
            SINGLE1: lambda: baseline_run("single1", warmup, steps, workdir),
            ASYNC: lambda: psflow_throughput(["--ps", "1", "--workers", "2"], warmup, steps, workdir),
            SYNC: lambda: psflow_throughput(["--ps", "1", "--workers", "2", "--mode", "sync"], warmup, steps, workdir),
            ALLREDUCE: lambda: psflow_throughput(["--strategy", "allreduce", "--workers", "2"], warmup, steps, workdir),
            DDP: lambda: baseline_run("ddp", warmup, steps, workdir),
        }
        log(f"cnn: {reps} interleaved round(s) of {len(cases)} configurations, {warmup} + {steps} steps each")
        res = harness.interleaved({k: logged(k, f) for k, f in cases.items()}, reps, warmup=0)
        slow: dict[str, list[dict[str, Any]]] = {}
        settings: dict[str, Any] = {"reps": reps, "warmup": warmup, "steps": steps}
        if not args.no_slow_worker:
            if args.delay is not None:
                delay_s, source = args.delay, "--delay"
            else:
                delay_s = 2 * median([r["per_worker_step_s"] for r in res[SYNC]])
                source = "2x the per-worker median step time of the sync N = M = 2 rounds"
            test_examples = 1000 if args.quick else 10000
            settings.update(delay_s=delay_s, delay_source=source, start=start, target=target,
                            test_examples=test_examples, reps_slow=reps)
            log(f"slow worker: delay {delay_s:.3f} s, global steps {start} -> {target}, {reps} round(s)")
            slow = harness.interleaved({
                NO_BACKUP: logged(NO_BACKUP, lambda: slow_worker_run(False, delay_s, start, target, test_examples, workdir)),
                BACKUP: logged(BACKUP, lambda: slow_worker_run(True, delay_s, start, target, test_examples, workdir)),
            }, reps, warmup=0)
    print(report(res, slow, settings, header))


if __name__ == "__main__":
    main()
