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


LIVE = ("push_rate", "pull_rate", "push_p50_ms", "push_p99_ms", "pull_p50_ms", "pull_p99_ms")


def _real(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _live(progress: Mapping[str, Any]) -> dict[str, float | None]:
    """The live figures of a ps's progress; an op without requests in the last window has no percentiles
    (the progress keeps those of an older window)."""
    out = {k: _real(progress.get(k)) for k in LIVE}
    for op in ("push", "pull"):
        if out[f"{op}_rate"] == 0:
            out[f"{op}_p50_ms"] = out[f"{op}_p99_ms"] = None
    return out


def shard_skew(ps: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per live figure (``LIVE``), across the ps that report it: ``{"max", "min", "ratio", "max_ps"}``
    (``ratio`` = max / min, None where min is 0); a figure fewer than two ps report is left out."""
    out: dict[str, Any] = {}
    for key in LIVE:
        seen = {name: v for name, p in ps.items() if (v := _real(p.get(key))) is not None}
        if len(seen) < 2:
            continue
        top = max(seen, key=lambda n: seen[n])
        low = min(seen.values())
        out[key] = {"max": seen[top], "min": low, "ratio": round(seen[top] / low, 3) if low > 0 else None, "max_ps": top}
    return out


def ps_health(run: Mapping[str, Any]) -> dict[str, Any]:
    """``{"version", "ps": {task: {...}}, "workers": {task: {...}}, "final": bool, "skew": {...}}``."""
    tasks = run.get("tasks") or {}
    reports = ((run.get("summary") or {}).get("reports") or {})
    ps, workers = {}, {}
    for name, t in tasks.items():
        progress = t.get("progress") or {}
        if name.startswith("ps:"):
            final = reports.get(name) or {}
            ps[name] = {"state": t.get("state"), "attempt": t.get("attempt"), "version": _int(progress.get("global_step")),
                        "stats": final.get("ps_stats"), "shards": final.get("shards"),
                        "lost_workers": final.get("lost_workers"), **_live(progress)}
        elif name.startswith(("worker:", "chief:")):
            workers[name] = {"state": t.get("state"), "version": _int(progress.get("global_step")),
                             "pushes": _int(progress.get("pushes")), "stale_pushes": _int(progress.get("stale_pushes")),
                             "examples_per_sec": progress.get("examples_per_sec")}
    versions = [v["version"] for v in [*ps.values(), *workers.values()] if v["version"] is not None]
    newest = max(versions, default=None)
    for w in workers.values():
        w["lag"] = newest - w["version"] if newest is not None and w["version"] is not None else None
    return {"version": newest, "ps": ps, "workers": workers, "final": bool(reports), "skew": shard_skew(ps)}
