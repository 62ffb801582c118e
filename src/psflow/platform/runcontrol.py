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
