"""Workers joining and leaving a running job, on one ps shard's rules stepped by hand (``resize``):
the sync quorum keeps its backups and counts joined members only, ssp's slowest clock leaves retired
workers out and a joining worker starts at the slowest clock, a retired worker's requests are
refused, and replay / export reproduce it. See psflow.ps.membership and psflow.ps.rules."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psflow.launch.control import check_workers
from psflow.ps.membership import data_shard, scaled_quorum
from psflow.ps.rules import Act, Decision, RuleSettings, ShardRules


def rules(mode: str = "async", workers: int = 2, *, n: int | None = None, m: int | None = None,
          staleness: int = 1) -> ShardRules:
    r = ShardRules(0, workers, keep_log=True)
    r.configure(RuleSettings(mode, n, m, staleness, None, 10.0))
    return r


def acts(decisions: list[Decision]) -> list[tuple[str, tuple[int, ...]]]:
    return [(d.act.name, d.workers) for d in decisions]


# -- the pure rules -----------------------------------------------------------------------------------


def test_scaled_quorum_keeps_the_backups_and_follows_the_members() -> None:
    assert scaled_quorum(None, None, launch=3, now=3) == (3, 3)
    assert scaled_quorum(None, None, launch=3, now=5) == (5, 5)
    assert scaled_quorum(None, None, launch=3, now=1) == (1, 1)
    assert scaled_quorum(2, 3, launch=3, now=3) == (2, 3)  # unscaled: the settings as written
    assert scaled_quorum(2, 3, launch=3, now=5) == (4, 5)  # one backup, kept
    assert scaled_quorum(2, 3, launch=3, now=1) == (1, 1)  # never below one gradient


def test_data_shards_keep_the_launch_count() -> None:
    assert [data_shard(r, 2) for r in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]


@pytest.mark.parametrize("bad", [0, -1, 257, "3", 2.0, True, None])
def test_a_bad_worker_count_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match=r"integer from 1 to 256 \(the run has 2 now\)\. Received: "):
        check_workers(bad, current=2)
    assert check_workers(3) == 3


# -- sync -----------------------------------------------------------------------------------------------


def test_sync_grown_counts_the_new_worker_only_once_it_is_ready() -> None:
    r = rules("sync", 2)
    assert acts(r.resize(3)) == [] and r.joining == {2}
    assert r.needed() == 2  # worker 2 is still starting: the step does not wait for it
    r.push(0, 0)
    assert acts(r.push(1, 0))[-1] == ("APPLY", (0, 1)) and r.version == 1
    joined = r.join(2, 0)
    assert acts(joined) == [("REJOINED", (2,))] and r.joining == set() and r.needed() == 3
    r.push(0, 1)
    r.push(1, 1)
    assert r.version == 1  # held for the new member
    assert acts(r.push(2, 1))[-1] == ("APPLY", (0, 1, 2)) and r.version == 2


def test_sync_shrunk_completes_the_step_held_for_a_retired_worker_and_drops_its_gradient() -> None:
    r = rules("sync", 3)
    r.push(0, 0)
    r.push(2, 0)  # the retiring worker's in-flight gradient, held
    assert r.pending == {0, 2}
    out = r.resize(2)
    assert acts(out) == [("RETIRED", (2,))] and r.pending == {0} and r.version == 0
    assert acts(r.push(1, 0))[-1] == ("APPLY", (0, 1))  # averaged over the members, without worker 2's
    (refused,) = r.push(2, 1)
    assert refused.act is Act.RETIRED and "retired it (the job has 2 training replicas now" in refused.reason
    assert r.worker_done(2) == [] and r.worker_lost(2) == []  # changes nothing


def test_sync_shrunk_without_backups_goes_on_when_the_retired_worker_was_already_lost() -> None:
    r = rules("sync", 3)
    r.push(0, 0)
    r.push(1, 0)
    r.worker_lost(2)  # SIGTERMed before this shard learned of the resize: held for it (no backups)
    assert r.version == 0 and r.lost_hold_message(1.0) is not None
    assert acts(r.resize(2))[-1] == ("APPLY", (0, 1)) and r.lost == set() and r.version == 1


def test_sync_with_one_backup_keeps_it_after_a_resize() -> None:
    r = rules("sync", 3, n=2, m=3)
    r.resize(4)
    r.join(3, 0)
    assert r.quorum() == (3, 4) and r.needed() == 3
    r.resize(2)
    assert r.quorum() == (1, 2) and r.needed() == 1


def test_every_member_done_after_a_shrink_ends_the_shard() -> None:
    r = rules("async", 3)
    r.worker_done(0)
    r.resize(1)
    assert r.done == {0} and len(r.done) >= r.num_workers


def test_a_retired_workers_done_does_not_count_for_the_shards_end() -> None:
    r = rules("async", 3)
    r.worker_done(0), r.worker_done(2)
    r.resize(2)
    assert r.done == {0} and not r.is_finished()  # worker:1 still trains


def test_a_second_grow_before_the_first_new_member_joined_waits_for_both() -> None:
    r = rules("sync", 2)
    r.resize(3)
    r.resize(4)
    assert r.joining == {2, 3}
    r.push(0, 0), r.push(1, 0)
    assert r.version == 1  # neither new member counts before it is ready


def test_sync_grown_before_the_new_member_joined_keeps_the_launch_quorum() -> None:
    r = rules("sync", 2, n=1, m=2)  # one backup
    r.resize(3)
    assert r.quorum() == (1, 2) and acts(r.push(0, 0)) == [("HOLD", (0,)), ("APPLY", (0,))]
    r = rules("sync", 2)
    r.resize(3)
    r.worker_done(1)
    assert r.needed() == 1 and acts(r.push(0, 0)) == [("HOLD", (0,)), ("APPLY", (0,))]  # the only member left


def test_a_new_member_done_before_it_said_ready_is_no_longer_joining() -> None:
    r = rules("sync", 2)
    r.resize(3)
    r.worker_done(2)
    assert r.joining == set() and r.done == {2}
    assert acts(r.push(0, 0)) == [("HOLD", (0,))]  # the two launched members make the step


def test_sync_with_m_below_the_workers_and_n_equal_to_m_has_no_backups() -> None:
    r = rules("sync", 3, n=2, m=2)
    assert r.quorum() == (2, 2) and not r.has_backups()


def test_a_resize_to_no_replica_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=re.escape(
            "A ps shard needs at least one training replica; a resize to 0 was asked.")):
        rules("async", 2).resize(0)


# -- ssp ------------------------------------------------------------------------------------------------


def test_ssp_a_new_members_first_clock_admits_it_and_a_retired_ones_is_refused_naming_it() -> None:
    r = rules("ssp", 2, staleness=5)
    r.clock(0, 3)
    r.resize(3)
    assert acts(r.clock(2, 4)) == [("REJOINED", (2,)), ("RELEASE", (2,))]
    assert r.joining == set() and r.clocks == {0: 3, 2: 4}
    r.resize(2)
    (refused,) = r.clock(2, 5)
    assert refused.act is Act.RETIRED and refused.reason.startswith(
        "ps shard 0 refused a clock of worker index 2: a scale request retired it (the job has 2 training replicas now")


def test_a_new_members_first_push_admits_it_and_a_retired_ones_is_refused_naming_it() -> None:
    r = rules("async", 2)
    r.resize(3)
    joined, applied = r.push(2, 0)
    assert (joined.act, joined.workers, joined.attempt, joined.clock) == (Act.REJOINED, (2,), 0, None)
    assert applied.act is Act.APPLY and r.joining == set()
    r.resize(2)
    (refused,) = r.push(2, 1)
    assert (refused.act, refused.workers) == (Act.RETIRED, (2,)) and refused.reason.startswith(
        "ps shard 0 refused a push of worker index 2: a scale request retired it")


def test_a_retired_workers_readiness_is_refused_naming_it_and_its_loss_changes_nothing() -> None:
    r = rules("sync", 3)
    r.resize(2)
    (refused,) = r.join(2)
    assert refused.act is Act.RETIRED and refused.reason == (
        "ps shard 0 refused a readiness request of worker index 2: a scale request retired it (the job has 2 training "
        "replicas now, 0..1). A retired worker stops; nothing is lost (its shard is not read while it is retired).")
    seq = r.seq
    assert r.worker_lost(2) == [] and r.seq == seq and r.lost == set()


def test_ssp_retired_worker_no_longer_holds_the_others_back() -> None:
    r = rules("ssp", 3, staleness=1)
    r.clock(0, 0)
    r.clock(1, 0)
    r.clock(2, 0)
    r.clock(0, 1)
    (held,) = r.clock(0, 2)  # worker 2 is slowest at 0; worker 1 too
    assert held.act is Act.HOLD
    r.clock(1, 1)
    out = r.resize(2)  # worker 2 retired: the slowest live clock is worker 1's, 1
    assert ("RELEASE", (0,)) in acts(out) and 2 not in r.clocks


def test_ssp_retired_worker_waiting_is_ended() -> None:
    r = rules("ssp", 2, staleness=0)
    r.clock(0, 0)
    r.clock(1, 0)
    r.clock(1, 1)  # held: worker 0 is at 0
    assert r.is_held(1, 1)
    out = r.resize(1)
    assert acts(out)[0] == ("RETIRED", (1,)) and out[0].clock == 1 and not r.is_held(1, 1)
    assert out[0].reason == "worker index 1 was waiting at clock 1 on ps shard 0 when a scale request retired it."


def test_ssp_joining_worker_starts_at_the_slowest_live_clock() -> None:
    r = rules("ssp", 2, staleness=1)
    for c in range(5):
        r.clock(0, c)
        r.clock(1, c)
    r.resize(3)
    assert r.clock(0, 5)[-1].act is Act.RELEASE  # the starting worker (no clock yet) does not hold anyone back
    (joined,) = r.join(2, 0)
    assert joined.act is Act.REJOINED and joined.clock == 4 and r.clocks[2] == 4  # worker 1's clock, the slowest


def test_a_worker_retired_then_added_back_resumes_as_a_newer_attempt() -> None:
    r = rules("ssp", 2, staleness=2)
    r.clock(0, 0)
    r.clock(1, 0)
    r.resize(1)
    for c in range(1, 4):
        r.clock(0, c)
    r.resize(2)
    out = r.join(1, 1)  # the launcher starts it again as its next attempt
    assert out[0].act is Act.REJOINED and r.clocks[1] == 3 and r.attempts[1] == 1
    (old,) = r.push(1, 0, attempt=0)  # a straggler of the retired attempt
    assert old.act is Act.SUPERSEDED


# -- replication: replay and full state ------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "clock", "resize", "join", "done", "lost"]),
                          st.integers(0, 3), st.integers(1, 4)), max_size=40),
       st.sampled_from(["sync", "ssp", "async"]))
def test_resizes_replay_and_export_to_the_same_state(ops: list[tuple[str, int, int]], mode: str) -> None:
    r = rules(mode, 2)
    clocks: dict[int, int] = {}
    for op, w, n in ops:
        if op == "push":
            r.push(w, r.version)
        elif op == "clock":
            clocks[w] = clocks.get(w, 0) + 1
            r.clock(w, clocks[w])
        elif op == "resize":
            r.resize(n)
        elif op == "join":
            r.join(w, 0)
        elif op == "done":
            r.worker_done(w)
        else:
            r.worker_lost(w)
        assert r.pending <= set(range(r.num_workers)) and r.joining <= set(range(r.num_workers))
        assert all(w < r.num_workers for w, _ in r.held)
    assert r.log is not None and ShardRules.replay(0, 2, r.log).state() == r.state()
    assert ShardRules.restore(0, 2, json.loads(json.dumps(r.export()))).state() == r.state()


def test_a_restored_copy_keeps_the_launch_size_and_the_shard_it_names() -> None:
    r = ShardRules(3, 2, keep_log=True)
    r.configure(RuleSettings(mode="sync", replicas_to_aggregate=1, total_num_replicas=2), 0)
    r.resize(3)
    r.join(2)
    r.worker_done(1, stays=True), r.worker_done(2), r.worker_lost(0)
    r.tick(5.0)  # waiting for the lost worker:0 only
    assert r.staying == {1} and r.lost_wait_since == 5.0
    back = ShardRules.restore(3, 3, json.loads(json.dumps(r.export())))
    assert back.state() == r.state() and (back.num_workers, back.launch_workers) == (3, 2)
    assert back.sync_wait_message(1, 1.0) == r.sync_wait_message(1, 1.0)  # "... on ps shard 3 ..."


def test_an_export_is_plain_json_data_already() -> None:
    r = ShardRules(0, 3)
    r.configure(RuleSettings(mode="ssp", staleness=0), 0)
    r.join(1, 1), r.clock(0, 0), r.clock(1, 0, 1)
    r.worker_lost(0)
    r.clock(1, 1, 1)  # held: worker:2 has no clock yet
    data = r.export()
    assert (data["lost_at"], data["clocks"], data["lost_clocks"], data["attempts"], data["held"]) == (
        {"0": 0}, {"1": 1}, {"0": 0}, {"1": 1}, [[1, 1]])
    assert json.loads(json.dumps(data)) == data  # string keys, lists: what crosses the wire is what was made


def test_a_state_exported_before_scaling_restores_with_the_shards_own_size() -> None:
    r = ShardRules(0, 2, keep_log=True)
    r.configure(RuleSettings(mode="sync"), 0)
    r.push(0, 0)
    data = json.loads(json.dumps(r.export()))
    for key in ("num_workers", "launch_workers", "joining", "failed", "never", "staying"):
        del data[key]
    assert ShardRules.restore(0, 2, data).state() == r.state()
