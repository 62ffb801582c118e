"""Control requests: what someone outside the launcher (``psflow stop``, the HTTP API, the dashboard)
asks a running run to do, and the launcher's answer.

The channel is the job store, not a signal to the launcher's pid: whoever asks writes a request
(:meth:`psflow.platform.jobstore.JobStore.request_control`); the run's store takes it
(:meth:`psflow.launch.runstore.RunStore.control_requests`: the job store's writer thread polls for
the run's pending requests); the runner's loop carries it out each tick and answers
(:meth:`~psflow.launch.runstore.RunStore.control_answered`). So every asker uses one path, it works
on every backend (the launcher needs no signal from a process on another machine, only the store),
and a request outlives the asker (the dashboard may go down after asking).

Kinds (:data:`KINDS`):

- ``stop``: stop every task (SIGTERM, SIGKILL after the plan's grace), as Ctrl-C on the launcher
  does; the run ends ``stopped``. Payload: none.
- ``dump``: every running task writes all its threads' stacks into its log (SIGUSR1, as the hang
  watchdog does for one task); the launcher records where each went (``stacks_dumped`` events: task,
  log, line), for :mod:`psflow.platform.stacks` to read back. Payload: none.
- ``scale``: change the number of workers (payload ``{"workers": N}``): the launcher starts the
  missing ``worker:K`` and retires the highest ones (:meth:`psflow.launch.controller.RunController.scale`;
  the job's semantics: :mod:`psflow.ps.membership`). Backends whose tasks are fixed when the run starts
  (Slurm, ssh), the all-reduce strategy, and a run that is not running refuse it (``refused``, saying
  why and what to do); ``psflow scale`` and the API refuse a bad count, an ended run and those backends
  before asking (:func:`psflow.platform.runcontrol.ask_scale`).

``restart`` is not a request to the launcher: it is a ``stop``, then the same plan launched again
(:mod:`psflow.platform.launching`), done by whoever asked.

Request states::

    pending --the run's store took it--> taken --the runner carried it out--> done
                                         taken --the runner cannot--> refused

Pure data; no I/O. Used by :mod:`psflow.launch.runner` and :mod:`psflow.platform.jobstore`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KINDS = ("stop", "dump", "scale")
STATES = ("pending", "taken", "done", "refused")


@dataclass(frozen=True)
class ControlRequest:
    """Request ``id`` of kind ``kind`` (one of :data:`KINDS`) from ``source`` (``cli``, ``api``)."""

    id: int
    kind: str
    source: str
    requested_unix: float
    payload: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """``stop requested through the api (request 3)``: the stop's reason in the run's record."""
        return f"{self.kind} requested through the {self.source} (request {self.id})"
