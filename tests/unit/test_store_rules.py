"""Rules of one ps shard's store that a training run depends on: the learning-rate schedule follows
the global step (also after a restore), a restore brings back optimizer slots and averages, what a
pull hands out, the replies, the end of a run, the ssp bound and the errors' advice. Stepped by hand."""

from __future__ import annotations

import json
import re

import pytest
import torch

from psflow.config import TrainConfig
from psflow.errors import TrainingError
from psflow.optim import SGD, ExponentialDecay
from psflow.ps.store import ParameterStore, StoreStats


def _store(mode: str = "async", workers: int = 2, *, version: int = 0, lr: float = 1.0, **init) -> ParameterStore:
    store = ParameterStore(shard=0, num_workers=workers)
    cfg = TrainConfig(mode=mode, staleness=1, sync_timeout_s=0.2).resolved(workers)
    assert store.initialize({"w": torch.zeros(2)}, optimizer=SGD(lr=lr).to_dict(), config=cfg,
                            placement_digest="d", version=version, **init)
    return store


_ONES = {"w": torch.ones(2)}


def test_a_new_store_is_at_version_0_uninitialized_and_says_what_to_do_when_used() -> None:
    store = ParameterStore(shard=3, num_workers=2)
    assert (store.version, store.initialized, store.values, store.meta) == (0, False, {}, {})
    with pytest.raises(TrainingError, match=re.escape(
            "ps shard 3 is not initialized yet: the chief has not sent the initial values. "
            "Wait for readiness (the trainer does) or check that the chief is running.")):
        store.pull()


def test_initialize_keeps_the_chiefs_meta_and_says_it_initialized() -> None:
    store = _store(meta={"run": "r1"})
    assert store.meta == {"run": "r1"} and store.initialized


def test_a_second_initialize_changes_nothing_and_is_counted() -> None:
    store = _store(meta={"run": "r1"})
    store.push(0, 0, _ONES)
    values = store.values["w"].clone()
    again = store.initialize({"w": torch.full((2,), 9.0)}, optimizer=SGD(lr=5.0).to_dict(), config=TrainConfig(),
                             placement_digest="other", version=0, meta={"run": "r2"})
    assert again is False and store.stats.init_requests == 2
    assert (store.version, store.meta, store.placement_digest) == (1, {"run": "r1"}, "d")
    assert torch.equal(store.values["w"], values)


@pytest.mark.parametrize("version", [0, 10])
def test_the_rate_applied_follows_the_global_step_also_after_a_restore(version: int) -> None:
    schedule = ExponentialDecay(decay_steps=1, decay_rate=0.5, staircase=True).to_dict()
    store = _store(version=version, schedule=schedule)
    for step in range(3):
        before = store.values["w"].clone()
        store.push(0, store.version, _ONES)
        assert torch.allclose(before - store.values["w"], torch.full((2,), 0.5 ** (version + step)))


def test_without_a_schedule_the_base_rate_applies_at_every_step() -> None:
    store = _store(version=5, lr=0.25)
    for _ in range(2):
        store.push(0, store.version, _ONES)
    assert torch.allclose(store.values["w"], torch.full((2,), -0.5))


def test_a_restore_brings_back_the_optimizer_slots_and_the_averages() -> None:
    """A run resumed from a snapshot continues exactly as the run that kept going."""
    init = {"ema_decay": 0.9}
    a = ParameterStore(shard=0, num_workers=1)
    cfg = TrainConfig().resolved(1)
    a.initialize({"w": torch.zeros(2)}, optimizer=SGD(lr=0.1, momentum=0.9).to_dict(), config=cfg,
                 placement_digest="d", **init)
    for _ in range(3):
        a.push(0, a.version, _ONES)
    version, snap = a.snapshot()
    opt = {k.removeprefix("opt/"): v for k, v in snap.items() if k.startswith("opt/")}
    ema = {k.removeprefix("ema/"): v for k, v in snap.items() if k.startswith("ema/")}
    assert opt and ema
    b = ParameterStore(shard=0, num_workers=1)
    b.initialize({"w": snap["w"]}, optimizer=SGD(lr=0.1, momentum=0.9).to_dict(), config=cfg, placement_digest="d",
                 version=version, optimizer_state=opt, ema_state=ema, **init)
    assert torch.equal(b.pull(averages=True)[1]["w"], a.pull(averages=True)[1]["w"])
    for s in (a, b):
        s.push(0, s.version, _ONES)
    assert torch.equal(a.values["w"], b.values["w"])
    assert torch.equal(a.pull(averages=True)[1]["w"], b.pull(averages=True)[1]["w"])


def test_a_snapshot_holds_tensors_for_every_slot_and_average() -> None:
    store = _store(ema_decay=0.5)
    store.push(0, 0, _ONES)
    _, snap = store.snapshot()
    assert all(isinstance(v, torch.Tensor) for v in snap.values()) and "ema/w" in snap


def test_sync_and_ssp_pulls_are_copies_and_async_pulls_are_the_live_values() -> None:
    for mode in ("sync", "ssp"):
        store = _store(mode, workers=1)
        _, pulled = store.pull()
        store.push(0, 0, _ONES)
        assert torch.equal(pulled["w"], torch.zeros(2)), mode
    store = _store("async")
    _, pulled = store.pull()
    assert pulled["w"] is store.values["w"]  # hogwild reads, as TensorFlow's default


def test_a_pull_waits_for_the_version_asked_for_and_not_for_the_one_it_has() -> None:
    store = _store("sync", workers=1)
    assert store.pull(min_version=0, timeout_s=0.05)[0] == 0
    with pytest.raises(TrainingError, match="waited 0.0 s for version 1"):
        store.pull(min_version=1, timeout_s=0.01)


def test_push_replies_name_the_version() -> None:
    assert _store("async").push(0, 0, _ONES) == {"version": 1, "applied": True}
    store = _store("sync", workers=2)
    assert store.push(0, 0, _ONES) == {"version": 0, "applied": True}
    assert store.push(0, 0, _ONES) == {"version": 0, "applied": False, "stale": True}


def test_a_lost_worker_that_pushes_again_is_no_longer_lost() -> None:
    store = _store("async")
    store.worker_lost(1)
    store.push(1, 0, _ONES)
    assert store.lost_workers == set()


def test_sync_without_backups_holds_the_step_to_its_deadline_naming_the_lost_worker_and_what_to_do() -> None:
    store = _store("sync", workers=2)
    store.push(0, 0, _ONES)
    store.worker_lost(1)
    with pytest.raises(TrainingError, match=re.escape(
            "worker:1 lost its connection to ps shard 0 without finishing (killed or crashed?), and sync training "
            "without backup workers (replicas_to_aggregate = total_num_replicas = 2) cannot take a step without it: "
            "step 0 was held 0.1 s (sync_timeout_s) for it to come back. Restart lost workers (psflow run --restart "
            "on-failure), or give the job backup workers (total_num_replicas > replicas_to_aggregate) so that steps "
            "go on without a lost worker.")):
        store.pull(min_version=1, timeout_s=0.1)


def test_the_run_is_done_when_every_worker_said_so_and_not_before() -> None:
    store = _store(workers=2)
    store.worker_done(0)
    assert not store.all_done()
    store.worker_done(1)
    assert store.all_done()


def test_ssp_holds_a_worker_back_from_one_that_has_not_reported_a_clock_yet() -> None:
    store = _store("ssp", workers=2)  # staleness 1
    assert store.clock(0, 1, timeout_s=0.01) == 0  # within staleness of worker 1's clock 0
    with pytest.raises(TrainingError, match=re.escape(
            "worker:0 at clock 2 waited 0.0 s for the slowest worker (clocks {0: 2}, staleness 1). "
            "A worker is stalled or dead; raise sync_timeout_s or restart it.")):
        store.clock(0, 2, timeout_s=0.01)
    store.worker_done(1)
    assert store.clock(0, 5, timeout_s=0.01) == 5  # alone now: the slowest live clock is its own


def test_a_worker_that_finished_does_not_hold_back_ssp() -> None:
    store = _store("ssp", workers=2)
    store.clock(1, 0, timeout_s=0.01)
    store.worker_done(1)
    assert store.clock(0, 3, timeout_s=0.01) == 3


def test_stats_are_plain_json_with_the_wait_in_milliseconds_precision() -> None:
    stats = StoreStats(pushes=3, applied_updates=2, stale_dropped=1, stale_by_worker={2: 1, 0: 4},
                       steps_without_all=1, duplicates=2, superseded=1, init_requests=1, wait_s=1.23456,
                       applied_by={1: {0: 5, 1: 2}})
    assert stats.to_dict() == {"pushes": 3, "applied_updates": 2, "stale_dropped": 1,
                               "stale_by_worker": {"0": 4, "2": 1}, "steps_without_all": 1, "duplicates": 2,
                               "superseded": 1, "init_requests": 1, "wait_s": 1.235,
                               "applied_by": {"1": {"0": 5, "1": 2}}, "nonfinite_by_worker": {}}


def test_stats_read_back_from_their_json_are_the_same_counters() -> None:
    stats = StoreStats(pushes=3, applied_updates=2, stale_dropped=1, stale_by_worker={2: 1, 0: 4},
                       steps_without_all=1, duplicates=2, superseded=1, init_requests=1, wait_s=1.25,
                       applied_by={1: {0: 5, 1: 2}}, nonfinite_by_worker={1: 3})
    back = StoreStats.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert back == stats


def test_stats_written_before_the_newer_counters_read_back_with_those_at_zero() -> None:
    old = {"pushes": 3, "applied_updates": 2, "stale_dropped": 1, "stale_by_worker": {}, "steps_without_all": 0,
           "duplicates": 0, "superseded": 0, "wait_s": 0.5}
    assert StoreStats.from_dict(old) == StoreStats(pushes=3, applied_updates=2, stale_dropped=1, wait_s=0.5)


def test_the_time_spent_waiting_adds_up() -> None:
    store = _store("sync", workers=2)
    for _ in range(2):
        with pytest.raises(TrainingError):
            store.pull(min_version=1, timeout_s=0.02)
    assert 0.04 <= store.stats.wait_s < 5


def _sync(workers: int, n: int | None, m: int | None, *, resolve: bool = True) -> ParameterStore:
    store = ParameterStore(shard=0, num_workers=workers)
    cfg = TrainConfig(mode="sync", replicas_to_aggregate=n, total_num_replicas=m, sync_timeout_s=0.2)
    store.initialize({"w": torch.zeros(2)}, optimizer=SGD(lr=1.0).to_dict(),
                     config=cfg.resolved(workers) if resolve else cfg, placement_digest="d")
    return store


def test_a_config_without_n_and_m_means_every_worker_and_no_backups() -> None:
    store = _sync(2, None, None, resolve=False)
    store.push(0, 0, _ONES)
    assert store.version == 0
    with pytest.raises(TrainingError, match=re.escape(
            "has 1 of 2 gradients; missing worker:1. There are no backup workers")):
        store.pull(min_version=1, timeout_s=0.01)
    store.push(1, 0, _ONES)
    assert store.version == 1 and store.stats.steps_without_all == 0
    store.worker_lost(0)
    with pytest.raises(TrainingError, match=re.escape("(replicas_to_aggregate = total_num_replicas = 2)")):
        store.pull(min_version=2, timeout_s=0.2)  # a lost worker holds the step until the deadline


def test_the_sync_wait_error_lists_every_missing_worker_and_mentions_backups_only_without_them() -> None:
    store = _sync(3, None, None)
    with pytest.raises(TrainingError, match=re.escape(
            "Sync step 0 on ps shard 0 waited 0.0 s for version 1: has 0 of 3 gradients; missing worker:0, worker:1, "
            "worker:2. There are no backup workers (replicas_to_aggregate == total_num_replicas). A worker is dead or "
            "stalled: restart it, add backup workers, or raise sync_timeout_s.")):
        store.pull(min_version=1, timeout_s=0.01)
    store = _sync(3, 2, 3)
    with pytest.raises(TrainingError) as e:
        store.pull(min_version=1, timeout_s=0.01)
    assert str(e.value).endswith("has 0 of 2 gradients; missing worker:0, worker:1, worker:2. A worker is dead or "
                                 "stalled: restart it, add backup workers, or raise sync_timeout_s.")


def test_every_lost_worker_is_named() -> None:
    store = _sync(3, None, None)
    store.worker_lost(0)
    store.worker_lost(2)
    with pytest.raises(TrainingError, match=re.escape("worker:0, worker:2 lost its connection to ps shard 0")):
        store.pull(min_version=1, timeout_s=0.2)  # (the lost workers hold it until the deadline)


def test_a_step_without_a_finished_worker_is_not_counted_as_one_without_all() -> None:
    store = _sync(3, None, None)
    store.worker_done(2)
    store.push(0, 0, _ONES)
    store.push(1, 0, _ONES)
    assert store.version == 1 and store.stats.steps_without_all == 0


def test_a_lost_workers_pending_gradient_is_not_used_by_a_later_step() -> None:
    store = _sync(3, 2, 3)  # one backup worker
    store.push(0, 0, {"w": torch.full((2,), 100.0)})
    store.worker_lost(0)
    store.push(1, 0, {"w": torch.full((2,), 1.0)})
    assert store.version == 0  # worker 0's gradient left with it: one of two
    store.push(2, 0, {"w": torch.full((2,), 3.0)})
    assert store.version == 1 and torch.allclose(store.values["w"], torch.full((2,), -2.0))


def test_a_worker_alone_after_the_others_are_gone_is_not_held_back() -> None:
    store = _store("ssp", workers=2)
    store.worker_lost(0)
    store.worker_done(1)
    assert store.clock(0, 7, timeout_s=0.01) == 7


def test_readiness_waits_for_the_chiefs_initial_values_and_then_says_so() -> None:
    store = ParameterStore(shard=0, num_workers=2)
    assert store.wait_initialized(0.01) is False
    store.initialize({"w": torch.zeros(2)}, optimizer=SGD(lr=1.0).to_dict(), config=TrainConfig(), placement_digest="d")
    assert store.wait_initialized(0.01) is True


def test_by_hand_a_store_whose_every_worker_failed_fails_at_once_before_the_chief_initialized_it() -> None:
    store = ParameterStore(shard=0, num_workers=2)
    store.expect(TrainConfig(lost_worker_timeout_s=60.0), by_hand=True)
    store.worker_done(0, 0, failed="ConfigError: bad flag")
    store.worker_done(1, 0, failed="ConfigError: bad flag too")
    (fail,) = store.tick(0.0)  # nobody restarts them: no wait of 60 s for the same end
    assert fail.act.name == "FAIL" and fail.reason.startswith("ps:0 has no worker left to serve")


def test_a_shrink_completes_the_sync_step_held_for_the_retired_worker_and_applies_it() -> None:
    store = _store("sync", workers=2)
    store.push(0, 0, _ONES)
    assert store.version == 0  # held for worker:1
    store.resize(1)
    assert store.num_workers == 1 and store.version == 1
    assert torch.equal(store.values["w"], -torch.ones(2))  # worker:0's gradient alone, lr 1
