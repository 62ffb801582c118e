"""Unit tests of the re-sync's pure parts: the pair of ps that holds a shard, what a copy does with a
request in each role, the full state transfer of a shard (rules, store) and a replaced forwarder."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from psflow.config import TrainConfig
from psflow.errors import ConfigError
from psflow.ps.progress import StepPlan
from psflow.ps.replication import Forwarder, pair_other, shards_held
from psflow.ps.rules import RuleSettings, ShardRules
from psflow.ps.store import ParameterStore


def test_a_shard_lives_on_its_primary_and_the_next_ps() -> None:
    assert [pair_other(0, 0, 2), pair_other(0, 1, 2)] == [1, 0]
    assert [pair_other(2, 2, 3), pair_other(2, 0, 3)] == [0, 2]
    assert shards_held(0, 3) == [0, 2] and shards_held(1, 2) == [0, 1]
    with pytest.raises(ConfigError, match="ps:1 holds no copy of shard 2"):
        pair_other(2, 1, 3)


def _busy_rules(mode: str) -> ShardRules:
    rules = ShardRules(0, 3)
    rules.configure(RuleSettings(mode=mode, stop_at=50), 0)
    for w in range(3):
        rules.push(w, rules.version, attempt=w % 2, push_seq=1)
    rules.clock(0, 3)
    rules.worker_lost(2)
    rules.join(1, 2)
    rules.tick(12.5)
    return rules


@pytest.mark.parametrize("mode", ["async", "sync", "ssp"])
def test_the_rules_state_crosses_as_json_and_decides_the_same_after(mode: str) -> None:
    import json

    rules = _busy_rules(mode)
    back = ShardRules.restore(0, 3, json.loads(json.dumps(rules.export())))
    assert back.state() == rules.state()
    assert back.push(0, back.version, 0, 2) == rules.push(0, rules.version, 0, 2)
    assert back.worker_done(1, 2) == rules.worker_done(1, 2)


def _store(**init) -> ParameterStore:  # noqa: ANN003
    s = ParameterStore(0, 2)
    s.initialize({"w": torch.ones(3), "b": torch.zeros(2)}, optimizer={"name": "adam", "lr": 0.1},
                 config=TrainConfig(mode="sync"), placement_digest="d", ema_decay=0.9,
                 step_plan=StepPlan(stop_at=40, snapshot_every=2), data_positions={"0": {"batch": 0}}, **init)
    return s


def test_a_full_state_makes_an_identical_store_that_goes_on_identically() -> None:
    primary = _store()
    for step in range(3):
        for w in range(2):
            primary.push(w, primary.version, {"w": torch.full((3,), 1.0 + w + step), "b": torch.ones(2)},
                         position={"batch": step + 1}, push_seq=step + 1)
    primary.push(0, primary.version, {"w": torch.ones(3), "b": torch.ones(2)}, position={"batch": 9}, push_seq=4)  # held
    meta, tensors = primary.transfer_state()
    copy = ParameterStore(0, 2)
    copy.load_state(meta, dict(tensors))
    assert copy.version == primary.version == 3 and copy.seq == primary.seq
    assert copy.rules.state() == primary.rules.state()
    assert copy.stats.to_dict() == primary.stats.to_dict()
    assert copy.progress.positions_now() == primary.progress.positions_now()
    for (k, a), (_, b) in zip(sorted(copy.snapshot()[1].items()), sorted(primary.snapshot()[1].items())):
        assert torch.equal(a, b), k  # values, Adam's slots and the moving averages
    held = primary.checkpoint_state(2, timeout_s=1.0)
    assert copy.checkpoint_state(2, timeout_s=1.0)[2] == held[2]  # the exact step-2 snapshot came along
    # The copy takes over: the held gradient lived on the primary only; both go on alike from there.
    copy.take_over()
    primary.take_over()
    for w in range(2):
        for s in (copy, primary):
            s.push(w, s.version, {"w": torch.ones(3), "b": torch.ones(2)}, push_seq=5)
    assert torch.equal(copy.values["w"], primary.values["w"]) and copy.version == primary.version == 4


def test_a_copy_loaded_from_a_full_state_hands_on_the_same_full_state() -> None:
    primary = _store(schedule={"name": "exponential_decay", "decay_steps": 1, "decay_rate": 0.5}, meta={"run": "r1"})
    for step in range(3):
        for w in range(2):
            primary.push(w, primary.version, {"w": torch.full((3,), 1.0 + w), "b": torch.ones(2)},
                         position={"batch": step + 1}, push_seq=step + 1)
    meta, tensors = primary.transfer_state()
    assert any(k.startswith("held/") for k, _ in tensors)  # the step-2 snapshot
    copy = ParameterStore(0, 2)
    copy.load_state(meta, dict(tensors))
    again, copied = copy.transfer_state()
    assert again == meta and (copy.num_workers, copy.placement_digest, copy.meta) == (2, "d", {"run": "r1"})
    assert [k for k, _ in copied] == [k for k, _ in tensors]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(copied, tensors))
    assert copy.rules.sync_wait_message(4, 1.0) == primary.rules.sync_wait_message(4, 1.0)  # names the same shard
    for s in (copy, primary):  # the schedule came along: both take step 3 at its rate
        for w in range(2):
            s.push(w, s.version, {"w": torch.ones(3), "b": torch.ones(2)}, push_seq=4)
    assert torch.equal(copy.values["w"], primary.values["w"]) and copy.version == primary.version == 4


def test_a_full_state_loads_the_values_as_they_are_even_non_finite_ones() -> None:
    primary = ParameterStore(0, 2)
    primary.initialize({"w": torch.tensor([float("inf"), 1.0])}, optimizer={"name": "sgd", "lr": 0.1},
                       config=TrainConfig(), placement_digest="d", check_values=False)
    meta, tensors = primary.transfer_state()
    copy = ParameterStore(0, 2)
    copy.load_state(meta, dict(tensors))  # a copy of the serving shard is what it is: no check refuses it
    assert torch.equal(copy.values["w"], primary.values["w"])


class _Recorder:
    """A stand-in for the Forwarder: what the store hands it, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def start(self, init_seq, init=None) -> None:  # noqa: ANN001
        self.calls.append(("start", init_seq, init))

    def add(self, events, last_seq, positions, updates) -> None:  # noqa: ANN001
        self.calls.append(("add", [e.seq for e in events], last_seq))

    def replace(self) -> None:
        self.calls.append(("replace",))

    def drop(self, why: str) -> None:
        self.calls.append(("drop", why))


def test_a_resync_forwards_from_the_full_state_on_to_the_new_backup_and_a_stop_forwards_nothing() -> None:
    store = _store()
    grads = {"w": torch.ones(3), "b": torch.ones(2)}
    store.push(0, 0, grads)
    old, new = _Recorder(), _Recorder()
    seq = store.replicate_to(old, {"epoch": 1})  # type: ignore[arg-type]
    ((call, at, (meta, tensors)),) = old.calls
    assert (call, at, seq) == ("start", store.seq, store.seq)
    assert meta == {**store.transfer_state()[0], "epoch": 1} and [k for k, _ in tensors] == [
        k for k, _ in store.transfer_state()[1]]
    store.push(1, 0, grads)  # completes step 1: recorded after the state, so forwarded
    assert old.calls[1] == ("add", [seq + 1], store.seq)
    again = store.replicate_to(new, {})  # type: ignore[arg-type]
    assert old.calls[2:] == [("replace",)] and new.calls[0][:2] == ("start", again) and store.forwarder is new
    store.push(0, 1, grads)
    assert new.calls[1] == ("add", [again + 1], store.seq) and len(old.calls) == 3
    store.stop_forwarding("the view has no backup")
    assert new.calls[2:] == [("drop", "the view has no backup")] and store.forwarder is None
    assert store.rules.log is None  # records are kept no more
    store.push(1, 1, grads)
    assert len(new.calls) == 3 and store.version == 2


def test_a_state_loads_only_into_an_empty_copy() -> None:
    primary = _store()
    meta, tensors = primary.transfer_state()
    with pytest.raises(Exception, match=re.escape(
            "ps shard 0's copy here is initialized already: a full state is loaded only into the empty copy of a "
            "restarted ps.")):
        _store().load_state(meta, dict(tensors))


def test_a_replaced_forwarder_releases_its_waiters_and_queues_nothing() -> None:
    gate = threading.Event()

    def send(meta, tensors):  # noqa: ANN001, ANN202
        gate.wait(5.0)
        return {}

    fwd = Forwarder(0, 1, send, ({"kind": "init"}, []), failover_s=1.0)
    fwd.start(3)
    waiter = threading.Thread(target=fwd.wait_acked, args=(3, 5.0))
    waiter.start()
    fwd.replace()
    waiter.join(2.0)
    assert not waiter.is_alive() and fwd.replaced
    fwd.add([], 4, {}, {})
    assert fwd.outbox.queued == []
    gate.set()


def test_records_nobody_waits_for_leave_once_they_stayed_queued_flush_s_not_at_the_next_record() -> None:
    """The forwarder's own thread ships what no request waits for only after flush_s: a record
    queued meanwhile (a notification) does not cut that wait short; both leave as one batch."""
    from psflow.ps.rules import Event, On

    shipped: list[tuple[float, int]] = []
    arrived = threading.Event()

    def send(meta, tensors):  # noqa: ANN001, ANN202
        if meta.get("kind") == "batch":
            shipped.append((time.monotonic(), len(meta["events"])))
            arrived.set()
        return {}

    flush_s = 0.6
    fwd = Forwarder(0, 1, send, ({"kind": "init"}, []), failover_s=1.0, flush_s=flush_s)
    fwd.start(1)
    fwd.wait_acked(1, 5.0)  # the init is held: from here on only batches
    queued = time.monotonic()
    fwd.add([Event(2, On.LOST, 0)], 3, {}, {})
    time.sleep(0.15)  # not a synchronisation: lets the thread start its flush wait, which the next record must not end
    fwd.add([Event(4, On.LOST, 1)], 5, {}, {})  # a second record: wakes the thread, ships nothing yet
    assert arrived.wait(5.0), "the queued records were never shipped"
    fwd.wait_acked(5, 5.0)  # everything queued reached the backup
    assert sum(n for _, n in shipped) == 2, shipped
    fwd.close()
    # The first batch left no sooner than flush_s after the first record (both in it, unless this
    # thread stalled past flush_s before queueing the second).
    assert shipped[0][0] - queued >= flush_s * 0.9, (shipped[0][0] - queued, flush_s)


def test_the_failover_timeouts_are_settings() -> None:
    assert (TrainConfig().primary_failover_s, TrainConfig().backup_failover_s) == (2.0, 5.0)
    with pytest.raises(ConfigError, match=r"primary_failover_s must be > 0; received 0 \(seconds: "):
        TrainConfig(primary_failover_s=0)
    with pytest.raises(ConfigError, match="backup_failover_s"):
        TrainConfig(backup_failover_s=float("inf"))


def test_a_ps_step_fault_kills_the_ps_once_its_shard_reaches_the_step(monkeypatch) -> None:  # noqa: ANN001
    import psflow.fault as fault

    faults = fault.parse_faults("ps:0@step=7:kill,worker:1@step=3:kill")
    fault.check_faults(faults, ["ps:0", "ps:1", "worker:0", "worker:1"])  # a ps step fault can fire: kill only
    with pytest.raises(ConfigError, match="a ps task takes no steps"):
        fault.check_faults(fault.parse_faults("ps:0@step=7"), ["ps:0", "worker:0"])
    assert fault.ps_step_kill(faults, "ps:1") is None
    kills: list[int] = []
    monkeypatch.setattr(fault.os, "kill", lambda pid, sig: kills.append(sig))
    check = fault.ps_step_kill(faults, "ps:0")
    assert check is not None
    check(6)
    assert kills == []
    check(7)
    assert kills == [fault.signal.SIGKILL]


def test_sync_steps_cross_to_the_backup_once_each_and_its_values_follow_the_primarys() -> None:
    # A real Forwarder between two stores in this process: a sync step's two pushes and its aggregated
    # update leave as one batch, shipped by the first request that waits for them.
    from psflow.ps.replication import Batch
    from psflow.ps.store import ParameterStore

    def store() -> ParameterStore:
        s = ParameterStore(0, 2)
        s.initialize({"w": torch.ones(4)}, optimizer={"name": "adam", "lr": 0.1},
                     config=TrainConfig(mode="sync"), placement_digest="d")
        return s

    backup = store()
    sent: list[int] = []

    def send(meta, tensors):  # noqa: ANN001, ANN202
        if meta.get("kind") != "batch":
            return {}
        batch = Batch.from_wire(meta, dict(tensors))
        sent.append(len(batch.updates))
        return {"seq": backup.follow(batch)}

    fwd = Forwarder(0, 1, send, ({"kind": "init"}, []), failover_s=1.0, flush_s=60.0)  # only waiters ship
    primary = ParameterStore(0, 2)
    primary.initialize({"w": torch.ones(4)}, optimizer={"name": "adam", "lr": 0.1},
                       config=TrainConfig(mode="sync"), placement_digest="d", forwarder=fwd)  # type: ignore[arg-type]
    fwd.wait_acked(primary.seq, 5.0)
    for step in range(5):
        primary.push(0, step, {"w": torch.full((4,), 1.0 + step)}, push_seq=step + 1)
        primary.push(1, step, {"w": torch.full((4,), -0.25 * step)}, push_seq=step + 1)
        assert primary.version == step + 1
        waiters = [threading.Thread(target=fwd.wait_acked, args=(primary.seq, 5.0)) for _ in range(2)]
        for w in waiters:  # both workers' requests wait for the step: one of them ships it
            w.start()
        for w in waiters:
            w.join(5.0)
        assert not any(w.is_alive() for w in waiters)
        assert fwd.outbox.acked_seq == primary.seq == backup.seq
        assert backup.version == primary.version and torch.equal(backup.values["w"], primary.values["w"])
    assert sent == [1] * 5 and fwd.batches_shipped == 5  # one batch, one aggregated update, per step
    fwd.close()
