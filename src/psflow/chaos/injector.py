"""The chaos injector: carries out the chaos schedule on a running run, through its backend.

The I/O shell of :mod:`psflow.chaos.schedule`. The runner calls it after each turn of its loop
(``Runner(on_tick=...)``) with the run controller (read only: which tasks run, since when, whether
the run is still running), the run store and the time. It

- takes the slot that is due, asks the schedule which task it hits, and sends the signal through
  :meth:`psflow.launch.backend.Backend.send_signal` (SIGKILL; or SIGSTOP, and SIGCONT ``stall_s``
  later; or, for a partition of a ps from the other ps, SIGUSR2 and SIGUSR2 again ``stall_s`` later):
  the run's restart policy, not the injector, brings a killed task back;
- records every fault (time, task, attempt, kind) in :attr:`ChaosInjector.faults`, in the run's
  history (``chaos_fault`` events) and on the console;
- continues every stopped task once the run stops running (a stopped task cannot exit), and in
  :meth:`ChaosInjector.close` (called by ``psflow chaos`` whatever happens).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from psflow.chaos.schedule import ChaosSchedule, TaskView, eligible, pick
from psflow.launch.backend import Backend
from psflow.launch.controller import RunController
from psflow.launch.runstore import RunStore


def is_ready(task: str, status: Mapping[str, Any], started_at: float | None) -> bool:
    """Whether ``task``'s current attempt (started at ``started_at``) reported that it works, from
    its entry in the run's live status (``status.json``'s ``tasks[task]``): a trainer a step, a ps its
    shard with no copy re-syncing.

    Example:
        >>> is_ready("ps:0", {"progress": {"global_step": 9, "time_unix": 5.0, "resyncing": False}}, started_at=4.0)
        True
    """
    progress = status.get("progress")
    if started_at is None or not isinstance(progress, Mapping) or float(progress.get("time_unix") or 0) < started_at:
        return False
    if task.split(":")[0] == "ps":
        return not progress.get("resyncing")
    return int(progress.get("local_step") or 0) >= 1


@dataclass
class InjectedFault:
    """One fault carried out: ``at_s`` into the run, on ``task``'s attempt ``attempt``."""

    slot: int
    at_s: float
    task: str
    attempt: int
    kind: str  # kill | stop
    stall_s: float | None = None  # stop: how long it was stopped
    time_unix: float | None = None  # when the signal was sent (the tasks' clock: failover latencies are measured from it)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


class ChaosInjector:
    """Injects ``schedule``'s faults into the run ``backend`` carries out; ``echo`` says each on the console."""

    def __init__(self, schedule: ChaosSchedule, backend: Backend, *, echo: Callable[[str], None] | None = None) -> None:
        self.schedule = schedule
        self.settings = schedule.settings
        self.backend = backend
        self.echo = echo or (lambda _line: None)
        self.faults: list[InjectedFault] = []
        self.skipped: list[int] = []  # slots no task was eligible for
        self.t0: float | None = None
        self._stopped: dict[str, tuple[float, InjectedFault]] = {}  # task -> (continue at, its fault)

    def __call__(self, controller: RunController, store: RunStore, now: float) -> None:
        self._continue_due(now, everything=controller.phase != "running")
        live = store.snapshot().get("tasks", {})
        views = {t: TaskView(r.state, r.started_at, t in self._stopped, is_ready(t, live.get(t) or {}, r.started_at),
                             finished=r.state == "exited" and bool(r.exits) and r.exits[-1].code == 0)
                 for t, r in controller.records.items()}
        if self.t0 is None:  # the schedule's clock starts with the job's first step, however long the start took
            if not any(v.ready for t, v in views.items() if t.split(":")[0] in ("chief", "worker")):
                return
            self.t0 = now
        elapsed = now - self.t0
        slot, skipped = self.schedule.due(elapsed)
        if slot is None:
            return
        for s in skipped:
            self.skipped.append(s.index)
            self.schedule.taken(s)
        if elapsed > self.settings.duration_s:  # its window is over
            self.skipped.append(slot.index)
            self.schedule.taken(slot)
            return
        task = pick(slot, eligible(views, now, self.settings, running=controller.phase == "running"))
        if task is None:
            return  # it waits for an eligible task, until the next slot is due
        self.schedule.taken(slot)
        attempt = controller.records[task].attempt
        fault = InjectedFault(slot.index, round(elapsed, 3), task, attempt, slot.kind,
                              None if slot.kind == "kill" else slot.stall_s)
        sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "partition": signal.SIGUSR2}[slot.kind]
        fault.time_unix = round(time.time(), 6)
        if not self.backend.send_signal(task, sig):
            self.skipped.append(slot.index)  # it ended between the controller's view and the signal
            return
        self.faults.append(fault)
        if slot.kind != "kill":
            self._stopped[task] = (now + slot.stall_s, fault)
        what = {"kill": "SIGKILL", "stop": f"SIGSTOP for {slot.stall_s:g} s",
                "partition": f"a partition from the other ps for {slot.stall_s:g} s"}[slot.kind]
        self.echo(f"psflow chaos: fault {len(self.faults)}: {what} to {task} (attempt {attempt}) at {elapsed:.1f} s")
        store.event("chaos_fault", **{("fault" if k == "kind" else k): v for k, v in fault.to_dict().items()})

    def close(self) -> None:
        """Continue every task still stopped (nothing the injector stopped stays stopped)."""
        self._continue_due(float("inf"), everything=True)

    def _continue_due(self, now: float, *, everything: bool) -> None:
        for task, (due, fault) in list(self._stopped.items()):
            if everything or now >= due:
                del self._stopped[task]
                self.backend.send_signal(task, signal.SIGUSR2 if fault.kind == "partition" else signal.SIGCONT)
