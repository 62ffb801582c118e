"""The run controller at the job's end, stepped by hand: a worker frozen after its PS_DONE, killed by the
watchdog and restarted, while the ps end the job (every worker had said it was done). The run trained
every step: it must succeed, and the restart, which would only wait for a ps that is gone, must not
outlive the job. The chief stays under the old rule: its end after the job fails the run.
"""

from __future__ import annotations

from test_controller import GRACE_S, TASKS

from psflow.launch.controller import (
    DumpStacks,
    HeartbeatMissed,
    RestartPolicy,
    RestartTask,
    RunController,
    RunFinished,
    StartTask,
    StopTasks,
    TaskExited,
    TaskStarted,
    TimeAdvanced,
)
from psflow.launch.watchdog import HangPolicy

ENDED = "ps:0 exited 0 once every worker had said it was done"


def started(backoff_s: float) -> RunController:
    """ps:0, worker:0 (the chief), worker:1 started at t=0; the watchdog on; restarts on failure."""
    c = RunController(TASKS, grace_s=GRACE_S, ps_exit_timeout_s=60.0,
                      policy=RestartPolicy("on-failure", backoff_base_s=backoff_s, backoff_max_s=max(backoff_s, 1.0)),
                      hangs=HangPolicy(hang_timeout_s=3.0, dump_wait_s=1.0))
    c.start(at=0.0)
    for i, t in enumerate(TASKS):
        assert c.handle(TaskStarted(t, 0, at=0.0, handle=100 + i)) == []
    return c


def freeze_and_kill_worker_1(c: RunController, at: float) -> list:
    """worker:1 (frozen after its PS_DONE) sends no heartbeat: its stacks are asked for, then it is killed."""
    [dump] = c.handle(HeartbeatMissed("worker:1", at=at))
    assert isinstance(dump, DumpStacks) and "sent no heartbeat" in dump.reason
    [kill] = c.handle(TimeAdvanced(at + 1.0))
    assert kill.tasks == ("worker:1",) and kill.grace_s == 0.0
    return c.handle(TaskExited("worker:1", 0, -9, at=at + 1.1))


def test_the_ps_ending_the_job_stops_a_restarted_worker_and_the_run_succeeds() -> None:
    c = started(backoff_s=0.0)
    assert c.handle(TaskExited("worker:0", 0, 0, at=5.0)) == []  # the chief: every other worker said done
    assert freeze_and_kill_worker_1(c, at=6.0) == [RestartTask("worker:1", 1, 0.0, "exit code -9 (SIGKILL)"),
                                                   StartTask("worker:1", 1)]
    assert c.handle(TaskStarted("worker:1", 1, at=7.2, handle=200)) == []
    # The frozen worker's connection closed with its kill: the ps, which had every PS_DONE, ends the job.
    assert c.handle(TaskExited("ps:0", 0, 0, at=7.3)) == [
        StopTasks(("worker:1",), GRACE_S, f"the job finished while worker:1 was restarting ({ENDED}); stopping it",
                  warning=True)]
    assert c.handle(TaskExited("worker:1", 1, -15, at=7.5)) == [RunFinished("succeeded", None, 0)]
    first, second = c.records["worker:1"].exits
    assert (first.restarted, first.hang.kind, second.job_done, second.not_restarted) == (True, "frozen", True, None)


def test_a_restart_still_in_its_backoff_when_the_ps_end_the_job_is_cancelled_and_the_run_succeeds() -> None:
    c = started(backoff_s=5.0)
    c.handle(TaskExited("worker:0", 0, 0, at=5.0))
    [restart] = freeze_and_kill_worker_1(c, at=6.0)
    assert restart == RestartTask("worker:1", 1, 5.0, "exit code -9 (SIGKILL)")
    assert c.handle(TaskExited("ps:0", 0, 0, at=7.3)) == [RunFinished("succeeded", None, 0)]
    [last] = c.records["worker:1"].exits
    assert (last.restarted, last.job_done, c.restarts) == (False, True, 0)
    assert last.not_restarted == f"the job finished while it waited for its restart ({ENDED})"
    assert c.handle(TimeAdvanced(20.0)) == []  # no StartTask after the end


def test_a_restart_being_started_when_the_ps_end_the_job_is_stopped_once_its_start_is_seen() -> None:
    c = started(backoff_s=0.0)
    c.handle(TaskExited("worker:0", 0, 0, at=5.0))
    freeze_and_kill_worker_1(c, at=6.0)  # StartTask("worker:1", 1): its start is not seen yet
    assert c.handle(TaskExited("ps:0", 0, 0, at=7.3)) == []
    [stop] = c.handle(TaskStarted("worker:1", 1, at=7.4, handle=200))
    assert stop.tasks == ("worker:1",) and stop.warning
    assert c.handle(TaskExited("worker:1", 1, 143, at=7.6)) == [RunFinished("succeeded", None, 0)]


def test_a_worker_killed_after_the_ps_ended_the_job_is_not_restarted_and_the_run_succeeds() -> None:
    c = started(backoff_s=0.0)
    c.handle(TaskExited("worker:0", 0, 0, at=5.0))
    assert c.handle(TaskExited("ps:0", 0, 0, at=5.5)) == []  # its 2 s for the last connections had passed
    assert freeze_and_kill_worker_1(c, at=6.0) == [RunFinished("succeeded", None, 0)]
    [last] = c.records["worker:1"].exits
    assert not last.restarted and last.job_done and last.hang.kind == "frozen"
    assert last.not_restarted == f"the job had finished ({ENDED}): its training was complete, so its end does not fail the run"


def test_the_chief_is_left_to_its_restart_and_its_end_after_the_job_still_fails_the_run() -> None:
    # A restarted chief may be the attempt whose final PS_DONE ended the job: never stopped for it.
    c = started(backoff_s=0.0)
    c.handle(TaskExited("worker:1", 0, 0, at=5.0))
    assert c.handle(TaskExited("worker:0", 0, -9, at=5.5))[0] == RestartTask("worker:0", 1, 0.0, "exit code -9 (SIGKILL)")
    c.handle(TaskStarted("worker:0", 1, at=5.6, handle=300))
    assert c.handle(TaskExited("ps:0", 0, 0, at=9.0)) == []
    assert c.handle(TaskExited("worker:0", 1, 0, at=12.0)) == [RunFinished("succeeded", None, 0)]
    # killed after the ps ended the job (in its final evaluation): not restarted, and the run fails
    c = started(backoff_s=0.0)
    c.handle(TaskExited("worker:1", 0, 0, at=5.0))
    c.handle(TaskExited("ps:0", 0, 0, at=5.5))
    assert c.handle(TaskExited("worker:0", 0, -9, at=6.0)) == [RunFinished("failed", "worker:0", 1)]


def test_a_worker_that_fails_while_the_ps_still_serve_fails_the_run_as_before() -> None:
    c = RunController(TASKS, grace_s=GRACE_S, ps_exit_timeout_s=60.0)  # restart: never
    c.start(at=0.0)
    for i, t in enumerate(TASKS):
        c.handle(TaskStarted(t, 0, at=0.0, handle=100 + i))
    c.handle(TaskExited("worker:0", 0, 0, at=5.0))
    [stop] = c.handle(TaskExited("worker:1", 0, 1, at=5.5))
    assert stop.tasks == ("ps:0",)
    assert c.handle(TaskExited("ps:0", 0, 0, at=5.6)) == [RunFinished("failed", "worker:1", 1)]
