"""Exact step arithmetic and per-worker data positions on a ps shard (ParameterStore + Progress),
and the chief's choice of checkpoint steps (due_checkpoint_step), stepped by hand."""

from __future__ import annotations

import threading

import pytest
import torch

from psflow.config import TrainConfig
from psflow.errors import ConfigError, TrainingError
from psflow.optim import SGD
from psflow.ps.progress import StepPlan
from psflow.ps.store import ParameterStore
from psflow.supervisor import due_checkpoint_step


def make_store(mode: str = "async", workers: int = 2, *, stop_at: int | None = None, every: int | None = None,
               positions: dict | None = None) -> ParameterStore:
    store = ParameterStore(shard=0, num_workers=workers)
    cfg = TrainConfig(mode=mode, sync_timeout_s=0.2).resolved(workers)
    # SGD with lr=1 on gradients of ones: after k updates w == -k, so a value names its step.
    store.initialize({"w": torch.zeros(3)}, optimizer=SGD(lr=1.0).to_dict(), config=cfg, placement_digest="d",
                     step_plan=StepPlan(stop_at, every), data_positions=positions)
    return store


ONES = {"w": torch.ones(3)}


def pos(batch: int, epoch: int = 0) -> dict[str, int]:
    return {"epoch": epoch, "batch_index": batch, "seed": 7}


# ----------------------------------------------------------------------- the chief's arithmetic


@pytest.mark.parametrize("global_step, last, every, due", [
    (199, 0, 200, None),
    (200, 0, 200, 200),
    (201, 0, 200, 200),   # the chief saw 201 first (another worker pushed 200): still the checkpoint of 200
    (399, 200, 200, None),
    (401, 200, 200, 400),
    (650, 200, 200, 600),  # a late look saves the newest multiple, not an older one
    (400, 400, 200, None),
    (450, 430, 200, None),  # resumed at 430: the next one is 600
    (600, 430, 200, 600),
    (5000, 0, None, None),
])
def test_step_based_checkpoints_fall_on_multiples_of_the_period(global_step, last, every, due):
    assert due_checkpoint_step(global_step, last, every) == due


def test_a_step_plan_rejects_a_bad_value_by_name():
    with pytest.raises(ConfigError, match=r"StepPlan.stop_at must be an int >= 1 or None. Received: 0"):
        StepPlan(0, None)
    assert StepPlan.from_dict(StepPlan(8000, 200).to_dict()) == StepPlan(8000, 200)


# ----------------------------------------------------------------------- the exact stop


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_no_update_is_applied_past_the_stop_step(mode):
    store = make_store(mode, stop_at=5)
    replies = [store.push(i % 2, store.version, ONES, position=pos(i // 2 + 1)) for i in range(8)]

    assert store.version == 5 and torch.equal(store.values["w"], torch.full((3,), -5.0))
    assert [r.get("stopped", False) for r in replies] == [False] * 5 + [True] * 3
    assert all(r["version"] == 5 and not r["applied"] for r in replies[5:])
    # Refused batches were not consumed: each worker's position is that of its last applied batch.
    assert store.data_positions() == {"0": pos(3), "1": pos(2)}


def test_sync_stops_at_the_stop_step_too():
    store = make_store("sync", stop_at=2)
    for step in range(3):
        replies = [store.push(w, step, ONES) for w in (0, 1)]
    assert store.version == 2 and all(r.get("stopped") for r in replies)


# ----------------------------------------------------------------------- exact checkpoints


def test_a_checkpoint_asked_for_late_holds_exactly_its_step():
    store = make_store(every=3)
    for i in range(7):
        store.push(i % 2, store.version, ONES, position=pos(i // 2 + 1))

    version, tensors, positions = store.checkpoint_state(3, timeout_s=1.0)
    assert version == 3 and torch.equal(tensors["w"], torch.full((3,), -3.0))
    assert positions == {"0": pos(2), "1": pos(1)}  # as of step 3, not as of now
    version, tensors, _ = store.checkpoint_state(6, timeout_s=1.0)
    assert version == 6 and torch.equal(tensors["w"], torch.full((3,), -6.0))
    version, tensors, positions = store.checkpoint_state(None, timeout_s=1.0)
    assert version == 7 and torch.equal(tensors["w"], torch.full((3,), -7.0)) and positions["0"] == pos(4)


def test_a_held_snapshot_is_a_copy_that_later_updates_do_not_touch():
    store = make_store(every=2)
    for _ in range(2):
        store.push(0, store.version, ONES)
    _, held, _ = store.checkpoint_state(2, timeout_s=1.0)
    for _ in range(3):
        store.push(0, store.version, ONES)
    assert torch.equal(held["w"], torch.full((3,), -2.0))
    assert torch.equal(store.checkpoint_state(2, timeout_s=1.0)[1]["w"], torch.full((3,), -2.0))


def test_a_shard_behind_the_asked_step_waits_for_it_then_answers_exactly():
    store = make_store(every=2)
    store.push(0, 0, ONES)
    answer: list = []
    waiter = threading.Thread(target=lambda: answer.append(store.checkpoint_state(2, timeout_s=5.0)))
    waiter.start()
    store.push(1, 1, ONES)
    store.push(0, 2, ONES)
    waiter.join(timeout=5.0)
    assert answer and answer[0][0] == 2 and torch.equal(answer[0][1]["w"], torch.full((3,), -2.0))


def test_a_shard_that_never_reaches_the_asked_step_says_so():
    store = make_store(every=2)
    with pytest.raises(TrainingError, match=r"ps shard 0 is at step 0 and did not reach step 2.*within 0.1 s"):
        store.checkpoint_state(2, timeout_s=0.1)


# ----------------------------------------------------------------------- data positions


def test_sync_positions_move_on_only_when_the_step_is_applied():
    store = make_store("sync")
    store.push(0, 0, ONES, position=pos(1))
    assert store.data_positions() == {}  # its gradient waits: a checkpoint now must not skip that batch
    store.push(1, 0, ONES, position=pos(1))
    assert store.data_positions() == {"0": pos(1), "1": pos(1)}
    store.push(0, 0, ONES, position=pos(2))  # stale (computed from version 0): dropped, and consumed
    assert store.data_positions()["0"] == pos(2)


def test_restored_positions_are_kept_for_workers_that_have_not_pushed_yet():
    store = make_store(positions={"0": pos(40), "1": pos(55)})
    store.push(0, store.version, ONES, position=pos(41))
    assert store.data_positions() == {"0": pos(41), "1": pos(55)}
    assert store.checkpoint_state(None, timeout_s=1.0)[2] == {"0": pos(41), "1": pos(55)}
