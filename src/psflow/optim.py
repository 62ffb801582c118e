"""Optimizer specs, learning-rate schedules and moving averages, as plain data.

This module owns *what* update rule a job uses, in a form that travels as JSON from the chief
to every ps shard (never pickled). A ps shard turns a spec into a real ``torch.optim`` optimizer
with :meth:`OptimizerSpec.build`, one per piece it holds, so its updates equal ``torch.optim``'s
by construction. For the elementwise optimizers here (SGD, Adagrad, Adam, RMSprop) an optimizer
per row-piece gives the same result as one optimizer on the whole tensor.

Invariants:

* specs and schedules are frozen dataclasses validated in ``__post_init__``; ``from_dict`` accepts
  exactly what ``to_dict`` produces (plus JSON's lists for tuples) and nothing else;
* :class:`MovingAverage` and the optimizer-state helpers are pure tensor code: no I/O; checkpoint
  files are written elsewhere (``psflow.checkpoint``) from the flat tensor dicts made here.

Callers: the Trainer (user-facing ``pf.optim.SGD(...)``), the ps service (``build``, ``set_lr``,
``Schedule.lr_at`` with the global step) and checkpointing (``optimizer_state_tensors``).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from psflow.errors import CheckpointError, ConfigError

# ---------------------------------------------------------------------------------------------
# Shared field checking: one place that type-checks dataclass fields from their annotations.
# ---------------------------------------------------------------------------------------------


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _coerce_field(owner: str, field: str, annotation: str, value: object) -> object:
    """Type-check one field value against its (string) annotation and normalize it."""
    if annotation == "float":
        if not _is_number(value):
            raise ConfigError(f"{owner} {field} must be a number. Received: {value!r}.")
        return float(value)  # type: ignore[arg-type]
    if annotation == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{owner} {field} must be an int. Received: {value!r}.")
        return value
    if annotation == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{owner} {field} must be true or false. Received: {value!r}.")
        return value
    if annotation.startswith("tuple["):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{owner} {field} must be a list. Received: {value!r}.")
        inner = annotation[len("tuple[") : -1].split(", ")
        if inner[-1] == "...":
            kinds = [inner[0]] * len(value)
        elif len(value) != len(inner):
            raise ConfigError(
                f"{owner} {field} must have {len(inner)} elements. Received: {value!r}."
            )
        else:
            kinds = inner
        return tuple(_coerce_field(owner, field, k, v) for k, v in zip(kinds, value))
    raise TypeError(f"unsupported annotation {annotation!r}")  # a bug in this module, not input


def _check_fields(obj: Any) -> None:
    """Type-check and normalize every dataclass field of a frozen ``obj`` in place."""
    for f in dataclasses.fields(obj):
        value = _coerce_field(type(obj).__name__, f.name, str(f.type), getattr(obj, f.name))
        object.__setattr__(obj, f.name, value)


def _require(ok: bool, owner: str, field: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{owner} {field} must be {rule}. Received: {value!r}.")


def _finite(x: float) -> bool:
    return math.isfinite(x)


def _to_dict(obj: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"name": obj.name}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        d[f.name] = list(value) if isinstance(value, tuple) else value
    return d


def _from_dict(kind: str, registry: Mapping[str, type], d: object) -> Any:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{kind} spec must be a JSON object. Received: {d!r}.")
    name = d.get("name")
    if name not in registry:
        raise ConfigError(
            f"Unknown {kind} {name!r}. Received: {dict(d)!r}. Allowed: {sorted(registry)}."
        )
    cls = registry[name]
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(allowed) - {"name"})
    if unknown:
        raise ConfigError(
            f"{kind} {name!r} has unknown fields {unknown}. Received: {dict(d)!r}. "
            f"Allowed fields: {allowed}."
        )
    try:
        return cls(**{k: v for k, v in d.items() if k != "name"})
    except TypeError as e:  # a required field is missing
        raise ConfigError(
            f"{kind} {name!r} is missing a field ({e}). Received: {dict(d)!r}. "
            f"Fields: {allowed}."
        ) from e


# ---------------------------------------------------------------------------------------------
# Optimizer specs
# ---------------------------------------------------------------------------------------------


class OptimizerSpec(abc.ABC):
    """Base of the optimizer specs: an update rule as data, built into ``torch.optim`` on a ps.

    Subclasses are frozen dataclasses with a class-level ``name`` and an ``lr`` field.
    """

    name: ClassVar[str]
    lr: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict: ``{"name": ..., <field>: <value>, ...}``."""
        return _to_dict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> OptimizerSpec:
        """Rebuild a spec from :meth:`to_dict` output (or hand-written JSON).

        Raises:
            ConfigError: Unknown optimizer name or field, wrong type, or out-of-range value.

        Example:
            >>> OptimizerSpec.from_dict({"name": "sgd", "lr": 0.1})
            SGD(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, fused=True)
        """
        return _from_dict("optimizer", _OPTIMIZERS, d)

    @abc.abstractmethod
    def build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """Create the ``torch.optim`` optimizer for ``params`` with this spec's settings."""

    def _check_common(self) -> None:
        _check_fields(self)
        owner = type(self).__name__
        _require(self.lr > 0 and _finite(self.lr), owner, "lr", self.lr, "a finite number > 0")
        wd = getattr(self, "weight_decay", 0.0)
        _require(wd >= 0 and _finite(wd), owner, "weight_decay", wd, "a finite number >= 0")
        eps = getattr(self, "eps", 0.0)
        _require(eps >= 0 and _finite(eps), owner, "eps", eps, "a finite number >= 0")
        momentum = getattr(self, "momentum", 0.0)
        _require(
            momentum >= 0 and _finite(momentum), owner, "momentum", momentum, "a finite number >= 0"
        )


@dataclass(frozen=True)
class SGD(OptimizerSpec):
    """Stochastic gradient descent, optionally with (Nesterov) momentum; ``torch.optim.SGD``.

    ``fused`` (default True): the ps applies it with torch's fused kernel (one vectorized pass over
    each tensor; on one CPU thread Adam's step on the MNIST CNN's 3.3M values takes 2.5 ms instead
    of 19 ms, SGD with momentum 1.8 instead of 2.9, Adagrad 1.8 instead of 4.7). Its results differ
    from the default implementation's in the last bits; ``fused=False`` gives
    ``torch.optim.SGD(...)``'s default for-loop implementation exactly.
    """

    name: ClassVar[str] = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    fused: bool = True

    def __post_init__(self) -> None:
        self._check_common()
        _require(
            0 <= self.dampening <= 1, "SGD", "dampening", self.dampening, "in [0, 1]"
        )
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError(
                "SGD nesterov=True needs momentum > 0 and dampening = 0. Received: "
                f"momentum={self.momentum!r}, dampening={self.dampening!r}."
            )

    def build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            params,
            lr=self.lr,
            momentum=self.momentum,
            dampening=self.dampening,
            weight_decay=self.weight_decay,
            nesterov=self.nesterov,
            fused=self.fused,
        )


@dataclass(frozen=True)
class Adagrad(OptimizerSpec):
    """Adagrad; ``torch.optim.Adagrad``.

    ``fused`` (default True): the ps applies it with torch's fused kernel (one vectorized pass over
    each tensor; on one CPU thread Adam's step on the MNIST CNN's 3.3M values takes 2.5 ms instead
    of 19 ms, SGD with momentum 1.8 instead of 2.9, Adagrad 1.8 instead of 4.7). Its results differ
    from the default implementation's in the last bits; ``fused=False`` gives
    ``torch.optim.Adagrad(...)``'s default for-loop implementation exactly.
    """

    name: ClassVar[str] = "adagrad"
    lr: float = 0.01
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    fused: bool = True

    def __post_init__(self) -> None:
        self._check_common()
        _require(
            self.lr_decay >= 0 and _finite(self.lr_decay),
            "Adagrad", "lr_decay", self.lr_decay, "a finite number >= 0",
        )
        iav = self.initial_accumulator_value
        _require(
            iav >= 0 and _finite(iav),
            "Adagrad", "initial_accumulator_value", iav, "a finite number >= 0",
        )

    def build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(
            params,
            lr=self.lr,
            lr_decay=self.lr_decay,
            weight_decay=self.weight_decay,
            initial_accumulator_value=self.initial_accumulator_value,
            eps=self.eps,
            fused=self.fused,
        )


@dataclass(frozen=True)
class Adam(OptimizerSpec):
    """Adam (and AMSGrad); ``torch.optim.Adam``.

    ``fused`` (default True): the ps applies it with torch's fused kernel (one vectorized pass over
    each tensor; on one CPU thread Adam's step on the MNIST CNN's 3.3M values takes 2.5 ms instead
    of 19 ms, SGD with momentum 1.8 instead of 2.9, Adagrad 1.8 instead of 4.7). Its results differ
    from the default implementation's in the last bits; ``fused=False`` gives
    ``torch.optim.Adam(...)``'s default for-loop implementation exactly.
    """

    name: ClassVar[str] = "adam"
    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    fused: bool = True

    def __post_init__(self) -> None:
        self._check_common()
        for b in self.betas:
            _require(0 <= b < 1, "Adam", "betas", self.betas, "two numbers in [0, 1)")

    def build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.Adam(
            params,
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
            amsgrad=self.amsgrad,
            fused=self.fused,
        )


@dataclass(frozen=True)
class RMSprop(OptimizerSpec):
    """RMSprop, optionally centered and with momentum; ``torch.optim.RMSprop``."""

    name: ClassVar[str] = "rmsprop"
    lr: float = 0.01
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False

    def __post_init__(self) -> None:
        self._check_common()
        _require(0 <= self.alpha <= 1, "RMSprop", "alpha", self.alpha, "in [0, 1]")

    def build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.RMSprop(
            params,
            lr=self.lr,
            alpha=self.alpha,
            eps=self.eps,
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            centered=self.centered,
        )


_OPTIMIZERS: dict[str, type[OptimizerSpec]] = {
    c.name: c for c in (SGD, Adagrad, Adam, RMSprop)
}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every param group of ``optimizer`` (e.g. from a :class:`Schedule`).

    Raises:
        ConfigError: ``lr`` is negative or not finite.
    """
    _require(_is_number(lr) and lr >= 0 and _finite(lr), "set_lr", "lr", lr, "a finite number >= 0")
    for group in optimizer.param_groups:
        group["lr"] = float(lr)


# ---------------------------------------------------------------------------------------------
# Learning-rate schedules by global step
# ---------------------------------------------------------------------------------------------


class Schedule(abc.ABC):
    """Base of the learning-rate schedules: a pure function of ``(base_lr, global_step)``."""

    name: ClassVar[str]

    @abc.abstractmethod
    def lr_at(self, base_lr: float, global_step: int) -> float:
        """The learning rate to use at ``global_step`` (>= 0)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict: ``{"name": ..., <field>: <value>, ...}``."""
        return _to_dict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Schedule:
        """Rebuild a schedule from :meth:`to_dict` output; ConfigError on anything else."""
        return _from_dict("schedule", _SCHEDULES, d)


def _check_step(global_step: object) -> int:
    if not isinstance(global_step, int) or isinstance(global_step, bool) or global_step < 0:
        raise ConfigError(f"global_step must be an int >= 0. Received: {global_step!r}.")
    return global_step


@dataclass(frozen=True)
class Constant(Schedule):
    """The base learning rate at every step."""

    name: ClassVar[str] = "constant"

    def lr_at(self, base_lr: float, global_step: int) -> float:
        _check_step(global_step)
        return float(base_lr)


@dataclass(frozen=True)
class ExponentialDecay(Schedule):
    """``tf.train.exponential_decay``: ``base_lr * decay_rate ** (step / decay_steps)``.

    With ``staircase`` the exponent is ``step // decay_steps``.
    """

    name: ClassVar[str] = "exponential_decay"
    decay_steps: int
    decay_rate: float
    staircase: bool = False

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(self.decay_steps > 0, "ExponentialDecay", "decay_steps", self.decay_steps, "> 0")
        _require(
            self.decay_rate > 0 and _finite(self.decay_rate),
            "ExponentialDecay", "decay_rate", self.decay_rate, "a finite number > 0",
        )

    def lr_at(self, base_lr: float, global_step: int) -> float:
        step = _check_step(global_step)
        p = step // self.decay_steps if self.staircase else step / self.decay_steps
        return float(base_lr) * self.decay_rate**p


@dataclass(frozen=True)
class PiecewiseConstant(Schedule):
    """``tf.train.piecewise_constant``: absolute learning rates between step boundaries.

    ``values[0]`` while ``step <= boundaries[0]``, ``values[i]`` while
    ``boundaries[i-1] < step <= boundaries[i]``, ``values[-1]`` after the last boundary.
    As in TensorFlow the values are learning rates, so ``base_lr`` is ignored.
    """

    name: ClassVar[str] = "piecewise_constant"
    boundaries: tuple[int, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        _check_fields(self)
        b, v = self.boundaries, self.values
        if len(v) != len(b) + 1:
            raise ConfigError(
                f"PiecewiseConstant needs one more value than boundaries. Received: "
                f"boundaries={list(b)}, values={list(v)}."
            )
        _require(
            all(x >= 0 for x in b) and all(x < y for x, y in zip(b, b[1:])),
            "PiecewiseConstant", "boundaries", list(b), "strictly increasing ints >= 0",
        )
        _require(
            all(x >= 0 and _finite(x) for x in v),
            "PiecewiseConstant", "values", list(v), "finite numbers >= 0",
        )

    def lr_at(self, base_lr: float, global_step: int) -> float:
        step = _check_step(global_step)
        for boundary, value in zip(self.boundaries, self.values):
            if step <= boundary:
                return value
        return self.values[-1]


_SCHEDULES: dict[str, type[Schedule]] = {
    c.name: c for c in (Constant, ExponentialDecay, PiecewiseConstant)
}


# ---------------------------------------------------------------------------------------------
# Moving averages
# ---------------------------------------------------------------------------------------------


class MovingAverage:
    """``tf.train.ExponentialMovingAverage`` over a dict of tensors (name -> tensor).

    Each update: ``shadow -= (1 - decay) * (shadow - value)``, where
    ``decay = min(decay, (1 + n) / (10 + n))`` if ``use_num_updates`` (``n`` is the
    ``num_updates`` argument, or the count of earlier updates when it is ``None``). It is computed
    as one ``lerp_`` towards the value (the same formula in one pass, without temporaries: a ps
    updates the averages after every step; its rounding may differ from the three-operation form
    in the last bit).

    With ``zero_debias`` (TF's ``assign_moving_average(zero_debias=True)``) a biased accumulator
    starts at zero and the shadow is ``biased / (1 - decay ** local_step)``.
    """

    def __init__(
        self, decay: float, *, zero_debias: bool = False, use_num_updates: bool = True
    ) -> None:
        _require(
            _is_number(decay) and 0 <= decay <= 1, "MovingAverage", "decay", decay, "in [0, 1]"
        )
        self.decay = float(decay)
        self.zero_debias = bool(zero_debias)
        self.use_num_updates = bool(use_num_updates)
        self.num_updates = 0
        self._shadow: dict[str, torch.Tensor] = {}
        self._biased: dict[str, torch.Tensor] = {}
        self._local_step: dict[str, int] = {}

    def effective_decay(self, num_updates: int | None = None) -> float:
        """The decay an update with ``num_updates`` would use."""
        if not self.use_num_updates:
            return self.decay
        n = self.num_updates if num_updates is None else num_updates
        return min(self.decay, (1.0 + n) / (10.0 + n))

    def register(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Start averaging ``tensors``; each shadow starts as a copy of the value.

        Raises:
            ConfigError: A name is already registered.
        """
        for name, t in tensors.items():
            if name in self._shadow:
                raise ConfigError(
                    f"MovingAverage already tracks {name!r}. Register each tensor once."
                )
            self._shadow[name] = t.detach().clone()
            if self.zero_debias:
                self._biased[name] = torch.zeros_like(self._shadow[name])
                self._local_step[name] = 0

    @torch.no_grad()
    def update(self, tensors: Mapping[str, torch.Tensor], num_updates: int | None = None) -> None:
        """Move the shadows of ``tensors`` (a subset of the registered names) towards them.

        Raises:
            ConfigError: A name is not registered, a shape differs, or ``num_updates < 0``.
        """
        if num_updates is not None and (
            not isinstance(num_updates, int) or isinstance(num_updates, bool) or num_updates < 0
        ):
            raise ConfigError(
                f"num_updates must be None or an int >= 0. Received: {num_updates!r}."
            )
        for name, t in tensors.items():
            if name not in self._shadow:
                raise ConfigError(
                    f"MovingAverage does not track {name!r}. Registered: {sorted(self._shadow)}. "
                    "Call register() first."
                )
            if t.shape != self._shadow[name].shape:
                raise ConfigError(
                    f"MovingAverage {name!r} has shape {tuple(self._shadow[name].shape)}; "
                    f"received a tensor of shape {tuple(t.shape)}."
                )
        decay = self.effective_decay(num_updates)
        for name, t in tensors.items():
            shadow = self._shadow[name]
            value = t.detach().to(device=shadow.device, dtype=shadow.dtype)
            if self.zero_debias:
                biased = self._biased[name]
                biased.lerp_(value, 1.0 - decay)
                self._local_step[name] += 1
                bias_factor = 1.0 - decay ** self._local_step[name]
                torch.div(biased, bias_factor, out=shadow)
            else:
                shadow.lerp_(value, 1.0 - decay)
        self.num_updates += 1

    def shadow(self) -> dict[str, torch.Tensor]:
        """The averaged tensors (the live shadows; clone them to keep a snapshot)."""
        return dict(self._shadow)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat tensors for a safetensors checkpoint: ``shadow/<name>``, ``biased/<name>``,
        ``local_step/<name>`` (zero_debias only) and ``num_updates``. Tensors are copies."""
        out = {"num_updates": torch.tensor(self.num_updates, dtype=torch.int64)}
        for name, t in self._shadow.items():
            out[f"shadow/{name}"] = t.clone()
            if self.zero_debias:
                out[f"biased/{name}"] = self._biased[name].clone()
                out[f"local_step/{name}"] = torch.tensor(self._local_step[name], dtype=torch.int64)
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace all state with ``state`` from :meth:`state_dict`.

        Raises:
            CheckpointError: An entry is missing or has an unknown key.
        """
        if "num_updates" not in state:
            raise CheckpointError(
                f"MovingAverage state has no 'num_updates'. Received keys: {sorted(state)}."
            )
        shadow: dict[str, torch.Tensor] = {}
        biased: dict[str, torch.Tensor] = {}
        local_step: dict[str, int] = {}
        for key, t in state.items():
            kind, _, name = key.partition("/")
            if key == "num_updates":
                continue
            if kind == "shadow":
                shadow[name] = t.detach().clone()
            elif kind == "biased" and self.zero_debias:
                biased[name] = t.detach().clone()
            elif kind == "local_step" and self.zero_debias:
                local_step[name] = int(t)
            else:
                raise CheckpointError(
                    f"Unexpected MovingAverage state entry {key!r} (zero_debias="
                    f"{self.zero_debias}). Was the checkpoint written with other settings?"
                )
        if self.zero_debias:
            for name in shadow:
                for kind, d in (("biased", biased), ("local_step", local_step)):
                    if name not in d:
                        raise CheckpointError(
                            f"MovingAverage state is missing {kind}/{name!r}. "
                            f"Received keys: {sorted(state)}."
                        )
        self.num_updates = int(state["num_updates"])
        self._shadow, self._biased, self._local_step = shadow, biased, local_step


# ---------------------------------------------------------------------------------------------
# Optimizer state <-> flat tensors (for safetensors checkpoints)
# ---------------------------------------------------------------------------------------------


def _params_in_order(opt: torch.optim.Optimizer, names: Sequence[str]) -> list[torch.Tensor]:
    params = [p for group in opt.param_groups for p in group["params"]]
    if len(params) != len(names) or len(set(names)) != len(names):
        raise ConfigError(
            f"Need one unique name per optimizer parameter ({len(params)}). "
            f"Received {len(names)} names: {list(names)}."
        )
    return params


# Every per-parameter state slot the optimizers above keep (the union of _required_state_keys): the
# slot names a ps admits in a PS_INIT's optimizer state (psflow.ps.bounds). ``step`` is a scalar.
STATE_SLOTS = frozenset({"momentum_buffer", "step", "sum", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "square_avg",
                         "grad_avg"})


def _required_state_keys(opt: torch.optim.Optimizer, group: Mapping[str, Any]) -> set[str] | None:
    """State keys a known torch optimizer keeps per parameter once it has stepped."""
    if isinstance(opt, torch.optim.SGD):
        return {"momentum_buffer"} if group["momentum"] != 0 else set()
    if isinstance(opt, torch.optim.Adagrad):
        return {"step", "sum"}
    if isinstance(opt, torch.optim.Adam):
        keys = {"step", "exp_avg", "exp_avg_sq"}
        return keys | {"max_exp_avg_sq"} if group["amsgrad"] else keys
    if isinstance(opt, torch.optim.RMSprop):
        keys = {"step", "square_avg"}
        if group["momentum"] > 0:
            keys.add("momentum_buffer")
        if group["centered"]:
            keys.add("grad_avg")
        return keys
    return None  # another optimizer: accept the keys the checkpoint has


def optimizer_state_tensors(
    opt: torch.optim.Optimizer, names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """Flatten ``opt``'s per-parameter state into ``"<name>/<key>" -> tensor`` copies.

    Python scalars become 0-dim tensors; ``None`` entries are skipped. Hyperparameters (lr, ...)
    are not included: they come from the :class:`OptimizerSpec` and the schedule.

    Args:
        opt: The optimizer.
        names: One name per parameter, in param-group order.

    Raises:
        ConfigError: ``names`` does not match the optimizer's parameters one to one.
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in zip(names, _params_in_order(opt, names)):
        for key, value in opt.state.get(p, {}).items():
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                out[f"{name}/{key}"] = value.detach().clone()
            elif isinstance(value, (bool, int, float)):
                out[f"{name}/{key}"] = torch.tensor(value)
            else:
                raise ConfigError(
                    f"Optimizer state {name}/{key} is a {type(value).__name__}, not a tensor or "
                    "number; it cannot be stored in a tensor checkpoint."
                )
    return out


def load_optimizer_state_tensors(
    opt: torch.optim.Optimizer, names: Sequence[str], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Inverse of :func:`optimizer_state_tensors`: put the state back into ``opt``.

    A parameter's entries are all-or-nothing: none (it keeps its current state, e.g. it never
    stepped) or every key the optimizer keeps. Entries whose name is not in ``names`` are
    ignored, so a whole shard's dict may be passed. Loading goes through ``opt.load_state_dict``, so dtype and device follow torch's rules.

    Raises:
        ConfigError: ``names`` does not match the optimizer's parameters.
        CheckpointError: An entry is missing, unknown for this optimizer, or has the wrong shape.
    """
    params = _params_in_order(opt, names)
    groups = [g for g in opt.param_groups for _ in g["params"]]
    sd = opt.state_dict()
    # Start from the current state so a parameter without entries keeps what it has (Adagrad,
    # for one, creates its state at construction and cannot step without it).
    state: dict[int, dict[str, Any]] = dict(sd["state"])
    for index, (name, p, group) in enumerate(zip(names, params, groups)):
        prefix = f"{name}/"
        entries = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not entries:
            continue
        required = _required_state_keys(opt, group)
        if required is not None:
            missing = sorted(required - set(entries))
            unknown = sorted(set(entries) - required)
            if missing or unknown:
                raise CheckpointError(
                    f"Optimizer state of {name!r} for {type(opt).__name__}: missing "
                    f"{[prefix + k for k in missing]}, unexpected {[prefix + k for k in unknown]}. "
                    "Was the checkpoint written with another optimizer spec?"
                )
        for key, t in entries.items():
            expected = () if key == "step" else tuple(p.shape)
            if required is not None and tuple(t.shape) != expected:
                raise CheckpointError(
                    f"Optimizer state {prefix + key} has shape {tuple(t.shape)}, expected "
                    f"{expected} (parameter shape {tuple(p.shape)})."
                )
        state[index] = {k: v.detach().clone() for k, v in entries.items()}
    sd["state"] = state
    opt.load_state_dict(sd)
