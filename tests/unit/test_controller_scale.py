"""RunController.scale stepped by hand: workers added (new tasks, or the next attempt of a retired
one), the highest retired (stopped with the grace; their exit, whatever its code, is ``retired``:
never a failure, never restarted), the drain and the run's end counting the members only."""

from __future__ import annotations

import pytest

from psflow.launch.controller import (
    RestartTask,
    RunController,
    RunFinished,
    StartTask,
    StopTasks,
    TaskExited,
    TaskStarted,
)
from psflow.launch.restart import RestartPolicy


def running(workers: int = 2, policy: RestartPolicy | None = None) -> RunController:
    names = ["ps:0"] + [f"worker:{i}" for i in range(workers)]
    c = RunController(names, grace_s=5, ps_exit_timeout_s=60, policy=policy)
    c.start(at=0.0)
    for i, t in enumerate(names):
        c.handle(TaskStarted(t, 0, at=0.1, handle=100 + i))
    return c


def test_scaling_up_starts_new_workers_as_attempt_zero() -> None:
    c = running(2)
    assert c.scale(4, at=1.0) == [StartTask("worker:2", 0), StartTask("worker:3", 0)]
    assert c.workers() == ["worker:0", "worker:1", "worker:2", "worker:3"] and c.names[-2:] == ["worker:2", "worker:3"]
    assert c.handle(TaskStarted("worker:2", 0, at=1.2, handle=7)) == []
    assert c.records["worker:2"].state == "running" and "worker:2" in c.watchdog.training


def test_retired_workers_exit_as_retired_not_failed_and_the_run_succeeds() -> None:
    c = running(3, RestartPolicy(kind="on-failure", max_restarts=3))
    (stop,) = c.scale(1, at=1.0)
    assert isinstance(stop, StopTasks) and stop.tasks == ("worker:1", "worker:2") and stop.grace_s == 5
    assert c.workers() == ["worker:0"]
    # SIGTERM's exit, or a crash on the way out: neither is a failure nor restarted
    assert c.handle(TaskExited("worker:1", 0, code=-15, at=1.5)) == []
    assert c.handle(TaskExited("worker:2", 0, code=1, at=1.6)) == []
    assert [c.records[t].state for t in ("worker:1", "worker:2")] == ["retired", "retired"]
    assert c.records["worker:2"].exits[-1].retired and c.restarts == 0
    assert c.handle(TaskExited("worker:0", 0, code=0, at=5.0)) == []  # draining: the ps gets its time
    assert c.phase == "draining"
    assert c.handle(TaskExited("ps:0", 0, code=0, at=5.5)) == [RunFinished("succeeded", None, 0)]


def test_a_retired_worker_added_back_starts_as_its_next_attempt() -> None:
    c = running(2)
    c.scale(1, at=1.0)
    c.handle(TaskExited("worker:1", 0, code=0, at=1.5))
    assert c.scale(2, at=2.0) == [StartTask("worker:1", 1)]
    assert c.handle(TaskStarted("worker:1", 1, at=2.1, handle=9)) == [] and c.records["worker:1"].state == "running"


def test_a_worker_retired_while_starting_is_stopped_once_it_starts() -> None:
    c = running(1)
    c.scale(2, at=1.0)
    assert c.scale(1, at=1.1) == []  # not started yet: nothing to signal
    (stop,) = c.handle(TaskStarted("worker:1", 0, at=1.2, handle=9))
    assert isinstance(stop, StopTasks) and stop.tasks == ("worker:1",)
    c.handle(TaskExited("worker:1", 0, code=-15, at=1.3))
    assert c.records["worker:1"].state == "retired" and c.result is None


def test_a_worker_waiting_for_its_restart_is_retired_without_starting() -> None:
    c = running(2, RestartPolicy(kind="on-failure", max_restarts=3, backoff_base_s=10))
    (restart,) = c.handle(TaskExited("worker:1", 0, code=1, at=1.0))
    assert isinstance(restart, RestartTask)
    assert c.scale(1, at=1.5) == []
    assert c.records["worker:1"].state == "retired" and c.restarts == 0
    assert c.handle(TaskExited("worker:0", 0, code=0, at=20.0)) == [] and c.phase == "draining"


def test_only_a_running_run_scales_and_the_count_is_checked() -> None:
    c = running(2)
    with pytest.raises(ValueError, match="at least one worker; received 0"):
        c.scale(0, at=1.0)
    c.handle(TaskExited("worker:0", 0, code=0, at=2.0))
    c.handle(TaskExited("worker:1", 0, code=0, at=2.0))
    with pytest.raises(ValueError, match="the run is draining, not running: only a running run can be scaled"):
        c.scale(3, at=3.0)
