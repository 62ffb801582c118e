"""The ps shard's rules for restarted workers, stepped by hand: a newer attempt joins (REJOINED),
an older attempt's requests are dropped (SUPERSEDED), a resent push is not applied twice (DUPLICATE),
and each mode's semantics for the restarted worker (sync quorum, ssp clock). See psflow.ps.rules."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from psflow.ps.rules import Act, Decision, On, RuleSettings, ShardRules


def rules(mode: str = "async", workers: int = 2, *, n: int | None = None, m: int | None = None, staleness: int = 1,
          stop_at: int | None = None) -> ShardRules:
    r = ShardRules(0, workers, keep_log=True)
    r.configure(RuleSettings(mode, n, m, staleness, stop_at, 10.0))
    return r


def acts(decisions: list[Decision]) -> list[tuple[str, tuple[int, ...]]]:
    return [(d.act.name, d.workers) for d in decisions]


# -- attempts: join, fence ---------------------------------------------------------------------------


def test_a_restarted_worker_joins_as_a_newer_attempt_and_its_earlier_attempt_is_fenced() -> None:
    r = rules("async")
    assert acts(r.push(1, 0)) == [("APPLY", (1,))]
    r.worker_lost(1)
    joined = r.join(1, 1)
    assert acts(joined) == [("REJOINED", (1,)), ("BACK", (1,))] and joined[0].attempt == 1
    assert r.lost == set() and r.attempts == {1: 1}
    # A push of the dead process still in flight: dropped, and its sender is told why.
    (dropped,) = r.push(1, 1, attempt=0)
    assert dropped.act is Act.SUPERSEDED and dropped.attempt == 0 and r.version == 1
    assert dropped.reason.startswith("ps shard 0 dropped a push of worker:1 attempt 0: attempt 1 of worker:1 has joined")
    assert acts(r.push(1, 1, attempt=1)) == [("APPLY", (1,))] and r.version == 2


def test_joining_again_with_the_same_attempt_changes_nothing_and_an_older_one_is_refused() -> None:
    r = rules("async")
    seq = r.seq
    assert r.join(0, 0) == [] and r.seq == seq  # the first start: nothing to record
    r.join(0, 2)
    seq = r.seq
    assert r.join(0, 2) == [] and r.seq == seq
    (refused,) = r.join(0, 1)
    assert refused.act is Act.SUPERSEDED and "readiness request of worker:0 attempt 1" in refused.reason
    assert r.attempts == {0: 2}


def test_a_lost_worker_that_joins_with_its_own_attempt_is_back() -> None:
    r = rules("async")
    r.worker_lost(1)
    assert acts(r.join(1, 0)) == [("BACK", (1,))] and r.lost == set()


def test_an_older_attempts_clock_and_done_are_refused_too() -> None:
    r = rules("ssp")
    r.join(1, 1)
    (refused,) = r.clock(1, 3, attempt=0)
    assert refused.act is Act.SUPERSEDED and refused.reason.startswith(
        "ps shard 0 dropped a clock of worker:1 attempt 0: attempt 1 of worker:1 has joined since")
    assert [d.act for d in r.worker_done(1, attempt=0)] == [Act.SUPERSEDED]
    assert r.done == set() and 3 not in r.clocks.values()


def test_an_ssp_clock_of_a_newer_attempt_without_readiness_joins_it_first() -> None:
    r = rules("ssp", staleness=5)
    assert acts(r.clock(1, 0, attempt=1)) == [("REJOINED", (1,)), ("RELEASE", (1,))]
    assert r.attempts == {1: 1} and r.clocks == {1: 0}


def test_a_done_without_an_attempt_is_attempt_0_and_an_older_attempts_is_refused_naming_it() -> None:
    r = rules("async", workers=3)
    assert r.worker_done(3) == [] and r.done == set()  # not a member
    r.worker_done(0)
    assert r.join(0) == [] and r.attempts.get(0, 0) == 0  # its own attempt: nothing new
    r.join(1, 2)
    (refused,) = r.worker_done(1, 1)
    assert refused.reason.startswith("ps shard 0 dropped a PS_DONE of worker:1 attempt 1: attempt 2 of worker:1 has "
                                     "joined since")
    assert ShardRules.replay(0, 3, r.log or []).log == r.log


def test_a_push_of_a_newer_attempt_without_readiness_joins_it_first() -> None:
    r = rules("async")
    assert acts(r.push(1, 0, attempt=1)) == [("REJOINED", (1,)), ("APPLY", (1,))]
    assert r.attempts == {1: 1}


# -- sync: the quorum and a restarted worker -------------------------------------------------------------


def test_sync_without_backups_the_step_held_for_a_lost_worker_takes_its_new_attempts_first_push() -> None:
    r = rules("sync")
    assert acts(r.push(0, 0) + r.push(1, 0)) == [("HOLD", (0,)), ("HOLD", (1,)), ("APPLY", (0, 1))]
    r.push(0, 1)
    assert r.worker_lost(1) == [] and r.version == 1  # held, no failure: it may come back
    assert acts(r.join(1, 1)) == [("REJOINED", (1,)), ("BACK", (1,))]
    # It pulled version 1: its first push is for the step being gathered.
    assert acts(r.push(1, 1, attempt=1)) == [("HOLD", (1,)), ("APPLY", (0, 1))] and r.version == 2
    # A push its dead attempt computed before it died arrives late: dropped (stale and superseded).
    assert [d.act for d in r.push(1, 0, attempt=0)] == [Act.SUPERSEDED]


def test_sync_a_newer_attempt_drops_the_gradient_its_earlier_attempt_left_held() -> None:
    r = rules("sync")
    r.push(1, 0)  # held; the process dies before the shard noticed (its connection is not closed yet)
    assert r.pending == {1}
    assert acts(r.join(1, 1)) == [("REJOINED", (1,))] and r.pending == set()
    r.push(0, 0)
    assert r.version == 0  # the old gradient is not part of the step: the new attempt redoes its batch
    assert acts(r.push(1, 0, attempt=1)) == [("HOLD", (1,)), ("APPLY", (0, 1))]


def test_sync_with_a_backup_goes_on_without_a_lost_worker_and_takes_it_back_in_the_quorum() -> None:
    r = rules("sync", workers=3, n=2, m=3)
    r.worker_lost(2)
    assert acts(r.push(0, 0) + r.push(1, 0)) == [("HOLD", (0,)), ("HOLD", (1,)), ("APPLY", (0, 1))]
    assert acts(r.join(2, 1)) == [("REJOINED", (2,)), ("BACK", (2,))] and r.needed() == 2
    assert acts(r.push(2, 0, attempt=1)) == [("DROP_STALE", (2,))]  # computed before the step went on
    assert acts(r.push(2, 1, attempt=1) + r.push(0, 1)) == [("HOLD", (2,)), ("HOLD", (0,)), ("APPLY", (0, 2))]


# -- ssp: where a restarted worker's clock resumes -----------------------------------------------------


def test_ssp_a_restarted_worker_resumes_at_the_slowest_live_clock_when_the_others_went_on() -> None:
    r = rules("ssp", workers=3, staleness=1)
    for w, c in ((0, 3), (1, 3), (2, 3)):
        r.clock(w, c)
    r.worker_lost(2)
    for c in (4, 5, 6):  # the others go on: the lost worker no longer holds them back
        assert [d.act for d in r.clock(0, c) + r.clock(1, c)] == [Act.RELEASE, Act.RELEASE]
    assert r.resume_clock(2) == 6
    (joined, back) = r.join(2, 1)
    assert (joined.act, joined.clock, back.act) == (Act.REJOINED, 6, Act.BACK)
    assert r.clocks == {0: 6, 1: 6, 2: 6}
    # Nobody is held by it, and it is not held: the bound holds at once and nothing deadlocks.
    assert [d.act for d in r.clock(0, 7)] == [Act.RELEASE]
    assert [d.act for d in r.clock(2, 6, attempt=1)] == [Act.RELEASE]


def test_ssp_a_worker_that_died_ahead_resumes_at_its_own_clock_never_behind_it() -> None:
    r = rules("ssp", workers=2, staleness=2)
    r.clock(0, 1)
    r.clock(1, 3)
    r.worker_lost(1)
    assert r.resume_clock(1) == 3
    assert r.join(1, 1)[0].clock == 3


def test_ssp_a_resumed_clock_counts_only_the_other_live_workers_and_starts_at_0() -> None:
    r = rules("ssp", workers=3, staleness=10)
    assert r.resume_clock(1) == 0  # nobody clocked yet
    r.clock(0, 5), r.clock(2, 1)
    r.worker_lost(1)
    r.clock(1, 2)  # a late clock of the lost worker: it holds nobody back, and sets nobody's start
    assert r.resume_clock(2) == 5  # the slowest other live clock, ahead of its own 1


def test_ssp_the_earlier_attempts_held_wait_ends_when_a_newer_attempt_joins() -> None:
    r = rules("ssp", workers=2, staleness=0)
    r.clock(0, 0)
    assert acts(r.clock(1, 1)) == [("HOLD", (1,))]  # too far ahead of worker:0
    superseded, joined = r.join(1, 1)
    assert (superseded.act, superseded.workers, superseded.clock, superseded.attempt) == (Act.SUPERSEDED, (1,), 1, 0)
    assert superseded.reason == "worker:1 attempt 0 was waiting at clock 1 when attempt 1 joined: it was restarted."
    assert (joined.act, joined.clock) == (Act.REJOINED, 1) and r.held == set()
    # The new attempt at the same clock is held again by the bound, as its own wait.
    assert acts(r.clock(1, 1, attempt=1)) == [("HOLD", (1,))]
    assert acts(r.clock(0, 1)) == [("RELEASE", (0,)), ("RELEASE", (1,))]


def test_a_restart_forgets_the_earlier_attempts_push_numbers_and_says_whom_it_refuses() -> None:
    r = rules("async")
    r.push(1, 0, 0, push_seq=4)
    (joined,) = r.join(1, 1)
    assert (joined.act, joined.workers, joined.attempt, joined.clock) == (Act.REJOINED, (1,), 1, None)
    assert r.state()["last_push"] == {}  # they left with the earlier attempt
    (refused,) = r.push(1, 1, 0, push_seq=5)
    assert (refused.act, refused.workers) == (Act.SUPERSEDED, (1,))
    (redone,) = r.push(1, 1, 1, push_seq=1, redone=True)
    assert (redone.act, redone.workers, redone.outcome) == (Act.DUPLICATE, (1,), Act.APPLY)


def test_ssp_a_restarted_worker_that_was_not_lost_resumes_at_the_others_clock_and_releases_who_waited() -> None:
    r = rules("ssp", workers=2, staleness=0)
    r.clock(0, 0), r.clock(1, 0)
    assert acts(r.clock(0, 1)) == [("HOLD", (0,))]  # worker:1 is at 0
    joined, release = r.join(1, 1)  # restarted without being counted lost: resumes at worker:0's clock
    assert (joined.act, joined.clock, release.act, release.workers) == (Act.REJOINED, 1, Act.RELEASE, (0,))
    assert r.clocks == {0: 1, 1: 1}


# -- duplicate pushes (resent after a reconnect) ---------------------------------------------------------


def test_a_resent_push_is_decided_once_and_numbers_start_again_with_each_attempt() -> None:
    r = rules("async")
    assert acts(r.push(0, 0, 0, push_seq=1)) == [("APPLY", (0,))]
    (dup,) = r.push(0, 0, 0, push_seq=1)
    assert (dup.act, dup.workers, dup.outcome, r.version) == (Act.DUPLICATE, (0,), Act.APPLY, 1)
    assert acts(r.push(0, 1, 0, push_seq=2)) == [("APPLY", (0,))]
    assert [d.act for d in r.push(0, 0, 0, push_seq=1)] == [Act.DUPLICATE]  # an even older one
    assert acts(r.push(0, 2, attempt=1, push_seq=1)) == [("REJOINED", (0,)), ("APPLY", (0,))]
    assert r.version == 3


def test_a_push_without_a_number_is_never_a_duplicate() -> None:
    r = rules("async")
    r.push(0, 0)
    assert acts(r.push(0, 0)) == [("APPLY", (0,))]


def test_sync_a_resent_held_push_is_a_duplicate_of_the_hold_and_a_stopped_one_of_the_stop() -> None:
    r = rules("sync", stop_at=1)
    r.push(0, 0, push_seq=1)
    (dup,) = r.push(0, 0, push_seq=1)
    assert (dup.act, dup.outcome, r.pending) == (Act.DUPLICATE, Act.HOLD, {0})
    r.push(1, 0, push_seq=1)
    assert r.version == 1
    assert [d.act for d in r.push(0, 1, push_seq=2)] == [Act.STOPPED]
    assert r.push(0, 1, push_seq=2)[0].outcome is Act.STOPPED


def test_sync_a_lost_workers_held_gradient_left_so_its_resent_push_is_taken_again() -> None:
    r = rules("sync")
    r.push(0, 0, push_seq=1)
    r.worker_lost(0)  # its only connection dropped (a network blip): the held gradient left with it
    assert r.pending == set()
    assert acts(r.push(0, 0, push_seq=1)) == [("BACK", (0,)), ("HOLD", (0,))]


def test_a_redone_push_is_a_duplicate_of_an_apply_in_async_and_ssp_and_taken_in_sync() -> None:
    for mode in ("async", "ssp"):
        r = rules(mode)
        r.push(0, 0, 0, push_seq=1)
        (dup,) = r.push(0, 1, attempt=1, push_seq=1, redone=True)[-1:]
        assert (dup.act, dup.outcome, r.version, r.attempts[0]) == (Act.DUPLICATE, Act.APPLY, 1, 1)
        (resent,) = r.push(0, 1, attempt=1, push_seq=1)  # its number was recorded: a resend is recognised
        assert (resent.act, r.version) == (Act.DUPLICATE, 1)
        assert acts(r.push(0, 1, attempt=1, push_seq=2)) == [("APPLY", (0,))]
    r = rules("sync")
    assert acts(r.push(0, 0, push_seq=1, redone=True)) == [("HOLD", (0,))]  # sync: the rejoin drops held ones instead


def test_the_new_events_replay_to_the_same_state() -> None:
    r = rules("ssp", workers=3, staleness=1)
    r.clock(0, 0), r.push(0, 0, push_seq=1), r.clock(1, 0), r.clock(2, 0)
    r.clock(1, 1), r.clock(1, 2), r.worker_lost(2), r.join(2, 1), r.push(2, 1, 0, push_seq=4)
    r.push(2, 1, 1, push_seq=1), r.push(2, 1, 1, push_seq=1), r.clock(2, 1, attempt=1), r.worker_done(2, attempt=1)
    r.push(1, 1, 0, push_seq=2, redone=True)
    assert r.log is not None and {rec.on for rec in r.log if not isinstance(rec, Decision)} >= {On.JOIN, On.PUSH}
    copy = ShardRules.replay(0, 3, r.log)
    assert copy.state() == r.state() and copy.log == r.log
    assert copy.attempts == {2: 1} and copy.last_push == {0: (0, 1, Act.APPLY), 1: (0, 2, Act.APPLY), 2: (1, 1, Act.APPLY)}


# -- a property: random kills, restarts and late pushes of dead attempts (async) -------------------------


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_async_applies_only_pushes_of_each_workers_newest_attempt_each_once(data: st.DataObject) -> None:
    """Workers push (sometimes resending a push after a dropped reply), die, restart as a newer attempt,
    and pushes of dead attempts arrive late: every (worker, attempt, number) is applied at most once,
    never after a newer attempt of that worker joined, and every push of a live attempt is applied."""
    workers = data.draw(st.integers(1, 3), label="workers")
    r = rules("async", workers=workers)
    attempt = dict.fromkeys(range(workers), 0)
    number = dict.fromkeys(range(workers), 0)
    applied: set[tuple[int, int, int]] = set()
    for _ in range(data.draw(st.integers(0, 50), label="events")):
        w = data.draw(st.sampled_from(range(workers)), label="worker")
        what = data.draw(st.sampled_from(["push", "resend", "late", "die"]), label="what")
        if what == "die":
            r.worker_lost(w)
            attempt[w] += 1
            number[w] = 0
            assert [d.act for d in r.join(w, attempt[w])][:1] == [Act.REJOINED]
            continue
        if what == "push":
            number[w] += 1
        a, n = attempt[w], number[w]
        if what == "late":
            # a push sent earlier: of a dead attempt (any number), or of this one (a number it used)
            a = data.draw(st.integers(0, attempt[w]), label="old attempt")
            n = data.draw(st.integers(0, 5 if a < attempt[w] else number[w]), label="n")
        decisions = r.push(w, r.version, a, push_seq=n)
        if any(d.act is Act.APPLY for d in decisions):
            assert a == attempt[w] and (w, a, n) not in applied
            applied.add((w, a, n))
        elif what == "push":
            raise AssertionError(f"a fresh push of a live attempt was not applied: {decisions}")
        if a < attempt[w]:
            assert [d.act for d in decisions] == [Act.SUPERSEDED]
    assert r.version == len(applied)
    assert r.log is not None and ShardRules.replay(0, workers, r.log).state() == r.state()
