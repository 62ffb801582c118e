"""The parameter servers of a run as the dashboard shows them: each ps's version (its global step),
each worker's lag behind the newest version, its pushes and stale pushes, and, once the run ended,
what each ps counted (pushes, applied updates, stale gradients dropped, duplicates, its shard copies
and their roles under replication). Pure: reads a run as :meth:`JobStore.run` gives it.

What is live comes from the tasks' progress reports, about one a second per task, each at its own
moment: a lag smaller than the steps of a second or so is noise. The ps count their figures only at
the end (the summary's reports), so push rates and per-shard latencies are not here.

Called by :mod:`psflow.platform.api` (``GET /api/runs/{run}/ps``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def ps_health(run: Mapping[str, Any]) -> dict[str, Any]:
    """``{"version", "ps": {task: {...}}, "workers": {task: {...}}, "final": bool}``."""
    tasks = run.get("tasks") or {}
    reports = ((run.get("summary") or {}).get("reports") or {})
    ps, workers = {}, {}
    for name, t in tasks.items():
        progress = t.get("progress") or {}
        if name.startswith("ps:"):
            final = reports.get(name) or {}
            ps[name] = {"state": t.get("state"), "attempt": t.get("attempt"), "version": _int(progress.get("global_step")),
                        "stats": final.get("ps_stats"), "shards": final.get("shards"),
                        "lost_workers": final.get("lost_workers")}
        elif name.startswith(("worker:", "chief:")):
            workers[name] = {"state": t.get("state"), "version": _int(progress.get("global_step")),
                             "pushes": _int(progress.get("pushes")), "stale_pushes": _int(progress.get("stale_pushes")),
                             "examples_per_sec": progress.get("examples_per_sec")}
    versions = [v["version"] for v in [*ps.values(), *workers.values()] if v["version"] is not None]
    newest = max(versions, default=None)
    for w in workers.values():
        w["lag"] = newest - w["version"] if newest is not None and w["version"] is not None else None
    return {"version": newest, "ps": ps, "workers": workers, "final": bool(reports)}
