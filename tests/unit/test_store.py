"""The ps shard's update rules (ParameterStore), stepped by hand: no sockets, no threads unless a wait is the point."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psflow.config import TrainConfig
from psflow.errors import ConfigError, TrainingError
from psflow.optim import SGD, Adam, PiecewiseConstant
from psflow.ps.store import ParameterStore


def make_store(mode="async", workers=3, n=None, m=None, optimizer=SGD(lr=0.1), staleness=1, timeout=0.2):
    store = ParameterStore(shard=0, num_workers=workers)
    cfg = TrainConfig(mode=mode, replicas_to_aggregate=n, total_num_replicas=m, staleness=staleness,
                      sync_timeout_s=timeout).resolved(workers)
    store.initialize({"w": torch.ones(4, 2), "b": torch.zeros(2)}, optimizer=optimizer.to_dict(), config=cfg,
                     placement_digest="d")
    return store


def grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 2, generator=g), "b": torch.randn(2, generator=g)}


def test_async_applies_each_push_and_counts_versions():
    store = make_store("async")
    for w in range(3):
        assert store.push(w, 0, grads(w))["applied"]
    expected = torch.ones(4, 2) - 0.1 * (grads(0)["w"] + grads(1)["w"] + grads(2)["w"])
    assert torch.allclose(store.values["w"], expected, atol=1e-6)
    assert store.version == 3 and store.stats.applied_updates == 3


@settings(max_examples=20, deadline=None)
@given(st.permutations([0, 1, 2]))
def test_sync_result_does_not_depend_on_arrival_order(order):
    reference = make_store("sync", optimizer=Adam(lr=0.01))
    for w in range(3):
        reference.push(w, 0, grads(w))
    store = make_store("sync", optimizer=Adam(lr=0.01))
    for w in order:
        store.push(w, 0, grads(w))
    assert store.version == reference.version == 1
    assert all(torch.equal(store.values[k], reference.values[k]) for k in store.values)


def test_sync_waits_for_n_then_applies_the_average_once():
    store = make_store("sync")
    store.push(0, 0, grads(0))
    store.push(1, 0, grads(1))
    assert store.version == 0  # two of three
    store.push(2, 0, grads(2))
    assert store.version == 1
    mean_w = (grads(0)["w"] + grads(1)["w"] + grads(2)["w"]) / 3
    assert torch.allclose(store.values["w"], torch.ones(4, 2) - 0.1 * mean_w, atol=1e-6)


def test_backup_worker_gradient_arriving_late_is_stale_and_counted():
    store = make_store("sync", n=2, m=3)
    store.push(2, 0, grads(2))
    store.push(0, 0, grads(0))
    assert store.version == 1 and store.stats.steps_without_all == 1
    reply = store.push(1, 0, grads(1))  # the slow one, computed from version 0
    assert reply["stale"] and not reply["applied"]
    assert store.stats.stale_dropped == 1 and store.stats.stale_by_worker == {1: 1}
    assert store.version == 1


def test_sync_wait_deadline_names_the_missing_worker():
    store = make_store("sync", workers=2, timeout=0.2)
    store.push(0, 0, grads(0))
    with pytest.raises(TrainingError, match=r"missing worker:1.*no backup workers.*sync_timeout_s"):
        store.pull(min_version=1, timeout_s=0.2)


def test_a_finished_worker_lowers_the_quorum():
    store = make_store("sync", workers=2)
    store.push(0, 0, grads(0))
    store.worker_done(1)
    assert store.version == 1  # the step completed with the one live worker


def test_ssp_lets_a_worker_run_at_most_staleness_ahead():
    store = make_store("ssp", workers=2, staleness=1)
    store.clock(0, 0, timeout_s=1)
    store.clock(1, 0, timeout_s=1)
    store.clock(0, 1, timeout_s=1)  # 1 ahead of worker 1: allowed
    with pytest.raises(TrainingError, match=r"worker:0 at clock 2 waited .* staleness 1"):
        store.clock(0, 2, timeout_s=0.2)
    for _worker, clock, slowest in store.stats.clock_log:
        assert clock - slowest <= 1


def test_gradients_for_unknown_parameters_are_refused_by_name():
    store = make_store("async")
    with pytest.raises(ConfigError, match=r"missing \['b'\], unexpected \['x'\]"):
        store.push(0, 0, {"w": torch.zeros(4, 2), "x": torch.zeros(1)})
    with pytest.raises(ConfigError, match=r"Gradient 'w' has shape \(2, 4\)"):
        store.push(0, 0, {"w": torch.zeros(2, 4), "b": torch.zeros(2)})


def test_uninitialized_store_says_it_waits_for_the_chief():
    store = ParameterStore(shard=3, num_workers=1)
    with pytest.raises(TrainingError, match="ps shard 3 is not initialized yet"):
        store.pull()
    assert not store.wait_initialized(0.01)


def test_second_initialize_changes_nothing():
    store = make_store("async")
    store.push(0, 0, grads(0))
    before = store.values["w"].clone()
    assert not store.initialize({"w": torch.zeros(4, 2), "b": torch.zeros(2)}, optimizer=SGD().to_dict(),
                                config=TrainConfig(), placement_digest="d")
    assert torch.equal(store.values["w"], before)


def test_snapshot_holds_values_optimizer_slots_and_averages():
    store = ParameterStore(shard=0, num_workers=1)
    store.initialize({"w": torch.ones(3)}, optimizer=Adam(lr=0.1).to_dict(), config=TrainConfig(),
                     placement_digest="d", ema_decay=0.5)
    store.push(0, 0, {"w": torch.ones(3)})
    version, snap = store.snapshot()
    assert version == 1
    assert {"w", "ema/w"} <= set(snap) and any(k.startswith("opt/w/") for k in snap)
    snap["w"].add_(1)  # a copy, not the live tensor
    assert not torch.equal(snap["w"], store.values["w"])


def test_ssp_bound_holds_against_a_worker_that_never_reported_a_clock():
    """worker:1 has not reported any clock yet: it counts as clock 0, so worker:0 (staleness 1)
    may reach clock 1 but must wait at clock 2, exactly as if worker:1 had reported clock 0."""
    store = make_store("ssp", workers=2, staleness=1)
    assert store.clock(0, 0, timeout_s=1) == 0
    assert store.clock(0, 1, timeout_s=1) == 0
    with pytest.raises(TrainingError, match=r"worker:0 at clock 2 waited .* staleness 1"):
        store.clock(0, 2, timeout_s=0.2)
    assert all(clock - slowest <= 1 for _, clock, slowest in store.stats.clock_log)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_lr_schedule_follows_the_global_step_also_after_a_restore(mode):
    """PiecewiseConstant: lr 1.0 up to step 1, 0.5 up to step 11, then 0.25 (the optimizer's own
    lr, 8.0, is not used). A push applied at version v uses the rate of step v, counted from the
    restored step, not from the shard's start."""
    schedule = PiecewiseConstant(boundaries=(1, 11), values=(1.0, 0.5, 0.25))

    def run(start: int, steps: int) -> float:
        store = ParameterStore(shard=0, num_workers=1)
        store.initialize({"w": torch.zeros(1)}, optimizer=SGD(lr=8.0).to_dict(), config=TrainConfig(mode=mode),
                         placement_digest="d", version=start, schedule=schedule.to_dict())
        for _ in range(steps):
            store.push(0, store.version, {"w": torch.ones(1)})
        assert store.version == start + steps
        return float(store.values["w"])

    assert run(0, 4) == -(1.0 + 1.0 + 0.5 + 0.5)
    assert run(10, 3) == -(0.5 + 0.5 + 0.25)  # restored at step 10


def test_a_request_from_a_worker_that_is_not_lost_neither_locks_nor_wakes_the_store():
    """worker_back runs on every request the ps serves: for a worker that is not lost (always, but
    after a restart) it must not take the store's lock, nor wake the sync/ssp waiters."""
    import threading

    store = make_store("sync", workers=2)
    result = {}
    with store._cond:  # another request holds the lock (a sync step waiting, say)
        t = threading.Thread(target=lambda: result.setdefault("back", store.worker_back(0)), daemon=True)
        t.start()
        t.join(5.0)
        assert result == {"back": False}, "worker_back waited for the store's lock"
    store.worker_lost(1)
    assert store.worker_back(1) is True and store.lost_workers == set()  # a lost one is still brought back


def test_applied_pushes_are_counted_per_worker_attempt_and_duplicates_not_again():
    store = make_store("async")
    store.push(0, 0, grads(0), attempt=0, push_seq=1)
    store.push(0, 0, grads(0), attempt=0, push_seq=2)
    assert store.push(0, 0, grads(0), attempt=0, push_seq=2).get("duplicate")  # resent: recognised
    store.push(0, 0, grads(0), attempt=1, push_seq=1)  # the restarted attempt
    store.push(1, 0, grads(1), attempt=0, push_seq=1)
    assert store.stats.applied_by == {0: {0: 2, 1: 1}, 1: {0: 1}}


def pos(epoch: int, batch: int, **config: int) -> dict[str, int]:
    return {"epoch": epoch, "batch_index": batch, "seed": 1, "batch_size": 8, "num_examples": 80, "shuffle": 1,
            "drop_last": 0, **config}


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_restarted_workers_redone_batch_is_applied_once_on_a_shard_that_took_it_already(mode):
    # A worker killed between its shards' pushes: this shard (not shard 0) applied batch (0, 3);
    # shard 0 did not record it, so the restarted attempt redoes it and pushes it here again.
    store = make_store(mode)
    store.push(0, 0, grads(0), position=pos(0, 2), attempt=0, push_seq=1)
    store.push(0, 1, grads(1), position=pos(0, 3), attempt=0, push_seq=2)
    before = {k: v.clone() for k, v in store.values.items()}
    reply = store.push(0, 2, grads(1), position=pos(0, 3), attempt=1, push_seq=1)  # redone: not again
    assert reply["duplicate"] and reply["applied"] and store.version == 2
    assert all(torch.equal(before[k], store.values[k]) for k in before)
    assert store.stats.applied_by == {0: {0: 2}} and store.stats.duplicates == 1
    store.push(0, 2, grads(2), position=pos(0, 4), attempt=1, push_seq=2)  # the next batch: applied
    store.push(0, 3, grads(3), position=pos(1, 0), attempt=1, push_seq=3)  # and the next epoch's
    assert store.version == 4 and store.progress.positions_now()["0"] == pos(1, 0)


def test_a_position_of_another_sequence_or_without_a_batch_index_is_never_a_repeat():
    store = make_store("async")
    store.push(0, 0, grads(0), position=pos(0, 5), attempt=0, push_seq=1)
    store.push(0, 1, grads(1), position=pos(0, 1, num_examples=60), attempt=1, push_seq=1)  # resharded data
    store.push(0, 2, grads(1), position=pos(0, 1, seed=2), attempt=2, push_seq=1)  # another shuffle
    store.push(0, 3, grads(1), position={"step": 1}, attempt=3, push_seq=1)  # a user's iterator
    store.push(1, 4, grads(1), position=pos(0, 1), attempt=0, push_seq=1)  # another worker
    assert store.version == 5 and store.stats.duplicates == 0


def test_an_iterator_started_again_within_one_attempt_is_never_taken_for_a_redone_batch():
    # A script that makes a new iterator per epoch (same settings): its positions go back within
    # one attempt. Only a newer attempt's push is compared with the recorded position.
    store = make_store("async")
    store.push(0, 0, grads(0), position=pos(0, 1), attempt=0, push_seq=1)
    store.push(0, 1, grads(1), position=pos(0, 2), attempt=0, push_seq=2)
    store.push(0, 2, grads(2), position=pos(0, 1), attempt=0, push_seq=3)  # the next epoch's first batch
    assert store.version == 3 and store.stats.duplicates == 0
    assert store.progress.position_attempts == {"0": 0}
    assert store.push(0, 3, grads(2), position=pos(0, 1), attempt=1, push_seq=1)["duplicate"]  # a restart's redo
    store.push(0, 3, grads(3), position=pos(0, 2), attempt=1, push_seq=2)
    assert store.progress.position_attempts == {"0": 1}
    store.push(0, 4, grads(3), position=pos(0, 1), attempt=1, push_seq=3)  # its own iterator, started again
    assert store.version == 5 and store.stats.duplicates == 1


def test_sync_leaves_a_redone_batch_to_the_rejoin():
    store = make_store("sync", workers=2, timeout=5)
    store.push(0, 0, grads(0), position=pos(0, 1), attempt=0, push_seq=1)
    store.push(1, 0, grads(1), position=pos(0, 1), attempt=0, push_seq=1)
    assert store.version == 1
    reply = store.push(0, 1, grads(0), position=pos(0, 1), attempt=1, push_seq=1)
    assert not reply.get("duplicate") and store.stats.duplicates == 0


def test_a_sync_step_counts_each_held_gradient_under_its_attempt():
    store = make_store("sync", workers=2)
    store.push(0, 0, grads(0), attempt=2, push_seq=1)
    assert store.stats.applied_by == {}  # held, not applied yet
    store.push(1, 0, grads(1), attempt=0, push_seq=1)
    assert store.stats.applied_by == {0: {2: 1}, 1: {0: 1}}


def test_gradients_that_do_not_match_are_refused_naming_at_most_five_keys_each_way_and_the_dtypes():
    store = ParameterStore(shard=2, num_workers=1)
    store.initialize({k: torch.zeros(2) for k in "abcdefg"}, optimizer=SGD().to_dict(), config=TrainConfig(),
                     placement_digest="d")
    with pytest.raises(ConfigError) as refused:
        store.push(0, 0, {k: torch.zeros(2) for k in "uvwxyz"})
    assert str(refused.value) == (
        "Gradients for ps shard 2 do not match its parameters (missing ['a', 'b', 'c', 'd', 'e'], unexpected "
        "['u', 'v', 'w', 'x', 'y']). Every worker must build the same model with the same placement.")
    grads = {k: torch.zeros(2) for k in "abcdefg"}
    grads["c"] = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ConfigError) as refused:
        store.push(0, 0, grads)
    assert str(refused.value) == "Gradient 'c' has shape (2,) torch.float64; the parameter is (2,) torch.float32."
    assert store.version == 0 and store.stats.pushes == 0
