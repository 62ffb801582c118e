"""The launcher's address book on the wire: a real Coordinator and real Servers on 127.0.0.1.

A fake ps (a Server that answers PS_STATUS/PS_PUSH with its own name) registers with the
coordinator; a worker's PsClient connects to it with the coordinator as its resolver; the ps stops
and a new one for the same task registers on a new port; the client's next request reaches the new
one. Every wait has a deadline (futures and events with timeouts, socket timeouts); nothing sleeps.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from psflow.cluster import ClusterSpec, TaskId
from psflow.errors import RemoteError, TransportError
from psflow.launch.controller import TaskHeartbeat
from psflow.launch.coordinator import Coordinator
from psflow.launch.runner import _to_store
from psflow.ps.client import PsClient
from psflow.server import Reply, Server
from psflow.wire.conn import PeerLostError, connect
from psflow.wire.ops import Op
from psflow.wire.resolve import CoordinatorResolver

pytestmark = pytest.mark.timeout(60)

SECRET = b"job-secret"
WAIT_S = 5.0  # deadline of every single wait in this file


class Run:
    """A coordinator for ``expected`` tasks, the servers started for the test, and the events seen."""

    def __init__(self, expected: list[str]) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self.launcher = self.server("launcher")
        self.coordinator = Coordinator(self.launcher, expected, register_timeout_s=WAIT_S, on_event=self._on_event)
        self.pool = ThreadPoolExecutor(4)
        self.servers: list[Server] = []

    def _on_event(self, kind: str, data: dict[str, Any]) -> None:
        with self._lock:
            self.events.append((kind, data))

    def server(self, task: str) -> Server:
        srv = Server(task, secret=SECRET, handshake_timeout_s=WAIT_S)
        srv.start()
        if task != "launcher":
            self.servers.append(srv)
        return srv

    def fake_ps(self, name: str) -> Server:
        """ps:0, answering every request with ``name`` (so a test sees which one it reached)."""
        srv = self.server("ps:0")
        srv.register(Op.PS_STATUS, lambda req: Reply({"who": name, "version": 0}))
        srv.register(Op.PS_PUSH, lambda req: Reply({"who": name, "version": 1}))
        return srv

    def register(self, task: str, address: str) -> dict[str, Any]:
        """CO_REGISTER as a task does it; returns the reply meta."""
        conn = connect(self.launcher.address, secret=SECRET, task=task, peer="launcher", deadline_s=WAIT_S)
        try:
            return conn.request(Op.CO_REGISTER, {"task": task, "address": address, "pid": 1}, timeout_s=WAIT_S).meta
        finally:
            conn.close()

    def resolver(self, task: str = "worker:0") -> CoordinatorResolver:
        return CoordinatorResolver(self.launcher.address, secret=SECRET, task=task, timeout_s=WAIT_S)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for srv in [*self.servers, self.launcher]:
            srv.stop()


@pytest.fixture
def run() -> Iterator[Run]:
    r = Run(["ps:0", "worker:0"])
    yield r
    r.close()


def first_round(run: Run, ps: Server) -> ClusterSpec:
    """ps:0 and worker:0 register; ps:0's answer waits for worker:0's registration."""
    ps_reply = run.pool.submit(run.register, "ps:0", ps.address)
    worker = run.server("worker:0")
    reply = run.register("worker:0", worker.address)
    assert ps_reply.result(timeout=WAIT_S)["cluster"] == reply["cluster"]
    return ClusterSpec.from_dict(reply["cluster"])


def client(cluster: ClusterSpec, resolve: Callable[[str], str] | None) -> PsClient:
    return PsClient(cluster, TaskId("worker", 0), SECRET, connect_timeout_s=WAIT_S, request_timeout_s=WAIT_S, resolve=resolve)


def test_a_client_s_next_request_reaches_the_ps_that_re_registered_on_a_new_port(run: Run) -> None:
    old = run.fake_ps("old")
    cluster = first_round(run, old)
    c = client(cluster, run.resolver())
    assert c.status()[0]["who"] == "old"

    old_address = old.address
    old.stop()
    new = run.fake_ps("new")
    assert new.address != old_address
    reply = run.pool.submit(run.register, "ps:0", new.address).result(timeout=WAIT_S)  # answered at once: no round to wait for
    assert reply["cluster"]["ps"] == [new.address]
    assert reply["version"] == 3

    assert c.status()[0]["who"] == "new"
    assert c.addresses[0] == new.address
    assert ("reregistered", {"task": "ps:0", "address": new.address, "previous_address": old_address,
                             "attempt": 1, "version": 3}) in run.events
    assert [d["address"] for k, d in run.events if k == "registered" and d["task"] == "ps:0"] == [old_address, new.address]
    c.close()


def test_a_client_keeps_asking_until_the_restarted_ps_has_registered(run: Run) -> None:
    """The old address refuses; the book still names it until the new ps registers."""
    old = run.fake_ps("old")
    cluster = first_round(run, old)
    asked = threading.Event()
    resolver = run.resolver()

    def resolve(peer: str) -> str:
        address = resolver(peer)
        asked.set()
        return address

    c = client(cluster, resolve)
    old.stop()
    status = run.pool.submit(c.status)
    assert asked.wait(WAIT_S), "the client never asked the coordinator where ps:0 is"
    assert not status.done()  # still knocking at the old address
    new = run.fake_ps("new")
    run.register("ps:0", new.address)
    assert status.result(timeout=WAIT_S)[0]["who"] == "new"
    c.close()


def test_a_push_that_lost_its_ps_raises_and_the_next_request_reconnects(run: Run) -> None:
    """A push may have been applied before the ps went away: it is not sent twice, the caller hears of the loss."""
    old = run.fake_ps("old")
    c = client(first_round(run, old), run.resolver())
    grads = [[("w", torch.zeros(2))]]
    assert c.push(0, [0], grads)[0]["who"] == "old"
    old.stop()
    run.register("ps:0", run.fake_ps("new").address)
    with pytest.raises(PeerLostError, match="ps:0"):
        c.push(0, [0], grads)
    assert c.push(0, [0], grads)[0]["who"] == "new"
    c.close()


def test_without_a_resolver_a_lost_ps_is_an_error_and_nothing_reconnects(run: Run) -> None:
    """A cluster given by flags or TF_CONFIG: addresses are fixed, a lost connection stays an error."""
    old = run.fake_ps("old")
    c = client(first_round(run, old), None)
    assert c.status()[0]["who"] == "old"
    old.stop()
    run.register("ps:0", run.fake_ps("new").address)
    with pytest.raises(TransportError):
        c.status()
    with pytest.raises(TransportError):
        c.status()  # the same dead connection, as before the address book
    c.close()


def test_the_coordinator_resolves_one_task_or_the_whole_book_and_names_what_it_does_not_know(run: Run) -> None:
    ps = run.fake_ps("old")
    first_round(run, ps)
    resolver = run.resolver()
    assert resolver("ps:0") == ps.address
    book = resolver.book()
    assert book["version"] == 2
    assert book["tasks"]["ps:0"]["address"] == ps.address and set(book["tasks"]) == {"ps:0", "worker:0"}
    with pytest.raises(RemoteError, match=r"Task 'ps:3' is not part of this run"):
        resolver("ps:3")


def test_resolving_a_task_that_has_not_registered_yet_is_refused_with_the_reason(run: Run) -> None:
    with pytest.raises(RemoteError, match="ps:0 has not registered with the launcher yet"):
        run.resolver()("ps:0")


def test_a_heartbeat_naming_the_ps_its_task_is_blocked_on_reaches_the_watchdog_so(run: Run) -> None:
    conn = connect(run.launcher.address, secret=SECRET, task="worker:0", peer="launcher", deadline_s=WAIT_S)
    try:
        beat = {"attempt": 2, "waiting": None, "waiting_on": "ps:1"}  # what Task.heartbeat_payload sends
        conn.request(Op.CO_REPORT, {"task": "worker:0", "metrics": {"heartbeat": beat}}, timeout_s=WAIT_S)
    finally:
        conn.close()
    [data] = [d for k, d in run.events if k == "heartbeat"]
    assert data == {"task": "worker:0", "attempt": 2, "waiting": None, "waiting_on": "ps:1"}
    signs: queue.Queue = queue.Queue()
    _to_store(None, signs)("heartbeat", data)  # type: ignore[arg-type]  # a heartbeat never reaches the store
    sign = signs.get_nowait()
    assert isinstance(sign, TaskHeartbeat)
    assert (sign.task, sign.attempt, sign.waiting, sign.waiting_on) == ("worker:0", 2, False, "ps:1")
