"""Dashboard and API latency over a big job store, and the cost of recording a run in the job store.

1. **API latency.** A job store with ``--runs`` runs (default 1,000: three tasks each, their attempts
   and events, a mix of states, a few live) and ``--points`` metric points (default 1,000,000,
   spread evenly over the runs), written straight into SQLite; a real ``psflow ui`` (uvicorn,
   127.0.0.1, port 0) over it, and the same server over a store of 10 runs. Each case is one HTTP
   request, timed from the client (httpx, keep-alive), its repetitions interleaved across the cases:
   the runs list (first page of 50; filtered by state; searched), a run's page (its record, tasks,
   attempts, events), its metric series, a task's log tail. Reported: p50 and p99 per case, and the
   big store's p50 over the small store's.
2. **Recording cost** (skipped with ``--quick``): the MNIST softmax, 1 ps + 2 workers, through the
   real launcher, with the job store (the default) and with the run's files only (the launcher as it
   was before the job store), interleaved; examples/sec from each run's summary and the ratio.

Run: ``.venv/bin/python benchmarks/bench_ui.py [--quick] [--runs N] [--points N] [--requests N]``.
Prints a markdown report on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness
from harness import REPO, log

TASKS = ["ps:0", "worker:0", "worker:1"]
NAMES = ["loss", "accuracy", "examples_per_sec", "global_step", "local_step"]
STATES = ["succeeded"] * 6 + ["failed"] * 2 + ["stopped"]


def build_store(home: Path, runs: int, points: int, *, live: int = 10) -> list[str]:
    """A job store of ``runs`` runs and ``points`` metric points; returns the run ids, newest first."""
    from psflow.launch.liveness import process_identity
    from psflow.platform.jobstore import JobStore

    rng = random.Random(0)
    me = process_identity(os.getpid())  # live runs' launcher: this process, so they read running
    t0 = time.time() - 86_400 * 30
    per_run = max(1, points // runs)
    per_series = max(1, per_run // (2 * len(NAMES)))
    ids = []
    with JobStore(home / "jobs.db") as db:
        for i in range(runs):
            run_id = f"2026{i:06d}-bench-{i:06d}"
            ids.append(run_id)
            created = t0 + i * 60
            state = "running" if i >= runs - live else rng.choice(STATES)
            with db.transaction():
                db.add_run({"id": run_id, "script": f"examples/{'mnist_softmax' if i % 2 else 'mnist_cnn'}.py",
                            "args": ["--epochs", str(i % 50 + 1)], "logdir": str(home / "runs" / run_id),
                            "cluster": {"ps": ["ps:0"], "worker": ["worker:0", "worker:1"]}, "mode": "async",
                            "strategy": "ps", "backend": "local", "restart_policy": {"kind": "on-failure"},
                            "launcher": me, "created_unix": created}, TASKS)
                for j, task in enumerate(TASKS):
                    db.task_started(run_id, task, 0, created + 1 + j, pid=None, scheduler_id=None, identity=None)
                    db.task_registered(run_id, task, f"127.0.0.1:{20000 + j}", created + 2)
                    db.add_event(run_id, "task_started", created + 1, {"task": task, "attempt": 0})
                    db.add_event(run_id, "task_registered", created + 2, {"task": task})
                rows = []
                for task in ("worker:0", "worker:1"):
                    for name in NAMES:
                        for k in range(per_series):
                            rows.append((run_id, task, name, created + 3 + k, k * 10, rng.random()))
                db.conn.executemany(  # type: ignore[union-attr]
                    "INSERT INTO metrics (run_id, task, name, time_unix, step, value) VALUES (?, ?, ?, ?, ?, ?)", rows)
                db.task_progress(run_id, "worker:0", {"global_step": per_series * 10, "examples_per_sec": 50_000.0},
                                 created + 3 + per_series, [])
                if state != "running":
                    for task in TASKS:
                        db.task_exited(run_id, task, 0, created + 50, 0 if state == "succeeded" else 1, "exit code")
                    db.finish_run(run_id, state, created + 50)
            log_dir = home / "runs" / run_id / "logs"
            if i >= runs - 3:
                log_dir.mkdir(parents=True, exist_ok=True)
                (log_dir / "worker-0.log").write_text("".join(f"worker:0: step {k} loss 0.3\n" for k in range(20_000)))
    return ids[::-1]


def start_ui(home: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PSFLOW_HOME": str(home), "PSFLOW_UI_TOKEN": "bench-token"}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "psflow"), "ui", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
            if m and not found:
                found.append(m.group(1))
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(60):
        proc.kill()
        raise SystemExit("psflow ui did not print its URL within 60 s")
    return proc, found[0]


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def latency(args: argparse.Namespace) -> str:
    import httpx

    with tempfile.TemporaryDirectory() as tmp:
        big, small = Path(tmp) / "big", Path(tmp) / "small"
        t = time.monotonic()
        big_ids = build_store(big, args.runs, args.points)
        log(f"built a store of {args.runs:,} runs and {args.points:,} points in {time.monotonic() - t:.1f} s "
            f"({(big / 'jobs.db').stat().st_size / 1e6:.0f} MB)")
        small_ids = build_store(small, 10, 10 * max(1, args.points // args.runs))
        servers = {name: start_ui(home) for name, home in (("big", big), ("small", small))}
        try:
            clients = {name: httpx.Client(base_url=url, timeout=60) for name, (_, url) in servers.items()}
            ids = {"big": big_ids, "small": small_ids}
            paths = {
                "runs list (page of 50)": lambda n: "/api/runs?limit=50",
                "runs list, state=failed": lambda n: "/api/runs?limit=50&state=failed",
                "runs list, search": lambda n: "/api/runs?limit=50&q=cnn",
                "run page (record, tasks, attempts, events)": lambda n: f"/api/runs/{ids[n][len(ids[n]) // 2]}",
                "run's metric series (1,000 points)": lambda n: f"/api/runs/{ids[n][len(ids[n]) // 2]}/metrics",
                "task log tail (64 KiB)": lambda n: f"/api/runs/{ids[n][0]}/tasks/worker:0/log",
            }
            cases = {}
            for label, path in paths.items():
                for name in ("big", "small"):
                    def one(name: str = name, path=path) -> float:
                        t0 = time.perf_counter()
                        r = clients[name].get(path(name))
                        elapsed = time.perf_counter() - t0
                        if r.status_code != 200:
                            raise SystemExit(f"{path(name)}: {r.status_code} {r.text[:300]}")
                        return elapsed * 1000
                    cases[f"{label}|{name}"] = one
            res = harness.interleaved(cases, args.requests, warmup=3, progress=False)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=20)
    lines = [f"### API latency (`psflow ui` over {args.runs:,} runs and {args.points:,} metric points; "
             f"{args.requests} requests per case, interleaved)", "",
             f"| request | p50 ms | p99 ms | p50 ms, 10 runs | p99 ms, 10 runs | p50 {args.runs:,} / 10 runs |",
             "|---|---|---|---|---|---|"]
    for label in paths:
        b, s = res[f"{label}|big"], res[f"{label}|small"]
        lines.append(f"| {label} | {percentile(b, .5):.1f} | {percentile(b, .99):.1f} | {percentile(s, .5):.1f} | "
                     f"{percentile(s, .99):.1f} | {percentile(b, .5) / percentile(s, .5):.2f} |")
    return "\n".join(lines) + "\n"


def recording(args: argparse.Namespace) -> str:
    """Examples/sec of the same run with the job store and with the run's files only."""
    script = REPO / "benchmarks" / "scripts" / "ui_record_run.py"

    def one(store: str) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            out = subprocess.run([sys.executable, str(script), store, tmp, str(args.epochs)], capture_output=True,
                                 text=True, timeout=600, cwd=REPO, env={**os.environ, "PSFLOW_HOME": tmp})
            if out.returncode != 0:
                raise SystemExit(f"the {store} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
            return float(json.loads(out.stdout.strip().splitlines()[-1])["examples_per_sec"])

    res = harness.interleaved({"job store": lambda: one("jobstore"), "files only": lambda: one("files")},
                              args.rounds, warmup=1)
    with_store, without = harness.median(res["job store"]), harness.median(res["files only"])
    return (f"### Recording cost (MNIST softmax, 1 ps + 2 workers, {args.epochs} epochs; {args.rounds} interleaved rounds)\n\n"
            "| launcher records the run in | examples/sec (median) | spread |\n|---|---|---|\n"
            f"| the job store and its files (default) | {with_store:,.0f} | {harness.spread(res['job store'], ',.0f')} |\n"
            f"| its files only | {without:,.0f} | {harness.spread(res['files only'], ',.0f')} |\n\n"
            f"Ratio with / without: **{with_store / without:.3f}**\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller store, fewer requests, no recording-cost runs")
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--points", type=int, default=None)
    p.add_argument("--requests", type=int, default=None, help="timed requests per case")
    p.add_argument("--rounds", type=int, default=3, help="recording cost: interleaved rounds")
    p.add_argument("--epochs", type=int, default=5, help="recording cost: epochs per run")
    args = p.parse_args()
    args.runs = args.runs or (200 if args.quick else 1000)
    args.points = args.points or (100_000 if args.quick else 1_000_000)
    args.requests = args.requests or (30 if args.quick else 200)
    print(f"## Dashboard and API\n\n`{harness.command_line()}`  \n{harness.machine()}\n")
    print(latency(args))
    if not args.quick:
        print(recording(args))


if __name__ == "__main__":
    main()
