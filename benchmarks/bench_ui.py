"""Dashboard and API latency over a big job store, and the cost of recording a run in the job store.

1. **API latency.** A job store with ``--runs`` runs (default 1,000: three tasks each, their attempts
   and events, a mix of states, a few live) and ``--points`` metric points (default 1,200,000), of
   which ``--heavy`` (default 200,000: 2 workers x 5 metrics x 20,000 reports, a loss spike) belong
   to the newest run, the rest spread evenly over the others; written as the launcher writes them
   (:func:`psflow.platform.metricstore.write`). A real ``psflow ui`` (uvicorn, 127.0.0.1, port 0)
   over it. Each case is one HTTP request as the page makes it, timed from the client (httpx,
   keep-alive), its repetitions interleaved across the cases: the runs list (100 rows; an older page
   by key; by state; searched), the heavy run's page data and its charts' data (loss, accuracy,
   examples/sec: the page's first look), a zoom by step, a live-update poll (from a cursor: what is
   new), a typical run's page and metric series, a task's log tail. Then ``psflow runs`` over the
   store (a subprocess, wall time), and, with Playwright and Chromium at hand (not with ``--quick``),
   the heavy run's page in a browser: a fresh page to both its loss and examples/sec charts drawn.
   Reported: p50 and p99 per case.
2. **Recording cost** (skipped with ``--quick`` or ``--no-recording``): the MNIST softmax, 1 ps + 2
   workers, through the real launcher, with the job store (the default) and with the run's files only
   (the launcher as it was before the job store), interleaved; examples/sec from each run's summary and the ratio.

Run: ``.venv/bin/python benchmarks/bench_ui.py [--quick] [--runs N] [--points N] [--heavy N] [--requests N]``.
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


def build_store(home: Path, runs: int, points: int, *, heavy: int = 0, live: int = 10) -> list[str]:
    """A job store of ``runs`` runs and ``points`` metric points; returns the run ids, newest first.

    With ``heavy``, the newest run (running) holds ``heavy`` of the points (a long run: 2 workers x
    5 metrics, one report a second, a loss spike at 60 % of its length) and the others share the rest.
    """
    from psflow.launch.liveness import process_identity
    from psflow.platform import metricstore
    from psflow.platform.jobstore import JobStore

    rng = random.Random(0)
    me = process_identity(os.getpid())  # live runs' launcher: this process, so they read running
    t0 = time.time() - 86_400 * 30
    per_run = max(1, (points - heavy) // max(1, runs - (1 if heavy else 0)))
    ids = []
    with JobStore(home / "jobs.db") as db:
        for i in range(runs):
            run_id = f"2026{i:06d}-bench-{i:06d}"
            ids.append(run_id)
            created = t0 + i * 60
            state = "running" if i >= runs - live else rng.choice(STATES)
            per_series = max(1, (heavy if heavy and i == runs - 1 else per_run) // (2 * len(NAMES)))
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
                for k in range(per_series):  # as the launcher records them: a report per task and second
                    for task in ("worker:0", "worker:1"):
                        points = [(name, 50.0 if name == "loss" and k == int(per_series * 0.6) else rng.random(), k * 10)
                                  for name in NAMES]
                        metricstore.write(db.conn, run_id, task, created + 3 + k, points)  # type: ignore[arg-type]
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


def http_cases(client, ids: list[str], cursor: int) -> dict[str, object]:
    """The requests timed, as the dashboard's pages make them: label -> a function timing one (ms)."""
    heavy, typical = ids[0], ids[len(ids) // 2]
    older = client.get("/api/runs", params={"limit": 100}).json()
    for _ in range(4):  # the fifth page, by key
        older = client.get("/api/runs", params={"limit": 100, "before": older["older"]}).json() if older["older"] else older
    charts = [("name", n) for n in ("loss", "accuracy", "examples_per_sec")]
    paths = {
        "runs list (100 rows, as the page asks)": ("/api/runs", {"limit": 100}),
        "runs list, fifth page by key": ("/api/runs", {"limit": 100, **({"after": older["newer"]} if older["newer"] else {})}),
        "runs list, state=failed": ("/api/runs", {"limit": 100, "state": "failed"}),
        "runs list, search": ("/api/runs", {"limit": 100, "q": "cnn"}),
        "heavy run: page data": (f"/api/runs/{heavy}", {}),
        "heavy run: chart data (3 metrics x 2 workers)": (f"/api/runs/{heavy}/metrics", charts),
        "heavy run: a zoom by step (5 % of the run)": (f"/api/runs/{heavy}/metrics", [*charts, ("x", "step"),
                                                                                   ("lo", 100_000), ("hi", 110_000)]),
        "heavy run: live-update poll (from a cursor)": (f"/api/runs/{heavy}/metrics", [*charts, ("cursor", cursor)]),
        "a typical run: page data": (f"/api/runs/{typical}", {}),
        "a typical run: chart data": (f"/api/runs/{typical}/metrics", charts),
        "task log tail (64 KiB)": (f"/api/runs/{heavy}/tasks/worker:0/log", {}),
    }
    cases = {}
    for label, (path, params) in paths.items():
        def one(path=path, params=params) -> float:
            t0 = time.perf_counter()
            r = client.get(path, params=params)
            elapsed = time.perf_counter() - t0
            if r.status_code != 200:
                raise SystemExit(f"{path}: {r.status_code} {r.text[:300]}")
            return elapsed * 1000
        cases[label] = one
    return cases


def psflow_runs(home: Path) -> float:
    """``psflow runs`` over the store, wall time in ms."""
    t0 = time.perf_counter()
    out = subprocess.run([str(Path(sys.executable).parent / "psflow"), "runs"], capture_output=True, text=True,
                         env={**os.environ, "PSFLOW_HOME": str(home)}, timeout=120)
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"psflow runs failed: {out.stderr[-2000:]}")
    return elapsed * 1000


def browser_page(url: str, run_id: str, reps: int) -> list[float] | str:
    """The heavy run's page in headless Chromium: a fresh page to its loss and examples/sec charts
    drawn, ms; or why it was not measured."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return "Playwright is not installed"
    found = subprocess.run(["bash", str(REPO / "tools" / "chromium.sh")], capture_output=True, text=True, timeout=900)
    if found.returncode != 0:
        return f"no Chromium ({found.stderr.strip()[-200:]})"
    drawn = '#chart-{}[data-points]:not([data-points="0"]) canvas'
    times = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=found.stdout.strip(), headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        try:
            for _ in range(reps + 1):  # the first one warms the server's and the browser's caches
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                t0 = time.perf_counter()
                page.goto(f"{url}#/run/{run_id}")
                page.wait_for_selector(drawn.format("loss"), timeout=60_000)
                page.wait_for_selector(drawn.format("examples_per_sec"), timeout=60_000)
                times.append((time.perf_counter() - t0) * 1000)
                page.close()
        finally:
            browser.close()
    return times[1:]


def latency(args: argparse.Namespace) -> str:
    import httpx

    from psflow.platform.jobstore import JobStore

    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "big"
        t = time.monotonic()
        ids = build_store(home, args.runs, args.points, heavy=args.heavy)
        log(f"built a store of {args.runs:,} runs and {args.points:,} points in {time.monotonic() - t:.1f} s "
            f"({(home / 'jobs.db').stat().st_size / 1e6:.0f} MB)")
        with JobStore(home / "jobs.db") as db:  # the live poll's cursor: the heavy run's last reports are new to it
            cursor = max(0, int(db.conn.execute("SELECT MAX(rowid) FROM metrics").fetchone()[0]) - 60)  # type: ignore[union-attr]
        proc, url = start_ui(home)
        try:
            with httpx.Client(base_url=url, timeout=60) as client:
                res = harness.interleaved(http_cases(client, ids, cursor), args.requests, warmup=3, progress=False)
            res["`psflow runs` (wall time of the command)"] = [psflow_runs(home) for _ in range(args.cli_runs)]
            page = browser_page(url, ids[0], args.browser_reps) if args.browser_reps else "not asked (--quick)"
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    if isinstance(page, list):
        res["heavy run's page in Chromium: load to charts drawn"] = page
    lines = [f"### API latency (`psflow ui` over {args.runs:,} runs and {args.points:,} metric points, the newest run "
             f"holding {args.heavy:,}; {args.requests} requests per case, interleaved)", "",
             "| case | p50 ms | p99 ms | n |", "|---|---|---|---|"]
    for label, values in res.items():
        lines.append(f"| {label} | {percentile(values, .5):.1f} | {percentile(values, .99):.1f} | {len(values)} |")
    if not isinstance(page, list):
        lines += ["", f"The browser timing was not taken: {page}."]
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
    p.add_argument("--heavy", type=int, default=None, help="points of the newest run (of --points)")
    p.add_argument("--requests", type=int, default=None, help="timed requests per case")
    p.add_argument("--cli-runs", type=int, default=None, help="timed `psflow runs`")
    p.add_argument("--browser-reps", type=int, default=None, help="timed page loads in Chromium (0: none)")
    p.add_argument("--no-recording", action="store_true", help="skip the recording-cost runs")
    p.add_argument("--rounds", type=int, default=3, help="recording cost: interleaved rounds")
    p.add_argument("--epochs", type=int, default=5, help="recording cost: epochs per run")
    args = p.parse_args()
    args.runs = args.runs or (200 if args.quick else 1000)
    args.points = args.points or (100_000 if args.quick else 1_200_000)
    args.heavy = args.heavy if args.heavy is not None else (min(20_000, args.points // 2) if args.quick else 200_000)
    args.requests = args.requests or (30 if args.quick else 200)
    args.cli_runs = args.cli_runs or (3 if args.quick else 20)
    args.browser_reps = args.browser_reps if args.browser_reps is not None else (0 if args.quick else 10)
    print(f"## Dashboard and API\n\n`{harness.command_line()}`  \n{harness.machine()}\n")
    print(latency(args))
    if not args.quick and not args.no_recording:
        print(recording(args))


if __name__ == "__main__":
    main()
