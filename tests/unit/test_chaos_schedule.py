"""The chaos schedule: seeded slots, who is eligible for a fault, and which task a slot hits."""

from __future__ import annotations

import pytest

from psflow.chaos.schedule import ChaosSchedule, ChaosSettings, Slot, TaskView, eligible, parse_kinds, pick
from psflow.errors import ConfigError


def settings(**kw) -> ChaosSettings:
    return ChaosSettings(**{"every_s": 2.0, "duration_s": 10.0, **kw})


def test_the_same_seed_gives_the_same_slots_and_another_seed_other_draws() -> None:
    a, b = ChaosSchedule(settings(seed=5)).slots(), ChaosSchedule(settings(seed=5)).slots()
    c = ChaosSchedule(settings(seed=6)).slots()
    assert a == b
    assert [s.draw for s in a] != [s.draw for s in c]
    assert [s.at_s for s in a] == [2.0, 4.0, 6.0, 8.0, 10.0]


def test_max_faults_caps_the_slots_and_kinds_follow_their_weights() -> None:
    assert len(ChaosSchedule(settings(max_faults=2)).slots()) == 2
    only_stops = ChaosSchedule(settings(duration_s=100.0, kinds=(("stop", 1.0),))).slots()
    assert {s.kind for s in only_stops} == {"stop"}
    mixed = ChaosSchedule(settings(every_s=1.0, duration_s=400.0, kinds=(("kill", 3.0), ("stop", 1.0)))).slots()
    kills = sum(s.kind == "kill" for s in mixed)
    assert 250 < kills < 350, kills  # 3:1 over 400 draws


def test_parse_kinds_reads_names_and_weights_and_refuses_the_rest() -> None:
    assert parse_kinds("kill,stop") == (("kill", 1.0), ("stop", 1.0))
    assert parse_kinds("kill=3, stop=0.5") == (("kill", 3.0), ("stop", 0.5))
    for bad in ("explode", "kill=0", "kill=x", " , "):
        with pytest.raises(ConfigError, match="--kinds"):
            parse_kinds(bad)


def test_bad_settings_are_refused_with_the_value() -> None:
    with pytest.raises(ConfigError, match="every_s.*-1"):
        settings(every_s=-1)
    with pytest.raises(ConfigError, match="targets.*evaluator"):
        settings(targets=("evaluator",))


def test_only_running_targets_up_long_enough_are_eligible() -> None:
    views = {"chief:0": TaskView("running", 0.0), "worker:0": TaskView("running", 9.0),
             "worker:1": TaskView("backoff", None), "worker:2": TaskView("running", 0.0),
             "evaluator:0": TaskView("running", 0.0)}
    assert eligible(views, 10.0, settings(min_up_s=2.0)) == ["chief:0", "worker:2"]
    assert eligible(views, 10.0, settings(min_up_s=2.0, targets=("worker",))) == ["worker:2"]
    assert eligible(views, 10.0, settings(), running=False) == []


def test_no_fault_while_a_task_is_stopped() -> None:
    views = {"worker:0": TaskView("running", 0.0, stopped=True), "worker:1": TaskView("running", 0.0)}
    assert eligible(views, 10.0, settings()) == []


def test_no_fault_once_a_task_has_finished() -> None:
    settings = ChaosSettings(every_s=1, duration_s=60, min_up_s=0.0)
    views = {"chief:0": TaskView("running", 0.0), "worker:0": TaskView("running", 0.0),
             "ps:0": TaskView("running", 0.0)}
    assert eligible(views, 10.0, settings) == ["chief:0", "worker:0"]
    # worker:0 is done (exit 0) while the chief still evaluates: the job is ending, nothing is hit
    views["worker:0"] = TaskView("exited", 0.0, finished=True)
    assert eligible(views, 10.0, settings) == []
    views["worker:0"] = TaskView("exited", 0.0)  # died (not finished): waiting for its restart
    assert eligible(views, 10.0, settings) == ["chief:0"]


def test_a_ps_is_hit_only_when_every_ps_has_run_for_settle_s() -> None:
    s = settings(targets=("ps", "worker"), settle_s=4.0, min_up_s=1.0)
    views = {"ps:0": TaskView("running", 0.0), "ps:1": TaskView("running", 8.0), "worker:0": TaskView("running", 0.0)}
    assert eligible(views, 10.0, s) == ["worker:0"]  # ps:1 restarted 2 s ago: its pair may still re-sync
    assert eligible(views, 12.0, s) == ["ps:0", "ps:1", "worker:0"]
    views["ps:1"] = TaskView("backoff", None)
    assert eligible(views, 30.0, s) == ["worker:0"]


def test_pick_uses_the_draw_over_the_sorted_candidates() -> None:
    cands = ["worker:1", "ps:0", "worker:0"]
    assert pick(Slot(0, 1.0, "kill", 0.0), cands) == "ps:0"
    assert pick(Slot(0, 1.0, "kill", 0.5), cands) == "worker:0"
    assert pick(Slot(0, 1.0, "kill", 0.999), cands) == "worker:1"
    assert pick(Slot(0, 1.0, "kill", 0.5), []) is None


def test_a_due_slot_waits_until_the_next_falls_due_then_is_skipped() -> None:
    s = ChaosSchedule(settings())
    assert s.due(1.9) == (None, [])
    first, skipped = s.due(2.5)
    assert (first.at_s, skipped) == (2.0, [])
    second, skipped = s.due(4.0)  # the first was not taken (no task eligible): the second replaces it
    assert second.at_s == 4.0 and [x.at_s for x in skipped] == [2.0]
    s.taken(second)
    assert s.due(5.0) == (None, []) and s.remaining == 3


def test_nothing_is_hit_before_a_task_is_ready_and_no_ps_before_the_job_trains() -> None:
    s = settings(targets=("ps", "worker"), settle_s=0.0, min_up_s=0.0)
    views = {"ps:0": TaskView("running", 0.0), "worker:0": TaskView("running", 0.0, ready=False)}
    assert eligible(views, 10.0, s) == []  # no worker has stepped: the chief may not have initialized the ps
    views["worker:0"] = TaskView("running", 0.0)
    assert eligible(views, 10.0, s) == ["ps:0", "worker:0"]
    views["ps:1"] = TaskView("running", 0.0, ready=False)  # re-syncing: its pair must not die now
    assert eligible(views, 10.0, s) == ["worker:0"]


def test_is_ready_reads_the_current_attempts_progress() -> None:
    from psflow.chaos.injector import is_ready

    assert not is_ready("worker:0", {}, started_at=1.0)
    assert not is_ready("worker:0", {"progress": {"local_step": 5, "time_unix": 0.5}}, started_at=1.0)  # the last attempt's
    assert is_ready("worker:0", {"progress": {"local_step": 5, "time_unix": 1.5}}, started_at=1.0)
    assert not is_ready("ps:1", {"progress": {"global_step": 5, "time_unix": 1.5, "resyncing": True}}, started_at=1.0)
    assert is_ready("ps:1", {"progress": {"global_step": 5, "time_unix": 1.5, "resyncing": False}}, started_at=1.0)
    assert not is_ready("ps:1", {"progress": {"global_step": 5, "time_unix": 1.5}}, started_at=None)


def test_a_stall_range_draws_each_faults_length_from_the_seed() -> None:
    from psflow.chaos.schedule import parse_stall

    assert parse_stall("3") == (3.0, None) and parse_stall("2-9") == (2.0, 9.0)
    for bad in ("0", "-1", "9-2", "x", "2-"):
        with pytest.raises(ConfigError, match="--stall"):
            parse_stall(bad)
    settings = ChaosSettings(every_s=1, duration_s=50, seed=4, kinds=(("stop", 1.0), ("partition", 1.0)),
                             stall_s=2.0, stall_max_s=9.0)
    stalls = [s.stall_s for s in ChaosSchedule(settings).slots()]
    assert all(2.0 <= x <= 9.0 for x in stalls) and len(set(stalls)) > 10  # drawn, not one value
    assert stalls == [s.stall_s for s in ChaosSchedule(settings).slots()]  # the same seed, the same lengths
    assert {s.stall_s for s in ChaosSchedule(ChaosSettings(every_s=1, duration_s=5, stall_s=3.0)).slots()} == {3.0}


def test_a_partition_hits_a_ps_only() -> None:
    slot = Slot(0, 1.0, "partition", 0.0)
    assert pick(slot, ["ps:1", "worker:0", "chief:0"]) == "ps:1"
    assert pick(slot, ["worker:0"]) is None
