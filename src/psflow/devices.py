"""Device names for the local compute: ``tf.device`` strings, soft placement, placement logs.

This module owns how a device *name* becomes a ``torch.device`` that exists on this machine.
It accepts PyTorch's names (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``) and TensorFlow's
(``"/cpu:0"``, ``"/gpu:1"``, ``"/device:GPU:1"``, ``"/job:worker/replica:0/task:1/gpu:0"``; the
job/replica/task prefix names the process, which in psflow is chosen by the launcher, so only
the device part is used here).

Invariants:

* every CPU is one device, ``torch.device("cpu")`` (TensorFlow's rule: all CPUs are ``/cpu:0``);
* a name that cannot be parsed is always a :class:`~psflow.errors.ConfigError` (a typo is not
  an absent device);
* a well-formed name of a device that does not exist falls back, with soft placement (the
  default, TensorFlow's ``allow_soft_placement=True``), to device 0 of the same kind when that
  kind exists, else to the CPU, with a :class:`SoftPlacementWarning` naming both; without soft
  placement it is a ConfigError naming the device and the ones available.

Callers: :class:`psflow.train.towers.Towers` (one replica per device), the trainers (moving a
model to its device), and ``format_device_placement`` for ``--log-placement``.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence

import torch

from psflow.errors import ConfigError

__all__ = [
    "SoftPlacementWarning",
    "available_devices",
    "format_device_placement",
    "parse_device",
    "resolve_device",
]

# Optional TF process prefix, then the device: "/gpu:1", "/device:GPU:1", "gpu:1", "cuda", "cpu:0".
_DEVICE_RE = re.compile(
    r"^(?:/job:[\w-]+)?(?:/replica:\d+)?(?:/task:\d+)?"
    r"/?(?:device:)?(?P<kind>cpu|gpu|cuda|mps)(?::(?P<index>\d+))?$",
    re.IGNORECASE,
)


class SoftPlacementWarning(UserWarning):
    """A requested device does not exist and another one is used instead."""


def parse_device(name: str | torch.device) -> torch.device:
    """Turn a PyTorch or TensorFlow device name into a ``torch.device`` (no existence check).

    Args:
        name: e.g. ``"cuda:1"``, ``"/gpu:1"``, ``"/cpu:0"``, ``"mps"``, or a ``torch.device``.

    Returns:
        ``cpu`` for any CPU name; ``cuda:N`` for ``gpu``/``cuda`` names (``N`` is 0 when omitted);
        ``mps:0`` for ``mps``.

    Raises:
        ConfigError: the name is not a device name.

    Example:
        >>> parse_device("/gpu:1")
        device(type='cuda', index=1)
    """
    if isinstance(name, torch.device):
        if name.type == "cpu":
            return torch.device("cpu")
        if name.type in ("cuda", "mps"):
            return torch.device(name.type, name.index or 0)
        raise ConfigError(f"Device {str(name)!r} is not supported. Use cpu, cuda:N (/gpu:N) or mps.")
    if not isinstance(name, str):
        raise ConfigError(f"A device name must be a string such as 'cuda:0' or '/gpu:0'; received {name!r}.")
    m = _DEVICE_RE.match(name.strip())
    if m is None:
        raise ConfigError(
            f"Cannot read the device name {name!r}. Use PyTorch's (cpu, cuda, cuda:1, mps) "
            "or TensorFlow's (/cpu:0, /gpu:1, /device:GPU:1) names."
        )
    kind = m.group("kind").lower()
    index = int(m.group("index") or 0)
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda" if kind in ("gpu", "cuda") else "mps", index)


def available_devices() -> list[torch.device]:
    """The devices of this machine: the CPU, then every CUDA device, then MPS if present."""
    out = [torch.device("cpu")]
    if torch.cuda.is_available():
        out += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append(torch.device("mps", 0))
    return out


def resolve_device(
    name: str | torch.device,
    *,
    soft_placement: bool = True,
    available: Sequence[torch.device] | None = None,
) -> torch.device:
    """The ``torch.device`` to use for ``name`` on this machine.

    Args:
        name: a PyTorch or TensorFlow device name (see :func:`parse_device`).
        soft_placement: when the device does not exist, use another one with a warning
            (TensorFlow's ``allow_soft_placement``) instead of failing.
        available: the devices that exist (default: :func:`available_devices`); tests pass a list.

    Returns:
        The requested device if it exists; with soft placement otherwise device 0 of the same
        kind if that kind exists, else the CPU.

    Raises:
        ConfigError: the name cannot be read, or the device does not exist and
            ``soft_placement`` is False.

    Example:
        >>> resolve_device("/cpu:0")
        device(type='cpu')
    """
    wanted = parse_device(name)
    have = list(available_devices() if available is None else available)
    if wanted in have:
        return wanted
    names = ", ".join(str(d) for d in have)
    shown = str(name) if str(name) == str(wanted) else f"{name} ({wanted})"
    if not soft_placement:
        raise ConfigError(
            f"Device {shown} does not exist on this machine. Available: {names}. "
            "Pick one of those, or allow soft placement to fall back automatically."
        )
    same_kind = [d for d in have if d.type == wanted.type]
    fallback = same_kind[0] if same_kind else torch.device("cpu")
    warnings.warn(
        f"Device {shown} does not exist on this machine (available: {names}); "
        f"using {fallback} instead (soft placement).",
        SoftPlacementWarning,
        stacklevel=2,
    )
    return fallback


def _device_of(replica: torch.nn.Module | torch.device | str) -> str:
    if isinstance(replica, torch.nn.Module):
        for t in replica.parameters():
            return str(t.device)
        for t in replica.buffers():
            return str(t.device)
        return "(no tensors)"
    return str(parse_device(replica))


def format_device_placement(
    replicas: Sequence[torch.nn.Module | torch.device | str],
    *,
    requested: Sequence[str | torch.device] | None = None,
    task: str | None = None,
) -> str:
    """Which replica runs where, one line each (like TensorFlow's ``log_device_placement``).

    Args:
        replicas: the replicas (modules: the device of their first tensor) or their devices.
        requested: the names asked for, in the same order; a line shows both when they differ.
        task: the task these replicas belong to, e.g. ``"worker:1"`` (prefixes each line).

    Raises:
        ConfigError: ``requested`` has a different length than ``replicas``.

    Example:
        >>> print(format_device_placement(["cpu", "cpu"], requested=["/gpu:0", "cpu"]))
        Device placement (2 replicas):
          replica 0: cpu  (requested /gpu:0; soft placement)
          replica 1: cpu
    """
    if requested is not None and len(requested) != len(replicas):
        raise ConfigError(
            f"requested names {len(requested)} devices for {len(replicas)} replicas; give one per replica."
        )
    prefix = f"{task} " if task else ""
    lines = [f"Device placement ({len(replicas)} replica{'s' * (len(replicas) != 1)}):"]
    for i, r in enumerate(replicas):
        where = _device_of(r)
        line = f"  {prefix}replica {i}: {where}"
        if requested is not None:
            asked = str(requested[i])
            if str(parse_device(asked)) != where:
                line += f"  (requested {asked}; soft placement)"
        lines.append(line)
    return "\n".join(lines)
