"""Optimizer specs, schedules, moving averages and optimizer-state flattening."""

from __future__ import annotations

import json
import math

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psflow import optim
from psflow.errors import CheckpointError, ConfigError
from psflow.optim import (
    SGD,
    Adagrad,
    Adam,
    Constant,
    ExponentialDecay,
    MovingAverage,
    OptimizerSpec,
    PiecewiseConstant,
    RMSprop,
    Schedule,
)
from psflow.ps.placement import ParamInfo, place, split_tensor

torch.set_num_threads(1)

# Each spec with its hand-written torch.optim twin: the reference does not go through the spec.
CASES = [
    pytest.param(
        SGD(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
        id="sgd-momentum",
    ),
    pytest.param(
        SGD(lr=0.1, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
        id="sgd-nesterov",
    ),
    pytest.param(
        Adagrad(lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1, eps=1e-9),
        lambda ps: torch.optim.Adagrad(
            ps, lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1, eps=1e-9
        ),
        id="adagrad",
    ),
    pytest.param(
        Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.01, amsgrad=True),
        lambda ps: torch.optim.Adam(
            ps, lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.01, amsgrad=True
        ),
        id="adam-amsgrad",
    ),
    pytest.param(
        RMSprop(lr=0.01, alpha=0.9, eps=1e-7, weight_decay=0.01, momentum=0.5, centered=True),
        lambda ps: torch.optim.RMSprop(
            ps, lr=0.01, alpha=0.9, eps=1e-7, weight_decay=0.01, momentum=0.5, centered=True
        ),
        id="rmsprop-centered-momentum",
    ),
]


@pytest.mark.parametrize("num_shards", [2, 3])
@pytest.mark.parametrize(("spec", "reference"), CASES)
def test_one_optimizer_per_row_piece_matches_torch_optim_on_the_whole_tensor(
    spec: OptimizerSpec, reference, num_shards: int
) -> None:
    gen = torch.Generator().manual_seed(num_shards)
    shape = (11, 7)
    init = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(5)]

    whole = init.clone().requires_grad_()
    whole_opt = reference([whole])
    placement = place([ParamInfo("w", shape)], num_shards, split_bytes=0)
    pieces = placement.pieces_of("w")
    assert len(pieces) == num_shards
    # As each ps shard does: its own leaf tensor and its own optimizer per piece.
    leaves = [split_tensor(init, p).clone().requires_grad_() for p in pieces]
    piece_opts = [spec.build([leaf]) for leaf in leaves]
    assert type(piece_opts[0]) is type(whole_opt)

    for grad in grads:
        whole.grad = grad.clone()
        whole_opt.step()
        for piece, leaf, opt in zip(pieces, leaves, piece_opts):
            leaf.grad = split_tensor(grad, piece).clone()
            opt.step()

    # Elementwise update rules: identical on this machine; the tolerance (about one float32 ulp
    # at these magnitudes) only allows for SIMD/scalar-tail differences on other CPUs.
    combined = torch.cat([leaf.detach() for leaf in leaves])
    torch.testing.assert_close(combined, whole.detach(), rtol=1e-7, atol=1e-7)
    assert not torch.equal(whole.detach(), init)


finite = dict(allow_nan=False, allow_infinity=False)
spec_strategies = st.one_of(
    st.builds(
        SGD,
        lr=st.floats(1e-6, 10, **finite),
        momentum=st.floats(0, 0.99, **finite),
        weight_decay=st.floats(0, 1, **finite),
    ),
    st.builds(
        Adagrad,
        lr=st.floats(1e-6, 10, **finite),
        lr_decay=st.floats(0, 1, **finite),
        initial_accumulator_value=st.floats(0, 1, **finite),
        eps=st.floats(0, 1e-3, **finite),
    ),
    st.builds(
        Adam,
        lr=st.floats(1e-6, 10, **finite),
        betas=st.tuples(st.floats(0, 0.999, **finite), st.floats(0, 0.9999, **finite)),
        amsgrad=st.booleans(),
    ),
    st.builds(
        RMSprop,
        lr=st.floats(1e-6, 10, **finite),
        alpha=st.floats(0, 1, **finite),
        momentum=st.floats(0, 0.99, **finite),
        centered=st.booleans(),
    ),
)


@settings(max_examples=80, deadline=None)
@given(spec=spec_strategies)
def test_optimizer_spec_round_trips_through_json(spec: OptimizerSpec) -> None:
    text = json.dumps(spec.to_dict())
    again = OptimizerSpec.from_dict(json.loads(text))
    assert again == spec
    assert type(again) is type(spec)
    assert again.lr == spec.lr


def test_spec_accepts_json_ints_and_lists() -> None:
    spec = OptimizerSpec.from_dict({"name": "adam", "lr": 1, "betas": [0, 0.5]})
    assert spec == Adam(lr=1.0, betas=(0.0, 0.5))
    assert isinstance(spec.lr, float) and isinstance(spec.betas, tuple)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SGD(lr=-1.0), r"SGD lr must be a finite number > 0. Received: -1.0"),
        (lambda: SGD(lr=0.0), r"lr .* Received: 0.0"),
        (lambda: SGD(lr=math.nan), r"lr .* Received: nan"),
        (lambda: SGD(lr="fast"), r"lr must be a number. Received: 'fast'"),
        (lambda: SGD(momentum=-0.5), r"momentum .* Received: -0.5"),
        (lambda: SGD(nesterov=True), r"nesterov=True needs momentum > 0.*momentum=0.0"),
        (lambda: SGD(nesterov=1), r"nesterov must be true or false. Received: 1"),
        (
            lambda: Adam(betas=(0.9, 1.0)),
            r"betas must be two numbers in \[0, 1\). Received: \(0.9, 1.0\)",
        ),
        (lambda: Adam(betas=(0.9,)), r"betas must have 2 elements. Received: \(0.9,\)"),
        (lambda: Adam(eps=-1e-8), r"eps .* Received: -1e-08"),
        (
            lambda: Adagrad(initial_accumulator_value=-1),
            r"initial_accumulator_value .* Received: -1",
        ),
        (lambda: RMSprop(alpha=1.5), r"alpha must be in \[0, 1\]. Received: 1.5"),
        (lambda: RMSprop(weight_decay=math.inf), r"weight_decay .* Received: inf"),
        (
            lambda: OptimizerSpec.from_dict({"name": "adamw", "lr": 0.1}),
            r"Unknown optimizer 'adamw'.*Allowed: \['adagrad', 'adam', 'rmsprop', 'sgd'\]",
        ),
        (
            lambda: OptimizerSpec.from_dict({"name": "sgd", "learning_rate": 0.1}),
            r"unknown fields \['learning_rate'\].*Allowed fields: \['lr', 'momentum'",
        ),
        (lambda: OptimizerSpec.from_dict(["sgd"]), r"must be a JSON object. Received: \['sgd'\]"),
    ],
)
def test_bad_optimizer_specs_are_rejected_with_the_value(make, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()


def test_exponential_decay_matches_tf_formula() -> None:
    smooth = ExponentialDecay(decay_steps=100, decay_rate=0.96)
    stairs = ExponentialDecay(decay_steps=100, decay_rate=0.96, staircase=True)
    assert smooth.lr_at(0.1, 0) == 0.1
    assert smooth.lr_at(0.1, 50) == pytest.approx(0.1 * 0.96**0.5, rel=1e-12)
    assert smooth.lr_at(0.1, 250) == pytest.approx(0.1 * 0.96**2.5, rel=1e-12)
    assert stairs.lr_at(0.1, 99) == 0.1
    assert stairs.lr_at(0.1, 100) == pytest.approx(0.096, rel=1e-12)
    assert stairs.lr_at(0.1, 250) == pytest.approx(0.009216 * 10, rel=1e-12)


def test_piecewise_constant_matches_tf_boundaries_inclusive_on_the_left_value() -> None:
    schedule = PiecewiseConstant(boundaries=(100, 200), values=(1.0, 0.5, 0.1))
    got = [schedule.lr_at(123.0, s) for s in (0, 100, 101, 200, 201, 10**9)]
    assert got == [1.0, 1.0, 0.5, 0.5, 0.1, 0.1]


def test_constant_schedule_returns_the_base_lr() -> None:
    assert Constant().lr_at(0.3, 12345) == 0.3


@pytest.mark.parametrize(
    "schedule",
    [Constant(), ExponentialDecay(10, 0.5, staircase=True), PiecewiseConstant((5,), (0.1, 0.01))],
)
def test_schedule_round_trips_through_json(schedule: Schedule) -> None:
    again = Schedule.from_dict(json.loads(json.dumps(schedule.to_dict())))
    assert again == schedule


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: ExponentialDecay(decay_steps=0, decay_rate=0.5),
            r"decay_steps must be > 0. Received: 0",
        ),
        (
            lambda: ExponentialDecay(decay_steps=10, decay_rate=-0.5),
            r"decay_rate .* Received: -0.5",
        ),
        (
            lambda: PiecewiseConstant((10, 5), (1.0, 0.5, 0.1)),
            r"strictly increasing.*Received: \[10, 5\]",
        ),
        (
            lambda: PiecewiseConstant((10,), (1.0,)),
            r"one more value than boundaries.*values=\[1.0\]",
        ),
        (
            lambda: Schedule.from_dict({"name": "cosine"}),
            r"Unknown schedule 'cosine'.*Allowed: \['constant'",
        ),
        (lambda: Schedule.from_dict({"name": "exponential_decay"}), r"missing a field"),
        (lambda: Constant().lr_at(0.1, -1), r"global_step must be an int >= 0. Received: -1"),
    ],
)
def test_bad_schedules_are_rejected_with_the_value(make, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()


def test_set_lr_changes_every_group_and_the_next_step() -> None:
    w = torch.ones(2, requires_grad=True)
    b = torch.ones(1, requires_grad=True)
    opt = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 5.0}], lr=1.0)
    optim.set_lr(opt, ExponentialDecay(1, 0.5, staircase=True).lr_at(1.0, 2))
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]
    w.grad, b.grad = torch.ones(2), torch.ones(1)
    opt.step()
    assert w.tolist() == [0.75, 0.75] and b.tolist() == [0.75]
    with pytest.raises(ConfigError, match="Received: -0.1"):
        optim.set_lr(opt, -0.1)


def test_moving_average_without_num_updates_matches_hand_computation() -> None:
    ema = MovingAverage(0.9, use_num_updates=False)
    ema.register({"w": torch.tensor([1.0], dtype=torch.float64)})
    ema.update({"w": torch.tensor([2.0], dtype=torch.float64)})
    ema.update({"w": torch.tensor([3.0], dtype=torch.float64)})
    # 1 - 0.1 * (1 - 2) = 1.1; 1.1 - 0.1 * (1.1 - 3) = 1.29
    assert ema.shadow()["w"].item() == pytest.approx(1.29, abs=1e-12)


def test_moving_average_decay_zero_takes_the_value_and_decay_one_keeps_the_shadow_exactly() -> None:
    """The ends of the formula are exact (one lerp): a value far from the shadow is not lost to
    rounding, as ``shadow - (shadow - value) * 1`` loses it (1e8 - (1e8 - 1) is 0 in float32)."""
    value = torch.tensor([1.0, -3.5, 7e-8], dtype=torch.float32)
    fast = MovingAverage(0.0, use_num_updates=False)
    fast.register({"w": torch.tensor([1e8, 2e7, -5e6], dtype=torch.float32)})
    fast.update({"w": value})
    assert torch.equal(fast.shadow()["w"], value)
    still = MovingAverage(1.0, use_num_updates=False)
    start = torch.tensor([1e8, 2e7, -5e6], dtype=torch.float32)
    still.register({"w": start})
    still.update({"w": value})
    assert torch.equal(still.shadow()["w"], start)


def test_moving_average_with_num_updates_caps_decay_early() -> None:
    ema = MovingAverage(0.99)
    ema.register({"w": torch.tensor([1.0], dtype=torch.float64)})
    ema.update({"w": torch.tensor([2.0], dtype=torch.float64)})  # n=0: decay 1/10
    ema.update({"w": torch.tensor([3.0], dtype=torch.float64)})  # n=1: decay 2/11
    ema.update({"w": torch.tensor([3.0], dtype=torch.float64)}, num_updates=1000)  # decay 0.99
    s1 = 1 - 0.9 * (1 - 2)
    s2 = s1 - (9 / 11) * (s1 - 3)
    s3 = s2 - 0.01 * (s2 - 3)
    assert ema.shadow()["w"].item() == pytest.approx(s3, abs=1e-12)
    assert ema.effective_decay(1000) == 0.99


def test_moving_average_zero_debias_matches_tf_bias_correction() -> None:
    ema = MovingAverage(0.5, zero_debias=True, use_num_updates=False)
    ema.register({"w": torch.tensor([7.0], dtype=torch.float64)})
    ema.update({"w": torch.tensor([2.0], dtype=torch.float64)})
    # biased = 0 - 0.5 * (0 - 2) = 1; shadow = 1 / (1 - 0.5) = 2
    assert ema.shadow()["w"].item() == pytest.approx(2.0, abs=1e-12)
    ema.update({"w": torch.tensor([4.0], dtype=torch.float64)})
    # biased = 1 - 0.5 * (1 - 4) = 2.5; shadow = 2.5 / (1 - 0.25)
    assert ema.shadow()["w"].item() == pytest.approx(2.5 / 0.75, abs=1e-12)


@pytest.mark.parametrize("zero_debias", [False, True])
def test_moving_average_state_dict_round_trip_continues_identically(zero_debias: bool) -> None:
    values = [torch.randn(3, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    a = MovingAverage(0.9, zero_debias=zero_debias)
    a.register({"w": values[0]})
    a.update({"w": values[1]})
    state = safetensors.torch.load(safetensors.torch.save(a.state_dict()))
    b = MovingAverage(0.9, zero_debias=zero_debias)
    b.load_state_dict(state)
    for v in values[2:]:
        a.update({"w": v})
        b.update({"w": v})
    assert torch.equal(a.shadow()["w"], b.shadow()["w"])
    assert b.num_updates == 3


def test_moving_average_rejects_unknown_names_and_double_registration() -> None:
    ema = MovingAverage(0.9)
    ema.register({"w": torch.zeros(2)})
    with pytest.raises(ConfigError, match=r"does not track 'v'. Registered: \['w'\]"):
        ema.update({"v": torch.zeros(2)})
    with pytest.raises(ConfigError, match=r"shape \(2,\); received a tensor of shape \(3,\)"):
        ema.update({"w": torch.zeros(3)})
    with pytest.raises(ConfigError, match="already tracks 'w'"):
        ema.register({"w": torch.zeros(2)})
    with pytest.raises(ConfigError, match=r"decay must be in \[0, 1\]. Received: 1.5"):
        MovingAverage(1.5)


def _train(
    params: list[torch.Tensor], opt: torch.optim.Optimizer, grads: list[list[torch.Tensor]]
) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize(("spec", "reference"), CASES)
def test_optimizer_state_flatten_round_trip_keeps_training_identical(spec, reference) -> None:
    gen = torch.Generator().manual_seed(7)
    shapes = [(4, 3), (3,)]
    names = ["fc.weight", "fc.bias"]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(5)]

    a = [t.clone().requires_grad_() for t in init]
    opt_a = spec.build(a)
    _train(a, opt_a, grads[:3])
    # Through safetensors bytes, as a checkpoint would go.
    flat = optim.optimizer_state_tensors(opt_a, names)
    flat = safetensors.torch.load(safetensors.torch.save(flat))
    assert all(k.split("/")[0] in names for k in flat)

    b = [t.detach().clone().requires_grad_() for t in a]
    opt_b = spec.build(b)
    optim.load_optimizer_state_tensors(opt_b, names, flat)
    _train(a, opt_a, grads[3:])
    _train(b, opt_b, grads[3:])
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_flattened_state_names_each_entry_and_stores_step_as_a_scalar() -> None:
    p = torch.zeros(2, 2, requires_grad=True)
    opt = Adam().build([p])
    p.grad = torch.ones(2, 2)
    opt.step()
    flat = optim.optimizer_state_tensors(opt, ["w"])
    assert sorted(flat) == ["w/exp_avg", "w/exp_avg_sq", "w/step"]
    assert flat["w/step"].shape == () and flat["w/step"].item() == 1.0
    flat["w/exp_avg"].add_(1.0)  # a copy: the optimizer's state is untouched
    assert not torch.equal(flat["w/exp_avg"], opt.state[p]["exp_avg"])


def _stepped_adam(amsgrad: bool = False) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    p = torch.zeros(2, 2, requires_grad=True)
    opt = Adam(amsgrad=amsgrad).build([p])
    p.grad = torch.ones(2, 2)
    opt.step()
    return p, opt


def test_loading_state_with_a_missing_entry_names_it() -> None:
    _, source = _stepped_adam()
    flat = optim.optimizer_state_tensors(source, ["w"])
    del flat["w/exp_avg_sq"]
    _, target = _stepped_adam()
    with pytest.raises(CheckpointError, match=r"missing \['w/exp_avg_sq'\]"):
        optim.load_optimizer_state_tensors(target, ["w"], flat)


def test_loading_state_from_another_optimizer_setting_names_the_extra_entry() -> None:
    _, source = _stepped_adam(amsgrad=True)
    flat = optim.optimizer_state_tensors(source, ["w"])
    _, target = _stepped_adam(amsgrad=False)
    with pytest.raises(CheckpointError, match=r"unexpected \['w/max_exp_avg_sq'\]"):
        optim.load_optimizer_state_tensors(target, ["w"], flat)


def test_loading_ill_shaped_state_names_entry_and_shapes() -> None:
    _, source = _stepped_adam()
    flat = optim.optimizer_state_tensors(source, ["w"])
    flat["w/exp_avg"] = torch.zeros(4)
    _, target = _stepped_adam()
    with pytest.raises(CheckpointError, match=r"w/exp_avg has shape \(4,\), expected \(2, 2\)"):
        optim.load_optimizer_state_tensors(target, ["w"], flat)


def test_state_helpers_reject_names_that_do_not_match_the_parameters() -> None:
    _, opt = _stepped_adam()
    message = r"one unique name per optimizer parameter \(1\).*\['a', 'b'\]"
    with pytest.raises(ConfigError, match=message):
        optim.optimizer_state_tensors(opt, ["a", "b"])
    with pytest.raises(ConfigError, match="Received 0 names"):
        optim.load_optimizer_state_tensors(opt, [], {})
