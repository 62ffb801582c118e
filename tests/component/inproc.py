"""An in-process psflow cluster for component tests: real servers, real sockets, workers as threads.

Owns: starting one real :class:`~psflow.server.Server` per task on 127.0.0.1 port 0 (each ps task
hosts a real :class:`~psflow.ps.service.PsService` that writes its own checkpoint shards), the resulting :class:`ClusterSpec`, and
:class:`InprocTask`, the few attributes of :class:`psflow.task.Task` that the Trainer reads, so a
worker can run as a thread of the test process. Nothing is faked: workers reach the ps over TCP with
the job secret, exactly as separate processes do.

Invariants: every server binds port 0 and the cluster is built from the addresses they got (no
free-port guessing); ``close()`` stops every server and closes every client it handed out; every
wait has a deadline (``run_threads`` joins with a timeout and fails naming the threads still alive).

:class:`CuttingProxy` is a TCP path in front of one server that can drop a connection at an exact
point of an exchange (a network blip), for the client's reconnect-and-resend tests, or hold every
reply back (a frozen server, as SIGSTOP makes it), for the waiting-on-a-ps test.

Used by tests/component/test_sync_modes.py, test_rejoin.py and test_chief_restart.py; :func:`wait_until`, the
component tests' one polling wait with a deadline, by test_ps_resync.py and the stack-dump tests too.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from psflow.cluster import ClusterSpec, TaskId
from psflow.config import TrainConfig
from psflow.identity import TaskIdentity
from psflow.optim import OptimizerSpec
from psflow.ps.authority import ViewAuthority, ViewClient
from psflow.ps.client import PsClient
from psflow.ps.replication import Role
from psflow.ps.service import PsService, default_save
from psflow.server import Server
from psflow.train.trainer import Trainer

SECRET = b"inproc-job-secret"


@dataclass
class InprocTask:
    """What the Trainer and the Supervisor (:class:`psflow.task.SupervisedTask`) need of a task, for a
    worker running as a thread in this process."""

    cluster: ClusterSpec
    task_id: TaskId
    secret: bytes
    config: TrainConfig
    connect_timeout_s: float = 5.0
    fail_at: str | None = None
    trainers: list[Trainer] = field(default_factory=list)
    resolve: Callable[[str], str] | None = None  # where a peer listens now (a launched task's address book)
    attempt: int = 0  # the restart count (a launched task's PSFLOW_ATTEMPT)
    logdir: str | None = None  # where a Supervisor writes checkpoints and summaries
    resume: bool | None = None
    checkpoint_dir: str | None = None  # a launched task's PSFLOW_CHECKPOINT_DIR (None: the logdir's)
    coordinator: str | None = None  # no launcher here: the Supervisor holds a named logdir itself
    reports: dict[str, Any] = field(default_factory=dict)  # what task.report() sent (no launcher here)

    @property
    def identity(self) -> TaskIdentity:
        return TaskIdentity(self.task_id, self.cluster)

    num_ps = property(lambda self: self.identity.num_ps)
    num_replicas = property(lambda self: self.identity.num_replicas)
    replica_index = property(lambda self: self.identity.replica_index)
    is_chief = property(lambda self: self.identity.is_chief)

    def _attach_trainer(self, trainer: Trainer) -> None:
        self.trainers.append(trainer)

    def report(self, **metrics: Any) -> None:
        self.reports.update(metrics)


class InprocCluster:
    """``num_ps`` ps tasks, ``num_workers`` worker tasks and evaluator:0, each with a started Server on 127.0.0.1.

    Args:
        num_ps: ps tasks; each hosts a PsService (one shard).
        num_workers: worker tasks; worker:0 is the chief.
        config: the job's TrainConfig (each Trainer may override fields, as in a real job).

    Example:
        >>> with InprocCluster(1, 2, TrainConfig(mode="sync")) as c:
        ...     trainer = c.trainer(0, torch.nn.Linear(8, 3), pf.optim.SGD(lr=0.1))
    """

    def __init__(self, num_ps: int, num_workers: int, config: TrainConfig = TrainConfig()) -> None:
        self.config = config
        self.servers: dict[TaskId, Server] = {}
        self.services: list[PsService] = []
        self._clients: list[PsClient] = []
        self.authority: ViewAuthority | None = None
        try:
            # The evaluator is the task that status and other side requests come from (a ps serves
            # only the cluster's own tasks).
            for job, n in (("ps", num_ps), ("worker", num_workers), ("evaluator", 1)):
                for i in range(n):
                    tid = TaskId(job, i)
                    server = Server(str(tid), host="127.0.0.1", port=0, secret=SECRET, handshake_timeout_s=5.0)
                    server.start()
                    self.servers[tid] = server
            addrs: dict[str, list[str]] = {"ps": [], "worker": [], "evaluator": []}
            for tid, server in self.servers.items():
                addrs[tid.job].append(server.address)
            self.cluster = ClusterSpec.from_dict(addrs)
            # ps_replicas=2: the authority over the shard copies, on a server of its own (the launcher's role).
            if config.ps_replicas == 2:
                self.launcher = Server("launcher", host="127.0.0.1", port=0, secret=SECRET, handshake_timeout_s=5.0)
                self.authority = ViewAuthority(self.launcher, num_ps)
                self.launcher.start()
            # Services register their routes before any task of the cluster can know the address.
            self.services = [self._service(self.servers[TaskId("ps", i)], i) for i in range(num_ps)]
            for service in self.services:
                service.on_save = default_save(service)  # each ps writes its own checkpoint shard, as a ps task does
        except BaseException:
            self.close()
            raise

    def task(self, index: int, *, fail_at: str | None = None, attempt: int = 0, logdir: str | None = None,
             **config: Any) -> InprocTask:
        """The task of ``worker:index`` (its ``attempt``: a restarted worker's is above 0; ``logdir``:
        the run's, for a Supervisor); ``config`` overrides fields of the job's TrainConfig."""
        return InprocTask(self.cluster, TaskId("worker", index), SECRET, replace(self.config, **config), fail_at=fail_at,
                          attempt=attempt, logdir=logdir)

    def trainer(
        self, index: int, model: torch.nn.Module, optimizer: OptimizerSpec, *, fail_at: str | None = None,
        attempt: int = 0, logdir: str | None = None, **settings: Any
    ) -> Trainer:
        """A Trainer for ``worker:index``, connected to every ps shard; ``attempt`` > 0 is a
        restarted worker's (a new process for the same task). Its task is ``trainer.task``."""
        trainer = Trainer(model, optimizer, self.task(index, fail_at=fail_at, attempt=attempt, logdir=logdir), **settings)
        self._clients.append(trainer.client)
        return trainer

    def _service(self, server: Server, index: int, attempt: int = 0) -> PsService:
        authority = None if self.authority is None else ViewClient(self.launcher.address, secret=SECRET,
                                                                    task=f"ps:{index}")
        return PsService(server, index, self.cluster, failover_s=self.config.backup_failover_s, attempt=attempt,
                         replicas=self.config.ps_replicas, authority=authority)

    def kill_ps(self, index: int, *, report: bool = True) -> None:
        """What SIGKILL does to a ps: its listener and every connection close at once; the launcher
        then learns of the exit (``report``) and tells the authority, as the runner does."""
        self.servers[TaskId("ps", index)].stop()
        self.services[index].stop()
        if report and self.authority is not None:
            self.authority.ps_down(index, "killed by the test")

    def restart_ps(self, index: int, *, attempt: int = 1) -> PsService:
        """Start ``ps:index`` again where it listened (a new process of the same task: ``attempt``
        above 0, nothing held), as the launcher restarts a dead ps. Its re-sync is the caller's to start."""
        tid = TaskId("ps", index)
        port = int(self.cluster.address(tid).rsplit(":", 1)[1])
        server = Server(str(tid), host="127.0.0.1", port=port, secret=SECRET, handshake_timeout_s=5.0)
        service = self._service(server, index, attempt)
        server.start()
        self.servers[tid], self.services[index] = server, service
        return service

    def settle(self, timeout_s: float = 10.0) -> None:
        """Every backup copy has applied the records it holds (it applies them on a thread of its own,
        after acknowledging them): call before reading a backup's state."""
        for service in self.services:
            for shard, role in list(service.roles.items()):
                if role is Role.BACKUP:
                    service._drain(shard, timeout_s)

    def client(self) -> PsClient:
        """A separate connection to every ps shard (for status), as an evaluator would hold."""
        c = PsClient(self.cluster, TaskId("evaluator", 0), SECRET, connect_timeout_s=5.0, request_timeout_s=5.0)
        self._clients.append(c)
        return c

    def status(self, *, clock_log: bool = False) -> list[dict[str, Any]]:
        """Every shard's PS_STATUS reply, fetched over the wire."""
        c = self.client()
        try:
            return c.status(clock_log=clock_log)
        finally:
            c.close()

    def close(self) -> None:
        for c in self._clients:
            c.close()
        for service in self.services:
            service.stop()
        for server in self.servers.values():
            server.stop()
        if self.authority is not None:
            self.launcher.stop()

    def __enter__(self) -> InprocCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ThreadGroup:
    """Named targets, each on its own daemon thread; their results and exceptions come back to the test.

    Example:
        >>> g = ThreadGroup({"worker:0": lambda: 1}).start()
        >>> g.join(timeout_s=5)["worker:0"]
        1
    """

    def __init__(self, targets: dict[str, Callable[[], Any]]) -> None:
        self.results: dict[str, Any] = {}
        self.errors: dict[str, BaseException] = {}
        self.threads = {name: threading.Thread(target=self._run, args=(name, fn), name=name, daemon=True)
                        for name, fn in targets.items()}

    def _run(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            self.results[name] = fn()
        except BaseException as e:  # handed to the test thread by join()
            self.errors[name] = e

    def start(self) -> ThreadGroup:
        for t in self.threads.values():
            t.start()
        return self

    def is_alive(self, name: str) -> bool:
        return self.threads[name].is_alive()

    def join(self, names: Sequence[str] | None = None, *, timeout_s: float) -> dict[str, Any]:
        """Join ``names`` (default all) within ``timeout_s`` in all; return their results by name.

        Raises the first exception one of them raised (in ``names`` order; a root cause comes before
        the hang it may have caused), else AssertionError naming the threads still running.
        """
        names = list(self.threads) if names is None else list(names)
        deadline = time.monotonic() + timeout_s
        for n in names:
            self.threads[n].join(max(0.0, deadline - time.monotonic()))
        for n in names:
            if n in self.errors:
                raise self.errors[n]
        alive = [n for n in names if self.threads[n].is_alive()]
        if alive:
            raise AssertionError(f"{alive} still running after {timeout_s} s: a hang (see the ps stats)")
        return {n: self.results.get(n) for n in names}


def run_threads(targets: Sequence[Callable[[], Any]], *, timeout_s: float) -> list[Any]:
    """Run each target on its own thread; return their results in order (see :meth:`ThreadGroup.join`)."""
    group = ThreadGroup({f"target-{i}": fn for i, fn in enumerate(targets)}).start()
    return list(group.join(timeout_s=timeout_s).values())


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``pred`` until it holds; fail naming ``what`` past ``timeout_s`` (the component tests' one wait)."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.01)


class CuttingProxy:
    """A TCP forwarder on 127.0.0.1 in front of the server at ``target``: a network path that drops.

    ``cut_next("reply")`` makes it close the next connection that carries bytes from the server (the
    reply to the request in flight, which the server received and carried out) instead of
    forwarding them; ``cut_next("request")`` drops the next bytes a client sends before the server
    gets them. Both sides of that connection are closed, as when a connection drops; later
    connections pass untouched; ``cut_all()`` drops every connection open now. ``cuts`` counts the
    connections it dropped. ``hold_replies()`` keeps
    every byte from the server back, on every connection, until ``release_replies()``.
    """

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._armed: str | None = None
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self.cuts = 0
        self._replies_flow = threading.Event()
        self._replies_flow.set()
        threading.Thread(target=self._accept, name="cutting-proxy", daemon=True).start()

    def hold_replies(self) -> None:
        self._replies_flow.clear()

    def release_replies(self) -> None:
        self._replies_flow.set()

    def cut_all(self) -> None:
        """Drop every connection open now, both sides, whatever is in flight on it."""
        with self._lock:
            socks, self._socks = self._socks, []
            self.cuts += len(socks) // 2
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut_next(self, direction: str) -> None:
        assert direction in ("request", "reply")
        with self._lock:
            self._armed = direction

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self._target, timeout=5.0)
            server.settimeout(None)
            with self._lock:
                self._socks += [client, server]
            for src, dst, direction in ((client, server, "request"), (server, client, "reply")):
                threading.Thread(target=self._pump, args=(src, dst, direction), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    cut = self._armed == direction
                    if cut:
                        self._armed = None
                        self.cuts += 1
                if cut:
                    break
                if direction == "reply":
                    self._replies_flow.wait()
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self._replies_flow.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() waiting in its thread
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for sock in self._socks:
                sock.close()
