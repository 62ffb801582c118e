"""The root-cause rule over recorded runs: exits in the order the launcher saw them, and the error
reports the tasks wrote. The ps's own error texts come from a real ParameterStore, so a change of
wording there that the rule no longer reads fails here."""

from __future__ import annotations

import pytest
import torch

from psflow.config import TrainConfig
from psflow.errors import TrainingError
from psflow.launch.rootcause import TaskExit, blamed_tasks, root_cause
from psflow.optim import SGD
from psflow.ps.store import ParameterStore

TASKS = ["ps:0", "worker:0", "worker:1"]


def store(mode: str, *, n: int | None = None, m: int | None = None) -> ParameterStore:
    s = ParameterStore(shard=0, num_workers=2)
    cfg = TrainConfig(mode=mode, replicas_to_aggregate=n, total_num_replicas=m, staleness=1, sync_timeout_s=0.05).resolved(2)
    s.initialize({"w": torch.ones(2)}, optimizer=SGD(lr=0.1).to_dict(), config=cfg, placement_digest="d")
    return s


def ps_error(fn) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(TrainingError) as e:
        fn()
    return f"ps:0: {e.value}"  # as the worker's RemoteError carries it


def lost_worker_message() -> str:
    s = store("sync")
    s.push(0, 0, {"w": torch.ones(2)})
    s.worker_lost(1)
    return ps_error(lambda: s.pull(min_version=1, timeout_s=1.0))


def missing_worker_message() -> str:
    s = store("sync")
    s.push(0, 0, {"w": torch.ones(2)})
    return ps_error(lambda: s.pull(min_version=1, timeout_s=0.05))


def ssp_clock_message() -> str:
    s = store("ssp")
    s.clock(1, 1, timeout_s=0.05)
    return ps_error(lambda: s.clock(0, 6, timeout_s=0.05))


def report(t: float, exception: str, message: str) -> dict[str, object]:
    return {"time_unix": t, "exception": exception, "message": message}


def test_sync_killed_worker_is_the_cause_although_the_survivor_failed_first() -> None:
    # worker:1 SIGKILLed (no report); the ps fails worker:0's step naming it; worker:0's exit is seen first.
    exits = [TaskExit("worker:0", 1, 10.3), TaskExit("worker:1", -9, 10.4, stopped=True), TaskExit("ps:0", -15, 10.5, stopped=True)]
    reports = {"worker:0": report(10.1, "RemoteError", lost_worker_message())}
    assert root_cause(TASKS, exits, reports) == "worker:1"


def test_sync_stalled_worker_named_missing_by_the_ps_is_the_cause() -> None:
    # worker:1 sleeps past --sync-timeout; worker:0's step times out naming it; the launcher stops worker:1.
    exits = [TaskExit("worker:0", 1, 20.0), TaskExit("worker:1", -15, 20.5, stopped=True), TaskExit("ps:0", -15, 20.5, stopped=True)]
    reports = {"worker:0": report(19.9, "RemoteError", missing_worker_message())}
    assert root_cause(TASKS, exits, reports) == "worker:1"


def test_ssp_stalled_worker_with_the_lowest_clock_is_the_cause() -> None:
    exits = [TaskExit("worker:0", 1, 5.0), TaskExit("worker:1", -15, 5.2, stopped=True)]
    reports = {"worker:0": report(4.9, "RemoteError", ssp_clock_message())}
    assert root_cause(TASKS, exits, reports) == "worker:1"


@pytest.mark.parametrize("mode", ["async", "sync with backups", "ssp"])
def test_a_killed_worker_whose_exit_comes_first_is_the_cause(mode: str) -> None:
    # Async, sync with backups and ssp go on without the killed worker: its exit is the only failure.
    exits = [TaskExit("worker:1", -9, 3.0), TaskExit("worker:0", -15, 3.2, stopped=True), TaskExit("ps:0", -15, 3.2, stopped=True)]
    assert root_cause(TASKS, exits, {}) == "worker:1"


def test_a_stalled_worker_in_async_is_no_failure() -> None:
    exits = [TaskExit("worker:0", 0, 1.0), TaskExit("worker:1", 0, 9.0), TaskExit("ps:0", 0, 9.1)]
    assert root_cause(TASKS, exits, {}) is None


def test_a_dead_ps_is_the_cause_of_the_workers_lost_connections() -> None:
    exits = [TaskExit("worker:0", 1, 7.1), TaskExit("worker:1", 1, 7.2, stopped=True), TaskExit("ps:0", -9, 7.3, stopped=True)]
    reports = {
        "worker:0": report(7.0, "TransportError", "ps:0 closed the connection."),
        "worker:1": report(7.05, "TransportError", "Lost the connection to ps:0: [Errno 104] Connection reset by peer."),
    }
    assert root_cause(TASKS, exits, reports) == "ps:0"


def test_a_script_error_is_the_cause_and_blames_nobody() -> None:
    exits = [TaskExit("worker:1", 1, 2.0), TaskExit("worker:0", -15, 2.2, stopped=True), TaskExit("ps:0", -15, 2.2, stopped=True)]
    reports = {"worker:1": report(1.9, "ZeroDivisionError", "division by zero")}
    assert root_cause(TASKS, exits, reports) == "worker:1"


def test_a_blamed_task_with_its_own_error_is_followed_to_that_error() -> None:
    # worker:1 raised; the ps then failed worker:0's step naming worker:1 as lost: worker:1's error is the cause.
    exits = [TaskExit("worker:0", 1, 2.0), TaskExit("worker:1", 1, 2.1)]
    reports = {"worker:0": report(1.5, "RemoteError", lost_worker_message()),
               "worker:1": report(1.6, "ValueError", "bad batch")}
    assert root_cause(TASKS, exits, reports) == "worker:1"


def test_a_task_that_exited_cleanly_is_never_blamed() -> None:
    exits = [TaskExit("ps:0", 0, 1.0), TaskExit("worker:0", 1, 2.0)]
    reports = {"worker:0": report(1.9, "TransportError", "ps:0 closed the connection.")}
    assert root_cause(TASKS, exits, reports) == "worker:0"


def test_a_structured_blame_field_wins_over_the_message() -> None:
    r = {**report(1.0, "RemoteError", "ps:0: worker:0 lost its connection to ps shard 0"), "blame": "worker:1"}
    assert blamed_tasks("worker:0", r, TASKS) == ["worker:1"]


def test_the_ps_relaying_an_error_is_not_blamed_for_it() -> None:
    assert blamed_tasks("worker:0", report(1.0, "RemoteError", "ps:0: bad gradient shape"), TASKS) == []


def test_no_failure_no_root_cause() -> None:
    assert root_cause(TASKS, [TaskExit(t, 0, 1.0) for t in TASKS], {}) is None
