"""The hang watchdog, stepped by hand through the run controller: heartbeats and progress in, stack
dumps, kills and restarts out (no processes, no clock). Also its settings and the fault shorthands."""

from __future__ import annotations

import re

import pytest
from test_controller import GRACE_S, TASKS

from psflow.errors import ConfigError
from psflow.fault import hang_spec, join_specs, parse_faults, slow_spec
from psflow.launch.controller import (
    DumpStacks,
    HeartbeatMissed,
    RestartPolicy,
    RestartTask,
    RunController,
    RunFinished,
    StacksDumped,
    StartTask,
    StopTasks,
    TaskExited,
    TaskHeartbeat,
    TaskProgressed,
    TaskStarted,
    TimeAdvanced,
)
from psflow.launch.watchdog import HangPolicy, StackDump, Watchdog

HANG_S = 3.0
DUMP_WAIT_S = 1.0
LOG = "runs/x/logs/worker-1.log"


def watched(policy: RestartPolicy | None = None, hangs: HangPolicy | None = None) -> RunController:
    """Every task started at t=0 and heard from (heartbeat, and a first step for the trainers) at t=1."""
    c = RunController(TASKS, grace_s=GRACE_S, ps_exit_timeout_s=60.0, policy=policy,
                      hangs=hangs or HangPolicy(hang_timeout_s=HANG_S, dump_wait_s=DUMP_WAIT_S))
    c.start(at=0.0)
    for i, t in enumerate(TASKS):
        c.handle(TaskStarted(t, 0, at=0.0, handle=100 + i))
    beat(c, 1.0, step=1)
    return c


def beat(c: RunController, at: float, *, step: int | None = None, skip: tuple[str, ...] = (),
         waiting: tuple[str, ...] = (), waiting_on: dict[str, str] | None = None) -> list:
    """A heartbeat from every task not in ``skip``; with ``step``, each trainer also reports it.
    ``waiting``: tasks that wait for their peers; ``waiting_on``: task -> the task it is blocked on."""
    out = []
    for t in TASKS:
        if t in skip:
            continue
        attempt = c.records[t].attempt
        out += c.handle(TaskHeartbeat(t, attempt, at, waiting=t in waiting, waiting_on=(waiting_on or {}).get(t)))
        if step is not None and t.startswith("worker"):
            out += c.handle(TaskProgressed(t, attempt, at, step))
    return out


def advance(c: RunController, until: float, *, stuck: str = "worker:1", **kw: object) -> list:
    """Every task beats each second up to ``until``; the trainers but ``stuck`` take a step each time."""
    out, t, step = [], 2.0, 2
    while t <= until:
        out += beat(c, t, skip=tuple(kw.get("skip", ())), waiting=tuple(kw.get("waiting", ())))
        for w in ("worker:0", "worker:1"):
            if w != stuck and w not in kw.get("skip", ()) and w not in kw.get("waiting", ()):
                out += c.handle(TaskProgressed(w, c.records[w].attempt, t, step))
        out += c.handle(TimeAdvanced(t))
        t, step = t + 1.0, step + 1
    return out


def test_a_worker_without_progress_gets_its_stacks_dumped_then_is_killed_and_restarted() -> None:
    c = watched(RestartPolicy("on-failure", backoff_base_s=0.5))
    out = advance(c, 4.0)
    assert out == []  # 3 s since its last step: not past the deadline yet
    [dump] = advance_to(c, 5.0)
    assert dump == DumpStacks("worker:1", 0, "worker:1 (attempt 0) made no progress for 4.0 s (hung); "
                                             "dumping its stacks into its log")
    assert c.handle(StacksDumped("worker:1", 0, 5.0, StackDump(LOG, 57))) == []
    assert c.handle(TimeAdvanced(5.5)) == []  # dump_wait_s not over
    [kill] = c.handle(TimeAdvanced(6.0))
    cause = f"hung: no progress for 4.0 s; stacks in {LOG} from line 57"
    assert kill == StopTasks(("worker:1",), 0.0, f"worker:1 (attempt 0) {cause}; killing it", warning=True)
    assert c.killed_hang("worker:1", 0).cause == cause
    [restart] = c.handle(TaskExited("worker:1", 0, -9, at=6.1))
    assert restart == RestartTask("worker:1", 1, 0.5, "exit code -9 (SIGKILL)")
    x = c.records["worker:1"].exits[-1]
    assert (x.cause, x.restarted, x.hang.kind, x.hang.stacks) == (cause, True, "hung", StackDump(LOG, 57))
    assert c.handle(TimeAdvanced(6.6)) == [StartTask("worker:1", 1)]
    assert c.handle(TaskStarted("worker:1", 1, at=6.7, handle=200)) == []
    assert c.records["worker:1"].hang is None and c.phase == "running"


def advance_to(c: RunController, at: float) -> list:
    """Like :func:`advance` for one more second, worker:1 still stuck."""
    out = beat(c, at)
    out += c.handle(TaskProgressed("worker:0", 0, at, 100 + int(at)))
    return out + c.handle(TimeAdvanced(at))


def test_a_hung_worker_that_may_not_be_restarted_fails_the_run_with_the_hang_as_its_cause() -> None:
    c = watched()  # restart: never
    advance(c, 4.0)
    advance_to(c, 5.0)
    c.handle(StacksDumped("worker:1", 0, 5.0, StackDump(LOG, 12)))
    [kill] = c.handle(TimeAdvanced(6.0))
    [stop] = c.handle(TaskExited("worker:1", 0, -9, at=6.1))
    assert stop.tasks == ("ps:0", "worker:0")
    assert stop.reason == f"worker:1 failed (hung: no progress for 4.0 s; stacks in {LOG} from line 12); stopping the others"
    c.handle(TaskExited("ps:0", 0, -15, at=6.2))
    assert c.handle(TaskExited("worker:0", 0, -15, at=6.3)) == [RunFinished("failed", "worker:1", 1)]


def test_progress_that_resumes_within_the_deadline_decides_nothing() -> None:
    c = watched()
    out = advance(c, 3.9)  # worker:1 quiet for 2.9 s of its 3 s
    out += c.handle(TaskProgressed("worker:1", 0, 3.95, 2))
    out += advance(c, 6.0, stuck="none")
    out += c.handle(TimeAdvanced(6.5))
    assert out == [] and all(r.hang is None for r in c.records.values())


def test_reports_that_repeat_the_same_step_are_not_progress() -> None:
    c = watched()
    out = []
    for t in (2.0, 3.0, 4.0, 5.0):
        out += beat(c, t)
        out += c.handle(TaskProgressed("worker:0", 0, t, int(t)))
        out += c.handle(TaskProgressed("worker:1", 0, t, 1))  # the same step again
    assert [(d.task, type(d).__name__) for d in out] == [("worker:1", "DumpStacks")]


def test_a_task_whose_heartbeats_stop_is_taken_for_frozen_ps_included() -> None:
    c = watched(RestartPolicy("on-failure"))
    out = advance(c, 5.0, stuck="none", skip=("ps:0",))  # the ps is SIGSTOPped after t=1
    assert out == [DumpStacks("ps:0", 0, "ps:0 (attempt 0) sent no heartbeat for 4.0 s (frozen); dumping its stacks into its log")]
    c.handle(StacksDumped("ps:0", 0, 5.0, StackDump("runs/x/logs/ps-0.log", 3)))
    [kill] = c.handle(TimeAdvanced(6.0))
    assert kill.tasks == ("ps:0",) and kill.grace_s == 0.0
    [restart] = c.handle(TaskExited("ps:0", 0, -9, at=6.1))
    assert restart.task == "ps:0"
    assert c.records["ps:0"].exits[-1].cause == ("frozen: no heartbeat for 4.0 s; stacks in runs/x/logs/ps-0.log from "
                                                 "line 3 (if the process could still run its signal handler)")


def test_a_worker_waiting_for_its_peers_is_not_the_hung_one() -> None:
    # sync: worker:1 hangs before its push; worker:0 has pushed and waits for the quorum (its heartbeats say so)
    c = watched()
    out = []
    for t in (2.0, 3.0, 4.0, 5.0):
        out += beat(c, t, waiting=("worker:0",))
        out += c.handle(TimeAdvanced(t))
    assert [(d.task, type(d).__name__) for d in out] == [("worker:1", "DumpStacks")]


def test_async_workers_blocked_on_a_frozen_ps_wait_and_the_ps_is_the_one_dumped_killed_and_restarted() -> None:
    # async: ps:0 is SIGSTOPped after t=1. Each worker's main thread blocks on its push's reply, its
    # heartbeats (a thread of their own) go on and say which ps it is blocked on; the ps sends none.
    c = watched(RestartPolicy("on-failure", backoff_base_s=0.5))
    on_ps = {"worker:0": "ps:0", "worker:1": "ps:0"}
    out = []
    for t in (2.0, 3.0, 4.0, 5.0):
        out += beat(c, t, skip=("ps:0",), waiting_on=on_ps)
        out += c.handle(TimeAdvanced(t))
    assert out == [DumpStacks("ps:0", 0, "ps:0 (attempt 0) sent no heartbeat for 4.0 s (frozen; worker:0 and worker:1 "
                                         "are blocked on it); dumping its stacks into its log")]
    assert c.records["ps:0"].hang.awaited_by == ("worker:0", "worker:1")
    c.handle(StacksDumped("ps:0", 0, 5.0, StackDump("runs/x/logs/ps-0.log", 3)))
    out = beat(c, 6.0, skip=("ps:0",), waiting_on=on_ps)
    [kill] = out + c.handle(TimeAdvanced(6.0))
    assert kill.tasks == ("ps:0",)
    [restart] = c.handle(TaskExited("ps:0", 0, -9, at=6.1))
    assert restart == RestartTask("ps:0", 1, 0.5, "exit code -9 (SIGKILL)")
    # The workers wait on through the ps's restart (blocked reconnecting), long past their progress deadline.
    out = []
    for t in (7.0, 8.0, 9.0, 10.0, 11.0):
        out += beat(c, t, skip=("ps:0",), waiting_on=on_ps)
        out += c.handle(TimeAdvanced(t))
    assert out == [StartTask("ps:0", 1)]
    assert [(r.task, r.attempt, len(r.exits)) for r in c.records.values()] == [
        ("ps:0", 1, 1), ("worker:0", 0, 0), ("worker:1", 0, 0)]


def test_a_worker_blocked_on_a_ps_is_watched_again_once_its_reply_came() -> None:
    w = Watchdog(HangPolicy(hang_timeout_s=HANG_S), training={"worker:0"})
    w.started("ps:0", 0)
    w.started("worker:0", 0)
    w.progressed("worker:0", 0, at=1.0, step=1)
    for t in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        w.heartbeat("ps:0", 0, at=t)
        w.heartbeat("worker:0", 0, at=t, waiting_on="ps:0")  # a slow reply: 5 s, past the 3 s deadline
    assert w.overdue(now=6.5) == []
    for t in (7.0, 8.0, 9.0, 10.0):
        w.heartbeat("ps:0", 0, at=t)
        w.heartbeat("worker:0", 0, at=t)  # the reply came; no step since: its own hang
    [hang] = w.overdue(now=10.0)
    assert (hang.task, hang.kind, hang.quiet_s, hang.awaited_by) == ("worker:0", "hung", 4.0, ())


def test_only_the_tasks_still_heard_from_are_named_as_blocked_on_a_frozen_ps() -> None:
    w = Watchdog(HangPolicy(hang_timeout_s=HANG_S), training={"worker:0", "worker:1"})
    for t in ("ps:0", "worker:0", "worker:1"):
        w.started(t, 0)
        w.heartbeat(t, 0, at=1.0)
    w.heartbeat("worker:1", 0, at=1.5, waiting_on="ps:0")  # then worker:1 froze too: its last word is stale
    for t in (2.0, 3.0, 4.0, 5.0):
        w.heartbeat("worker:0", 0, at=t, waiting_on="ps:0")
    hangs = {h.task: h for h in w.overdue(now=5.0)}
    assert (hangs["ps:0"].kind, hangs["ps:0"].awaited_by) == ("frozen", ("worker:0",))


def test_deadlines_are_armed_by_the_first_sign_of_each_attempt_not_by_its_start() -> None:
    c = RunController(TASKS, grace_s=GRACE_S, ps_exit_timeout_s=60.0, hangs=HangPolicy(hang_timeout_s=HANG_S))
    c.start(at=0.0)
    for t in TASKS:
        c.handle(TaskStarted(t, 0, at=0.0, handle=1))
    assert c.handle(TimeAdvanced(30.0)) == []  # still importing torch, waiting for the rendezvous: not watched
    beat(c, 31.0)  # heartbeats only: the trainers have taken no step yet
    assert c.handle(TimeAdvanced(33.0)) == []
    assert {d.task for d in c.handle(TimeAdvanced(34.5))} == {"ps:0", "worker:0", "worker:1"}  # no heartbeat since 31


def test_signs_from_an_attempt_already_replaced_are_ignored() -> None:
    w = Watchdog(HangPolicy(hang_timeout_s=HANG_S), training={"worker:1"})
    w.started("worker:1", 1)
    w.heartbeat("worker:1", 0, at=1.0)
    w.progressed("worker:1", 0, at=1.0, step=5)
    assert w.overdue(now=100.0) == []


def test_the_watchdog_off_decides_nothing_and_a_missed_heartbeat_is_only_counted() -> None:
    c = watched(hangs=HangPolicy())
    assert advance(c, 30.0) == []
    assert c.handle(HeartbeatMissed("worker:1", at=31.0)) == []
    assert c.heartbeats_missed == {"worker:1": 1}


def test_a_missed_heartbeat_notice_with_the_watchdog_on_counts_as_frozen() -> None:
    c = watched()
    [dump] = c.handle(HeartbeatMissed("worker:1", at=2.0))
    assert (dump.task, c.records["worker:1"].hang.kind) == ("worker:1", "frozen")


def test_a_dump_that_could_not_be_asked_for_says_why_and_the_task_is_killed_all_the_same() -> None:
    c = watched(RestartPolicy("on-failure"))
    advance(c, 4.0)
    advance_to(c, 5.0)
    c.handle(StacksDumped("worker:1", 0, 5.0, None, "SlurmBackend cannot signal a task for its stacks"))
    [kill] = c.handle(TimeAdvanced(6.0))
    assert kill.reason.endswith("no stacks (SlurmBackend cannot signal a task for its stacks); killing it")


def test_a_hung_task_that_ends_by_itself_before_the_kill_keeps_its_own_cause() -> None:
    c = watched(RestartPolicy("on-failure"))
    advance(c, 4.0)
    advance_to(c, 5.0)
    c.handle(StacksDumped("worker:1", 0, 5.0, StackDump(LOG, 9)))
    c.handle(TaskExited("worker:1", 0, 1, at=5.5))  # e.g. its sync timeout fired first
    assert c.records["worker:1"].exits[-1].cause == "exit code 1"
    assert c.handle(TimeAdvanced(6.0)) == []  # nothing left to kill


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"hang_timeout_s": 0}, "HangPolicy: hang_timeout_s must be > 0; received 0 (seconds (--hang-timeout)"),
    ({"hang_timeout_s": float("inf")}, "HangPolicy: hang_timeout_s must be a finite number; received inf (seconds (--hang-timeout)"),
    ({"hang_timeout_s": 3, "dump_wait_s": -1}, "HangPolicy: dump_wait_s must be >= 0; received -1"),
    ({"heartbeat_timeout_s": 5}, "--heartbeat-timeout 5 needs --hang-timeout"),
])
def test_bad_hang_settings_are_refused_naming_the_option_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        HangPolicy(**kwargs)


def test_a_deadline_shorter_than_two_reports_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--hang-timeout 1.5 is shorter than two progress reports \(progress_every_s=1\)"):
        HangPolicy(hang_timeout_s=1.5).check_intervals(progress_every_s=1.0, heartbeat_every_s=0.5)
    with pytest.raises(ConfigError, match=r"heartbeat deadline 1 s is shorter than two heartbeats"):
        HangPolicy(hang_timeout_s=5, heartbeat_timeout_s=1).check_intervals(progress_every_s=1.0, heartbeat_every_s=1.0)
    HangPolicy(hang_timeout_s=3).check_intervals(progress_every_s=1.0, heartbeat_every_s=1.0)


def test_hang_at_and_slow_map_onto_fail_at_faults() -> None:
    faults = parse_faults(join_specs("worker:0@step=5:kill", hang_spec("worker:1@step=20"), slow_spec("worker:2=0.2s")))
    assert [(f.task, f.step, f.action, f.seconds, f.attempt) for f in faults] == [
        ("worker:0", 5, "kill", 0.0, 0), ("worker:1", 20, "hang", 0.0, 0), ("worker:2", 0, "delay", 0.2, 0)]
    assert hang_spec("worker:1@step=3@attempt=1") == "worker:1@step=3:hang@attempt=1"
    assert slow_spec("worker:2=1,worker:3=.5s@attempt=2") == "worker:2@step=0:delay=1,worker:3@step=0:delay=0.5@attempt=2"
    assert join_specs(None, hang_spec(None), slow_spec("")) is None


@pytest.mark.parametrize(("spec", "make", "message"), [
    ("worker:1@20", hang_spec, r"--hang-at 'worker:1@20': use TASK@step=N\[@attempt=K\], e.g. worker:1@step=20"),
    ("worker:1@step=20:kill", hang_spec, r"--hang-at 'worker:1@step=20:kill': use TASK@step=N"),
    ("worker:2=fast", slow_spec, r"--slow 'worker:2=fast': use TASK=SECONDS\[s\]\[@attempt=K\], e.g. worker:2=0.2s"),
    ("worker:2", slow_spec, r"--slow 'worker:2': use TASK=SECONDS"),
])
def test_bad_hang_at_and_slow_specs_name_the_part_and_the_syntax(spec: str, make: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make(spec)  # type: ignore[operator]
