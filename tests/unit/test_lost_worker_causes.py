"""Why a worker is lost, as a ps shard knows it (issue 23, items 7 and 8): a worker whose PS_DONE says
it stopped on an error is waited for like a lost one (a launcher may restart it), not counted
finished; a worker that never sends anything is counted lost ``lost_worker_timeout_s`` after the
shard started; and the lost-worker messages say what happened and how long the shard really waited.

Rules stepped by hand (no threads, no clocks), then the store that drives them with a clock."""

from __future__ import annotations

import json

import pytest
import torch

from psflow import optim
from psflow.config import TrainConfig
from psflow.errors import TrainingError
from psflow.ps.rules import FAILED, NEVER_CONNECTED, Act, Decision, Event, On, RuleSettings, ShardRules
from psflow.ps.store import ParameterStore


def rules(mode: str = "async", workers: int = 2, *, n: int | None = None, m: int | None = None,
          lost_worker_timeout_s: float = 10.0, by_hand: bool = False) -> ShardRules:
    r = ShardRules(0, workers, keep_log=True)
    r.by_hand = by_hand
    r.configure(RuleSettings(mode, n, m, lost_worker_timeout_s=lost_worker_timeout_s), 0)
    return r


def acts(decisions: list[Decision]) -> list[tuple[str, tuple[int, ...]]]:
    return [(d.act.name, d.workers) for d in decisions]


# -- a worker that stopped on an error ---------------------------------------------------------------


def test_a_worker_that_stopped_on_an_error_is_lost_not_done_and_its_restart_is_waited_for() -> None:
    """The README's restart example: worker:1 fails (--fail-at), worker:0 finishes before the launcher
    has it back. A failed worker counted done would let the shard end with worker:1 still to come."""
    r = rules()
    r.join(0), r.join(1)
    r.push(0, 0), r.push(1, 1)
    r.worker_failed(1, 0, "TrainingError: injected fault at step 200")
    r.worker_done(0)
    assert r.done == {0} and r.lost == {1} and r.failed == {1}
    (wait,) = r.tick(100.0)
    assert wait.act is Act.WAIT_LOST and wait.workers == (1,)
    assert "worker:1 at global step 2: stopped on an error: TrainingError: injected fault at step 200" in wait.reason
    assert acts(r.join(1, 1)) == [("REJOINED", (1,)), ("BACK", (1,))]  # its restart: waited for as before
    assert r.failed == set() and r.why == {} and r.lost == set()
    assert r.tick(105.0) == [] and r.lost_wait_since is None
    r.worker_done(1, 1)
    assert r.done == {0, 1}


def test_a_failed_done_of_an_older_attempt_is_refused() -> None:
    r = rules()
    r.join(1, 1)
    (refused,) = r.worker_failed(1, 0, "ValueError: late")
    assert refused.act is Act.SUPERSEDED and r.lost == set()


def test_sync_without_backups_holds_the_step_for_a_failed_worker_and_names_its_error() -> None:
    r = rules("sync")
    r.push(0, 0)
    r.worker_failed(1, 0, "RuntimeError: CUDA out of memory")
    assert r.version == 0 and r.pending == {0}  # not done: the step still needs it (or its restart)
    message = r.lost_hold_message(2.0)
    assert message is not None and message.startswith(
        "worker:1 lost its connection to ps shard 0 without finishing (stopped on an error: RuntimeError: CUDA out of "
        "memory), and sync training without backup workers")


def test_by_hand_every_worker_stopped_on_an_error_fails_at_once_naming_the_first() -> None:
    """By hand nobody restarts them: waiting lost_worker_timeout_s would only delay the same end."""
    r = rules(by_hand=True)
    r.worker_failed(1, 0, "ConfigError: runs/default holds checkpoints")
    r.worker_failed(0, 0, "ConfigError: runs/default holds checkpoints (chief)")
    (fail,) = r.tick(3.0)
    assert fail.act is Act.FAIL and fail.workers == (0, 1)
    assert fail.reason == (
        "ps:0 has no worker left to serve: every one stopped without finishing, and no launcher restarts them. In "
        "the order they stopped (the first is the root cause): worker:1 at global step 0: stopped on an error: "
        "ConfigError: runs/default holds checkpoints; worker:0 at global step 0: stopped on an error: ConfigError: "
        "runs/default holds checkpoints (chief). Fix the cause, then start the job again.")


def test_under_a_launcher_every_worker_failing_is_waited_for() -> None:
    r = rules(by_hand=False)
    r.worker_failed(0, 0, "ValueError: a"), r.worker_failed(1, 0, "ValueError: b")
    assert acts(r.tick(3.0)) == [("WAIT_LOST", (0, 1))]  # the launcher restarts them, or stops the run


def test_by_hand_a_failed_worker_beside_a_finished_one_is_waited_for() -> None:
    r = rules(by_hand=True)
    r.worker_done(0)
    r.worker_failed(1, 0, "ValueError: a")
    assert acts(r.tick(3.0)) == [("WAIT_LOST", (1,))]  # it may be started again by hand


# -- a worker that never connects --------------------------------------------------------------------


def test_a_never_connected_worker_lost_with_every_other_done_fails_at_once() -> None:
    r = rules()
    r.join(0), r.push(0, 0)
    assert r.unheard() == [1]
    assert r.never_connected(1, 10.0) == [] and r.lost == {1} and r.never == {1}
    assert r.unheard() == []
    assert r.tick(11.0) == []  # worker:0 still trains
    r.worker_done(0)
    (fail,) = r.tick(12.0)
    assert fail.act is Act.FAIL and fail.workers == (1,)
    assert fail.reason.startswith("ps:0 gave up on worker:1: never connected within lost_worker_timeout_s (10 s) of "
                                  "the ps's start, and every other worker has finished.")


def test_never_connected_changes_nothing_for_a_finished_lost_joining_or_unknown_worker() -> None:
    r = rules(workers=4)
    r.worker_done(0), r.worker_lost(1)
    r.resize(5)  # worker:4 joins once it is ready
    seq = r.seq
    for worker in (0, 1, 4, 5):
        assert r.never_connected(worker, 10.0) == []
    assert r.seq == seq and r.never == set() and r.lost == {1}
    r.never_connected(2, 10.0)
    (event,) = [e for e in r.log or [] if isinstance(e, Event) and e.value == NEVER_CONNECTED]
    assert (event.on, event.worker, event.seconds) == (On.LOST, 2, 10.0)


def test_the_lost_worker_waits_are_recorded_ticks_a_copy_replays_alike() -> None:
    r = rules(workers=3, lost_worker_timeout_s=10.0)
    r.worker_done(0), r.worker_lost(1), r.worker_lost(2)
    (wait,) = r.tick(100.0)
    assert wait.reason == (
        "waiting for worker:1, worker:2 to finish (worker:1 at global step 0: its connection closed without PS_DONE: "
        "killed or crashed?; worker:2 at global step 0: its connection closed without PS_DONE: killed or crashed?); "
        "every other worker has finished. Giving up in 10 s unless it reconnects (lost_worker_timeout_s).")
    r.worker_back(1)
    assert r.tick(101.0) == [] and r.lost_wait_since is None  # the reset: a record too
    r.worker_lost(1)
    r.tick(102.0)
    (fail,) = r.tick(112.0)
    assert fail.reason == (
        "ps:0 waited 10.0 s for worker:1, worker:2 to come back (worker:1 at global step 0: its connection closed "
        "without PS_DONE: killed or crashed?; worker:2 at global step 0: its connection closed without PS_DONE: "
        "killed or crashed?); every other worker has finished. Restart a lost worker within lost_worker_timeout_s "
        "(10 s; --lost-worker-timeout, or in PSFLOW_TRAIN_CONFIG by hand), or see its log for why it stopped.")
    ticks = [e.seconds for e in r.log or [] if isinstance(e, Event) and e.on is On.TICK]
    assert ticks == [100.0, 101.0, 102.0, 112.0]
    copy = ShardRules.replay(0, 3, r.log or [])
    assert copy.state() == r.state() and copy.log == r.log


def test_workers_that_never_connected_and_nobody_finished_fail_at_once_naming_each() -> None:
    r = rules(workers=2)
    r.never_connected(0, 10.0), r.never_connected(1, 10.0)
    (fail,) = r.tick(11.0)
    assert fail.reason == (
        "ps:0 gave up on worker:0, worker:1: never connected within lost_worker_timeout_s (10 s) of the ps's start. "
        "Start it with the same cluster flags (is its host or port right?), or raise lost_worker_timeout_s "
        "(--lost-worker-timeout, or in PSFLOW_TRAIN_CONFIG by hand).")
    assert [e.seconds for e in r.log or [] if isinstance(e, Event) and e.on is On.TICK] == [11.0]
    assert ShardRules.replay(0, 2, r.log or []).log == r.log


def test_by_hand_a_failed_worker_and_one_that_never_connected_fail_at_once_naming_both() -> None:
    r = rules(by_hand=True)
    r.never_connected(1, 10.0)
    r.worker_failed(0, 0, "ValueError: x")
    (fail,) = r.tick(11.0)
    assert fail.reason == (
        "ps:0 has no worker left to serve: every one stopped without finishing, and no launcher restarts them. In "
        "the order they stopped (the first is the root cause): worker:0 at global step 0: stopped on an error: "
        "ValueError: x; worker:1 at global step 0: never connected. Fix the cause, then start the job again.")


def test_a_lost_worker_is_waited_for_at_the_step_it_was_lost_at() -> None:
    r = rules(workers=2)
    r.worker_lost(1)
    for step in range(3):
        r.push(0, step)
    r.worker_done(0)
    assert r.version == 3 and r.waiting_only_for_lost() == {1: 0}


def test_a_worker_lost_again_after_it_was_back_is_waited_for_at_the_later_step() -> None:
    r = rules(workers=2)
    r.worker_lost(1)
    r.worker_back(1)
    r.push(0, 0), r.push(1, 1)
    r.worker_lost(1)
    r.worker_done(0)
    assert r.waiting_only_for_lost() == {1: 2}


def test_ssp_a_worker_back_keeps_its_clock_and_a_done_one_has_none() -> None:
    r = rules("ssp", workers=2)
    r.clock(0, 2), r.clock(1, 4)
    r.worker_lost(1)
    assert r.clocks == {0: 2} and r.lost_clocks == {1: 4}
    r.worker_back(1)
    assert r.clocks == {0: 2, 1: 4} and r.lost_clocks == {}
    r.worker_done(0)
    assert r.clocks == {1: 4}


def test_any_first_request_counts_a_worker_heard() -> None:
    r = rules("ssp", workers=3)
    r.push(0, 0)
    r.clock(1, 2)  # a clock numbered like a never-connected loss: heard all the same
    assert r.unheard() == [2]


def test_a_never_connected_worker_that_comes_after_all_is_back() -> None:
    r = rules()
    r.never_connected(1, 10.0)
    assert acts(r.join(1)) == [("BACK", (1,))] and r.never == set() and r.unheard() == [0]


def test_sync_with_a_backup_goes_on_once_a_never_connected_worker_is_counted_lost() -> None:
    r = rules("sync", workers=3, n=2, m=3)
    r.push(0, 0)
    assert r.version == 0
    assert acts(r.never_connected(2, 10.0)) == []
    r.push(1, 0)
    assert r.version == 1


def test_the_wait_for_lost_workers_says_how_long_it_really_waited() -> None:
    r = rules(lost_worker_timeout_s=30.0)
    r.worker_done(0)
    r.worker_lost(1)
    r.tick(100.0)
    (fail,) = r.tick(136.25)
    assert fail.reason.startswith("ps:0 waited 36.2 s for worker:1 to come back"), fail.reason


def test_failed_and_never_connected_losses_replay_and_restore_to_the_same_state() -> None:
    r = rules("sync", workers=3, n=2, m=3)
    r.push(0, 0)
    r.worker_failed(1, 0, "ValueError: x")
    r.never_connected(2, 12.5)
    lost_events = [e for e in r.log or [] if getattr(e, "on", None) is On.LOST]
    assert [(e.worker, e.value) for e in lost_events] == [(1, FAILED), (2, NEVER_CONNECTED)]
    assert ShardRules.replay(0, 3, r.log or []).state() == r.state()
    assert ShardRules.restore(0, 3, json.loads(json.dumps(r.export()))).state() == r.state()


# -- the store: its clock, PS_DONE that says why ------------------------------------------------------


def _store(workers: int = 2, timeout_s: float = 5.0) -> ParameterStore:
    store = ParameterStore(0, workers)
    store.initialize({"w": torch.zeros(2)}, optimizer=optim.SGD(lr=0.1).to_dict(),
                     config=TrainConfig(lost_worker_timeout_s=timeout_s), placement_digest="d")
    return store


def test_the_store_counts_a_silent_worker_lost_after_the_timeout_from_its_first_tick() -> None:
    store = _store()
    store.join(0)
    assert store.tick(1000.0) == []  # the clock starts here (the ps's start)
    assert store.tick(1004.9) == [] and store.lost_workers == set()
    store.tick(1005.0)
    assert store.lost_workers == {1} and store.rules.never == {1}
    store.worker_done(0)
    (fail,) = [d for d in store.tick(1006.0) if d.act is Act.FAIL]
    assert "gave up on worker:1: never connected" in fail.reason


def test_the_store_takes_the_ps_own_timeout_before_the_chief_initializes_it() -> None:
    store = ParameterStore(0, 2)
    store.expect(TrainConfig(lost_worker_timeout_s=2.0), by_hand=True)
    store.worker_done(1, 0, failed="ConfigError: bad flag")
    assert store.done_workers == {1} and not store.all_done()  # said PS_DONE, did not finish
    store.tick(0.0)
    store.worker_lost(0)  # the chief's connection closed before it initialized anything
    (wait,) = store.tick(1.0)
    assert wait.act is Act.WAIT_LOST and "Giving up in 2 s" in wait.reason


def test_a_failed_done_to_the_store_raises_for_an_older_attempt() -> None:
    store = _store()
    store.join(1, 1)
    with pytest.raises(TrainingError, match="attempt 1 of worker:1 has joined since"):
        store.worker_done(1, 0, failed="ValueError: late")


# -- a chief that stays for its final checkpoint (issue 23 item 9) -------------------------------------


def test_a_staying_worker_counts_done_for_the_quorum_but_the_shard_serves_it_until_its_last_done() -> None:
    r = rules("sync", workers=3, n=2, m=3)
    r.push(1, 0)
    assert r.worker_done(0, stays=True) == [] and r.needed() == 2  # done: the backup quorum is still 2 of 2 live
    assert acts(r.push(2, 0)) == [("HOLD", (2,)), ("APPLY", (1, 2))]
    r.worker_done(1)
    assert r.needed() == 1 and acts(r.push(2, 1)) == [("HOLD", (2,)), ("APPLY", (2,))]  # goes on alone
    r.worker_done(2)
    assert not r.is_finished() and r.staying == {0}  # the chief's final checkpoint is still to come
    r.worker_done(0)
    assert r.is_finished() and r.staying == set()
    assert ShardRules.replay(0, 3, r.log or []).state() == r.state()


def test_a_staying_worker_that_never_ends_fails_the_shard_after_the_timeout() -> None:
    r = rules(lost_worker_timeout_s=10.0)
    r.worker_done(0, stays=True), r.worker_done(1)
    assert r.tick(100.0) == [] and r.tick(109.0) == []  # quiet: it writes its final checkpoint now
    (fail,) = r.tick(110.5)
    assert fail.act is Act.FAIL and fail.workers == (0,)
    assert fail.reason.startswith("ps:0 waited 10.5 s for worker:0 to end after every worker finished training")


def test_a_staying_workers_wait_is_recorded_and_its_failure_at_the_deadline_names_each_and_the_timeout() -> None:
    r = rules(workers=3, lost_worker_timeout_s=10.0)
    r.worker_done(0, stays=True), r.worker_done(2, stays=True), r.worker_done(1)
    assert r.tick(100.0) == [] and r.lost_wait_since == 100.0  # the wait starts, recorded for a backup
    (fail,) = r.tick(110.0)  # the deadline itself: not a moment more
    assert fail.act is Act.FAIL and fail.workers == (0, 2)
    assert fail.reason == (
        "ps:0 waited 10.0 s for worker:0, worker:2 to end after every worker finished training: it said it stays for "
        "its final duties (the chief's final checkpoint) and never said it is done (killed, or stuck?); "
        "lost_worker_timeout_s is 10 s. See its log.")
    ticks = [(e.on, e.seconds) for e in r.log or [] if isinstance(e, Event) and e.on not in (On.CONFIGURE, On.DONE)]
    assert ticks == [(On.TICK, 100.0), (On.TICK, 110.0)]
    copy = ShardRules.replay(0, 3, r.log or [])
    assert copy.state() == r.state() and copy.log == r.log


def test_a_failed_done_of_a_finished_joining_or_unknown_worker_changes_nothing() -> None:
    r = rules(workers=3)
    r.worker_done(0)
    r.resize(4)  # worker:3 joins once it is ready
    seq = r.seq
    assert r.worker_failed(0, 0, "ValueError: after its done") == []
    assert r.worker_failed(3, 0, "ValueError: before its readiness") == []
    assert r.worker_failed(4, 0, "ValueError: not a member") == []
    assert r.seq == seq and r.lost == set() and r.failed == set()


def test_a_failed_done_without_attempt_or_error_is_attempt_0_and_the_wait_says_see_its_log() -> None:
    r = rules()
    r.worker_failed(1)
    r.worker_done(0)
    (wait,) = r.tick(1.0)
    assert "(worker:1 at global step 0: stopped on an error: see its log)" in wait.reason
    assert acts(r.join(1)) == [("BACK", (1,))]  # its own attempt again, not an older one


def test_a_copy_that_replays_a_failed_done_knows_its_attempt_and_error_and_refuses_an_older_one_the_same() -> None:
    r = rules()
    r.worker_failed(1, 2, "ValueError: boom")
    (refused,) = r.worker_failed(1, 1, "ValueError: older")
    assert refused.act is Act.SUPERSEDED and refused.reason == (
        "ps shard 0 dropped a PS_DONE of worker:1 attempt 1: attempt 2 of worker:1 has joined since (the task was "
        "restarted). An earlier attempt of a task that is still running must stop; its work is redone by the newer one.")
    copy = ShardRules.replay(0, 2, r.log or [])
    assert copy.state() == r.state() and copy.log == r.log
    assert copy.attempts == {1: 2} and copy.why == {1: "ValueError: boom"}
