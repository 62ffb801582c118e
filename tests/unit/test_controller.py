"""The run controller stepped by hand: scripted event sequences in, decisions out (no processes, no clock).

The root-cause cases reuse the ps's real error texts (from test_rootcause), so the controller is
checked against the wording the rule reads.
"""

from __future__ import annotations

import pytest
from test_rootcause import lost_worker_message, missing_worker_message

from psflow.launch.controller import (
    HeartbeatMissed,
    RestartPolicy,
    RestartTask,
    RunController,
    RunFinished,
    StartTask,
    StopRequested,
    StopTasks,
    TaskExited,
    TaskReported,
    TaskStarted,
    TimeAdvanced,
)

TASKS = ["ps:0", "worker:0", "worker:1"]
GRACE_S = 5.0


def running(policy: RestartPolicy | None = None, tasks: list[str] = TASKS, ps_exit_timeout_s: float = 60.0) -> RunController:
    """A controller whose tasks have all started (attempt 0) at t=0."""
    c = RunController(tasks, grace_s=GRACE_S, ps_exit_timeout_s=ps_exit_timeout_s, policy=policy)
    assert c.start(at=0.0) == [StartTask(t, 0) for t in tasks]
    for i, t in enumerate(tasks):
        assert c.handle(TaskStarted(t, 0, at=0.1, handle=100 + i)) == []
    return c


def exit_(c: RunController, task: str, code: int, at: float, report: dict | None = None) -> list:
    """A task's exit as the runner feeds it: its error report first."""
    attempt = c.records[task].attempt
    out = c.handle(TaskReported(task, attempt, report, at)) if report else []
    return out + c.handle(TaskExited(task, attempt, code, at))


def report(t: float, exception: str, message: str) -> dict:
    return {"time_unix": t, "exception": exception, "message": message}


# -- today's rules --------------------------------------------------------------------------------


def test_a_run_succeeds_once_the_workers_and_then_the_ps_exit_cleanly() -> None:
    c = running()
    assert exit_(c, "worker:0", 0, at=10.0) == []
    assert exit_(c, "worker:1", 0, at=10.2) == []
    assert c.phase == "draining"
    assert exit_(c, "ps:0", 0, at=10.5) == [RunFinished("succeeded", None, 0)]
    assert c.handle(TimeAdvanced(100.0)) == []  # finished: nothing more happens
    assert [c.records[t].attempts for t in TASKS] == [1, 1, 1]


def test_a_failing_worker_stops_the_others_and_is_the_root_cause() -> None:
    c = running()
    out = exit_(c, "worker:1", 1, at=10.0, report=report(9.9, "ValueError", "boom"))
    assert out == [StopTasks(("ps:0", "worker:0"), GRACE_S, "worker:1 failed (exit code 1); stopping the others")]
    assert exit_(c, "worker:0", -15, at=10.3) == []
    assert exit_(c, "ps:0", -15, at=10.4) == [RunFinished("failed", "worker:1", 1)]
    assert [x.stopped for x in c.records["worker:0"].exits] == [True]  # no sign of failure by itself


def test_a_ps_that_fails_fails_the_run_too() -> None:
    c = running()
    assert exit_(c, "ps:0", -9, at=5.0) == [StopTasks(("worker:0", "worker:1"), GRACE_S, "ps:0 failed (exit code -9 (SIGKILL)); stopping the others")]
    exit_(c, "worker:0", -15, at=5.1)
    assert exit_(c, "worker:1", -15, at=5.2) == [RunFinished("failed", "ps:0", 1)]


def test_a_sigkilled_worker_is_the_root_cause_though_the_survivor_failed_first() -> None:
    # The survivor fails with the ps's "worker:1 lost its connection" error before worker:1's exit is seen.
    c = running()
    out = exit_(c, "worker:0", 1, at=10.3, report=report(10.1, "RemoteError", lost_worker_message()))
    assert out == [StopTasks(("ps:0", "worker:1"), GRACE_S, "worker:0 failed (exit code 1); stopping the others")]
    exit_(c, "worker:1", -9, at=10.4)
    assert exit_(c, "ps:0", -15, at=10.5) == [RunFinished("failed", "worker:1", 1)]


def test_a_stalled_worker_is_the_root_cause_of_the_survivors_sync_timeout() -> None:
    # worker:0 times out naming the missing worker:1, which is still running: the launcher stops it.
    c = running()
    out = exit_(c, "worker:0", 1, at=20.0, report=report(19.9, "RemoteError", missing_worker_message()))
    assert out[0].tasks == ("ps:0", "worker:1")
    exit_(c, "worker:1", -15, at=20.5)
    assert exit_(c, "ps:0", -15, at=20.6) == [RunFinished("failed", "worker:1", 1)]


def test_a_ps_that_does_not_exit_after_the_workers_is_stopped_with_a_warning_and_the_run_succeeds() -> None:
    c = running(ps_exit_timeout_s=60.0)
    exit_(c, "worker:0", 0, at=10.0)
    exit_(c, "worker:1", 0, at=10.0)
    assert c.handle(TimeAdvanced(69.9)) == []
    out = c.handle(TimeAdvanced(70.0))
    assert out == [StopTasks(("ps:0",), GRACE_S, "ps:0 did not exit 60 s after the workers finished; stopping them.", warning=True)]
    assert c.handle(TimeAdvanced(71.0)) == []  # said once
    assert exit_(c, "ps:0", -15, at=71.0) == [RunFinished("succeeded", None, 0)]


def test_ctrl_c_stops_every_task_and_the_run_ends_stopped() -> None:
    c = running()
    out = c.handle(StopRequested("Ctrl-C", at=3.0))
    assert out == [StopTasks(tuple(TASKS), GRACE_S, "Ctrl-C: stopping every task (SIGTERM, then SIGKILL after 5 s; "
                                                    "Ctrl-C again kills them now)", warning=True)]
    exit_(c, "ps:0", -15, at=3.1)
    exit_(c, "worker:0", -15, at=3.2, report=report(3.15, "KeyboardInterrupt", ""))
    assert exit_(c, "worker:1", -15, at=3.3) == [RunFinished("stopped", None, 130)]


def test_a_second_ctrl_c_kills_the_tasks_left_at_once_and_the_run_still_ends_stopped() -> None:
    c = running()
    c.handle(StopRequested("Ctrl-C", at=3.0))
    exit_(c, "ps:0", -15, at=3.1)
    (kill,) = c.handle(StopRequested("Ctrl-C again", at=4.0, hurry=True))
    assert (kill.tasks, kill.grace_s) == (("worker:0", "worker:1"), 0.0) and kill.warning
    assert kill.reason.startswith("Ctrl-C again: killing every task now (SIGKILL); the run is recorded as stopped.")
    exit_(c, "worker:0", -9, at=4.1)
    assert exit_(c, "worker:1", -9, at=4.2) == [RunFinished("stopped", None, 130)]
    assert c.stopped_by == "Ctrl-C"


def test_a_stop_after_a_failure_ends_stopped_and_still_names_the_root_cause() -> None:
    c = running()
    exit_(c, "worker:1", 1, at=10.0, report=report(9.9, "ValueError", "boom"))
    out = c.handle(StopRequested("SIGTERM", at=10.1))
    assert out[0].tasks == ("ps:0", "worker:0") and out[0].warning
    exit_(c, "worker:0", -15, at=10.2)
    assert exit_(c, "ps:0", -15, at=10.3) == [RunFinished("stopped", "worker:1", 130)]


def test_a_task_that_starts_while_the_run_stops_is_stopped_too_and_one_never_started_is_not_waited_for() -> None:
    c = RunController(TASKS, grace_s=GRACE_S, ps_exit_timeout_s=60.0)
    c.start(at=0.0)
    c.handle(TaskStarted("ps:0", 0, at=0.1, handle=1))
    assert c.handle(StopRequested("Ctrl-C", at=0.2))[0].tasks == ("ps:0",)
    assert c.handle(TaskStarted("worker:0", 0, at=0.3, handle=2)) == [StopTasks(("worker:0",), GRACE_S, "the run is stopping")]
    exit_(c, "ps:0", -15, at=0.4)
    assert exit_(c, "worker:0", -15, at=0.5) == [RunFinished("stopped", None, 130)]  # worker:1 never started
    assert c.records["worker:1"].attempts == 0


def test_missed_heartbeats_are_recorded_and_decide_nothing_yet() -> None:
    c = running()
    assert c.handle(HeartbeatMissed("worker:1", at=4.0)) == []
    assert c.heartbeats_missed == {"worker:1": 1}


def test_late_or_foreign_notices_are_ignored_or_refused() -> None:
    c = running()
    assert c.handle(TaskExited("worker:0", 3, 1, at=1.0)) == []  # an attempt that never ran
    exit_(c, "worker:0", 0, at=2.0)
    assert c.handle(TaskExited("worker:0", 0, 0, at=2.1)) == []  # said twice
    with pytest.raises(ValueError, match="'worker:7' is not part of this run"):
        c.handle(TaskExited("worker:7", 0, 1, at=3.0))


# -- restart policies -----------------------------------------------------------------------------


def test_never_is_the_default_and_restarts_nothing() -> None:
    c = running()
    assert c.policy.kind == "never"
    out = exit_(c, "worker:1", -9, at=5.0)
    assert [type(d) for d in out] == [StopTasks]


def test_on_failure_restarts_after_a_backoff_that_doubles_and_is_capped() -> None:
    c = running(RestartPolicy("on-failure", max_restarts=5, backoff_base_s=1.0, backoff_max_s=3.0))
    now, waits = 0.6, []  # attempt 0 (started at 0.1) dies 0.5 s in
    for attempt in range(1, 5):
        [restart] = exit_(c, "worker:1", -9, at=now)
        assert isinstance(restart, RestartTask) and (restart.task, restart.attempt) == ("worker:1", attempt)
        assert restart.reason == "exit code -9 (SIGKILL)"
        waits.append(restart.after_s)
        assert c.handle(TimeAdvanced(now + restart.after_s - 0.01)) == []  # not before its time
        assert c.handle(TimeAdvanced(now + restart.after_s)) == [StartTask("worker:1", attempt)]
        assert c.handle(TaskStarted("worker:1", attempt, at=now + restart.after_s, handle=200 + attempt)) == []
        now += restart.after_s + 0.5  # each attempt dies 0.5 s after its start: shorter than the longest wait
    assert waits == [1.0, 2.0, 3.0, 3.0]
    exit_(c, "worker:0", 0, at=now)
    exit_(c, "worker:1", 0, at=now)
    assert exit_(c, "ps:0", 0, at=now) == [RunFinished("succeeded", None, 0)]
    rec = c.records["worker:1"]
    assert rec.attempts == 5 and [x.restarted for x in rec.exits] == [True] * 4 + [False]


def test_an_attempt_that_outlived_the_longest_wait_resets_the_backoff() -> None:
    c = running(RestartPolicy("on-failure", max_restarts=9, backoff_base_s=1.0, backoff_max_s=4.0))
    now, waits = 0.6, []  # attempt 0 (started at 0.1) dies 0.5 s in
    for ran_s in (0.5, 0.5, 4.0, 0.5, 3.9, 10.0):
        [restart] = exit_(c, "worker:1", -9, at=now)
        waits.append(restart.after_s)
        start = now + restart.after_s
        c.handle(TimeAdvanced(start))
        c.handle(TaskStarted("worker:1", restart.attempt, at=start, handle=restart.attempt))
        now = start + ran_s
    # quick deaths double the wait (1, 2, 4); one that ran 4 s (>= the 4 s cap) was healthy: its restart
    # waits 1 s again; then 0.5 s and 3.9 s are quick again (2, 4); one that ran 10 s resets it once more.
    assert waits == [1.0, 2.0, 4.0, 1.0, 2.0, 4.0]
    [restart] = exit_(c, "worker:1", -9, at=now)
    assert restart.after_s == 1.0


def test_a_task_out_of_restarts_fails_the_run_and_is_its_root_cause() -> None:
    c = running(RestartPolicy("on-failure", max_restarts=2, backoff_base_s=0.0))
    for attempt in (1, 2):
        out = exit_(c, "worker:1", 1, at=float(attempt))
        # A zero backoff starts the next attempt at once.
        assert out == [RestartTask("worker:1", attempt, 0.0, "exit code 1"), StartTask("worker:1", attempt)]
        c.handle(TaskStarted("worker:1", attempt, at=float(attempt), handle=attempt))
    out = exit_(c, "worker:1", 1, at=3.0, report=report(2.9, "ValueError", "boom"))
    assert out == [StopTasks(("ps:0", "worker:0"), GRACE_S, "worker:1 failed (exit code 1); stopping the others")]
    exit_(c, "ps:0", -15, at=3.1)
    assert exit_(c, "worker:0", -15, at=3.2) == [RunFinished("failed", "worker:1", 1)]
    assert c.records["worker:1"].attempts == 3


def test_the_per_run_budget_is_shared_by_every_task() -> None:
    c = running(RestartPolicy("on-failure", max_restarts=5, max_restarts_per_run=1, backoff_base_s=1.0))
    assert isinstance(exit_(c, "worker:0", -9, at=1.0)[0], RestartTask)
    out = exit_(c, "worker:1", -9, at=1.5)  # the run's one restart is taken
    assert out == [StopTasks(("ps:0",), GRACE_S, "worker:1 failed (exit code -9 (SIGKILL)); stopping the others")]
    # worker:0's pending restart is cancelled: its exit stands, and the run ends without waiting for it.
    assert exit_(c, "ps:0", -15, at=1.6) == [RunFinished("failed", "worker:0", 1)]
    assert c.records["worker:0"].attempts == 1 and c.restarts == 0


@pytest.mark.parametrize("code,retryable", [(0, False), (1, False), (2, False), (127, False), (128, True), (137, True),
                                            (143, True), (255, True), (-9, True), (-15, True)])
def test_exit_code_policy_retries_128_to_255_and_signals_never_1_to_127(code: int, retryable: bool) -> None:
    assert RestartPolicy("exit-code").is_retryable("worker", code) is retryable


def test_exit_code_policy_in_a_run_restarts_a_137_and_fails_on_a_1() -> None:
    c = running(RestartPolicy("exit-code", backoff_base_s=2.0))
    assert exit_(c, "worker:0", 137, at=1.0) == [RestartTask("worker:0", 1, 2.0, "exit code 137")]
    out = exit_(c, "worker:1", 1, at=1.5)
    assert [type(d) for d in out] == [StopTasks] and out[0].tasks == ("ps:0",)  # worker:0 waits in its backoff
    assert exit_(c, "ps:0", -15, at=1.6) == [RunFinished("failed", "worker:0", 1)]  # the 137 came first


def test_always_restarts_a_ps_that_exits_early_but_never_a_finished_trainer() -> None:
    c = running(RestartPolicy("always", backoff_base_s=1.0))
    assert exit_(c, "ps:0", 0, at=1.0) == [RestartTask("ps:0", 1, 1.0, "exit code 0")]
    assert c.handle(TimeAdvanced(2.0)) == [StartTask("ps:0", 1)]
    c.handle(TaskStarted("ps:0", 1, at=2.0, handle=9))
    assert exit_(c, "worker:0", 0, at=5.0) == []  # completion, not a restart
    assert exit_(c, "worker:1", 0, at=5.0) == []
    assert exit_(c, "ps:0", 0, at=6.0) == [RunFinished("succeeded", None, 0)]  # draining: no restart
    assert c.records["ps:0"].attempts == 2


def test_a_trainer_that_dies_after_the_ps_finished_the_job_is_not_restarted_into_a_job_that_is_gone() -> None:
    # The chief (worker:0) evaluates after the ps exited 0 (every worker said done) and is killed there.
    c = running(RestartPolicy("on-failure", max_restarts=600, backoff_base_s=0.5))
    assert exit_(c, "worker:1", 0, at=5.0) == []
    assert exit_(c, "ps:0", 0, at=5.5) == []
    assert exit_(c, "worker:0", -9, at=6.0) == [RunFinished("failed", "worker:0", 1)]
    last = c.records["worker:0"].exits[-1]
    assert not last.restarted and "ps:0 exited 0" in last.not_restarted and c.restarts == 0
    # while the ps runs, the same death is restarted
    c = running(RestartPolicy("on-failure", max_restarts=600, backoff_base_s=0.5))
    assert exit_(c, "worker:1", 0, at=5.0) == []
    assert exit_(c, "worker:0", -9, at=6.0) == [RestartTask("worker:0", 1, 0.5, "exit code -9 (SIGKILL)")]


def test_draining_cancels_a_pending_restart_and_a_stop_cancels_one_too() -> None:
    c = running(RestartPolicy("on-failure", backoff_base_s=30.0))
    assert isinstance(exit_(c, "ps:0", -9, at=1.0)[0], RestartTask)
    exit_(c, "worker:0", 0, at=2.0)
    # Training is over: the ps's restart is not needed, and the run does not fail for it.
    assert exit_(c, "worker:1", 0, at=2.0) == [RunFinished("succeeded", None, 0)]

    c = running(RestartPolicy("on-failure", backoff_base_s=30.0))
    exit_(c, "worker:1", -9, at=1.0)
    assert c.handle(StopRequested("Ctrl-C", at=2.0))[0].tasks == ("ps:0", "worker:0")
    exit_(c, "ps:0", -15, at=2.1)
    assert exit_(c, "worker:0", -15, at=2.2) == [RunFinished("stopped", None, 130)]
    assert c.handle(TimeAdvanced(100.0)) == []  # no StartTask after the end


@pytest.mark.parametrize("kwargs,message", [
    ({"kind": "sometimes"}, "RestartPolicy: kind must be 'never', 'on-failure', 'always' or 'exit-code'; received 'sometimes'"),
    ({"max_restarts": -1}, "RestartPolicy: max_restarts must be >= 0; received -1"),
    ({"backoff_base_s": 5.0, "backoff_max_s": 1.0}, "backoff_base_s=5.0, backoff_max_s=1.0"),
])
def test_a_bad_policy_is_refused_with_the_value_received(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RestartPolicy(**kwargs)


def test_a_run_failed_by_a_lost_shard_restarts_nothing_and_names_the_ps() -> None:
    """A ps shard whose copies are both gone (the launcher's views say lost): the ps's restart would
    only meet the same loss, so the run fails at once with that as its root cause."""
    from psflow.launch.controller import RunFailed

    c = RunController(["ps:0", "ps:1", "worker:0"], grace_s=GRACE_S, ps_exit_timeout_s=60.0,
                      policy=RestartPolicy.parse("on-failure"))
    c.start(0.0)
    for i, t in enumerate(["ps:0", "ps:1", "worker:0"]):
        c.handle(TaskStarted(t, 0, 1.0 + i))
    reason = "ps shard 1 lost: ps:1 (attempt 0) exited while it served it and no synced copy existed"
    c.handle(TaskReported("ps:1", 0, {"task": "ps:1", "exception": "ShardLost", "message": reason, "time_unix": 5.0}, 5.0))
    out = c.handle(TaskExited("ps:1", 0, -9, 5.0))
    assert any(isinstance(d, RestartTask) for d in out)  # on its own, a SIGKILLed ps is restarted
    out = c.handle(RunFailed("ps:1", 0, reason, 5.0))
    assert [type(d) for d in out] == [StopTasks] and set(out[0].tasks) == {"ps:0", "worker:0"}
    assert c.records["ps:1"].state == "exited"  # its restart was cancelled
    for t in ("ps:0", "worker:0"):
        out = c.handle(TaskExited(t, 0, -15, 6.0))
    result = out[-1]
    assert isinstance(result, RunFinished) and result.status == "failed" and result.root_cause == "ps:1"
