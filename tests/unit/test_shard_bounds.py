"""What a request carrying a shard's state may declare (psflow.ps.bounds): the layout from a placement or
from values, and each rule of a state, its held snapshots and a record batch's updates, with the
message each refusal gives. Pure: the frames' tensor entries as (name, dtype, shape)."""

from __future__ import annotations

import pytest
import torch

from psflow import optim
from psflow.errors import ConfigError
from psflow.ps.bounds import Layout, check_held, check_state, check_updates, declared
from psflow.ps.placement import ParamInfo, place

PLACEMENT = place([ParamInfo("w", (4, 3)), ParamInfo("b", (3,), "float16")], 2, strategy="round_robin").to_dict()


def test_a_placement_declares_each_shards_keys_shapes_and_dtypes() -> None:
    assert Layout.of_placement(0, PLACEMENT, 2, "PS_INIT").keys == {"w": ((4, 3), "float32")}
    assert Layout.of_placement(1, PLACEMENT, 2, "PS_INIT").keys == {"b": ((3,), "float16")}
    assert Layout.of_values(0, {"w": torch.zeros(4, 3)}) == Layout(0, {"w": ((4, 3), "float32")}, "now")
    with pytest.raises(ConfigError, match="PS_INIT declares a placement over 2 shards; this job has 3 ps"):
        Layout.of_placement(0, PLACEMENT, 3, "PS_INIT")
    with pytest.raises(ConfigError, match="PS_INIT declares an invalid placement: Placement"):
        Layout.of_placement(0, {**PLACEMENT, "pieces": "all"}, 2, "PS_INIT")
    with pytest.raises(ConfigError, match=r"PS_INIT declares no placement \(meta.placement\)"):
        Layout.of_placement(0, None, 2, "PS_INIT")


LAYOUT = Layout(0, {"w": ((4, 3), "float32")}, "now")


@pytest.mark.parametrize("tensors", [
    [("w", "float32", (4, 3))],
    [("w", "float32", (4, 3)), ("opt/w/exp_avg", "float32", (4, 3)), ("opt/w/exp_avg_sq", "float32", (4, 3)),
     ("opt/w/step", "float32", ()), ("ema/w", "float32", (4, 3))],
])
def test_a_state_of_the_shard_is_admitted(tensors: list) -> None:
    check_state("PS_INIT", LAYOUT, tensors)


@pytest.mark.parametrize("tensors, said", [
    ([("w", "float32", (4, 4))], "tensor 'w' (float32 [4, 4], 64 bytes) does not fit: shard 0 holds 'w' as float32 "
                                 "[4, 3] (48 bytes) now"),
    ([("w", "float32", (4, 3)), ("opt/w/step", "float32", (1000,))], "must be a scalar (shape [])"),
    ([("w", "float32", (4, 3)), ("opt/v/exp_avg", "float32", (4, 3))],
     "is an optimizer slot of 'v', none of the keys shard 0 holds now (w)"),
    ([("w", "float32", (4, 3)), ("ema/v", "float32", (4, 3))], "is none of the keys shard 0 holds now (w)"),
    ([], "it lacks 1 of the values shard 0 holds now (w)"),
])
def test_a_state_that_is_not_the_shards_is_refused_naming_the_tensor(tensors: list, said: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_state("PS_INIT from chief:0", LAYOUT, tensors)
    assert str(e.value).startswith("PS_INIT from chief:0 refused: ") and said in str(e.value), str(e.value)
    assert "Nothing was changed" in str(e.value)


def test_held_snapshots_are_states_of_the_versions_the_meta_lists_and_no_more_than_a_shard_keeps() -> None:
    tensors = [("w", "float32", (4, 3)), ("held/4/w", "float32", (4, 3)), ("held/4/opt/w/step", "int64", ())]
    assert check_held("state", LAYOUT, tensors, {"4": {}}) == [("w", "float32", (4, 3))]
    with pytest.raises(ConfigError, match=r"is a snapshot of version '4', which the state's meta does not hold \(it holds \['2'\]\)"):
        check_held("state", LAYOUT, tensors, {"2": {}})
    with pytest.raises(ConfigError, match="'held/4/w' .* does not fit"):
        check_held("state", LAYOUT, [("held/4/w", "float32", (1 << 20,))], {"4": {}})
    with pytest.raises(ConfigError, match="it holds snapshots of 3 versions; a shard keeps at most 2"):
        check_held("state", LAYOUT, [], {"1": {}, "2": {}, "3": {}})


def test_a_batchs_updates_are_values_of_the_shard_of_at_most_one_version_per_event() -> None:
    check_updates("batch", LAYOUT, [("7/w", "float32", (4, 3)), ("8/w", "float32", (4, 3))], 2)
    with pytest.raises(ConfigError, match="more versions than its 1 event"):
        check_updates("batch", LAYOUT, [("7/w", "float32", (4, 3)), ("8/w", "float32", (4, 3))], 1)
    with pytest.raises(ConfigError, match="update 'x/w' .* is not named <version>/<key>"):
        check_updates("batch", LAYOUT, [("x/w", "float32", (4, 3))], 1)
    with pytest.raises(ConfigError, match="update '7/v' .* is of 'v', none of the keys shard 0 holds now"):
        check_updates("batch", LAYOUT, [("7/v", "float32", (4, 3))], 1)


def test_declared_reads_frame_specs_and_received_tensors_alike() -> None:
    from psflow.wire.frame import TensorSpec

    spec = TensorSpec("w", torch.float16, (2,))
    assert declared([spec]) == declared([("w", torch.zeros(2, dtype=torch.float16))]) == [("w", "float16", (2,))]



@pytest.mark.parametrize("spec", [optim.SGD(lr=0.1, momentum=0.9), optim.Adagrad(lr=0.1), optim.Adam(lr=0.1, amsgrad=True),
                                  optim.RMSprop(lr=0.1, momentum=0.9, centered=True)], ids=lambda s: type(s).__name__)
def test_every_slot_a_psflow_optimizer_keeps_is_one_a_ps_admits(spec: optim.OptimizerSpec) -> None:
    w = torch.nn.Parameter(torch.ones(3))
    opt = spec.build([w])
    w.grad = torch.ones(3)
    opt.step()
    assert set(opt.state[w]) <= optim.STATE_SLOTS, set(opt.state[w]) - optim.STATE_SLOTS
