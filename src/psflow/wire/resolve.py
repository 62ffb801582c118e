"""Where a task listens now: the task side of the launcher's address book.

A task started by the launcher knows the coordinator's address. When its connection to a peer
drops, or the peer's old address refuses, it asks the coordinator (CO_RESOLVE) for the peer's
current address: a restarted task registers again on a new port (see ``launch/addressbook.py``).
A :class:`CoordinatorResolver` is the ``resolve(task) -> address`` callable that ``connect`` and
the ps client take; a task without a launcher (cluster from flags or TF_CONFIG) has none, and its
peers' addresses never change.

Each lookup is one short authenticated connection to the coordinator: lookups are rare (only
after a connection is lost), and a connection per lookup leaves nothing to keep in step or close.
"""

from __future__ import annotations

from typing import Any

from psflow.errors import ClusterError
from psflow.wire.conn import connect
from psflow.wire.ops import Op


class CoordinatorResolver:
    """``resolver("ps:0") -> "127.0.0.1:41234"``: a peer's current address, from the launcher's coordinator.

    Args:
        coordinator: the coordinator's "host:port" (PSFLOW_COORDINATOR).
        secret: the job's secret.
        task: this task's id, e.g. "worker:0" (it names itself in the handshake).
        timeout_s: the longest one lookup may take, connecting included.

    Example:
        >>> resolve = CoordinatorResolver("127.0.0.1:5000", secret=b"s", task="worker:0")
        >>> resolve("ps:0")
        '127.0.0.1:41234'
    """

    def __init__(self, coordinator: str, *, secret: bytes, task: str, timeout_s: float = 5.0) -> None:
        self.coordinator = coordinator
        self.secret = secret
        self.task = task
        self.timeout_s = timeout_s

    def __call__(self, peer: str) -> str:
        """The current address of ``peer``.

        Raises:
            TransportError: the coordinator cannot be reached within ``timeout_s``.
            RemoteError: the coordinator does not know ``peer`` (not in the run, or not registered yet).
        """
        meta = self._ask({"task": peer})
        address = meta.get("address")
        if not isinstance(address, str) or not address:
            raise ClusterError(f"The launcher's coordinator answered no address for {peer}. Received: {meta!r}.")
        return address

    def book(self) -> dict[str, Any]:
        """The whole address book: ``{"version": v, "tasks": {task: {address, pid, attempt, version}}}``."""
        return self._ask({})

    def _ask(self, meta: dict[str, Any]) -> dict[str, Any]:
        conn = connect(self.coordinator, secret=self.secret, task=self.task, peer="launcher", deadline_s=self.timeout_s)
        try:
            return conn.request(Op.CO_RESOLVE, meta, timeout_s=self.timeout_s).meta
        finally:
            conn.close()
