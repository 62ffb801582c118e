"""The ps shard's rules (ShardRules) stepped through scripted event sequences: no threads, no
tensors, no clocks. Each test reads as the log of one shard: events in, decisions out."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psflow.config import TrainConfig
from psflow.ps.rules import Act, Decision, Event, On, RuleSettings, ShardRules


def rules(mode: str = "sync", workers: int = 3, *, n: int | None = None, m: int | None = None, staleness: int = 1,
          stop_at: int | None = None, lost_worker_timeout_s: float = 10.0, version: int = 0) -> ShardRules:
    r = ShardRules(0, workers, keep_log=True)
    r.configure(RuleSettings(mode, n, m, staleness, stop_at, lost_worker_timeout_s), version)
    return r


def acts(decisions: list[Decision]) -> list[tuple[str, tuple[int, ...]]]:
    return [(d.act.name, d.workers) for d in decisions]


# -- sync: a quorum of N out of M ------------------------------------------------------------------


def test_sync_applies_the_first_n_pushes_of_a_step_and_drops_the_backups_as_stale() -> None:
    r = rules(n=2, m=3)
    assert acts(r.push(2, 0)) == [("HOLD", (2,))]
    decisions = r.push(0, 0)
    assert acts(decisions) == [("HOLD", (0,)), ("APPLY", (0, 2))]  # worker order, not arrival order
    assert decisions[-1].version == 1 and decisions[-1].without_all  # worker:1 did not contribute
    assert acts(r.push(1, 0)) == [("DROP_STALE", (1,))]  # the backup: computed from version 0, now 1
    assert r.version == 1 and r.pending == set()
    # The next step: the slow worker is on time, another is the backup.
    assert acts(r.push(1, 1)) == [("HOLD", (1,))]
    assert acts(r.push(0, 1)) == [("HOLD", (0,)), ("APPLY", (0, 1))]
    assert acts(r.push(2, 1)) == [("DROP_STALE", (2,))]
    assert r.version == 2


def test_sync_without_backups_waits_for_every_worker() -> None:
    r = rules(workers=3)
    assert acts(r.push(0, 0) + r.push(1, 0)) == [("HOLD", (0,)), ("HOLD", (1,))]
    assert r.needed() == 3 and r.version == 0
    (_, apply) = r.push(2, 0)
    assert (apply.act, apply.workers, apply.version, apply.without_all) == (Act.APPLY, (0, 1, 2), 1, False)


def test_a_second_push_of_a_worker_in_the_same_step_is_stale() -> None:
    r = rules(workers=2)
    r.push(0, 0)
    assert acts(r.push(0, 0)) == [("DROP_STALE", (0,))]
    assert r.pending == {0}


def test_a_push_from_a_version_the_shard_has_not_reached_fails_naming_both() -> None:
    r = rules(workers=2)
    (fail,) = r.push(1, 5)
    assert fail.act is Act.FAIL and fail.workers == (1,) and fail.reason == (
        "worker:1 pushed gradients for version 5, but ps shard 0 is at version 0. The worker pulled from a different "
        "job or a restarted ps; restart the worker.")
    assert r.pending == set() and r.version == 0


def test_a_finished_worker_lowers_the_quorum_and_may_complete_the_step() -> None:
    r = rules(workers=2)
    r.push(0, 0)
    (apply,) = r.worker_done(1)
    assert (apply.act, apply.workers, apply.without_all) == (Act.APPLY, (0,), False)  # done is not missing


# -- sync: lost workers ------------------------------------------------------------------------------


def test_with_backups_a_lost_worker_lowers_the_quorum_and_its_held_gradient_leaves_with_it() -> None:
    r = rules(n=2, m=3)
    r.push(0, 0)
    assert r.worker_lost(0) == []  # lost: its gradient is no longer held; nobody fails (one backup)
    assert r.pending == set() and r.needed() == 2 and r.lost_hold_message(1.0) is None
    r.push(1, 0)
    assert acts(r.worker_lost(2)) == [("APPLY", (1,))]  # one live worker left: a step of one
    assert r.version == 1 and r.lost_at == {0: 0, 2: 0}


def test_without_backups_a_step_is_held_for_a_lost_worker_until_it_is_back() -> None:
    r = rules(workers=2)
    r.push(0, 0)
    assert r.worker_lost(1) == []  # no FAIL: the step is held (until the waiting pulls' deadline)
    assert r.pending == {0} and r.needed() == 2 and r.version == 0
    reason = r.lost_hold_message(2.5)
    assert reason is not None and reason == r.sync_wait_message(1, 2.5)
    assert reason.startswith("worker:1 lost its connection to ps shard 0 without finishing")
    assert "(replicas_to_aggregate = total_num_replicas = 2)" in reason and "held 2.5 s (sync_timeout_s)" in reason
    assert acts(r.worker_back(1)) == [("BACK", (1,))]
    assert r.lost_hold_message(2.5) is None and r.lost == set()
    assert acts(r.push(1, 0)) == [("HOLD", (1,)), ("APPLY", (0, 1))]


def test_a_lost_worker_that_pushes_is_back_in_the_same_event() -> None:
    r = rules("async", workers=2)
    r.worker_lost(1)
    assert acts(r.push(1, 0)) == [("BACK", (1,)), ("APPLY", (1,))]
    assert r.lost == set()


def test_events_that_change_nothing_are_not_recorded() -> None:
    r = rules(workers=2)
    seq = r.seq
    assert r.worker_back(0) == [] and r.seq == seq  # not lost
    r.worker_done(1)
    seq = r.seq
    assert r.worker_lost(1) == [] and r.seq == seq  # lost after done: nothing
    assert r.tick(5.0) == [] and r.seq == seq  # nobody lost: no wait to start
    r.worker_done(0)
    seq = r.seq
    assert r.tick(6.0) == [] and r.tick(100.0) == [] and r.seq == seq  # every worker done, none stays: no wait
    assert r.is_finished()


def test_the_sync_wait_message_names_the_missing_workers() -> None:
    r = rules(workers=3)
    r.push(1, 0)
    assert r.sync_wait_message(1, 0.25) == (
        "Sync step 0 on ps shard 0 waited 0.2 s for version 1: has 1 of 3 gradients; missing worker:0, worker:2. "
        "There are no backup workers (replicas_to_aggregate == total_num_replicas). A worker is dead or stalled: "
        "restart it, add backup workers, or raise sync_timeout_s.")


def test_the_sync_wait_message_with_every_worker_lost_and_backups_says_none_is_missing() -> None:
    r = rules(n=1, m=2, workers=2)
    r.worker_lost(0), r.worker_lost(1)
    assert r.sync_wait_message(1, 1.0) == (
        "Sync step 0 on ps shard 0 waited 1.0 s for version 1: has 0 of 1 gradients; missing none. A worker is dead or "
        "stalled: restart it, add backup workers, or raise sync_timeout_s.")


def test_a_step_held_for_two_lost_workers_names_each_and_its_cause() -> None:
    r = rules(workers=3)
    r.push(0, 0)
    r.worker_lost(1), r.worker_failed(2, 0, "ValueError: x")
    message = r.lost_hold_message(1.0)
    assert message is not None and message.startswith(
        "worker:1, worker:2 lost its connection to ps shard 0 without finishing (killed or crashed?; stopped on an "
        "error: ValueError: x), and sync training without backup workers (replicas_to_aggregate = "
        "total_num_replicas = 3)")


def test_a_step_held_for_a_worker_that_never_connected_says_so() -> None:
    r = rules(workers=2)
    r.push(0, 0)
    r.never_connected(1, 10.0)
    message = r.lost_hold_message(1.0)
    assert message is not None and message.startswith(
        "worker:1 lost its connection to ps shard 0 without finishing (never connected), and sync training")


# -- the lost-worker deadline, time passed in ----------------------------------------------------------


def test_only_lost_workers_left_start_a_wait_that_fails_at_its_deadline() -> None:
    r = rules("async", workers=2, lost_worker_timeout_s=10.0)
    r.push(0, 0)
    r.worker_lost(1)
    assert r.tick(100.0) == []  # worker:0 still trains: nobody waits for worker:1
    r.worker_done(0)
    (wait,) = r.tick(200.0)
    assert wait.act is Act.WAIT_LOST and wait.workers == (1,)
    assert ("waiting for worker:1 to finish (worker:1 at global step 1: its connection closed without PS_DONE: "
            "killed or crashed?)") in wait.reason
    assert r.tick(209.9) == []
    (fail,) = r.tick(210.0)
    assert fail.act is Act.FAIL and fail.reason.startswith("ps:0 waited 10.0 s for worker:1 to come back")


def test_a_lost_worker_back_before_the_deadline_resets_the_wait() -> None:
    r = rules("async", workers=2, lost_worker_timeout_s=10.0)
    r.worker_done(0)
    r.worker_lost(1)
    assert acts(r.tick(0.0)) == [("WAIT_LOST", (1,))]
    r.worker_back(1)
    assert r.tick(9.0) == [] and r.lost_wait_since is None  # the reset is recorded: replay must see it
    r.worker_lost(1)
    assert acts(r.tick(15.0)) == [("WAIT_LOST", (1,))]
    assert r.tick(24.0) == [] and acts(r.tick(25.0)) == [("FAIL", (1,))]


# -- ssp: bounded staleness ----------------------------------------------------------------------------


def test_ssp_holds_a_worker_too_far_ahead_and_releases_it_when_the_slowest_clocks() -> None:
    r = rules("ssp", workers=2, staleness=1)
    (first,) = r.clock(0, 0)
    assert (first.act, first.slowest) == (Act.RELEASE, 0)
    (ahead,) = r.clock(0, 1)
    assert (ahead.act, ahead.slowest) == (Act.RELEASE, 0)  # worker:1 has no clock yet: it counts as 0
    (held,) = r.clock(0, 2)
    assert (held.act, held.clock) == (Act.HOLD, 2) and r.is_held(0, 2)
    own, release = r.clock(1, 1)
    assert (own.act, own.workers, own.slowest) == (Act.RELEASE, (1,), 1)
    assert (release.act, release.workers, release.clock, release.slowest) == (Act.RELEASE, (0,), 2, 1)
    assert r.held == set()


def test_ssp_releases_a_held_worker_when_the_slowest_is_lost_or_done() -> None:
    for leave in ("worker_lost", "worker_done"):
        r = rules("ssp", workers=2, staleness=0)
        r.clock(1, 0)
        assert acts(r.clock(0, 1)) == [("HOLD", (0,))]
        (release,) = getattr(r, leave)(1)
        assert (release.act, release.slowest) == (Act.RELEASE, 1), leave  # alone: its own clock


def test_an_ssp_wait_that_runs_out_fails_with_the_clocks() -> None:
    r = rules("ssp", workers=2, staleness=1)
    r.clock(0, 2)
    (fail,) = r.clock_expired(0, 2, 0.5)
    assert fail.act is Act.FAIL and fail.reason == (
        "worker:0 at clock 2 waited 0.5 s for the slowest worker (clocks {0: 2}, staleness 1). "
        "A worker is stalled or dead; raise sync_timeout_s or restart it.")
    assert r.held == set()
    assert (fail.workers, fail.clock) == ((0,), 2)
    expired = [e for e in r.log or [] if isinstance(e, Event) and e.on is On.CLOCK_EXPIRED]
    assert [(e.worker, e.value, e.seconds) for e in expired] == [(0, 2, 0.5)]  # a backup replays the same failure
    assert ShardRules.replay(0, 2, r.log or []).state() == r.state()
    assert r.clock(1, 1)[-1].act is Act.RELEASE and len(r.clock(1, 1)) == 1  # nobody left to release


def test_ssp_counts_a_clocks_pipelined_steps_against_the_bound_and_a_copy_decides_the_same() -> None:
    """``ahead``: the steps past its clock a pipelined worker computes from the values it reads next."""
    r = rules("ssp", workers=2, staleness=2)
    r.clock(1, 0)
    (first,) = r.clock(0, 0, ahead=2)
    assert (first.act, first.slowest) == (Act.RELEASE, 0)  # 0 + 2 is within 2 of worker:1's 0
    assert acts(r.clock(0, 1, ahead=2)) == [("HOLD", (0,))]  # 1 + 2 is not: without ahead it would go
    assert r.clocks == {0: 1, 1: 0}  # the others' bound sees the clock, not the steps ahead
    (fail,) = ShardRules.restore(0, 2, r.export()).clock_expired(0, 1, 0.5)  # a copy knows the steps ahead
    assert fail.reason.startswith("worker:0 at clock 1 (and 2 pipelined steps ahead) waited 0.5 s")
    copy = ShardRules.replay(0, 2, r.log or [])
    _own, release = r.clock(1, 1)
    assert (release.act, release.workers, release.clock, release.slowest) == (Act.RELEASE, (0,), 1, 1)
    assert copy.clock(1, 1)[1:] == [release]
    assert acts(r.clock(1, 2, ahead=1)) == [("RELEASE", (1,))]  # 2 + 1 is within 2 of worker:0's 1


def test_ssp_the_chiefs_settings_release_a_clock_held_under_the_defaults_before_them() -> None:
    r = ShardRules(0, 2, keep_log=True)
    r.settings = RuleSettings("ssp", staleness=4)  # before PS_INIT
    assert acts(r.clock(0, 6)) == [("HOLD", (0,))]  # worker:1 has no clock: 6 ahead
    (release,) = r.configure(RuleSettings("ssp", staleness=10))
    assert (release.act, release.workers, release.clock, release.slowest) == (Act.RELEASE, (0,), 6, 0)


def test_ssp_a_lost_workers_held_wait_is_released_once_nobody_is_left_to_wait_for() -> None:
    r = rules("ssp", workers=2, staleness=0)
    assert acts(r.clock(0, 1)) == [("HOLD", (0,))]
    assert r.worker_lost(0) == []  # still held: worker:1 has no clock yet
    (release,) = r.worker_done(1)
    assert (release.act, release.workers, release.slowest) == (Act.RELEASE, (0,), 1)


def test_ssp_applies_every_push() -> None:
    r = rules("ssp", workers=2)
    assert acts(r.push(0, 0) + r.push(0, 0)) == [("APPLY", (0,)), ("APPLY", (0,))]


# -- async and the stop ----------------------------------------------------------------------------


def test_async_applies_everything_old_or_not() -> None:
    r = rules("async", workers=3)
    decisions = r.push(0, 0) + r.push(1, 0) + r.push(2, 0) + r.push(0, 1)
    assert [d.act for d in decisions] == [Act.APPLY] * 4
    assert [d.version for d in decisions] == [1, 2, 3, 4] and r.version == 4


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_no_update_is_applied_at_or_past_the_stop(mode: str) -> None:
    r = rules(mode, workers=1, stop_at=12, version=10)
    r.push(0, 10), r.push(0, 11)
    assert r.version == 12
    assert acts(r.push(0, 12)) == [("STOPPED", (0,))] and r.version == 12


def test_settings_come_from_the_train_config_and_the_step_plan() -> None:
    cfg = TrainConfig(mode="sync", replicas_to_aggregate=2, total_num_replicas=3, staleness=2,
                      lost_worker_timeout_s=7.0)
    assert RuleSettings.of(cfg, 100) == RuleSettings("sync", 2, 3, 2, 100, 7.0)


# -- sequence numbers and replay -----------------------------------------------------------------------


def _scripted() -> ShardRules:
    r = rules(n=2, m=3, workers=3)
    r.push(2, 0), r.push(0, 0), r.push(1, 0)
    r.push(0, 1), r.worker_lost(1), r.push(2, 1)
    r.worker_done(0), r.worker_back(1), r.push(1, 2), r.tick(3.0)
    r.worker_done(2), r.worker_lost(1), r.tick(4.0), r.tick(50.0)
    return r


def test_every_record_takes_the_next_sequence_number_and_decisions_name_their_event() -> None:
    r = _scripted()
    assert r.log is not None
    assert [rec.seq for rec in r.log] == list(range(1, r.seq + 1))
    event = None
    for rec in r.log:
        if isinstance(rec, Event):
            event = rec
        else:
            assert event is not None and rec.cause == event.seq


def test_replaying_the_log_reproduces_the_state_and_the_decisions() -> None:
    r = _scripted()
    assert r.log is not None
    copy = ShardRules.replay(0, 3, r.log)
    assert copy.state() == r.state() and copy.log == r.log
    assert copy.state()["version"] == 3 and copy.lost == {1}


def test_replay_refuses_a_log_with_a_gap_or_other_decisions() -> None:
    r = _scripted()
    assert r.log is not None
    with pytest.raises(ValueError, match="Replay expected the event numbered 2"):
        ShardRules.replay(0, 3, r.log[:1] + r.log[3:])  # the first push and its decision left out
    with pytest.raises(ValueError, match="the log holds \\[\\]"):
        ShardRules.replay(0, 3, r.log[:2] + r.log[3:])  # a decision left out
    with pytest.raises(ValueError, match=re.escape("or not one of a shard with 2 workers")):
        ShardRules.replay(0, 2, r.log)


def test_replay_refusals_say_what_the_log_holds_and_what_replay_needs() -> None:
    r = ShardRules(0, 2, keep_log=True)
    r.configure(RuleSettings("sync"))
    r.push(0, 0), r.push(1, 0)
    assert r.log is not None
    with pytest.raises(ValueError) as wrong:
        ShardRules.replay(0, 3, r.log)  # a step of 3 gradients: the second push is held, not applied
    assert re.search(r"decided \[Decision\(seq=5, act=<Act.HOLD: 'hold'>.*\]; the log holds \[Decision\(seq=5, "
                     r"act=<Act.HOLD: 'hold'>.*, Decision\(seq=6, act=<Act.APPLY: 'apply'>.*\]\. The log is not a "
                     r"shard's whole log, or not one of a shard with 3 workers\.$", str(wrong.value))
    with pytest.raises(ValueError) as late:
        ShardRules.replay(0, 2, r.log[1:])
    assert str(late.value).startswith("Replay expected the event numbered 1; the log has Event(seq=2, ")
    assert str(late.value).endswith(". Replay needs a shard's whole log, in order, from its first record.")


def test_a_replay_of_a_shard_started_after_a_scale_keeps_its_launch_size() -> None:
    r = ShardRules(0, 3, keep_log=True, launch_workers=2)  # a ps restarted after a grow from 2 to 3
    r.configure(RuleSettings("sync", 1, 2))  # one backup, written for the 2 launched
    assert r.quorum() == (2, 3)
    r.push(0, 0), r.push(1, 0)
    assert ShardRules.replay(0, 3, r.log or [], launch_workers=2).state() == r.state()


def test_a_recorded_event_without_its_worker_or_value_is_refused() -> None:
    r = rules(workers=2)
    for on in (On.PUSH, On.CLOCK, On.DONE, On.LOST, On.BACK):
        with pytest.raises(ValueError, match="^" + re.escape(
                "A recorded push, clock, done, lost or back event has no worker or value.") + "$"):
            r.step(Event(r.seq + 1, on, value=None if on is not On.PUSH else 0))


def test_a_new_shard_assumes_a_launcher_restarts_failed_workers() -> None:
    r = ShardRules(0, 2)
    r.configure(RuleSettings("async"))
    r.worker_failed(0, 0, "ValueError: a"), r.worker_failed(1, 0, "ValueError: b")
    assert [d.act for d in r.tick(1.0)] == [Act.WAIT_LOST]  # not by hand: waited for, not failed at once


def test_a_replay_keeps_the_start_version_and_times_of_0_s() -> None:
    r = ShardRules(0, 3, keep_log=True)
    r.configure(RuleSettings("ssp", staleness=0), 10)  # restored from a checkpoint at step 10
    assert [d.act for d in r.clock(0, 1)] == [Act.HOLD]  # nobody else has a clock yet
    r.clock_expired(0, 1, 0.0)
    r.never_connected(2, 0.0)
    r.worker_lost(1), r.worker_done(0)
    assert [d.act for d in r.tick(0.0)] == [Act.WAIT_LOST] and r.lost_wait_since == 0.0
    copy = ShardRules.replay(0, 3, r.log or [])
    assert copy.state() == r.state() and copy.log == r.log and copy.version == 10


def test_a_shard_without_a_log_decides_the_same() -> None:
    quiet = ShardRules(0, 2)
    loud = ShardRules(0, 2, keep_log=True)
    for s in (quiet, loud):
        s.configure(RuleSettings("sync"))
    assert quiet.push(0, 0) + quiet.push(1, 0) == loud.push(0, 0) + loud.push(1, 0)
    assert quiet.log is None and loud.log and loud.log[0].on is On.CONFIGURE


# -- a property: random interleavings of a sync job ----------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_sync_applies_one_aggregate_per_step_of_exactly_the_quorum_never_more_than_n(data: st.DataObject) -> None:
    """Workers pull, compute and push in any order (a slow one pushes from an old version), and
    some finish early: every step is applied once, from N gradients of that step (fewer only where
    fewer workers are left), each a gradient the shard held; every push is held or dropped; the log
    replays to the same state."""
    m = data.draw(st.integers(1, 5), label="M")
    n = data.draw(st.integers(1, m), label="N")
    r = rules(n=n, m=m, workers=m)
    pulled = dict.fromkeys(range(m), 0)  # the version each worker computes its next gradient from
    held: set[int] = set()  # gradients held for the current step
    applied_versions: list[int] = []
    for _ in range(data.draw(st.integers(0, 60), label="events")):
        free = sorted(set(range(m)) - r.pending - r.done)  # a held worker waits for its step
        if not free:
            break
        w = data.draw(st.sampled_from(free), label="worker")
        if data.draw(st.integers(0, 9), label="finish") == 0:
            decisions = r.worker_done(w)
        else:
            decisions = r.push(w, pulled[w])
            assert decisions[0].act in (Act.HOLD, Act.DROP_STALE)
            if decisions[0].act is Act.HOLD:
                held.add(w)
            pulled[w] = r.version  # a stale worker pulls the newest values at once
        for d in decisions:
            assert d.act is not Act.FAIL
            if d.act is Act.APPLY:
                # N, or the workers left where fewer are: the quorum, never more, never less
                assert len(d.workers) == min(n, m - len(r.done)) and set(d.workers) == held
                applied_versions.append(d.version)
                for worker in d.workers:
                    pulled[worker] = d.version  # released from the step's wait: pulls the new values
                held = set()
        assert r.pending == held
    assert applied_versions == list(range(1, r.version + 1))  # one aggregate per step, in order
    assert r.log is not None and ShardRules.replay(0, m, r.log).state() == r.state()
