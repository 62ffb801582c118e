"""The launcher's rendezvous and results service (runs inside the launcher process).

Tasks bind port 0, then register here with the address they got; once every expected task has
registered, each registration is answered with the whole cluster. Tasks also report metrics here
(final accuracy, trainer stats, ps counters), which end up in the job summary.

State: ``expected`` tasks -> ``addresses`` as they register; ``reports`` merged per task.
Transitions: waiting (some unregistered) -> complete (every registration answered). A task that
registers again (a restart) replaces its address.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from psflow.cluster import ClusterSpec
from psflow.errors import ClusterError, ConfigError
from psflow.server import Reply, Request, Server
from psflow.wire.ops import Op


class Coordinator:
    """Serve rendezvous and reports for ``expected`` tasks on ``server``."""

    def __init__(
        self,
        server: Server,
        expected: Sequence[str],
        *,
        register_timeout_s: float = 120.0,
        require_ps: bool = True,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.expected = list(expected)
        self.addresses: dict[str, str] = {}
        self.pids: dict[str, int] = {}
        self.reports: dict[str, dict[str, Any]] = {}
        self.register_timeout_s = register_timeout_s
        self.require_ps = require_ps
        self.on_event = on_event or (lambda kind, data: None)
        self._cond = threading.Condition()
        server.register(Op.CO_REGISTER, self._register)
        server.register(Op.CO_REPORT, self._report)
        server.register(Op.CO_STATUS, lambda req: Reply({"addresses": self.addresses, "reports": self.reports}))

    def cluster(self) -> ClusterSpec:
        jobs: dict[str, list[str]] = {}
        for t in self.expected:
            job = t.split(":")[0]
            jobs.setdefault(job, []).append(self.addresses[t])
        return ClusterSpec.from_dict(jobs, require_ps=self.require_ps)

    def _register(self, req: Request) -> Reply:
        task, address = str(req.meta.get("task")), str(req.meta.get("address"))
        if task not in self.expected:
            raise ConfigError(f"Task {task!r} is not part of this run; expected one of {self.expected}.")
        with self._cond:
            self.addresses[task] = address
            self.pids[task] = int(req.meta.get("pid", 0))
            self._cond.notify_all()
            complete = self._cond.wait_for(lambda: len(self.addresses) == len(self.expected), self.register_timeout_s)
        self.on_event("registered", {"task": task, "address": address})
        if not complete:
            missing = [t for t in self.expected if t not in self.addresses]
            raise ClusterError(
                f"Rendezvous timed out after {self.register_timeout_s:.0f} s: {', '.join(missing)} never registered. "
                "Check those tasks' logs; raise register_timeout_s if they start slowly."
            )
        return Reply({"cluster": self.cluster().to_dict()})

    def _report(self, req: Request) -> Reply:
        task = str(req.meta.get("task"))
        metrics = req.meta.get("metrics") or {}
        with self._cond:
            self.reports.setdefault(task, {}).update(metrics)
        self.on_event("report", {"task": task, "metrics": metrics})
        return Reply({})
