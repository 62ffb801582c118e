"""The launcher's rendezvous, address book and results service (runs inside the launcher process).

Tasks bind port 0, then register here with the address they got. The addresses live in an
:class:`~psflow.launch.addressbook.AddressBook` (pure; this module is its threaded shell on a
Server). Tasks also report metrics here (final accuracy, trainer stats, ps counters), which end up
in the job summary.

Requests:
    CO_REGISTER {task, address, pid[, attempt]} -> {cluster, version}: in the first round, answered
        once every expected task has registered; after it (a restarted task, on a new port), at once,
        except for the ``rounds`` tasks (all-reduce ranks, which restart together): their attempt N
        is answered once every one of them has registered attempt N, so that no rank of the new
        attempt is given an address of the old one (rank 0's rendezvous store moves with it).
    CO_RESOLVE {task} -> {task, address, pid, attempt, version}: where the task listens now (a
        client whose connection to a peer dropped asks this); {} -> the whole book {version, tasks,
        members} (``members``: the training replicas now and at launch, what a ps counts: ``psflow scale``).
    CO_REPORT {task, metrics}. A report whose metrics
        are ``{"heartbeat": {attempt, waiting, waiting_on}}`` is a task's heartbeat (:mod:`psflow.heartbeat`): it
        is passed on as an event, not merged into the reports.

Events (``on_event(kind, data)``, called outside the lock): ``registered`` {task, address} for
every registration once it is answered (as before the book existed), ``reregistered`` {task,
address, previous_address, attempt, version} as soon as a task registers again, ``report``, and
``heartbeat`` {task, attempt, waiting, waiting_on}.

State: the book; ``reports`` merged per task. Transitions: see the book (assembling -> complete;
each registration replaces the task's entry and raises the version).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from psflow.cluster import ClusterSpec
from psflow.errors import ClusterError
from psflow.launch.addressbook import REREGISTERED, AddressBook
from psflow.server import Reply, Request, Server
from psflow.wire.ops import Op


class Coordinator:
    """Serve rendezvous, the address book and reports for ``expected`` tasks on ``server``."""

    def __init__(
        self,
        server: Server,
        expected: Sequence[str],
        *,
        register_timeout_s: float = 120.0,
        require_ps: bool = True,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        rounds: Sequence[str] = (),
    ) -> None:
        self.book = AddressBook(expected)
        self.rounds = tuple(rounds)
        self.reports: dict[str, dict[str, Any]] = {}
        self.register_timeout_s = register_timeout_s
        self.require_ps = require_ps
        self.on_event = on_event or (lambda kind, data: None)
        self._cond = threading.Condition()
        server.register(Op.CO_REGISTER, self._register)
        server.register(Op.CO_RESOLVE, self._resolve)
        server.register(Op.CO_REPORT, self._report)

    @property
    def expected(self) -> list[str]:
        return self.book.expected

    @property
    def addresses(self) -> dict[str, str]:
        """task -> its current address (a copy)."""
        with self._cond:
            return self.book.addresses()

    @property
    def pids(self) -> dict[str, int]:
        with self._cond:
            return self.book.pids()

    def scale(self, expected: Sequence[str]) -> list[str]:
        """The run's tasks are ``expected`` now (``psflow scale``); returns the retired ones. The ps
        tasks learn the new membership from the book (``members``, through CO_RESOLVE)."""
        with self._cond:
            retired = self.book.scale(expected)
            self._cond.notify_all()
        return retired

    def cluster(self) -> ClusterSpec:
        with self._cond:
            return ClusterSpec.from_dict(self.book.cluster_dict(), require_ps=self.require_ps)

    def _register(self, req: Request) -> Reply:
        task, address = str(req.meta.get("task")), str(req.meta.get("address"))
        attempt = req.meta.get("attempt")
        with self._cond:
            reg = self.book.register(task, address, pid=int(req.meta.get("pid", 0)),
                                     attempt=None if attempt is None else int(attempt))
            self._cond.notify_all()
        if reg.kind == REREGISTERED:
            assert reg.previous is not None
            self.on_event("reregistered", {"task": task, "address": address, "previous_address": reg.previous.address,
                                           "attempt": reg.entry.attempt, "version": reg.entry.version})
        with self._cond:
            # After the first round this returns at once (a complete book stays complete), except
            # for a group's new attempt, which waits for the whole group's registrations of it.
            n = reg.entry.attempt if task in self.rounds else 0
            complete = self._cond.wait_for(lambda: self.book.is_complete and not self.book.behind(n, self.rounds),
                                           self.register_timeout_s)
            missing, version = self.book.missing() or self.book.behind(n, self.rounds), self.book.version
            jobs = self.book.cluster_dict() if complete else None
        self.on_event("registered", {"task": task, "address": address})
        if jobs is None:
            raise ClusterError(
                f"Rendezvous timed out after {self.register_timeout_s:.0f} s: {', '.join(missing)} never registered. "
                "Check those tasks' logs; raise register_timeout_s if they start slowly."
            )
        return Reply({"cluster": ClusterSpec.from_dict(jobs, require_ps=self.require_ps).to_dict(), "version": version})

    def _resolve(self, req: Request) -> Reply:
        task = req.meta.get("task")
        with self._cond:
            if task is None:
                return Reply(self.book.snapshot())
            entry, version = self.book.resolve(str(task)), self.book.version
        return Reply({"task": str(task), "address": entry.address, "pid": entry.pid, "attempt": entry.attempt,
                      "version": version})

    def _report(self, req: Request) -> Reply:
        task = str(req.meta.get("task"))
        metrics = req.meta.get("metrics") or {}
        beat = metrics.get("heartbeat") if isinstance(metrics, dict) else None
        if isinstance(beat, dict) and len(metrics) == 1:
            self.on_event("heartbeat", {"task": task, "attempt": beat.get("attempt"), "waiting": beat.get("waiting"),
                                        "waiting_on": beat.get("waiting_on")})
            return Reply({})
        with self._cond:
            self.reports.setdefault(task, {}).update(metrics)
        self.on_event("report", {"task": task, "metrics": metrics})
        return Reply({})
