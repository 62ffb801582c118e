"""Prometheus metrics of the job store, read at each scrape (``GET /metrics`` of ``psflow ui``).

Families (all gauges or counters read from the store, none kept in memory, so a restarted dashboard
reports the same figures):

- ``psflow_runs{state}``: runs recorded, by state (every state listed, 0 included);
- per task of each live run (pending or running; finished runs would grow the series for ever):
  ``psflow_task_global_step``, ``psflow_task_examples_per_sec``, ``psflow_task_attempt`` (restarts so
  far), ``psflow_task_pushes_total``, ``psflow_task_stale_dropped_total`` (sync: gradients dropped as
  stale), ``psflow_task_up`` (1 while the task is running), labelled ``run``, ``task``;
- ``psflow_task_restarts_total{run}``: restarts of every task of each live run;
- per ps task of each live run, over its last report window (about a second, :mod:`psflow.ps.latency`):
  ``psflow_ps_requests_per_second{run,task,op}`` and ``psflow_ps_request_latency_ms{run,task,op,quantile}``
  (``op`` push or pull, ``quantile`` 0.5 or 0.99; none for an op without requests in the window).

Called by :mod:`psflow.platform.api`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from psflow.platform.jobstore import RUN_STATES, JobStore

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class StoreCollector(Collector):
    """Reads the job store at ``db_path`` on every collect (one connection per scrape)."""

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path

    def collect(self) -> Iterator[Any]:
        with JobStore(self.db_path) as db:
            counts = dict.fromkeys(RUN_STATES, 0)
            for row in db.conn.execute("SELECT state, COUNT(*) FROM runs GROUP BY state"):  # type: ignore[union-attr]
                counts[row[0]] = counts.get(row[0], 0) + int(row[1])
            live, _ = db.run_page(state="running", limit=1000, metrics=True)
            pending, _ = db.run_page(state="pending", limit=1000, metrics=True)
        runs = GaugeMetricFamily("psflow_runs", "Runs recorded in the job store, by state.", labels=["state"])
        for state, n in counts.items():
            runs.add_metric([state], n)
        yield runs
        families = {
            "global_step": GaugeMetricFamily("psflow_task_global_step", "The job's global step a task last reported.",
                                             labels=["run", "task"]),
            "examples_per_sec": GaugeMetricFamily("psflow_task_examples_per_sec", "A task's last examples/sec.",
                                                  labels=["run", "task"]),
            "pushes": CounterMetricFamily("psflow_task_pushes", "Gradients a task pushed.", labels=["run", "task"]),
            "stale_dropped": CounterMetricFamily("psflow_task_stale_dropped",
                                                 "Gradients dropped as stale (sync mode).", labels=["run", "task"]),
        }
        attempt = GaugeMetricFamily("psflow_task_attempt", "A task's attempt (its restarts so far).", labels=["run", "task"])
        up = GaugeMetricFamily("psflow_task_up", "1 while a task is running.", labels=["run", "task"])
        restarts = CounterMetricFamily("psflow_task_restarts", "Restarts of a run's tasks.", labels=["run"])
        ps_rate = GaugeMetricFamily("psflow_ps_requests_per_second", "A ps's push or pull requests per second over "
                                    "its last report window.", labels=["run", "task", "op"])
        ps_latency = GaugeMetricFamily("psflow_ps_request_latency_ms", "A ps's push or pull latency (ms) over its "
                                       "last report window.", labels=["run", "task", "op", "quantile"])
        for run in [*live, *pending]:
            if run["state"] not in ("running", "pending"):
                continue  # found abandoned by the liveness check while read
            for name, t in run["tasks"].items():
                figures = {**(t.get("progress") or {}), **(t.get("metrics") or {})}
                for key, family in families.items():
                    if isinstance(figures.get(key), (int, float)):
                        family.add_metric([run["id"], name], float(figures[key]))
                attempt.add_metric([run["id"], name], t.get("attempt") or 0)
                up.add_metric([run["id"], name], 1 if t.get("state") == "running" else 0)
                if name.startswith("ps:"):
                    _ps_requests(run["id"], name, figures, ps_rate, ps_latency)
            restarts.add_metric([run["id"]], sum(t.get("attempt") or 0 for t in run["tasks"].values()))
        yield from (*families.values(), attempt, up, restarts, ps_rate, ps_latency)


def _ps_requests(run_id: str, task: str, figures: dict[str, Any], rate: GaugeMetricFamily,
                 latency: GaugeMetricFamily) -> None:
    for op in ("push", "pull"):
        if _is_number(figures.get(f"{op}_rate")):
            rate.add_metric([run_id, task, op], float(figures[f"{op}_rate"]))
        for quantile, key in (("0.5", f"{op}_p50_ms"), ("0.99", f"{op}_p99_ms")):
            if _is_number(figures.get(key)) and figures.get(f"{op}_rate") != 0:  # no requests: no latency
                latency.add_metric([run_id, task, op, quantile], float(figures[key]))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def exposition(db_path: Path) -> bytes:
    """The store's metrics in Prometheus's text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(db_path))
    return generate_latest(registry)
