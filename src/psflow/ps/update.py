"""One optimizer step on a ps shard's values, without ``torch.optim.Optimizer.step``'s wrapper.

A ps applies an update per push (async) or per step (sync). ``Optimizer.step()`` wraps the
update rule in a profiler ``record_function``, hook loops, a grad-mode switch and a pass over
the param group that collects ``p.grad`` and the state into lists, every call; on a small shard
that wrapper is most of the apply. :class:`DirectStep` keeps the argument lists and calls the
same functional implementation ``step()`` calls (``torch.optim.sgd.sgd``, ``adam.adam``,
``adagrad.adagrad``, ``rmsprop.rmsprop``) with the same arguments, read from the same param
group and the same ``optimizer.state`` entries, so the result is bit-identical to ``step()``
(tests/unit/test_direct_step.py checks it for every optimizer psflow ships) and the state stays
where checkpoints read it (:func:`psflow.optim.optimizer_state_tensors`).

It falls back to ``step()`` (setting ``p.grad`` for it) whenever the direct call could differ:
an optimizer class other than those four (subclasses included), more than one param group, a
step hook registered (on the optimizer or globally), ``differentiable``/``capturable``,
parameters that require grad or are complex, and any call where a parameter's state is not
complete yet (the first step creates it: SGD's momentum buffer, Adam's moments). A ``fused``
optimizer (psflow's specs build SGD, Adam and Adagrad fused) takes the direct path too: the
functional call with ``fused=True`` is the fused kernel ``step()`` runs.

Called by :class:`psflow.ps.store.ParameterStore` (``_apply``), under the store's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import adagrad, adam, rmsprop, sgd
from torch.optim import optimizer as _optimizer_module

from psflow.optim import _required_state_keys

_DIRECT_TYPES = (torch.optim.SGD, torch.optim.Adam, torch.optim.Adagrad, torch.optim.RMSprop)


class DirectStep:
    """Apply ``grads`` to ``optimizer``'s parameters as ``optimizer.step()`` would.

    Args:
        optimizer: a ``torch.optim`` optimizer over the shard's values (one param group).

    Example:
        >>> p = torch.zeros(3); opt = torch.optim.SGD([p], lr=0.1)
        >>> DirectStep(opt)([torch.ones(3)]); p
        tensor([-0.1000, -0.1000, -0.1000])
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.direct_calls = 0  # how many updates took the direct path (tests, benchmarks)
        self._kernel = _kernel_for(optimizer) if _eligible(optimizer, self.params) else None

    @property
    def is_direct(self) -> bool:
        """Whether this optimizer can take the direct path at all (its state may still be building)."""
        return self._kernel is not None

    def __call__(self, grads: Sequence[torch.Tensor]) -> None:
        """One update with ``grads`` (one per parameter, in param-group order)."""
        opt = self.optimizer
        if (self._kernel is None or opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or _optimizer_module._global_optimizer_pre_hooks or _optimizer_module._global_optimizer_post_hooks
                or not self._kernel(opt, self.params, grads)):
            self._step(grads)
            return
        self.direct_calls += 1

    def _step(self, grads: Sequence[torch.Tensor]) -> None:
        for p, g in zip(self.params, grads):
            p.grad = g
        try:
            self.optimizer.step()
        finally:
            for p in self.params:
                p.grad = None


def _eligible(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    if type(opt) not in _DIRECT_TYPES or len(opt.param_groups) != 1 or not params:
        return False
    group = opt.param_groups[0]
    if group.get("differentiable") or group.get("capturable"):
        return False
    if isinstance(group["lr"], torch.Tensor):
        return False
    return not any(p.requires_grad or p.is_complex() or p.is_sparse for p in params)


_Kernel = Callable[[torch.optim.Optimizer, list[torch.Tensor], Sequence[torch.Tensor]], bool]


def _kernel_for(opt: torch.optim.Optimizer) -> _Kernel:
    return {torch.optim.SGD: _sgd, torch.optim.Adam: _adam, torch.optim.Adagrad: _adagrad,
            torch.optim.RMSprop: _rmsprop}[type(opt)]


def _states(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[dict[str, Any]] | None:
    """Each parameter's state, or None while one of them lacks a key its step needs (the first
    step, through ``step()``, creates them exactly as torch does)."""
    required = _required_state_keys(opt, opt.param_groups[0]) or set()
    state = opt.state
    out = []
    for p in params:
        s = state.get(p)
        if s is None or any(s.get(k) is None for k in required):
            return None
        out.append(s)
    return out


# Each kernel mirrors its optimizer's step() in torch 2.13 argument for argument (see torch/optim/*.py).

def _sgd(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
    group = opt.param_groups[0]
    momentum = group["momentum"]
    if momentum != 0:
        states = _states(opt, params)
        if states is None:
            return False
        buffers: list[torch.Tensor | None] = [s["momentum_buffer"] for s in states]
    else:
        states, buffers = None, [None] * len(params)
    sgd.sgd(params, list(grads), buffers, weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
            dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
            has_sparse_grad=False, foreach=group["foreach"], fused=group["fused"],
            grad_scale=getattr(opt, "grad_scale", None), found_inf=getattr(opt, "found_inf", None))
    if states is not None:
        for s, b in zip(states, buffers):
            s["momentum_buffer"] = b
    return True


def _adam(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
    group = opt.param_groups[0]
    states = _states(opt, params)
    if states is None:
        return False
    amsgrad = group["amsgrad"]
    beta1, beta2 = group["betas"]
    adam.adam(params, list(grads), [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
              [s["max_exp_avg_sq"] for s in states] if amsgrad else [], [s["step"] for s in states],
              amsgrad=amsgrad, has_complex=False, beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
              foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
              fused=group["fused"], grad_scale=getattr(opt, "grad_scale", None),
              found_inf=getattr(opt, "found_inf", None),
              decoupled_weight_decay=group.get("decoupled_weight_decay", False))
    return True


def _adagrad(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
    group = opt.param_groups[0]
    states = _states(opt, params)
    if states is None:
        return False
    adagrad.adagrad(params, list(grads), [s["sum"] for s in states], [s["step"] for s in states],
                    lr=group["lr"], weight_decay=group["weight_decay"], lr_decay=group["lr_decay"], eps=group["eps"],
                    has_sparse_grad=False, foreach=group["foreach"], maximize=group["maximize"],
                    differentiable=group["differentiable"], has_complex=False, fused=group["fused"],
                    grad_scale=getattr(opt, "grad_scale", None), found_inf=getattr(opt, "found_inf", None))
    return True


def _rmsprop(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
    group = opt.param_groups[0]
    states = _states(opt, params)
    if states is None:
        return False
    momentum, centered = group["momentum"], group["centered"]
    rmsprop.rmsprop(params, list(grads), [s["square_avg"] for s in states],
                    [s["grad_avg"] for s in states] if centered else [],
                    [s["momentum_buffer"] for s in states] if momentum > 0 else [], [s["step"] for s in states],
                    lr=group["lr"], alpha=group["alpha"], eps=group["eps"], weight_decay=group["weight_decay"],
                    momentum=momentum, centered=centered, foreach=group["foreach"], maximize=group["maximize"],
                    differentiable=group["differentiable"], capturable=group["capturable"], has_complex=False)
    return True
