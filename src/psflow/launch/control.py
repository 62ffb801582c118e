"""Control requests: what someone outside the launcher (``psflow stop``, the HTTP API, the dashboard)
asks a running run to do, and the launcher's answer.

The channel is the job store, not a signal to the launcher's pid: whoever asks writes a request
(:meth:`psflow.platform.jobstore.JobStore.request_control`); the run's store takes it (its writer
thread polls for the run's pending requests); the runner's loop carries it out each tick and answers
(:meth:`~psflow.launch.runstore.RunStore.control_answered`). So every asker uses one path, on every
backend, and a request outlives the asker (the dashboard may go down after asking).

Kinds (:data:`KINDS`):

- ``stop``: stop every task (SIGTERM, SIGKILL after the plan's grace), as Ctrl-C does. No payload.
- ``dump``: every running task writes its threads' stacks into its log (SIGUSR1); the launcher
  records where each went (``stacks_dumped`` events), for :mod:`psflow.platform.stacks`. No payload.
- ``scale``: ``{"workers": N}`` (:func:`check_workers` is the one rule for N, for the runner, the
  API and ``psflow scale``): the launcher starts the missing ``worker:K`` and retires the highest
  (:meth:`psflow.launch.controller.RunController.scale`; the job's semantics:
  :mod:`psflow.ps.membership`). Slurm, ssh, all-reduce and an ended run refuse it, saying why.

``restart`` is not a request to the launcher: a ``stop``, then the plan launched again
(:mod:`psflow.platform.launching`) by whoever asked.

Request states::

    pending --the run's store took it--> taken --the runner carried it out--> done
                                         taken --the runner cannot--> refused

Pure data; no I/O. Used by :mod:`psflow.launch.runner` and the platform (jobstore, runcontrol, api).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KINDS = ("stop", "dump", "scale")
STATES = ("pending", "taken", "done", "refused")
MAX_WORKERS = 256  # the most workers a scale request may ask for (a typo guard, not a limit of the runtime)


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


def check_workers(workers: object, *, current: int | None = None) -> int:
    """A scale request's worker count, checked: the one rule, wherever a count comes in (the runner,
    the HTTP API, ``psflow scale``). Returns it.

    Args:
        workers: the count asked for, as received.
        current: the run's workers now, named in the message.

    Raises:
        ValueError: not an integer in ``1 .. MAX_WORKERS`` (the message names the value and the range).

    Example:
        >>> check_workers(3, current=2)
        3
    """
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= MAX_WORKERS:
        now = f" (the run has {current} now)" if current is not None else ""
        raise ValueError(f"The number of workers must be an integer from 1 to {MAX_WORKERS}{now}. Received: {workers!r}. "
                         "Pass e.g. --workers 3 (the chief, if the job has one, is not counted).")
    return workers
