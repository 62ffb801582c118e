"""Stop and restart a recorded run from outside its launcher: the one path ``psflow stop``,
``psflow restart`` and the HTTP API share.

A stop is a control request in the job store (:mod:`psflow.launch.control`); the run's launcher takes
it at its next tick and stops every task. :func:`wait_until_over` waits, with a deadline, for the run
to end (or its launcher to vanish). A restart is a stop (when the run still runs), the wait, then the
same plan launched again (:mod:`psflow.platform.launching`).

Called by :mod:`psflow.cli` and :mod:`psflow.platform.api`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psflow.platform.jobstore import FINAL_STATES, JobStore, JobStoreError

LIVE_STATES = ("pending", "running")


class StopTimeout(JobStoreError):
    """A run did not end within the deadline after a stop was asked for."""


@dataclass(frozen=True)
class StopAsked:
    """A stop was asked of run ``run_id`` (request ``request_id``; None: the run had already ended)."""

    run_id: str
    request_id: int | None
    state: str  # the run's state when asked


def ask_stop(db: JobStore, run_id: str, *, source: str) -> StopAsked:
    """Ask run ``run_id`` to stop; a run that has already ended is left as it is (no request).

    Raises:
        JobStoreError: no such run.
    """
    run = db.run(run_id, metrics=False)
    if run is None:
        raise JobStoreError(f"No run {run_id!r} in the job store {db.path}; `psflow runs` lists the runs.")
    if run["state"] not in LIVE_STATES:
        return StopAsked(run_id, None, run["state"])
    return StopAsked(run_id, db.request_control(run_id, "stop", source=source), run["state"])


def wait_until_over(db_path: Path, run_id: str, *, timeout_s: float, poll_s: float = 0.25,
                    request_id: int | None = None) -> dict[str, Any]:
    """Wait until run ``run_id`` has ended (or its launcher is gone: abandoned); return its record.

    Raises:
        StopTimeout: still running after ``timeout_s``; says whether the launcher took the request.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with JobStore(db_path) as db:
            run = db.run(run_id, metrics=False)
            asked = db.controls(request_id=request_id) if request_id is not None else []
        if run is None or run["state"] in FINAL_STATES:
            return run or {"id": run_id, "state": "gone"}
        if time.monotonic() >= deadline:
            taken = asked and asked[0]["state"] != "pending"
            why = ("its launcher took the stop request and is still stopping the tasks (they get the plan's grace "
                   "period, then SIGKILL)") if taken else (
                "its launcher has not taken the stop request (an older psflow, or the launcher is stuck); stop it "
                "with Ctrl-C in its terminal or kill -TERM on the launcher's pid")
            raise StopTimeout(f"Run {run_id} is still {run['state']} after {timeout_s:g} s: {why}. Wait longer "
                              f"(--timeout) or check `psflow status {run_id}`.")
        time.sleep(poll_s)  # a poll interval, not a synchronisation: the loop ends on the run's state


# -- scale ------------------------------------------------------------------------------------------

# The backends whose launcher cannot add or retire workers of a running run, and why (the launcher
# says the same when asked: psflow.launch.backend.Backend.scale_refusal).
NOT_SCALABLE = {
    "k8s": "a TFJob's replica counts are fixed by the manifest psflow applied when the run started",
}


def scale_refusal(run: dict[str, Any]) -> str | None:
    """Why workers cannot join or leave run ``run`` (a job store record) on its backend or strategy;
    None where they can. The run page says it instead of offering the scale control."""
    backend = str(run.get("backend") or "")
    if backend in NOT_SCALABLE:
        return f"it runs on the {backend} backend, and {NOT_SCALABLE[backend]}"
    if run.get("strategy") == "allreduce":
        return "all-reduce ranks cannot join or leave a running group (its ranks are fixed at its rendezvous)"
    return None


class ScaleRefused(JobStoreError):
    """A scale request that cannot be carried out (bad count, an ended run, a backend that cannot)."""


def ask_scale(db: JobStore, run_id: str, workers: object, *, source: str) -> int:
    """Ask run ``run_id``'s launcher to have ``workers`` workers (``psflow scale``); return the request's id.

    Raises:
        ScaleRefused: ``workers`` is not a count of 1..MAX_WORKERS, the run has ended, or its backend cannot
            scale; the message says why and what to do.
        JobStoreError: no such run.
    """
    from psflow.launch.control import check_workers

    run = db.run(run_id, metrics=False)
    if run is None:
        raise JobStoreError(f"No run {run_id!r} in the job store {db.path}; `psflow runs` lists the runs.")
    now = sum(1 for t, v in run.get("tasks", {}).items() if t.startswith("worker:") and v.get("state") != "retired")
    try:
        count = check_workers(workers, current=now)
    except ValueError as e:
        raise ScaleRefused(str(e)) from None
    if run["state"] not in LIVE_STATES:
        raise ScaleRefused(f"Run {run_id} has already ended ({run['state']}); only a running run can be scaled. "
                           f"Start it again with `psflow restart {run_id}` (same shape), or `psflow run --workers {count} ...`.")
    why = scale_refusal(run)
    if why is not None:
        raise ScaleRefused(f"Run {run_id} cannot be scaled: {why}, so workers cannot join or leave it. Stop it "
                           f"(`psflow stop {run_id}`) and start it again with --workers {count}.")
    return db.request_control(run_id, "scale", source=source, payload={"workers": count})


def wait_scaled(db_path: Path, run_id: str, request_id: int, *, timeout_s: float, poll_s: float = 0.25) -> dict[str, Any]:
    """Wait until the launcher answered scale request ``request_id`` and, if it carried it out, every
    added worker runs and every retired one has exited. Returns the request (``state``, ``answer``).

    Raises:
        StopTimeout: not there within ``timeout_s``; says what is still awaited.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with JobStore(db_path) as db:
            (asked,) = db.controls(request_id=request_id)
            run = db.run(run_id, metrics=False) or {"state": "gone", "tasks": {}}
        awaited = _scale_awaited(asked, run)
        if asked["state"] == "refused" or (asked["state"] == "done" and not awaited) or run["state"] not in LIVE_STATES:
            return asked
        if time.monotonic() >= deadline:
            what = (f"waiting for {', '.join(awaited)}" if asked["state"] == "done" else
                    "its launcher has not answered the request (busy, or an older psflow)")
            raise StopTimeout(f"Scale request {request_id} of run {run_id} is not complete after {timeout_s:g} s: {what}. "
                              f"Wait longer (--timeout) or check `psflow status {run_id}`.")
        time.sleep(poll_s)  # a poll interval, not a synchronisation: the loop ends on the recorded states


def _scale_awaited(asked: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """Workers a carried-out scale request still waits for: added ones not running, retired ones not exited."""
    if asked["state"] != "done":
        return ["the launcher's answer"]
    workers = int(asked["payload"].get("workers", 0))
    out = []
    for name, t in run.get("tasks", {}).items():
        if not name.startswith("worker:"):
            continue
        wanted = "running" if int(name.split(":")[1]) < workers else "retired"
        state = t.get("state")
        if wanted == "running" and state not in ("running", "exited") or wanted == "retired" and state != "retired":
            out.append(f"{name} ({state}, to be {wanted})")
    return out
