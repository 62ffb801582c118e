"""When a ps stops serving: every worker done, or lost workers that never came back.

A ps started by hand (the seeds' flags, no launcher) runs as a real process, exactly as a user
starts it (``psflow.init()`` then ``task.join()``); the workers are real Trainers on threads of this
process, talking to it over TCP. What is proven:

- the ps serves until every worker has said it is done, also when they finish far apart;
- a worker whose connection closed without PS_DONE (killed) is named in the ps's log once every
  other worker is done, and past ``lost_worker_timeout_s`` the ps fails naming it, instead of
  waiting forever in silence; a restarted worker that reconnects before the deadline clears it.

Every wait has a deadline; teardown kills the ps process if it is still alive.
"""

from __future__ import annotations

import logging
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from inproc import SECRET, InprocCluster, InprocTask, ThreadGroup

from psflow import optim
from psflow.cluster import ClusterSpec, TaskId
from psflow.config import TrainConfig
from psflow.errors import TrainingError
from psflow.identity import TaskIdentity
from psflow.ps.service import PsService
from psflow.server import Server
from psflow.task import Task
from psflow.train.trainer import Trainer
from psflow.wire.conn import connect

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

WAIT_S = 60.0  # a ps process imports torch on a loaded machine: generous, but every wait has it
PS_MAIN = "import psflow; task = psflow.init(); task.join()"


class ByHandPs:
    """``ps:0`` of a 1-ps, 2-worker cluster, started by hand in its own process; stderr read line by line."""

    def __init__(self) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # by-hand flags need the port before the task starts
        port = sock.getsockname()[1]
        sock.close()
        hosts = {"ps": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:1", "127.0.0.1:2"]}  # workers: never dialled
        self.cluster = ClusterSpec.from_dict(hosts)
        flags = [f"--ps_hosts={hosts['ps'][0]}", f"--worker_hosts={','.join(hosts['worker'])}", "--job_name=ps",
                 "--task_index=0"]
        env = {"PSFLOW_SECRET": SECRET.decode(), "PYTHONUNBUFFERED": "1", "PATH": "/usr/bin:/bin",
               "PYTHONPATH": ":".join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-c", PS_MAIN, *flags], stderr=subprocess.PIPE, text=True,
                                     env=env, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)
            self.lines.put(line)

    def wait_for_line(self, text: str, timeout_s: float = WAIT_S) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"ps:0 never logged {text!r} within {timeout_s} s:\n{''.join(self.stderr)}") from None
            if text in line:
                return line

    def wait_exit(self, timeout_s: float = WAIT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"ps:0 still running after {timeout_s} s:\n{''.join(self.stderr)}") from None

    def log(self) -> str:
        return "".join(self.stderr)

    def trainer(self, index: int, model: torch.nn.Module, config: TrainConfig) -> Trainer:
        task = InprocTask(self.cluster, TaskId("worker", index), SECRET, config, connect_timeout_s=WAIT_S)
        return Trainer(model, optim.SGD(lr=0.1), task)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def ps() -> Iterator[ByHandPs]:
    p = ByHandPs()
    yield p
    p.kill()


class ThreadPs:
    """``ps:0`` as :class:`psflow.task.Task` runs it by hand (``task.join()``), on a thread of this
    process: the same serve loop as :class:`ByHandPs` without a process start (torch's import) per test."""

    def __init__(self) -> None:
        server = Server("ps:0", secret=SECRET, handshake_timeout_s=5.0)
        address = server.start()
        self.cluster = ClusterSpec.from_dict({"ps": [address], "worker": ["127.0.0.1:1", "127.0.0.1:2"]})
        self.task = Task(TaskIdentity(TaskId("ps", 0), self.cluster), secret=SECRET, server=server, config=TrainConfig(),
                         argv=[], coordinator=None, logdir=None, connect_timeout_s=5.0)
        self.group = ThreadGroup({"ps:0": self.task.join}).start()

    def trainer(self, index: int, model: torch.nn.Module, config: TrainConfig, attempt: int = 0) -> Trainer:
        task = InprocTask(self.cluster, TaskId("worker", index), SECRET, config, connect_timeout_s=5.0, attempt=attempt)
        return Trainer(model, optim.SGD(lr=0.1), task)

    def close(self) -> None:
        self.task.ps_service.stop()
        self.task.server.stop()


@pytest.fixture
def thread_ps() -> Iterator[ThreadPs]:
    p = ThreadPs()
    yield p
    p.close()


def step(t: Trainer) -> None:
    t.step(lambda: t.model(torch.ones(1, 4)).pow(2).sum())


# -- the ps serves until every worker is done ----------------------------------------------------


def test_ps_serves_until_every_worker_is_done_even_when_they_finish_far_apart(thread_ps: ThreadPs) -> None:
    """worker:0 finishes after 2 steps; worker:1 goes on for longer than the ps's exit grace (2 s)
    and is served throughout; the ps's join() returns only after worker:1's PS_DONE."""
    cfg = TrainConfig(mode="async")
    first, second = thread_ps.trainer(0, torch.nn.Linear(4, 2), cfg), thread_ps.trainer(1, torch.nn.Linear(4, 2), cfg)
    first.prepare(), second.prepare()
    for _ in range(2):
        step(first), step(second)
    first.close()  # PS_DONE of worker:0
    until = time.monotonic() + 3.0  # "far apart": past the 2 s a finished ps waits for connections to close
    steps = 0
    while time.monotonic() < until or steps < 5:
        step(second)  # fails if the ps stopped serving after worker:0's PS_DONE
        steps += 1
    assert thread_ps.group.is_alive("ps:0")
    assert second.global_step == 4 + steps
    second.close()
    thread_ps.group.join(timeout_s=10.0)  # join() returned: the ps would exit now
    assert thread_ps.task.reports["global_step"] == 4 + steps


def test_ps_service_keeps_serving_after_the_first_done_in_process() -> None:
    """The same rule on the service itself: join() returns only once both workers said done."""
    with InprocCluster(1, 2, TrainConfig(mode="async")) as c:
        trainers = [c.trainer(w, torch.nn.Linear(4, 2), optim.SGD(lr=0.1)) for w in range(2)]
        for t in trainers:
            t.prepare()
        step(trainers[0]), trainers[0].close()
        assert not c.services[0].join(0)
        for _ in range(10):
            step(trainers[1])
        assert not c.services[0].join(0) and trainers[1].global_step == 11
        trainers[1].close()
        assert c.services[0].join(5.0)


# -- a lost worker: named, and a deadline -------------------------------------------------------


def test_by_hand_ps_names_a_lost_worker_and_fails_after_the_deadline(ps: ByHandPs) -> None:
    cfg = TrainConfig(mode="async", lost_worker_timeout_s=1.0)
    chief, doomed = ps.trainer(0, torch.nn.Linear(4, 2), cfg), ps.trainer(1, torch.nn.Linear(4, 2), cfg)
    chief.prepare(), doomed.prepare()
    for _ in range(2):
        step(chief), step(doomed)
    doomed.client.close()  # what SIGKILL does to its sockets: no PS_DONE
    # The ps is up and serving by now: what follows comes within seconds (its loop looks once a second).
    ps.wait_for_line("lost worker:1: its connection closed at global step 4 without PS_DONE", timeout_s=20.0)
    chief.close()
    line = ps.wait_for_line("ps:0: waiting for worker:1 to finish", timeout_s=20.0)
    assert "worker:1 at global step 4" in line and "lost_worker_timeout_s" in line, line
    assert ps.wait_exit(timeout_s=20.0) != 0, ps.log()
    assert re.search(r"psflow: ps:0 failed: TrainingError: ps:0 waited \d+\.\d s for worker:1 to come back", ps.log()), ps.log()
    assert "Traceback" not in ps.log(), ps.log()


class LogWaiter(logging.Handler):
    """Collects the ps's log messages; :meth:`wait_for` blocks (with a deadline) until one contains a text."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self._cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._cond:
            self.messages.append(record.getMessage())
            self._cond.notify_all()

    def wait_for(self, text: str, timeout_s: float) -> str:
        with self._cond:
            if not self._cond.wait_for(lambda: any(text in m for m in self.messages), timeout=timeout_s):
                raise AssertionError(f"the ps never logged {text!r} within {timeout_s} s: {self.messages}")
            return next(m for m in self.messages if text in m)


@pytest.fixture
def ps_log() -> Iterator[LogWaiter]:
    handler = LogWaiter()
    logger = logging.getLogger("psflow.ps")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def test_a_restarted_worker_that_reconnects_before_the_deadline_clears_it(thread_ps: ThreadPs, ps_log: LogWaiter) -> None:
    cfg = TrainConfig(mode="async", lost_worker_timeout_s=1.5)
    chief, doomed = thread_ps.trainer(0, torch.nn.Linear(4, 2), cfg), thread_ps.trainer(1, torch.nn.Linear(4, 2), cfg)
    chief.prepare(), doomed.prepare()
    step(chief), step(doomed)
    doomed.client.close()
    chief.close()
    ps_log.wait_for("ps:0: waiting for worker:1 to finish", timeout_s=10.0)  # the ps's loop looks about once a second
    restarted = thread_ps.trainer(1, torch.nn.Linear(4, 2), cfg)
    restarted.prepare()  # its first request already counts: the wait for it is over
    ps_log.wait_for("worker:1 is back", timeout_s=0.0)
    until = time.monotonic() + 3.0  # twice the deadline: it would have fired by now
    while time.monotonic() < until:
        step(restarted)
    assert thread_ps.group.is_alive("ps:0")
    restarted.close()
    thread_ps.group.join(timeout_s=10.0)  # returns normally (raises if the ps failed)


def test_a_worker_lost_before_its_first_push_is_named_too(thread_ps: ThreadPs, ps_log: LogWaiter) -> None:
    """worker:1 connects (waits for readiness) and dies before any push, e.g. while loading its data."""
    cfg = TrainConfig(mode="async", lost_worker_timeout_s=1.0)
    chief, doomed = thread_ps.trainer(0, torch.nn.Linear(4, 2), cfg), thread_ps.trainer(1, torch.nn.Linear(4, 2), cfg)
    chief.prepare(), doomed.prepare()
    step(chief)
    doomed.client.close()
    ps_log.wait_for("lost worker:1: its connection closed at global step 1", timeout_s=10.0)
    chief.close()
    with pytest.raises(TrainingError, match=r"ps:0 waited \d+\.\d s for worker:1 to come back"):
        thread_ps.group.join(timeout_s=10.0)


def test_a_worker_that_stopped_on_an_error_is_waited_for_until_its_restart_is_done(thread_ps: ThreadPs,
                                                                                   ps_log: LogWaiter) -> None:
    """Issue 23 item 8, the README's restart example on a busy machine: worker:1 fails (an exception,
    as --fail-at raises), worker:0 finishes before the launcher has worker:1 back. Its PS_DONE said
    it stopped on an error, so the ps does not end with worker:0: it serves the restart to the end."""
    cfg = TrainConfig(mode="async", lost_worker_timeout_s=30.0)
    chief, doomed = thread_ps.trainer(0, torch.nn.Linear(4, 2), cfg), thread_ps.trainer(1, torch.nn.Linear(4, 2), cfg)
    chief.prepare(), doomed.prepare()
    with pytest.raises(RuntimeError), doomed:  # the trainer's exit tells the ps why it stops
        step(doomed)
        raise RuntimeError("injected fault at step 1")
    ps_log.wait_for("worker:1 stopped on an error at global step 1: RuntimeError: injected fault at step 1", 10.0)
    step(chief), chief.close()
    ps_log.wait_for("ps:0: waiting for worker:1 to finish (worker:1 at global step 1: stopped on an error", 10.0)
    assert thread_ps.group.is_alive("ps:0")  # before the fix it ended here, and the restart found no ps
    restarted = thread_ps.trainer(1, torch.nn.Linear(4, 2), cfg, attempt=1)  # PSFLOW_ATTEMPT of the restart
    restarted.prepare()
    for _ in range(3):
        step(restarted)
    assert thread_ps.group.is_alive("ps:0")
    restarted.close()
    thread_ps.group.join(timeout_s=10.0)  # ends normally once the restart finished
    assert thread_ps.task.reports["global_step"] == 5


def test_by_hand_every_worker_failing_at_start_ends_the_ps_at_once_with_the_first_error(ps: ByHandPs) -> None:
    """Issue 23 item 7: the README's second by-hand run, whose workers stop at start (runs/default
    holds checkpoints): the ps used to wait 300 s and blame a 'killed or crashed?' chief."""
    cfg = TrainConfig(mode="async", lost_worker_timeout_s=300.0)
    for index, error in ((1, "ConfigError: runs/default holds 1 checkpoint"), (0, "ConfigError: the chief's too")):
        t = ps.trainer(index, torch.nn.Linear(4, 2), cfg)
        t.close(failed=error)  # as the task's error hook has it say (a chief that never initialized the ps, too)
    started = time.monotonic()
    assert ps.wait_exit(timeout_s=WAIT_S) != 0, ps.log()
    assert time.monotonic() - started < 30.0, ps.log()  # at once (its loop looks about once a second), not 300 s
    assert ("ps:0 has no worker left to serve: every one stopped without finishing, and no launcher restarts them. "
            "In the order they stopped (the first is the root cause): worker:1 at global step 0: stopped on an error: "
            "ConfigError: runs/default holds 1 checkpoint; worker:0 at global step 0: stopped on an error: "
            "ConfigError: the chief's too. Fix the cause") in ps.log(), ps.log()
    assert "killed or crashed" not in ps.log() and "Traceback" not in ps.log(), ps.log()


def test_by_hand_a_worker_that_never_connects_is_given_up_after_the_timeout(thread_ps: ThreadPs,
                                                                            ps_log: LogWaiter) -> None:
    """Issue 23 item 7: worker:1 is never started. worker:0 (the chief) finishes and waits for it;
    once lost_worker_timeout_s has passed since the ps started, the ps counts it lost (so the chief
    stops waiting) and, with nobody else left, fails naming it."""
    thread_ps.task.ps_service.store.expect(TrainConfig(lost_worker_timeout_s=1.5), by_hand=True)
    cfg = TrainConfig(mode="async", lost_worker_timeout_s=1.5)
    chief = thread_ps.trainer(0, torch.nn.Linear(4, 2), cfg)
    chief.prepare()
    step(chief)
    ps_log.wait_for("worker:1 has sent nothing in the", timeout_s=10.0)
    assert chief.client.status()[0]["lost_workers"] == [1]  # what the chief's wait for the others reads
    chief.close()
    with pytest.raises(TrainingError, match=r"ps:0 gave up on worker:1: never connected within lost_worker_timeout_s "
                                            r"\(1\.5 s\) of the ps's start, and every other worker has finished"):
        thread_ps.group.join(timeout_s=10.0)


def test_a_closed_connection_from_outside_the_cluster_is_no_lost_worker(thread_ps: ThreadPs, ps_log: LogWaiter) -> None:
    """A task id the ps refused (worker:7 in a 2-worker cluster) is nobody it waits for: both real
    workers finish and the ps ends normally."""
    cfg = TrainConfig(mode="async", lost_worker_timeout_s=60.0)
    outsider = connect(thread_ps.cluster.address(TaskId("ps", 0)), secret=SECRET, task="worker:7", peer="ps:0",
                       deadline_s=5.0)
    outsider.close()
    trainers = [thread_ps.trainer(w, torch.nn.Linear(4, 2), cfg) for w in range(2)]
    for t in trainers:
        t.prepare()
    for t in trainers:
        step(t), t.close()
    thread_ps.group.join(timeout_s=10.0)  # returned: no wait for a "worker:7"
    assert not [m for m in ps_log.messages if "lost" in m or "waiting" in m], ps_log.messages


def test_lost_worker_watch_states_and_deadline() -> None:
    """PsService.watch_lost_workers, stepped by hand with its clock: quiet while any worker still
    trains (async goes on without a lost worker), says whom it waits for once only lost ones are
    left, fails at the deadline, and a worker that is back resets it."""
    workers = [f"127.0.0.1:{port}" for port in (2, 3, 4)]  # never dialled
    service = PsService(Server("ps:0"), 0, ClusterSpec.from_dict({"ps": ["127.0.0.1:1"], "worker": workers}))
    store = service.store
    store.initialize({"w": torch.zeros(2)}, optimizer=optim.SGD(lr=0.1).to_dict(),
                     config=TrainConfig(lost_worker_timeout_s=10.0), placement_digest="d")
    store.join(0), store.join(1)  # training: they sent requests (one that never does is lost 10 s after the start)
    store.worker_lost(2)
    service.watch_lost_workers(100.0)
    service.watch_lost_workers(1000.0)  # worker:0 and worker:1 still train: no deadline runs
    store.worker_done(0), store.worker_done(1)
    assert store.waiting_only_for_lost() == {2: 0}
    service.watch_lost_workers(1000.0)  # the wait starts here
    service.watch_lost_workers(1009.9)
    store.worker_back(2)
    service.watch_lost_workers(1011.0)  # back: no error, the wait is reset
    store.worker_lost(2)
    service.watch_lost_workers(1020.0)
    with pytest.raises(Exception, match=r"ps:0 waited 10\.0 s for worker:2 to come back"):
        service.watch_lost_workers(1030.0)
