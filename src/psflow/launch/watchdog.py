"""The hang watchdog: per-task deadlines on heartbeats and progress, as pure books.

Every task sends a heartbeat about once a second from a daemon thread (:mod:`psflow.heartbeat`),
also while its main thread is stuck; trainers report their progress after their steps. Two deadlines
of :class:`HangPolicy` follow (what each catches and lets go, and why: ``docs/design/hang-watchdog.md``):

- **progress** (``hang_timeout_s``, chief and workers): no new step while the heartbeats still come
  is a *hang*; a task whose heartbeat says it waits for its peers (a sync quorum, the ssp bound) or
  names the task it is blocked on (``waiting_on``: a ps) is not hung itself;
- **heartbeat** (``heartbeat_timeout_s``, every task): no heartbeat means the whole process is
  *frozen*; its :class:`Hang` names the tasks blocked on it (``awaited_by``).

Each deadline is armed by the attempt's first heartbeat or progress report (the phases before have
deadlines of their own). Default: off (no ``--hang-timeout``): only the user knows the longest pause
between two steps of their script. What a missed deadline brings is the run controller's
(:mod:`psflow.launch.controller`): the task's stacks, ``dump_wait_s``, then a kill whose cause is the
:class:`Hang`.

States of one task's books::

    unarmed --first heartbeat--> heartbeat armed --first progress (training task)--> progress armed
    armed   --deadline passed (overdue)--> reported (once per attempt)
    any     --started again (a new attempt)--> unarmed
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from psflow.errors import ConfigError
from psflow.validation import checked


@checked
@pydantic_dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class HangPolicy:
    """When a task counts as hung or frozen (see the module docstring).

    Raises:
        ConfigError: a deadline that is not a positive number of seconds, or a heartbeat deadline
            without a progress deadline.
    """

    hang_timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False, description=(
        "seconds (--hang-timeout): the progress deadline of training tasks; None: no watchdog"))
    heartbeat_timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False, description=(
        "seconds (--heartbeat-timeout): the heartbeat deadline of every task; None: hang_timeout_s"))
    dump_wait_s: float = Field(1.0, ge=0, allow_inf_nan=False, description=(
        "seconds between asking for a task's stacks and killing it (time for the dump to reach its log)"))

    @model_validator(mode="after")
    def _watchdog_on(self) -> HangPolicy:
        if self.heartbeat_timeout_s is not None and self.hang_timeout_s is None:
            raise ConfigError(f"--heartbeat-timeout {self.heartbeat_timeout_s:g} needs --hang-timeout: the watchdog is "
                              "on only with a progress deadline. Add --hang-timeout S.")
        return self

    @property
    def enabled(self) -> bool:
        return self.hang_timeout_s is not None

    @property
    def heartbeat_deadline_s(self) -> float | None:
        return self.heartbeat_timeout_s if self.heartbeat_timeout_s is not None else self.hang_timeout_s

    def check_intervals(self, progress_every_s: float, heartbeat_every_s: float) -> None:
        """A deadline must leave room for at least two reports of what it watches.

        Raises:
            ConfigError: naming the deadline, the interval of its reports, and what to set.
        """
        if self.hang_timeout_s is not None and self.hang_timeout_s < 2 * progress_every_s:
            raise ConfigError(f"--hang-timeout {self.hang_timeout_s:g} is shorter than two progress reports "
                              f"(progress_every_s={progress_every_s:g}): a healthy task would look hung. "
                              f"Give at least {2 * progress_every_s:g} s.")
        hb = self.heartbeat_deadline_s
        if hb is not None and hb < 2 * heartbeat_every_s:
            raise ConfigError(f"The heartbeat deadline {hb:g} s is shorter than two heartbeats (heartbeat_every_s="
                              f"{heartbeat_every_s:g}): a healthy task would look frozen. Give at least "
                              f"{2 * heartbeat_every_s:g} s (--heartbeat-timeout).")

    def describe(self) -> str:
        """``off``, or ``no progress for 3 s (training tasks) or no heartbeat for 3 s``."""
        if not self.enabled:
            return "off"
        return (f"no progress for {self.hang_timeout_s:g} s (training tasks) or no heartbeat for "
                f"{self.heartbeat_deadline_s:g} s; stacks dumped into the task's log, then it is killed")


@dataclass(frozen=True)
class StackDump:
    """Where a task's stack dump went: its log, at or after ``line`` (1-based; the log's length when
    the signal was sent, plus one)."""

    log: str
    line: int

    def __str__(self) -> str:
        return f"{self.log} from line {self.line}"


@dataclass
class Hang:
    """A missed deadline of one attempt, and what became of it.

    ``kind``: ``hung`` (no progress, heartbeats flowing) or ``frozen`` (no heartbeat). ``quiet_s``: how
    long the task had been quiet when it was caught. ``stacks``: where its dump went (None until the
    dump was asked for; ``unavailable`` says why there is none).
    """

    task: str
    attempt: int
    kind: str
    quiet_s: float
    detected_at: float
    kill_at: float
    stacks: StackDump | None = None
    unavailable: str | None = None
    killed: bool = False
    awaited_by: tuple[str, ...] = ()  # the tasks blocked on this one when it was caught (a frozen ps's workers)

    @property
    def cause(self) -> str:
        """``hung: no progress for 3.2 s; stacks in LOG from line 57`` (the exit's cause)."""
        what = "no progress" if self.kind == "hung" else "no heartbeat"
        where = f"stacks in {self.stacks}" if self.stacks is not None else f"no stacks ({self.unavailable or 'not dumped'})"
        if self.kind == "frozen" and self.stacks is not None:
            where += " (if the process could still run its signal handler)"
        return f"{self.kind}: {what} for {self.quiet_s:.1f} s; {where}"

    def to_dict(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "kind": self.kind, "quiet_s": round(self.quiet_s, 3),
                "detected_unix": round(self.detected_at, 3), "cause": self.cause,
                "stacks": None if self.stacks is None else {"log": self.stacks.log, "line": self.stacks.line}}


@dataclass
class _Books:
    attempt: int = 0
    heartbeat_at: float | None = None  # the attempt's last heartbeat (None: not armed)
    progress_at: float | None = None  # its last progress (None: not armed)
    step: int | None = None  # the last step it reported
    reported: bool = False  # a deadline of this attempt was missed and reported
    waiting_on: str | None = None  # the task its last heartbeat said it is blocked on


@dataclass
class Watchdog:
    """The deadlines of every task of a run (pure: every call carries the time).

    Example:
        >>> w = Watchdog(HangPolicy(hang_timeout_s=3), training={"worker:0"})
        >>> w.started("worker:0", 0); w.heartbeat("worker:0", 0, at=1.0); w.progressed("worker:0", 0, at=1.0, step=1)
        >>> w.heartbeat("worker:0", 0, at=4.5); [h.kind for h in w.overdue(now=4.5)]
        ['hung']
    """

    policy: HangPolicy
    training: set[str] | frozenset[str] = frozenset()
    _books: dict[str, _Books] = field(default_factory=dict)

    def started(self, task: str, attempt: int) -> None:
        """A new attempt: nothing armed until it is heard from."""
        self._books[task] = _Books(attempt)

    def forget(self, task: str) -> None:
        """The task exited: nothing to watch until it starts again."""
        self._books.pop(task, None)

    def heartbeat(self, task: str, attempt: int, at: float, *, waiting: bool = False,
                  waiting_on: str | None = None) -> None:
        """A heartbeat of ``task``'s ``attempt``; ``waiting``: it waits for its peers, ``waiting_on``:
        it is blocked on that task (``"ps:1"``). Either way it is not hung itself."""
        b = self._current(task, attempt)
        if b is None:
            return
        b.heartbeat_at, b.waiting_on = at, waiting_on
        if (waiting or waiting_on is not None) and b.progress_at is not None:
            b.progress_at = max(b.progress_at, at)

    def progressed(self, task: str, attempt: int, at: float, step: int | None) -> None:
        """A progress report: a step later than the last one (or any report without a step) is progress."""
        b = self._current(task, attempt)
        if b is None or task not in self.training:
            return
        b.heartbeat_at = at if b.heartbeat_at is None else max(b.heartbeat_at, at)  # a report is a sign of life too
        if step is None or b.step is None or step > b.step or b.progress_at is None:
            b.progress_at = at
        if step is not None:
            b.step = step if b.step is None else max(b.step, step)

    def overdue(self, now: float) -> list[Hang]:
        """The attempts that missed a deadline by ``now`` and were not reported yet (each once)."""
        if not self.policy.enabled:
            return []
        out = []
        for task, b in self._books.items():
            if b.reported:
                continue
            hang = self._check(task, b, now)
            if hang is not None:
                b.reported = True
                hang.awaited_by = self._blocked_on(task, now)
                out.append(hang)
        return out

    def _blocked_on(self, task: str, now: float) -> tuple[str, ...]:
        """The tasks whose last heartbeat, recent enough to trust, said they are blocked on ``task``."""
        deadline = self.policy.heartbeat_deadline_s or math.inf
        return tuple(sorted(t for t, b in self._books.items() if t != task and b.waiting_on == task
                            and b.heartbeat_at is not None and now - b.heartbeat_at <= deadline))

    def _check(self, task: str, b: _Books, now: float) -> Hang | None:
        hb_deadline, progress_deadline = self.policy.heartbeat_deadline_s, self.policy.hang_timeout_s
        kill_at = now + self.policy.dump_wait_s
        if b.heartbeat_at is not None and hb_deadline is not None and now - b.heartbeat_at > hb_deadline:
            return Hang(task, b.attempt, "frozen", now - b.heartbeat_at, now, kill_at)
        if b.progress_at is not None and progress_deadline is not None and now - b.progress_at > progress_deadline:
            return Hang(task, b.attempt, "hung", now - b.progress_at, now, kill_at)
        return None

    def _current(self, task: str, attempt: int) -> _Books | None:
        b = self._books.get(task)
        return b if b is not None and b.attempt == attempt else None
