"""Restart groups in the run controller, stepped by hand: all-reduce ranks restart together
(torchrun's rule), and with one copy of each ps shard a ps's restart rolls every ps and training
task back together; a worker of such a job still restarts alone."""

from __future__ import annotations

from psflow.launch.controller import (
    RestartPolicy,
    RestartTask,
    RunController,
    RunFinished,
    StartTask,
    StopRequested,
    StopTasks,
    TaskExited,
    TaskStarted,
    TimeAdvanced,
)
from psflow.launch.restart import restart_group

GRACE_S = 5.0
RANKS = ["worker:0", "worker:1", "worker:2"]
PS_JOB = ["ps:0", "ps:1", "worker:0", "worker:1", "evaluator:0"]


def running(tasks: list[str], policy: RestartPolicy, strategy: str, ps_replicas: int = 1) -> RunController:
    c = RunController(tasks, grace_s=GRACE_S, ps_exit_timeout_s=60.0, policy=policy,
                      group=restart_group(strategy, ps_replicas, tasks))
    c.start(at=0.0)
    for i, t in enumerate(tasks):
        c.handle(TaskStarted(t, 0, at=0.1, handle=100 + i))
    return c


def exited(c: RunController, task: str, code: int, at: float) -> list:
    return c.handle(TaskExited(task, c.records[task].attempt, code, at))


def started(c: RunController, tasks, at: float) -> None:
    for t in tasks:
        assert c.handle(TaskStarted(t, c.records[t].attempt, at=at, handle=at)) == []


ON_FAILURE = RestartPolicy("on-failure", backoff_base_s=1.0)


def test_restart_group_per_strategy() -> None:
    assert restart_group("allreduce", 1, ["chief:0", "worker:0", "evaluator:0"]).members == ("chief:0", "worker:0")
    g = restart_group("ps", 1, PS_JOB)
    assert (g.members, g.triggers) == (("ps:0", "ps:1", "worker:0", "worker:1"), ("ps:0", "ps:1"))
    assert restart_group("ps", 2, PS_JOB) is None


def test_a_dead_rank_stops_the_others_and_the_whole_group_restarts_as_the_next_attempt() -> None:
    c = running(RANKS, ON_FAILURE, "allreduce")
    out = exited(c, "worker:1", -9, at=5.0)
    assert len(out) == 1 and isinstance(out[0], StopTasks) and out[0].tasks == ("worker:0", "worker:2"), out
    assert "worker:1 (attempt 0) killed (SIGKILL): restarting the all-reduce group" in out[0].reason
    # The survivors' exits (gloo errors, SIGTERM) are the restart's, not failures.
    assert exited(c, "worker:0", 1, at=5.5) == []
    out = exited(c, "worker:2", -15, at=5.6)
    assert out == [RestartTask(t, 1, 1.0, "worker:1 (attempt 0) killed (SIGKILL)", group="the all-reduce group")
                   for t in RANKS]
    assert c.handle(TimeAdvanced(6.0)) == []
    assert c.handle(TimeAdvanced(6.7)) == [StartTask(t, 1) for t in RANKS]
    assert c.phase == "running" and c.first_failure is None and c.restarts == 3
    assert [x.stopped for x in (c.records["worker:0"].exits[0], c.records["worker:1"].exits[0])] == [True, False]
    started(c, RANKS, at=7.0)
    for t in RANKS:
        exited(c, t, 0, at=20.0)
    assert c.result == RunFinished("succeeded", None, 0)
    assert all(r.attempts == 2 and r.exits[0].restarted for r in c.records.values())


def test_a_rank_whose_group_is_out_of_restarts_fails_the_run_as_its_root_cause() -> None:
    c = running(RANKS, RestartPolicy("on-failure", max_restarts=1, backoff_base_s=0.0), "allreduce")
    exited(c, "worker:2", -9, at=1.0)
    exited(c, "worker:0", 1, at=1.1)
    exited(c, "worker:1", 1, at=1.2)
    c.handle(TimeAdvanced(1.3))
    started(c, RANKS, at=1.4)
    out = exited(c, "worker:0", -9, at=2.0)  # every member at attempt 1 of 1: no second restart
    assert isinstance(out[0], StopTasks) and out[0].tasks == ("worker:1", "worker:2")
    assert "restart budget is spent" in c.records["worker:0"].exits[-1].not_restarted
    exited(c, "worker:1", -15, at=2.1)
    out = exited(c, "worker:2", -15, at=2.2)
    assert out == [RunFinished("failed", "worker:0", 1)]


def test_the_per_run_budget_counts_every_member_of_a_group_restart() -> None:
    c = running(RANKS, RestartPolicy("on-failure", max_restarts_per_run=2), "allreduce")
    exited(c, "worker:0", -9, at=1.0)
    assert "per run; the all-reduce group restarts 3 tasks" in c.records["worker:0"].exits[-1].not_restarted


def test_a_stop_while_the_group_is_being_stopped_cancels_its_restart() -> None:
    c = running(RANKS, ON_FAILURE, "allreduce")
    exited(c, "worker:1", -9, at=1.0)
    out = c.handle(StopRequested("Ctrl-C", at=1.1))
    assert isinstance(out[0], StopTasks)
    exited(c, "worker:0", -15, at=1.2)
    out = exited(c, "worker:2", -15, at=1.3)
    assert out == [RunFinished("stopped", None, 130)]  # as a single task's cancelled restart: no failure
    assert not c.records["worker:1"].exits[-1].restarted  # no restart came of it
    assert all(r.attempts == 1 for r in c.records.values())


def test_a_member_still_starting_when_the_group_restarts_is_stopped_once_it_starts() -> None:
    c = RunController(RANKS[:2], grace_s=GRACE_S, ps_exit_timeout_s=60.0, policy=ON_FAILURE,
                      group=restart_group("allreduce", 1, RANKS[:2]))
    c.start(at=0.0)
    c.handle(TaskStarted("worker:0", 0, at=0.1, handle=1))
    assert exited(c, "worker:0", -9, at=0.5) == []  # worker:1 has not started: nothing to stop yet
    out = c.handle(TaskStarted("worker:1", 0, at=0.6, handle=2))
    assert len(out) == 1 and out[0].tasks == ("worker:1",) and "the all-reduce group restarts" in out[0].reason
    assert [d.task for d in exited(c, "worker:1", -15, at=0.7)] == ["worker:0", "worker:1"]


def test_one_copy_ps_death_rolls_back_every_ps_and_training_task_but_not_the_evaluator() -> None:
    c = running(PS_JOB, ON_FAILURE, "ps", ps_replicas=1)
    out = exited(c, "ps:1", -9, at=3.0)
    assert out[0].tasks == ("ps:0", "worker:0", "worker:1")
    assert "every shard back to the newest checkpoint" in out[0].reason and out[0].grace_s == 0.0
    for t in ("ps:0", "worker:0", "worker:1"):
        out = exited(c, t, -15, at=3.5)
    assert sorted(d.task for d in out) == ["ps:0", "ps:1", "worker:0", "worker:1"]
    assert c.records["evaluator:0"].state == "running" and c.records["evaluator:0"].attempt == 0


def test_one_copy_ps_job_restarts_a_worker_alone_and_a_finished_worker_rejoins_a_rollback() -> None:
    c = running(PS_JOB, ON_FAILURE, "ps", ps_replicas=1)
    assert exited(c, "worker:1", -9, at=1.0) == [RestartTask("worker:1", 1, 1.0, "exit code -9 (SIGKILL)")]
    assert c.records["ps:0"].state == "running"
    c.handle(TimeAdvanced(2.0))
    started(c, ["worker:1"], at=2.1)
    assert exited(c, "worker:1", 0, at=5.0) == []  # finished its epochs
    out = exited(c, "ps:0", -9, at=6.0)  # the rollback takes it back to the checkpoint: it must redo its steps
    assert out[0].tasks == ("ps:1", "worker:0")
    exited(c, "ps:1", -15, at=6.1)
    out = exited(c, "worker:0", -15, at=6.2)
    assert {d.task: d.attempt for d in out} == {"ps:0": 1, "ps:1": 1, "worker:0": 1, "worker:1": 2}
