"""Restart policies: when a task that exited is started again, per job, with budgets and a backoff.

Pure data carried by the launch plan (:attr:`psflow.launch.plan.LaunchPlan.restart`) and read by the
run controller (:class:`psflow.launch.controller.RunController`), which counts the attempts; this
module also parses ``psflow run --restart SPEC``.

Kinds:

- ``never``: the task is not restarted (the default; a failure fails the run).
- ``on-failure``: a non-zero exit (an exit code, a signal) is restarted.
- ``always``: any exit is restarted while the run is running, a clean one too: a ps or an evaluator
  has no business exiting before the training tasks are done. A training task's clean exit is its
  completion and is never restarted (otherwise no run could finish), and nothing is restarted once
  the run drains or stops.
- ``exit-code`` (Kubeflow's): exit codes 1-127 are permanent errors (a bug, a bad flag: the same
  again), 128-255 and deaths by signal are retryable (137 is SIGKILL, an OOM kill or a preempted
  node). A negative code (killed by signal N) counts as 128 + N.

The kind is chosen per job (``worker=on-failure,ps=never``); budgets and backoff are the run's:
``max_restarts`` per task, ``max_restarts_per_run`` all tasks together (None: no cap beyond the
per-task one); a restart the budgets do not allow fails the run. A task's restart waits
``backoff_base_s * 2**(n-1)``, at most ``backoff_max_s``, where n counts its latest attempts in a row
that ended before running ``backoff_max_s``: an attempt that outlived the longest wait was healthy,
and its restart waits ``backoff_base_s`` again (so a task killed now and then, hours apart, is not
kept waiting a minute each time). Where the backend's place restarts the tasks itself (Kubernetes),
its own :class:`Backoff` stands in for the policy's.

``--restart`` syntax: comma-separated items, each ``POLICY`` (every job not named otherwise) or
``JOB=POLICY``: ``on-failure``, ``worker=on-failure,ps=never``, ``on-failure,ps=never``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from psflow.errors import ConfigError
from psflow.validation import checked

TRAINING_JOBS = ("chief", "worker")
JOBS = ("chief", "ps", "worker", "evaluator")
POLICIES = ("never", "on-failure", "always", "exit-code")
_SYNTAX = ("Write POLICY for every job, or JOB=POLICY items separated by commas (jobs: chief, ps, worker, evaluator), "
           "e.g. --restart on-failure or --restart worker=on-failure,ps=never.")


@checked
@pydantic_dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class RestartPolicy:
    """When a task that exited is started again (see the module docstring for the kinds).

    ``by_job``: ``{job: kind}`` for the jobs whose kind differs from ``kind``, given as a mapping or
    pairs and kept as sorted pairs (two policies written either way are equal).

    Raises:
        ConfigError: an unknown kind or job, a negative budget, a backoff outside 0 <= base <= max.
    """

    kind: Literal[POLICIES] = Field("never", description="the policy of every job not in by_job")  # type: ignore[valid-type]
    max_restarts: int = Field(3, ge=0, description="restarts allowed per task")
    max_restarts_per_run: int | None = Field(None, ge=0, description=(
        "restarts allowed for all tasks together; None: no cap"))
    backoff_base_s: float = Field(1.0, ge=0, allow_inf_nan=False, description=(
        "seconds before a task's first restart; doubled for each later one in a row (reset once an attempt "
        "has run backoff_max_s)"))
    backoff_max_s: float = Field(60.0, ge=0, allow_inf_nan=False, description="the longest wait before a restart, in seconds")
    by_job: tuple[tuple[str, str], ...] = ()

    @field_validator("by_job", mode="before")
    @classmethod
    def _sorted_pairs(cls, by_job: object) -> object:
        pairs = by_job.items() if isinstance(by_job, Mapping) else by_job
        if isinstance(pairs, Iterable) and not isinstance(pairs, str):
            return tuple(sorted(tuple(p) if isinstance(p, (list, tuple)) else p for p in pairs))  # type: ignore[type-var]
        return by_job

    @model_validator(mode="after")
    def _rules(self) -> RestartPolicy:
        for job, kind in self.by_job:
            if kind not in POLICIES:
                raise ConfigError(f"Restart policy {kind!r} for {job} is not one of {', '.join(POLICIES)}.")
            if job not in JOBS:
                raise ConfigError(f"Restart policy for job {job!r}: no such job; the jobs are {', '.join(JOBS)}.")
        if self.backoff_base_s > self.backoff_max_s:
            raise ConfigError(f"Restart backoff needs 0 <= backoff_base_s <= backoff_max_s; received "
                              f"backoff_base_s={self.backoff_base_s}, backoff_max_s={self.backoff_max_s}.")
        return self

    @classmethod
    def from_dict(cls, fields: object, *, what: str = "A restart policy", fix: str = "") -> RestartPolicy:
        """The policy whose fields ``fields`` names (``dataclasses.asdict`` of one, read back from JSON:
        a job store's record, a launch spec), checked as the constructor checks them.

        Args:
            fields: ``{"kind": ..., "max_restarts": ..., ...}``; a field left out keeps its default.
            what: where ``fields`` came from, as the user knows it (the error starts with it).
            fix: a sentence that ends the error: what to do.

        Example:
            >>> RestartPolicy.from_dict({"kind": "on-failure", "by_job": [["ps", "never"]]}).kind_for("ps")
            'never'

        Raises:
            ConfigError: ``fields`` is not a mapping, names a field RestartPolicy does not have, or
                holds a value out of its field's bounds: the field, the value received, what is allowed.
        """
        if not isinstance(fields, Mapping):
            known = ", ".join(cls.__pydantic_fields__)  # type: ignore[attr-defined]
            raise ConfigError(f"{what} must be a mapping of RestartPolicy's fields ({known}); received "
                              f"{fields!r}.{f' {fix}' if fix else ''}")
        try:
            return cls(**fields)
        except ConfigError as e:
            raise ConfigError(f"{what}: {e}{f' {fix}' if fix else ''}") from e

    @classmethod
    def parse(cls, spec: str | None, **budgets: Any) -> RestartPolicy:
        """The policy of ``psflow run --restart SPEC`` with the given budgets and backoff.

        Example:
            >>> RestartPolicy.parse("on-failure,ps=never", max_restarts=2).kind_for("ps")
            'never'

        Raises:
            ConfigError: naming the item of SPEC that is wrong, what is allowed, and the syntax.
        """
        kind, by_job = "never", {}
        bare = None
        for item in (i.strip() for i in (spec or "").split(",")):
            if not item:
                continue
            job, sep, value = item.rpartition("=")
            if not sep:
                if bare is not None:
                    raise ConfigError(f"--restart {spec!r}: two policies for every job ({bare!r}, {item!r}); give one. {_SYNTAX}")
                bare = kind = _kind(item, spec)
                continue
            if job not in JOBS:
                raise ConfigError(f"--restart {spec!r}: {job!r} (in {item!r}) is not a job. {_SYNTAX}")
            if job in by_job:
                raise ConfigError(f"--restart {spec!r}: {job} is given twice; give it once. {_SYNTAX}")
            by_job[job] = _kind(value, spec)
        return cls(kind, by_job=by_job, **budgets)

    def kind_for(self, job: str) -> str:
        """The policy of ``job``'s tasks."""
        return dict(self.by_job).get(job, self.kind)

    def restarts(self, job: str) -> bool:
        """Whether ``job``'s tasks can be restarted at all."""
        return self.kind_for(job) != "never" and self.max_restarts > 0 and self.max_restarts_per_run != 0

    def last_attempt(self, job: str) -> int:
        """The highest attempt a task of ``job`` can reach (0: it is never restarted)."""
        return self.max_restarts if self.restarts(job) else 0

    def is_retryable(self, job: str, code: int) -> bool:
        """Whether this exit of a task of ``job`` is one the policy restarts (budgets aside)."""
        kind = self.kind_for(job)
        if kind == "never" or (code == 0 and job in TRAINING_JOBS):
            return False
        if kind == "always":
            return True
        if kind == "on-failure":
            return code != 0
        status = 128 - code if code < 0 else code  # exit-code: killed by signal N reads as 128 + N
        return 128 <= status <= 255

    @property
    def backoff(self) -> Backoff:
        """The launcher's own wait before each restart (``backoff_base_s`` doubling to ``backoff_max_s``)."""
        return Backoff(self.backoff_base_s, self.backoff_max_s)

    def describe(self, jobs: tuple[str, ...] = JOBS, backoff: Backoff | None = None) -> str:
        """One line for the launcher's banner: ``worker: on-failure, ps: never; up to 3 restarts per task ...``;
        ``backoff``: the wait that applies where it is not the policy's (the backend's, :class:`Backoff`)."""
        kinds = {j: self.kind_for(j) for j in jobs}
        if not any(k != "never" for k in kinds.values()):
            return "never"
        by_kind: dict[str, list[str]] = {}
        for job, kind in kinds.items():
            by_kind.setdefault(kind, []).append(job)
        shown = ", ".join(f"{'/'.join(js)}: {k}" for k, js in by_kind.items())
        run_cap = f", {self.max_restarts_per_run} per run" if self.max_restarts_per_run is not None else ""
        return f"{shown}; up to {self.max_restarts} restarts per task{run_cap}, {(backoff or self.backoff).describe()}"


@dataclass(frozen=True)
class Backoff:
    """The wait before a task's restart: ``base_s * 2**(n-1)``, at most ``max_s``, before its n-th restart.

    ``resets``: the launcher's rule (:attr:`RestartPolicy.backoff`): n counts only the task's latest
    attempts in a row that ended before running ``max_s`` (an attempt that outlived the longest wait
    was healthy). Without it, n counts every restart of the task, as Kubernetes' Job controller counts
    every failure of a pod's index. ``by``: who starts the task again after the wait (None: the
    launcher; else the backend's place, by its own rule whatever the policy's backoff says).

    Example:
        >>> [Backoff(10.0, 600.0, resets=False).wait_s(n) for n in (1, 2, 7)]
        [10.0, 20.0, 600.0]
    """

    base_s: float
    max_s: float
    resets: bool = True
    by: str | None = None

    def wait_s(self, n: int) -> float:
        """The wait before the ``n``-th restart (1 for the first)."""
        return min(self.max_s, self.base_s * 2.0 ** min(n - 1, 64))  # bounded: a float power past 2**1023 overflows

    def describe(self) -> str:
        """``backoff 1 s doubling to 60 s``, or whose it is: ``Kubernetes' Job controller's backoff: 10 s ...``."""
        whose = f"{self.by}'s backoff:" if self.by else "backoff"
        return f"{whose} {self.base_s:g} s doubling to {self.max_s:g} s"


def _kind(value: str, spec: str | None) -> str:
    if value not in POLICIES:
        raise ConfigError(f"--restart {spec!r}: {value!r} is not a restart policy; the policies are "
                          f"{', '.join(POLICIES)}. {_SYNTAX}")
    return value


@dataclass(frozen=True)
class RestartGroup:
    """Tasks that restart together, from the newest checkpoint: when one of ``triggers`` exits and the
    restart policy restarts it, every other member still running is stopped, and once all have exited
    every member starts again as the same new attempt (torchrun's rule for a group of ranks). The
    members resume from the newest checkpoint (the chief restores it; with parameter servers they
    restore it on every shard at once), each with the data position saved in it.

    ``what`` names the group in messages (``"the all-reduce group"``). ``grace_s``: how long the
    members stopped for the restart get between SIGTERM and SIGKILL (None: the run's grace; 0: killed
    at once, for members whose state the restart discards anyway).
    """

    members: tuple[str, ...]
    triggers: tuple[str, ...]
    what: str
    grace_s: float | None = None


def restart_group(strategy: str, ps_replicas: int, tasks: tuple[str, ...] | list[str]) -> RestartGroup | None:
    """The group a run's restarts keep together, if any.

    - ``allreduce``: every training task (chief, workers): a rank cannot rejoin a running group, so
      any rank's restart restarts them all.
    - parameter servers with one copy of each shard (``ps_replicas`` 1): a ps restarted empty would
      mix its initial values with the others' trained ones, so a ps's restart rolls every ps and
      every training task back to the newest checkpoint together (never a mix of steps). A worker
      still restarts alone (the ps keep its position).
    - with a backup of each shard (``ps_replicas`` 2): none (a ps re-syncs from its pair).

    Example:
        >>> restart_group("allreduce", 1, ["worker:0", "worker:1"]).members
        ('worker:0', 'worker:1')
        >>> restart_group("ps", 2, ["ps:0", "ps:1", "worker:0"]) is None
        True
    """
    training = tuple(t for t in tasks if t.split(":")[0] in TRAINING_JOBS)
    if strategy == "allreduce":
        # SIGTERM first: the chief then checkpoints the step where the group broke (less to redo).
        return RestartGroup(training, training, "the all-reduce group")
    ps = tuple(t for t in tasks if t.split(":")[0] == "ps")
    if ps and ps_replicas == 1:
        # Killed at once: their state is rolled back anyway, and a worker blocked on the dead ps, or a
        # chief's final checkpoint (which a dead ps cannot write), would only hold the restart up.
        return RestartGroup(ps + training, ps, "the job (every shard back to the newest checkpoint)", grace_s=0.0)
    return None
