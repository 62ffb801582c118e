"""Pushes holding NaN or inf at the ps shard (ParameterStore, TrainConfig.nonfinite), stepped by hand.

What is proven: under ``refuse`` (the default) such a push changes nothing (values, version, the
rules' records: nothing for a backup), is counted per worker and logged once per worker, also in
sync mode before the step's sum; ``apply`` applies it; ``fail``, and ``nonfinite_limit`` refusals of a
worker in a row, raise naming the worker and step and make the next tick a FAIL; the chief's
initial values are checked the same way; the check itself is exact (a finite sum that overflows
is not taken for a NaN); the settings are checked where they enter.
"""

from __future__ import annotations

import logging

import pytest
import torch

from psflow.config import TrainConfig, check_launch_settings
from psflow.errors import ConfigError, TrainingError
from psflow.optim import SGD
from psflow.ps.finite import nonfinite_keys
from psflow.ps.rules import Act
from psflow.ps.store import ParameterStore

NAN, INF = float("nan"), float("inf")


def make_store(mode: str = "async", workers: int = 3, **settings: object) -> ParameterStore:
    store = ParameterStore(shard=0, num_workers=workers)
    cfg = TrainConfig(mode=mode, sync_timeout_s=0.2, **settings).resolved(workers)  # type: ignore[arg-type]
    store.initialize({"w": torch.ones(4, 2), "b": torch.zeros(2)}, optimizer=SGD(lr=0.1).to_dict(), config=cfg,
                     placement_digest="d")
    store.rules.log = []  # what a primary with a backup ships: every record from here on
    return store


def grads(value: float = 0.5, bad: float | None = None) -> dict[str, torch.Tensor]:
    w = torch.full((4, 2), value)
    if bad is not None:
        w[2, 1] = bad
    return {"w": w, "b": torch.full((2,), value)}


def snapshot(store: ParameterStore) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in store.values.items()}


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_a_nonfinite_push_is_refused_counted_and_changes_nothing(bad: float) -> None:
    store = make_store()
    before, seq = snapshot(store), store.rules.seq
    reply = store.push(1, 0, grads(bad=bad))
    assert reply == {"version": 0, "applied": False, "refused": "nonfinite", "nonfinite_keys": ["w"]}
    assert all(torch.equal(store.values[k], before[k]) for k in before)
    assert store.version == 0 and store.stats.applied_updates == 0
    assert store.stats.nonfinite_by_worker == {1: 1}
    assert store.rules.seq == seq and store.rules.log == []  # not recorded: a backup never receives it
    assert store.stats.to_dict()["nonfinite_by_worker"] == {"1": 1}
    assert store.push(1, 0, grads())["applied"]  # the worker goes on; its next finite push is applied
    assert store.version == 1 and store.rules.log


def test_each_worker_is_logged_once_by_name_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    store = make_store()
    with caplog.at_level(logging.WARNING, logger="psflow.ps"):
        for worker in (1, 1, 2, 1):
            store.push(worker, 0, grads(bad=NAN))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "worker:1 (attempt 0) pushed a gradient holding NaN or inf to ps shard 0 at step 0 (in 'w')" in lines[0]
    assert "worker:2" in lines[1]
    assert store.stats.nonfinite_by_worker == {1: 3, 2: 1}
    assert torch.equal(store.values["w"], torch.ones(4, 2))


def test_sync_refuses_before_the_sum_and_the_step_waits_for_a_finite_one() -> None:
    store = make_store("sync", workers=2)
    store.push(0, 0, grads(0.5))
    assert store.push(1, 0, grads(bad=INF))["refused"] == "nonfinite"
    assert store.version == 0 and store.rules.pending == {0}  # the step still waits for worker:1
    store.push(1, 0, grads(0.3))  # its next batch, for the same step
    assert store.version == 1
    assert torch.allclose(store.values["w"], torch.ones(4, 2) - 0.1 * 0.4)  # the finite pair's average only


def test_apply_applies_a_nan_push_as_before() -> None:
    store = make_store(nonfinite="apply")
    reply = store.push(1, 0, grads(bad=NAN))
    assert reply["applied"] and "refused" not in reply
    assert store.version == 1 and torch.isnan(store.values["w"][2, 1])
    assert store.stats.nonfinite_by_worker == {}


def test_fail_raises_naming_worker_and_step_and_the_next_tick_fails() -> None:
    store = make_store(nonfinite="fail")
    store.push(0, 0, grads())
    before, records = snapshot(store), list(store.rules.log or [])
    with pytest.raises(TrainingError, match=r"worker:2 \(attempt 1\) pushed a gradient holding NaN or inf to ps shard 0 "
                                            r"at step 1 .*nonfinite = fail"):
        store.push(2, 1, grads(bad=NAN), attempt=1)
    assert all(torch.equal(store.values[k], before[k]) for k in before) and store.version == 1
    (fail,) = store.tick(0.0)
    assert fail.act is Act.FAIL and "worker:2" in fail.reason and "step 1" in fail.reason
    assert store.rules.log == records  # neither the push nor the FAIL is a record: nothing to ship


def test_refusals_in_a_row_fail_the_run_and_an_accepted_push_resets_the_count() -> None:
    store = make_store(nonfinite_limit=3)
    for _ in range(2):
        store.push(1, 0, grads(bad=NAN))
    store.push(1, 0, grads())  # accepted: the run of refusals ends
    for _ in range(2):
        assert store.push(1, 1, grads(bad=NAN))["refused"]
    assert store.tick(0.0) == []
    with pytest.raises(TrainingError, match=r"worker:1 .*3 of its pushes in a row were refused \(nonfinite_limit = 3\)"):
        store.push(1, 1, grads(bad=NAN))
    assert [d.act for d in store.tick(0.0)] == [Act.FAIL]
    assert store.stats.nonfinite_by_worker == {1: 5}


@pytest.mark.parametrize("policy", ["refuse", "fail"])
def test_nonfinite_initial_values_are_refused_naming_the_key(policy: str) -> None:
    store = ParameterStore(shard=3, num_workers=1)
    with pytest.raises(TrainingError, match=r"ps shard 3 refused the initial values from the chief: NaN or inf in 'b' \(nonfinite = "):
        store.initialize({"w": torch.ones(2), "b": torch.tensor([0.0, INF])}, optimizer=SGD(lr=0.1).to_dict(),
                         config=TrainConfig(nonfinite=policy), placement_digest="d")
    assert not store.initialized


def test_apply_takes_nonfinite_initial_values() -> None:
    store = ParameterStore(shard=0, num_workers=1)
    assert store.initialize({"w": torch.tensor([NAN])}, optimizer=SGD(lr=0.1).to_dict(),
                            config=TrainConfig(nonfinite="apply"), placement_digest="d")


def test_the_check_is_exact() -> None:
    assert nonfinite_keys({"a": torch.ones(3), "b": torch.tensor([1.0, NAN]), "c": torch.tensor([-INF])}) == ["b", "c"]
    big = torch.full((4,), 3e38)  # finite, but its sum overflows: the exact scan clears it
    assert nonfinite_keys({"big": big, "half": torch.full((70_000,), 1.0, dtype=torch.float16)}) == []
    assert nonfinite_keys({"i": torch.arange(3), "bf": torch.tensor([INF], dtype=torch.bfloat16)}) == ["bf"]
    assert nonfinite_keys({}) == []


def test_the_setting_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"TrainConfig: nonfinite must be 'refuse', 'fail' or 'apply'; received 'skip' \(what the ps does"):
        TrainConfig(nonfinite="skip")
    with pytest.raises(ConfigError, match=r"nonfinite_limit must be >= 1; received 0"):
        TrainConfig(nonfinite_limit=0)
    with pytest.raises(ConfigError, match=r"--nonfinite fail applies to --strategy ps"):
        check_launch_settings(TrainConfig(strategy="allreduce", mode="sync", nonfinite="fail"), {"nonfinite"},
                              num_replicas=2, num_ps=0)
    with pytest.raises(ConfigError, match=r"--nonfinite-limit 3 applies to --nonfinite refuse"):
        check_launch_settings(TrainConfig(nonfinite="apply", nonfinite_limit=3), {"nonfinite", "nonfinite_limit"},
                              num_replicas=2, num_ps=1)
    check_launch_settings(TrainConfig(nonfinite_limit=3), {"nonfinite_limit"}, num_replicas=2, num_ps=1)
