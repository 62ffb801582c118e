"""Unit tests of primary-backup replication's pure parts (psflow.ps.replication) and of a backup
store fed by hand: placement of backups, records on the wire, ordering, gaps refused, resent
batches skipped, and a backup that ends in its primary's state (what ``ShardRules.replay`` gives)."""

from __future__ import annotations

import re

import pytest
import torch

from psflow.config import TrainConfig, check_launch_settings
from psflow.errors import ConfigError, PsflowError, TrainingError
from psflow.ps.replication import Applier, Batch, Outbox, backup_of, check_next, event_from_dict, event_to_dict
from psflow.ps.rules import Event, On, RuleSettings, ShardRules
from psflow.ps.store import ParameterStore


def test_each_shards_backup_is_the_next_ps_wrapping_around() -> None:
    assert [backup_of(s, 3) for s in range(3)] == [1, 2, 0]
    assert [backup_of(s, 2) for s in range(2)] == [1, 0]
    with pytest.raises(ValueError, match="second ps task"):
        backup_of(0, 1)


def test_events_cross_the_wire_unchanged_and_configure_never_does() -> None:
    rules = ShardRules(0, 2, keep_log=True)
    rules.configure(RuleSettings(mode="sync"), 0)
    rules.push(0, 0, attempt=1, push_seq=3)
    rules.clock(0, 1, attempt=1, ahead=2)
    rules.worker_lost(1)
    rules.tick(12.5)
    events = [r for r in rules.log or [] if isinstance(r, Event)]
    for ev in events[1:]:
        assert event_from_dict(event_to_dict(ev)) == ev
    with pytest.raises(ValueError, match="CONFIGURE"):
        event_to_dict(events[0])
    with pytest.raises(PsflowError, match="malformed"):
        event_from_dict({"seq": 2, "on": "nonsense"})


def test_a_gap_is_refused_and_a_record_held_already_is_skipped() -> None:
    assert check_next(0, 8, 7) is True
    assert check_next(0, 7, 7) is False  # a resent batch
    with pytest.raises(TrainingError, match="received event 10: 2 records are missing"):
        check_next(0, 10, 7)


def test_the_outbox_ships_in_order_as_one_batch_and_counts_acknowledgements() -> None:
    out = Outbox()
    e1, e2 = Event(2, On.PUSH, 0, 0), Event(5, On.PUSH, 1, 1)
    out.add([e1], 4, {2: {"epoch": 0}}, {1: {"w": torch.ones(2)}})
    out.add([e2], 7, {}, {2: {"w": torch.zeros(2)}})
    batch = out.take()
    assert batch is not None and batch.events == [e1, e2] and batch.last_seq == 7
    assert sorted(batch.updates) == [1, 2] and batch.positions == {2: {"epoch": 0}}
    assert out.take() is None and out.queued_seq == 7
    out.acked(7)
    out.acked(4)  # never goes back
    assert out.acked_seq == 7


def test_a_batch_crosses_the_wire_unchanged() -> None:
    batch = Batch([Event(2, On.PUSH, 0, 0, push_seq=1)], {2: {"epoch": 1}}, {1: {"a.weight": torch.arange(3.0)}}, 4)
    meta, tensors = batch.to_wire(0)
    back = Batch.from_wire(meta, dict(tensors))
    assert back.events == batch.events and back.positions == batch.positions and back.last_seq == 4
    assert torch.equal(back.updates[1]["a.weight"], torch.arange(3.0))


class Capture:
    """A stand-in for the Forwarder: the store hands it what it records."""

    def __init__(self) -> None:
        self.outbox = Outbox()

    def start(self, init_seq: int) -> None:
        self.outbox.queued_seq = init_seq

    def add(self, events, last_seq, positions, updates) -> None:  # noqa: ANN001
        self.outbox.add(events, last_seq, positions, updates)


def _store(mode: str, forwarder: Capture | None = None) -> ParameterStore:
    s = ParameterStore(0, 2)
    s.initialize({"w": torch.ones(3)}, optimizer={"name": "sgd", "lr": 0.5}, config=TrainConfig(mode=mode),
                 placement_digest="d", forwarder=forwarder)  # type: ignore[arg-type]
    return s


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_backup_fed_the_primarys_batches_ends_in_its_state(mode: str) -> None:
    cap = Capture()
    primary, backup = _store(mode, cap), _store(mode)
    for step in range(3):
        primary.push(0, primary.version, {"w": torch.full((3,), 1.0 + step)}, position={"epoch": 0, "batch_index": step},
                     push_seq=step + 1)
        primary.push(1, primary.version, {"w": torch.full((3,), -0.5)}, push_seq=step + 1)
    primary.push(0, 0, {"w": torch.ones(3)}, push_seq=1)  # a resent push: DUPLICATE
    position = {"epoch": 0, "batch_index": 2}
    primary.push(0, primary.version, {"w": torch.full((3,), 2.0)}, position=position, attempt=1, push_seq=1)
    if mode == "async":  # a restarted attempt's redone batch: DUPLICATE on the backup too
        assert primary.stats.duplicates == 2
    primary.push(0, primary.version, {"w": torch.ones(3)}, position={"epoch": 0, "batch_index": 3}, attempt=1,
                 push_seq=2)  # async: its next batch, applied under attempt 1; sync: a second push of the step, stale
    primary.push(1, 0, {"w": torch.ones(3)}, position={"epoch": 0, "batch_index": 7}, push_seq=5)  # sync: stale
    with pytest.raises(TrainingError):
        primary.push(0, primary.version, {"w": torch.ones(3)}, push_seq=9)  # attempt 0: superseded by attempt 1
    primary.worker_lost(1)
    assert primary.rules.pending == ({0} if mode == "sync" else set())
    primary.worker_lost(0)  # sync: its held gradient (attempt 1's) leaves with it, and its position
    batch = cap.outbox.take()
    assert batch is not None and all(e.on is not On.CONFIGURE for e in batch.events)
    if mode == "sync":  # after aggregation: one update per step, not one per push
        assert len(batch.updates) == 3
    assert backup.follow(batch) == primary.seq
    assert torch.equal(backup.values["w"], primary.values["w"]) and backup.version == primary.version
    assert backup.rules.state() == primary.rules.state()
    assert backup.progress.positions_now() == primary.progress.positions_now()
    assert backup.progress.export()[0] == primary.progress.export()[0]  # held positions too
    assert backup.stats.to_dict() == primary.stats.to_dict()  # pushes, stale, duplicates, superseded, applied
    assert backup.follow(batch) == primary.seq  # resent after a reconnect: held already, nothing applied twice
    assert torch.equal(backup.values["w"], primary.values["w"])
    assert backup.stats.to_dict() == primary.stats.to_dict()


def _sync_store(forwarder: Capture | None = None) -> ParameterStore:
    s = ParameterStore(0, 2)
    s.initialize({"w": torch.ones(3)}, optimizer={"name": "sgd", "lr": 0.5}, placement_digest="d",
                 config=TrainConfig(mode="sync", replicas_to_aggregate=1, total_num_replicas=2),  # one backup
                 forwarder=forwarder)  # type: ignore[arg-type]
    return s


def test_a_sync_backup_with_a_backup_worker_keeps_the_primarys_counters_and_positions() -> None:
    cap = Capture()
    primary, backup = _sync_store(cap), _sync_store()
    ones = {"w": torch.ones(3)}
    for step in range(2):  # each push a step of one: without worker:1
        primary.push(0, primary.version, ones, position={"batch_index": step}, push_seq=step + 1)
    first = cap.outbox.take()
    primary.join(0, 1)  # a restarted worker:0
    primary.push(0, 0, ones, position={"batch_index": 5}, attempt=1, push_seq=1)  # stale: from step 0
    for seq in (7, 8):
        with pytest.raises(TrainingError):
            primary.push(0, primary.version, ones, push_seq=seq)  # attempt 0 twice: superseded
    second = cap.outbox.take()
    assert first is not None and second is not None
    assert backup.follow(first) == first.last_seq and backup.follow(second) == primary.seq
    assert backup.follow(first) == primary.seq  # an older batch resent late: held already, nothing raised
    assert backup.stats.to_dict() == primary.stats.to_dict() and backup.stats.steps_without_all == 2
    assert backup.stats.superseded == 2
    assert backup.progress.export()[0] == primary.progress.export()[0]


def test_a_sync_backup_drops_the_position_of_a_held_gradient_its_rejoined_worker_left_and_keeps_a_done_ones() -> None:
    cap = Capture()
    primary, backup = _store("sync", cap), _store("sync")
    ones = {"w": torch.ones(3)}
    primary.push(0, 0, ones, position={"batch_index": 3}, push_seq=1)  # held for worker:1
    primary.join(0, 1)  # restarted: its held gradient and position leave
    primary.push(1, 0, ones, position={"batch_index": 4}, push_seq=1)  # held
    primary.worker_done(1)  # finished with its gradient held: a step of that one gradient
    assert primary.version == 1 and primary.progress.positions_now() == {"1": {"batch_index": 4}}
    batch = cap.outbox.take()
    assert batch is not None
    backup.follow(batch)
    assert backup.version == 1 and backup.progress.export()[0] == primary.progress.export()[0]
    assert backup.progress.positions_now() == primary.progress.positions_now()


def test_a_backup_applies_the_new_records_of_a_batch_that_holds_some_already() -> None:
    cap = Capture()
    primary, backup = _store("async", cap), _store("async")
    primary.push(0, 0, {"w": torch.ones(3)})
    first = cap.outbox.take()
    primary.push(1, 1, {"w": torch.ones(3)})
    second = cap.outbox.take()
    assert first is not None and second is not None
    backup.follow(first)
    both = Batch(first.events + second.events, {**first.positions, **second.positions},
                 {**first.updates, **second.updates}, second.last_seq)  # resent together after a reconnect
    assert backup.follow(both) == primary.seq and backup.version == 2
    assert torch.equal(backup.values["w"], primary.values["w"])


def test_a_backup_refuses_a_batch_past_a_gap() -> None:
    cap = Capture()
    primary, backup = _store("async", cap), _store("async")
    primary.push(0, 0, {"w": torch.ones(3)})
    cap.outbox.take()  # lost
    primary.push(1, 1, {"w": torch.ones(3)})
    with pytest.raises(TrainingError, match="The backup of ps shard 0 holds its records up to 1 and received event 4: "
                                            "2 records are missing"):
        backup.follow(cap.outbox.take())  # type: ignore[arg-type]
    assert backup.version == 0


def test_a_backup_refuses_an_apply_without_its_update_and_a_batch_that_ends_elsewhere() -> None:
    cap = Capture()
    primary = _store("async", cap)
    primary.push(0, 0, {"w": torch.ones(3)})
    batch = cap.outbox.take()
    assert batch is not None
    with pytest.raises(TrainingError, match=re.escape(
            "The backup of ps shard 0 decided to apply version 1 (event 2), but the primary sent no update for it: the "
            "copies diverged; re-sync it.")):
        _store("async").follow(Batch(batch.events, batch.positions, {}, batch.last_seq))
    with pytest.raises(TrainingError, match=re.escape(
            f"The backup of ps shard 0 is at record {batch.last_seq} after a batch the primary ended at "
            f"{batch.last_seq + 1}: its rules decided differently. The copies diverged; re-sync it.")):
        _store("async").follow(Batch(batch.events, batch.positions, batch.updates, batch.last_seq + 1))


def test_ps_replicas_is_1_or_2_and_2_needs_a_second_ps() -> None:
    assert TrainConfig().ps_replicas == 1
    with pytest.raises(ConfigError, match=r"ps_replicas must be <= 2; received 3 \(copies of each shard: 1, or 2"):
        TrainConfig(ps_replicas=3)
    check_launch_settings(TrainConfig(ps_replicas=2), {"ps_replicas"}, num_replicas=2, num_ps=2)
    with pytest.raises(ConfigError, match="--ps-replicas 2: this run has 1 ps.*Use --ps 2 or more"):
        check_launch_settings(TrainConfig(ps_replicas=2), {"ps_replicas"}, num_replicas=2, num_ps=1)


def test_a_takeover_drops_the_held_sync_gradients_so_their_resent_pushes_are_taken_again() -> None:
    rules = ShardRules(0, 3, keep_log=True)
    rules.configure(RuleSettings(mode="sync"), 0)
    rules.push(0, 0, push_seq=1)  # held: its gradient lived on the dead primary only
    rules.push(2, 0)  # held too, a push without a number
    assert rules.pending == {0, 2}
    rules.take_over()
    assert rules.pending == set()
    assert [d.act.name for d in rules.push(0, 0, push_seq=1)] == ["HOLD"]  # resent: taken again, not a DUPLICATE
    assert [d.act.name for d in rules.push(2, 0)] == ["HOLD"]
    assert [d.act.name for d in rules.push(1, 0, push_seq=1)] == ["HOLD", "APPLY"]
    assert ShardRules.replay(0, 3, rules.log or []).state() == rules.state()


def test_a_backup_store_that_takes_over_forgets_the_held_positions() -> None:
    cap = Capture()
    primary, backup = _store("sync", cap), _store("sync")
    primary.push(0, 0, {"w": torch.ones(3)}, position={"batch": 7}, push_seq=1)
    backup.follow(cap.outbox.take())  # type: ignore[arg-type]
    assert backup.transfer_state()[0]["progress"]["pending"] == {"0": {"batch": 7}}
    backup.take_over()
    assert backup.transfer_state()[0]["progress"]["pending"] == {}  # a re-synced copy holds it no more either
    reply = backup.push(0, 0, {"w": torch.ones(3)}, position={"batch": 7}, push_seq=1)
    assert reply["applied"] and "duplicate" not in reply


def test_an_applier_holds_batches_in_order_applies_them_on_its_thread_and_keeps_a_failure() -> None:
    cap = Capture()
    primary, backup = _store("async", cap), _store("async")
    batches = []
    for step in range(4):
        primary.push(0, primary.version, {"w": torch.full((3,), 1.0 + step)}, push_seq=step + 1)
        batches.append(cap.outbox.take())
    applier = Applier(0, backup.follow, backup.seq)
    try:
        assert applier.hold(batches[0]) == batches[0].last_seq
        with pytest.raises(TrainingError, match="missing"):  # a gap is refused when it arrives, not when applied
            applier.hold(batches[2])
        assert applier.hold(batches[0]) == batches[0].last_seq  # resent: held already, queued once
        for b in batches[1:]:
            applier.hold(b)
        assert applier.held_seq == primary.seq
        applier.drain(10.0)
        assert backup.version == primary.version and torch.equal(backup.values["w"], primary.values["w"])
    finally:
        applier.close()

    def diverged(batch: Batch) -> int:
        raise TrainingError("the copies diverged")

    broken = Applier(0, diverged, 1)
    try:
        broken.hold(batches[0])
        with pytest.raises(TrainingError, match="diverged"):
            broken.drain(10.0)
        with pytest.raises(TrainingError, match="diverged"):  # every later batch is refused: the serving copy drops it
            broken.hold(batches[1])
    finally:
        broken.close()
