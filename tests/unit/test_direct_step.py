"""The ps's direct update (psflow.ps.update.DirectStep) is bit-identical to ``Optimizer.step()``.

For every optimizer psflow ships, in every setting that changes its state (momentum, nesterov,
dampening, weight decay, Adam's AMSGrad and decoupled decay, centered RMSprop...), two copies of the
same parameters take the same gradients for several steps, one through ``step()`` and one through
DirectStep; parameters and every state entry must be equal bit for bit, the direct path must really
have been taken, and a checkpoint of the direct copy's state must restore into a fresh optimizer that
goes on identically. Where the direct path could differ (a hook, a subclass, two param groups) it must
fall back to ``step()``.
"""

from __future__ import annotations

import pytest
import torch

from psflow.config import TrainConfig
from psflow.optim import (
    SGD,
    Adagrad,
    Adam,
    OptimizerSpec,
    RMSprop,
    load_optimizer_state_tensors,
    optimizer_state_tensors,
    set_lr,
)
from psflow.ps.store import ParameterStore
from psflow.ps.update import DirectStep

SHAPES = {"w": (7, 5), "b": (5,), "e": (3, 2, 4)}
STEPS = 12

SPECS = [
    SGD(lr=0.1),
    SGD(lr=0.05, weight_decay=0.01),
    SGD(lr=0.05, momentum=0.9),
    SGD(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=1e-3),
    SGD(lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-3),
    Adam(lr=1e-2),
    Adam(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.01, eps=1e-6),
    Adam(lr=1e-2, amsgrad=True, weight_decay=0.01),
    Adagrad(lr=0.1),
    Adagrad(lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1),
    RMSprop(lr=1e-2),
    RMSprop(lr=1e-2, momentum=0.9, weight_decay=0.01),
    RMSprop(lr=1e-2, centered=True, momentum=0.5),
    # psflow builds SGD, Adam and Adagrad fused by default (above); torch's for-loop kernels too:
    SGD(lr=0.05, momentum=0.9, fused=False),
    Adam(lr=1e-2, amsgrad=True, fused=False),
    Adagrad(lr=0.1, fused=False),
]


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES.values()]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) for s in SHAPES.values()]


def _reference_step(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for p in params:
        p.grad = None


def _assert_same(a_params, a_opt, b_params, b_opt) -> None:
    for x, y in zip(a_params, b_params):
        assert torch.equal(x, y), (x - y).abs().max()
    names = list(SHAPES)
    sa, sb = optimizer_state_tensors(a_opt, names), optimizer_state_tensors(b_opt, names)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_direct_step_is_bit_identical_to_optimizer_step(spec: OptimizerSpec):
    ref_params, params = _params(), _params()
    ref_opt, opt = spec.build(ref_params), spec.build(params)
    direct = DirectStep(opt)
    assert direct.is_direct
    for step in range(STEPS):
        if step == STEPS // 2:  # a schedule's new learning rate is read by the next update
            set_lr(ref_opt, spec.lr / 3)
            set_lr(opt, spec.lr / 3)
        grads = _grads(step)
        _reference_step(ref_opt, ref_params, grads)
        direct([g.clone() for g in grads])
        _assert_same(ref_params, ref_opt, params, opt)
    stateful = bool(optimizer_state_tensors(ref_opt, list(SHAPES)))
    stateful_at_start = isinstance(opt, torch.optim.Adagrad)  # Adagrad creates its state at construction
    # Only the first update of an optimizer that keeps state goes through step(), which creates it.
    assert direct.direct_calls == (STEPS - 1 if stateful and not stateful_at_start else STEPS)


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_direct_step_state_survives_a_checkpoint_round_trip(spec: OptimizerSpec):
    ref_params, params = _params(), _params()
    ref_opt, opt = spec.build(ref_params), spec.build(params)
    direct = DirectStep(opt)
    for step in range(5):
        _reference_step(ref_opt, ref_params, _grads(step))
        direct(_grads(step))
    # What a ps checkpoint holds: values and the flat optimizer state; restored into a fresh optimizer.
    saved = optimizer_state_tensors(opt, list(SHAPES))
    restored_params = [p.clone() for p in params]
    restored_opt = spec.build(restored_params)
    load_optimizer_state_tensors(restored_opt, list(SHAPES), saved)
    restored = DirectStep(restored_opt)
    for step in range(5, 10):
        _reference_step(ref_opt, ref_params, _grads(step))
        restored(_grads(step))
    _assert_same(ref_params, ref_opt, restored_params, restored_opt)
    assert restored.direct_calls == 5  # the restored state is complete: no step() needed to create it


class _MySGD(torch.optim.SGD):
    pass


def test_specs_build_fused_optimizers_unless_told_not_to():
    for spec in (SGD(lr=0.1), Adam(), Adagrad()):
        opt = spec.build(_params())
        assert opt.param_groups[0]["fused"] is True, spec
        assert type(spec).from_dict(spec.to_dict()) == spec
    for spec in (SGD(lr=0.1, fused=False), Adam(fused=False), Adagrad(fused=False)):
        assert not spec.build(_params()).param_groups[0]["fused"], spec
    assert OptimizerSpec.from_dict({"name": "adam", "lr": 0.01}).fused is True  # a spec written before the field


def test_direct_step_falls_back_to_step_for_a_hook_a_subclass_or_two_groups():
    calls = []
    params = _params()
    hooked = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    hooked.register_step_post_hook(lambda opt, args, kwargs: calls.append(1))
    sub_params = _params()
    sub = _MySGD(sub_params, lr=0.1, momentum=0.9)
    two_params = _params()
    two = torch.optim.SGD([{"params": two_params[:1]}, {"params": two_params[1:]}], lr=0.1, momentum=0.9)
    ref_params = _params()
    ref = torch.optim.SGD(ref_params, lr=0.1, momentum=0.9)
    steps = [DirectStep(o) for o in (hooked, sub, two)]
    assert [s.is_direct for s in steps] == [True, False, False]  # a hook can come and go: checked per call
    for step in range(4):
        _reference_step(ref, ref_params, _grads(step))
        for s in steps:
            s(_grads(step))
    assert calls == [1, 1, 1, 1]  # the hook ran on every update: step() did them
    assert all(s.direct_calls == 0 for s in steps)
    for ps in (params, sub_params, two_params):
        assert all(torch.equal(a, b) for a, b in zip(ps, ref_params))


@pytest.mark.parametrize("spec", [SGD(lr=0.1, momentum=0.9, nesterov=True), Adam(lr=0.01, amsgrad=True),
                                  RMSprop(lr=0.01, centered=True)], ids=repr)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_store_updates_equal_a_plain_torch_optimizer(spec: OptimizerSpec, mode: str):
    """A ps shard's values after N pushes (async) or N sync steps of 2 workers equal the same
    updates made with torch.optim's step() by hand."""
    store = ParameterStore(shard=0, num_workers=2)
    cfg = TrainConfig(mode=mode, sync_timeout_s=1.0).resolved(2)
    store.initialize(dict(zip(SHAPES, _params())), optimizer=spec.to_dict(), config=cfg, placement_digest="d")
    ref_params = _params()
    ref_opt = spec.build(ref_params)
    for step in range(6):
        g0, g1 = _grads(2 * step), _grads(2 * step + 1)
        store.push(0, step, dict(zip(SHAPES, g0)))
        store.push(1, step, dict(zip(SHAPES, g1)))
        if mode == "async":
            _reference_step(ref_opt, ref_params, g0)
            _reference_step(ref_opt, ref_params, g1)
        else:  # the held gradients summed in worker order, then divided by their number
            _reference_step(ref_opt, ref_params, [(a.clone().add_(b)).div_(2) for a, b in zip(g0, g1)])
    for k, ref in zip(SHAPES, ref_params):
        assert torch.equal(store.values[k], ref), k
    assert store._step is not None and store._step.direct_calls == store.stats.applied_updates - 1
