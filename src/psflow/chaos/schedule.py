"""The chaos schedule: which fault, when, and on which task, as a pure function of a seed.

``psflow chaos`` injects a fault every ``every_s`` seconds for ``duration_s`` seconds of a run, counted
from the job's first training step (a slow start takes nothing from the schedule). The
times, the kinds (``kill``: SIGKILL, ``stop``: SIGSTOP for ``stall_s`` then SIGCONT, ``partition``: a ps's
links to the other ps cut for ``stall_s``, through SIGUSR2 under ``PSFLOW_CHAOS``) and a draw in
[0, 1) per fault are fixed by the seed before the run starts (:meth:`ChaosSchedule.slots`); the task
a fault hits is chosen when it falls due, among the tasks eligible then (:func:`eligible`), by its
draw (:func:`pick`): the same seed on the same course of a run hits the same tasks.

Eligible (the rules that keep a chaos run inside what psflow survives):

- only jobs in ``targets`` (default chief, worker, and ps when each shard has a backup);
- only a task whose current attempt has run at least ``min_up_s`` and is ``ready``: a training task
  that has reported a step of this attempt, a ps that has reported its shard since it started and
  holds no copy still re-syncing (a fault hits training, not a start: a ps killed before the chief
  initialized it, or while its pair re-syncs, loses the shard);
- no task while another is stopped (one stall at a time), and no fault once the run is no longer
  running (draining, stopping: a dead task then fails the run or is not restarted), nor once any
  task has finished (exited 0: the job is ending; a chief killed in its final evaluation after the
  ps had exited would be restarted against ps that are gone);
- a ps only when every ps is running, ready, and has been for ``settle_s``, and some training task
  is ready (the job is initialized): with primary-backup replication the killed ps's pair must have
  re-synced before the other one of it may die (two dead ps of a pair lose the shard).

A slot that falls due when no task is eligible waits for one, until the next slot falls due (then
it is skipped, and counted as such). Used by :class:`psflow.chaos.injector.ChaosInjector`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass

from psflow.errors import ConfigError
from psflow.validation import checked

KINDS = ("kill", "stop", "partition")
JOBS = ("chief", "worker", "ps")

Weight = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def _seconds(default: float = ..., *, meaning: str, zero_ok: bool = False) -> Any:  # type: ignore[assignment]
    """A number of seconds, > 0 (>= 0 with ``zero_ok``); no default: required."""
    bound = {"ge": 0} if zero_ok else {"gt": 0}
    return Field(default, **bound, allow_inf_nan=False, description=f"seconds: {meaning}")


@checked(what="psflow chaos")
@dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class ChaosSettings:
    """What ``psflow chaos`` injects (each field's description says what it means).

    ``stall_s`` is how long a ``stop`` keeps a task stopped (a ``partition`` lasts): the shortest, when
    ``stall_max_s`` is set, each fault's length then drawn by the seed in [stall_s, stall_max_s].
    """

    every_s: float = _seconds(meaning="between faults (the first at every_s after the job's first step)")
    duration_s: float = _seconds(meaning="faults are injected during this long from the job's first step")
    seed: int = Field(0, description="fixes the times, kinds and draws")
    kinds: tuple[tuple[Literal[KINDS], Weight], ...] = Field(  # type: ignore[valid-type]
        (("kill", 3.0), ("stop", 1.0)), min_length=1,
        description="each kind with a positive weight, e.g. kill=3,stop=1")
    targets: tuple[Literal[JOBS], ...] = Field(  # type: ignore[valid-type]
        ("chief", "worker"), min_length=1, description="the jobs whose tasks may be hit")
    stall_s: float = _seconds(1.0, meaning="how long a stop or a partition lasts (the shortest, with stall_max_s)")
    stall_max_s: float | None = Field(None, allow_inf_nan=False, description=(
        "seconds: the longest stall, each drawn in [stall_s, stall_max_s]; None: every stall lasts stall_s"))
    min_up_s: float = _seconds(2.0, zero_ok=True, meaning="a task is hit only once its attempt has run this long")
    settle_s: float = _seconds(4.0, zero_ok=True, meaning="a ps is hit only once every ps has run this long")
    max_faults: int | None = Field(None, ge=1, description="at most this many faults; None: as many as the slots")

    @model_validator(mode="after")
    def _stalls_agree(self) -> ChaosSettings:
        if self.stall_max_s is not None and self.stall_max_s < self.stall_s:
            raise ConfigError(f"psflow chaos --stall A-B: B must be a number of seconds >= A; received {self.stall_s:g}-"
                              f"{self.stall_max_s!r}.")
        return self


def parse_kinds(text: str) -> tuple[tuple[str, float], ...]:
    """``"kill,stop"`` -> ``(("kill", 1.0), ("stop", 1.0))``; ``"kill=3,stop=1"`` keeps the weights.

    Raises:
        ConfigError: a part that is not KIND or KIND=WEIGHT (names it and the syntax).
    """
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        kind, _, weight = part.partition("=")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = -1.0
        if kind not in KINDS or not (w > 0 and math.isfinite(w)):
            raise ConfigError(f"psflow chaos --kinds {part!r}: use KIND or KIND=WEIGHT with KIND one of "
                              f"{', '.join(KINDS)} and a positive weight, e.g. kill=3,stop=1.")
        out.append((kind, w))
    if not out:
        raise ConfigError(f"psflow chaos --kinds: name at least one of {', '.join(KINDS)}; received {text!r}.")
    return tuple(out)


def parse_stall(text: str) -> tuple[float, float | None]:
    """``"3"`` -> ``(3.0, None)``; ``"2-9"`` -> ``(2.0, 9.0)`` (each fault's length drawn between).

    Raises:
        ConfigError: not S or A-B with 0 < A <= B (names the value and the syntax).
    """
    low, sep, high = text.strip().partition("-")
    try:
        a, b = float(low), (float(high) if sep else None)
    except ValueError:
        a, b = -1.0, None
    if not (a > 0 and math.isfinite(a)) or (b is not None and not (math.isfinite(b) and b >= a)):
        raise ConfigError(f"psflow chaos --stall {text!r}: give seconds, S or A-B with 0 < A <= B, e.g. 3 or 2-9.")
    return a, b


@dataclass(frozen=True)
class Slot:
    """A fault planned at ``at_s`` seconds into the run: its ``kind`` and ``draw`` (picks the task)."""

    index: int
    at_s: float
    kind: str
    draw: float
    stall_s: float = 1.0  # how long a stop or a partition lasts


@dataclass(frozen=True)
class TaskView:
    """What the schedule needs to know of a task now: its state (the controller's: running, exited,
    backoff, starting), when its current attempt started (None: not started) and whether it is stopped."""

    state: str
    started_at: float | None
    stopped: bool = False
    ready: bool = True  # its current attempt reported that it works (see the module docstring)
    finished: bool = False  # it exited 0 (its part of the job is done)

    def up_s(self, now: float) -> float:
        return -math.inf if self.started_at is None else now - self.started_at


class ChaosSchedule:
    """The slots of one chaos run, and which of them are due.

    Example:
        >>> s = ChaosSchedule(ChaosSettings(every_s=5, duration_s=12, seed=1))
        >>> [slot.at_s for slot in s.slots()]
        [5.0, 10.0]
    """

    def __init__(self, settings: ChaosSettings) -> None:
        self.settings = settings
        rng = random.Random(settings.seed)
        kinds = [k for k, _ in settings.kinds]
        weights = [w for _, w in settings.kinds]
        count = int(settings.duration_s // settings.every_s)
        if settings.max_faults is not None:
            count = min(count, settings.max_faults)
        self._slots = []
        for i in range(count):
            kind, draw = rng.choices(kinds, weights)[0], rng.random()
            stall = settings.stall_s if settings.stall_max_s is None else round(
                rng.uniform(settings.stall_s, settings.stall_max_s), 2)
            self._slots.append(Slot(i, (i + 1) * float(settings.every_s), kind, draw, stall))
        self._next = 0  # the first slot not taken yet

    def slots(self) -> list[Slot]:
        return list(self._slots)

    def due(self, elapsed_s: float) -> tuple[Slot | None, list[Slot]]:
        """The slot to carry out now (the latest that fell due) and the earlier due ones it replaces
        (skipped: no task was eligible while they waited). Taking a slot is :meth:`taken`."""
        ready = [s for s in self._slots[self._next:] if s.at_s <= elapsed_s]
        if not ready:
            return None, []
        return ready[-1], ready[:-1]

    def taken(self, slot: Slot) -> None:
        """``slot`` was carried out or skipped, with every slot before it."""
        self._next = max(self._next, slot.index + 1)

    @property
    def remaining(self) -> int:
        return len(self._slots) - self._next


def eligible(tasks: Mapping[str, TaskView], now: float, settings: ChaosSettings, *, running: bool = True) -> list[str]:
    """The tasks a fault may hit now, sorted (see the module docstring for the rules).

    Example:
        >>> views = {"ps:0": TaskView("running", 0.0), "worker:0": TaskView("running", 0.0), "worker:1": TaskView("backoff", None)}
        >>> eligible(views, 10.0, ChaosSettings(every_s=1, duration_s=5))
        ['worker:0']
    """
    if not running or any(v.stopped or v.finished for v in tasks.values()):
        return []
    ps = {t: v for t, v in tasks.items() if t.split(":")[0] == "ps"}
    training = any(v.ready and v.state == "running" for t, v in tasks.items() if t.split(":")[0] in ("chief", "worker"))
    ps_settled = training and all(v.state == "running" and v.ready and v.up_s(now) >= settings.settle_s for v in ps.values())
    out = []
    for task, view in tasks.items():
        job = task.split(":")[0]
        if (job not in settings.targets or view.state != "running" or not view.ready
                or view.up_s(now) < settings.min_up_s):
            continue
        if job == "ps" and not ps_settled:
            continue
        out.append(task)
    return sorted(out)


def pick(slot: Slot, candidates: Sequence[str]) -> str | None:
    """The task ``slot`` hits among ``candidates`` (by its draw), or None if there is none; a
    ``partition`` hits a ps only (it cuts the links between shard copies).

    Example:
        >>> pick(Slot(0, 5.0, "kill", 0.6), ["worker:0", "worker:1"])
        'worker:1'
    """
    ordered = sorted(t for t in candidates if slot.kind != "partition" or t.split(":")[0] == "ps")
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(slot.draw * len(ordered)))]
