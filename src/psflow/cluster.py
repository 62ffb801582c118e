"""The cluster: which tasks exist and where each one listens.

Owns :class:`ClusterSpec` (TensorFlow's ``tf.train.ClusterSpec``), :class:`TaskId` (written
``worker:1`` everywhere) and the rules of a task's address (:func:`parse_address`,
:func:`address_key`, :func:`is_loopback_host`). The sources a task learns its cluster from (the
seeds' flags, ``TF_CONFIG``, Slurm's environment, the launcher) are :mod:`psflow.resolve`'s. Pure:
no I/O.

Invariants of a ClusterSpec, checked in ``__post_init__`` so an invalid one never exists: jobs are
among :data:`JOBS` and kept in that order; every job has at least one task; at most one chief; a
chief or a worker exists; a ps exists unless ``require_ps=False`` (all-reduce mode); every address
is ``host:port`` (IPv6 as ``[::1]:2222``) with a port in 1..65535 (0 only with ``allow_port_zero``,
the launcher's placeholder before tasks bind); no two tasks share an address, however it is written
(``localhost:2222`` and ``127.0.0.1:2222`` are one address; see :func:`address_key`).
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from psflow.errors import ConfigError

JOBS: tuple[str, ...] = ("chief", "ps", "worker", "evaluator")
_ALIASES = {"master": "chief"}
_HOST_RE = re.compile(r"[A-Za-z0-9_.-]+")

JobTasks = tuple[tuple[str, tuple[str, ...]], ...]


def _canonical_job(name: object, where: str) -> str:
    job = _ALIASES.get(name, name) if isinstance(name, str) else name
    if job not in JOBS:
        raise ConfigError(
            f"Unknown job name {name!r} in {where}. Allowed: {', '.join(JOBS)} ('master' is read as 'chief')."
        )
    return str(job)


@dataclass(frozen=True, order=True)
class TaskId:
    """One task of the cluster: a job name and an index within that job, e.g. ``worker:1``."""

    job: str
    index: int

    def __post_init__(self) -> None:
        if self.job not in JOBS:  # aliases ('master') are resolved by the parsers, never stored
            raise ConfigError(f"Unknown job name {self.job!r} in a TaskId. Allowed: {', '.join(JOBS)}.")
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ConfigError(f"Task index must be a non-negative integer. Received: {self.index!r} ({self.job!r}).")

    def __str__(self) -> str:
        return f"{self.job}:{self.index}"

    @classmethod
    def parse(cls, text: str) -> TaskId:
        """Parses ``"worker:1"`` (``"master:0"`` reads as ``chief:0``).

        Raises:
            ConfigError: the text is not ``job:index`` or names an unknown job.
        """
        m = re.fullmatch(r"\s*([A-Za-z_]+):([0-9]+)\s*", text) if isinstance(text, str) else None
        if m is None:
            raise ConfigError(f"Cannot parse task {text!r}: expected 'job:index', e.g. 'worker:1'.")
        return cls(_canonical_job(m[1], f"task {text!r}"), int(m[2]))


def parse_address(addr: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """Splits ``"host:port"`` (IPv6 as ``"[::1]:2222"``) into the host (no brackets) and the port.

    Raises:
        ConfigError: the address is malformed or its port is not an integer in 1..65535
            (0 too when ``allow_port_zero``).
    """
    def bad(why: str) -> ConfigError:
        return ConfigError(f"Malformed address {addr!r}: {why}. Expected 'host:port', IPv6 as '[::1]:2222'.")

    if not isinstance(addr, str):
        raise bad("not a string")
    if addr.startswith("["):
        host, sep, port = addr[1:].partition("]:")
        if not sep:
            raise bad("a bracketed IPv6 host must be followed by ']:port'")
        try:
            ipaddress.IPv6Address(host)
        except ValueError as e:
            raise bad(f"{host!r} is not an IPv6 address") from e
    else:
        host, sep, port = addr.rpartition(":")
        if not sep or not host:
            raise bad("no host before ':port'" if sep else "no ':port'")
        if ":" in host:
            raise bad("an IPv6 host needs brackets")
        if not _HOST_RE.fullmatch(host):
            raise bad(f"host {host!r} may hold only letters, digits, '.', '-' and '_'")
    if not re.fullmatch(r"[0-9]+", port):
        raise ConfigError(f"Port {port!r} in address {addr!r} is not an integer. Use a port in 1..65535.")
    low = 0 if allow_port_zero else 1
    if not low <= int(port) <= 65535:
        raise ConfigError(f"Port {int(port)} in address {addr!r} is out of range. Use a port in {low}..65535.")
    return host, int(port)


def is_loopback_host(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ``::1`` (bracketed or IPv4-mapped too)."""
    h = host.strip().strip("[]").lower().rstrip(".")
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(h.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def address_key(host: str) -> str:
    """A canonical form of ``host`` for telling whether two addresses are the same.

    Literal IPs in their canonical text (IPv4-mapped IPv6 as IPv4), ``localhost`` (and ``*.localhost``)
    as ``127.0.0.1``, any other name lower-cased without a trailing dot. Pure, no DNS lookup: a lookup
    could be slow, and only loopback names have a fixed answer. psflow binds a name without ':' over
    IPv4, so ``localhost`` is the socket ``127.0.0.1`` (RFC 6761 reserves the name for loopback).
    """
    h = host.strip().strip("[]").lower().rstrip(".")
    if h == "localhost" or h.endswith(".localhost"):
        return "127.0.0.1"
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return h
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def _normalize(raw: object) -> JobTasks:
    """Turns a mapping or pairs into canonical pairs: aliases resolved, strings split, JOBS order."""
    try:
        pairs = [(name, addrs) for name, addrs in (raw.items() if isinstance(raw, Mapping) else raw)]  # type: ignore
    except (TypeError, ValueError) as e:
        raise ConfigError(f"A cluster spec maps job names to lists of 'host:port'. Received: {raw!r}.") from e
    jobs: dict[str, tuple[str, ...]] = {}
    for name, addrs in pairs:
        job = _canonical_job(name, "the cluster spec")
        if job in jobs:
            raise ConfigError(f"Job {job!r} is given twice ('master' is an alias of 'chief'). Received: {raw!r}.")
        if isinstance(addrs, str):
            addrs = [a.strip() for a in addrs.split(",")] if addrs.strip() else []
        elif not isinstance(addrs, Sequence):
            raise ConfigError(f"Tasks of job {job!r} must be a list of 'host:port' or a comma-separated string. "
                              f"Received: {addrs!r}.")
        jobs[job] = tuple(addrs)
    return tuple((job, jobs[job]) for job in JOBS if job in jobs)


@dataclass(frozen=True)
class ClusterSpec:
    """The jobs of a training cluster, each an ordered tuple of ``host:port`` task addresses.

    Build one with :meth:`from_dict` or another ``from_*``; the constructor takes the same mapping or
    ``(job, addresses)`` pairs. ``require_ps``/``allow_port_zero`` are the validation policy, kept so
    :meth:`with_address` applies it again; they take no part in equality.

    Example:
        >>> ClusterSpec.from_dict({"ps": ["h:2222"], "worker": "h:2223,h:2224"}).address(TaskId("worker", 1))
        'h:2224'
    """

    job_tasks: JobTasks
    require_ps: bool = field(default=True, compare=False)
    allow_port_zero: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "job_tasks", _normalize(self.job_tasks))
        # Made once: a ps consults it on every request (its sender's job and range). Never mutated.
        object.__setattr__(self, "_jobs", dict(self.job_tasks))
        got = f"Received: {self.to_dict()}."
        for job, addrs in self.job_tasks:
            if not addrs:
                raise ConfigError(f"Job {job!r} has no tasks. {got} Give it at least one 'host:port' or leave it out.")
        if (chiefs := self.num_tasks("chief")) > 1:
            raise ConfigError(f"ClusterSpec has {chiefs} 'chief' tasks. {got} At most one; make the rest workers.")
        if not chiefs and not self.num_tasks("worker"):
            raise ConfigError(f"ClusterSpec has neither a 'worker' nor a 'chief' task. {got} Add at least one worker.")
        if self.require_ps and not self.num_tasks("ps"):
            raise ConfigError(f"ClusterSpec has no 'ps' task. {got} Parameter-server training needs at least one.")
        seen: dict[tuple[str, int], TaskId] = {}
        for task in self.tasks():
            addr = self.jobs[task.job][task.index]
            try:
                host, port = parse_address(addr, allow_port_zero=self.allow_port_zero)
            except ConfigError as e:
                raise ConfigError(f"Task {task}: {e} {got}") from e
            key = (address_key(host), port)
            if port and key in seen:  # port 0 is a placeholder: many tasks may share it before they bind
                raise ConfigError(self._duplicate(seen[key], task, addr, key[0]) + f" {got} One per task.")
            seen[key] = task

    def _duplicate(self, first: TaskId, second: TaskId, addr: str, key: str) -> str:
        other = self.jobs[first.job][first.index]
        same = "" if other == addr else f" ({other!r} and {addr!r} are one address: {key}:{addr.rpartition(':')[2]})"
        return f"Address {addr!r} is used by both {first} and {second}{same}."

    def __repr__(self) -> str:
        return f"ClusterSpec({self.to_dict()})"

    def _names(self) -> str:
        return ", ".join(job for job, _ in self.job_tasks)

    @property
    def jobs(self) -> Mapping[str, tuple[str, ...]]:
        """Job name -> task addresses, read-only, in :data:`JOBS` order."""
        return MappingProxyType(self._jobs)

    @classmethod
    def from_dict(
        cls, d: Mapping[str, Sequence[str] | str], *, require_ps: bool = True, allow_port_zero: bool = False
    ) -> ClusterSpec:
        """Builds a spec from ``{"ps": [...], "worker": "h:1,h:2"}``; ``master`` reads as ``chief``.

        Raises:
            ConfigError: any invariant of the module docstring is broken.
        """
        return cls(_normalize(d), require_ps=require_ps, allow_port_zero=allow_port_zero)

    @classmethod
    def from_json(cls, text: str, *, require_ps: bool = True, allow_port_zero: bool = False) -> ClusterSpec:
        """Inverse of :meth:`to_json`. Raises ConfigError on malformed JSON or an invalid spec."""
        data = load_json(text, "Cluster JSON")
        if not isinstance(data, dict):
            raise ConfigError(f"Cluster JSON must be an object of job -> addresses. Received: {text!r}.")
        return cls.from_dict(data, require_ps=require_ps, allow_port_zero=allow_port_zero)

    def named_task(self, job_name: object, index: object, where: str) -> TaskId:
        """The task a source names by job (``master`` reads as ``chief``) and index, checked against
        this spec; ``where`` names the source in the error.

        Raises:
            ConfigError: the job is not in the spec, or the index is not an integer in its range.
        """
        job = _ALIASES.get(job_name, job_name) if isinstance(job_name, str) else None
        if job not in self.jobs:
            raise ConfigError(f"{where}: job {job_name!r} is not in the cluster. Jobs that exist: {self._names()}.")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ConfigError(f"{where}: task index must be a non-negative integer. Received: {index!r}.")
        task = TaskId(str(job), index)
        try:
            self.check_task(task)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from e
        return task

    def tasks(self) -> list[TaskId]:
        """Every task, jobs in :data:`JOBS` order (chief, ps, worker, evaluator), then by index."""
        return [TaskId(job, i) for job, addrs in self.job_tasks for i in range(len(addrs))]

    def num_tasks(self, job: str) -> int:
        """Number of tasks of ``job``; 0 when the job is absent."""
        return len(self._jobs.get(job, ()))

    def check_task(self, task: TaskId) -> None:
        """Raises ConfigError unless ``task`` names a job of this spec and an index within it."""
        n = self.num_tasks(task.job)
        if n == 0:
            raise ConfigError(f"Task {task}: job {task.job!r} is not in the cluster. Jobs that exist: {self._names()}.")
        if task.index >= n:
            span = f"{task.job}:0" if n == 1 else f"{task.job}:0..{task.job}:{n - 1}"
            raise ConfigError(f"{task} is out of range: job {task.job!r} has {n} task{'s' * (n != 1)} ({span}).")

    def address(self, task: TaskId) -> str:
        """The ``host:port`` of ``task``. Raises ConfigError when the task is not in the spec."""
        self.check_task(task)
        return self.jobs[task.job][task.index]

    def chief(self) -> TaskId:
        """``chief:0`` when there is a chief job, else ``worker:0`` (TensorFlow's rule)."""
        return TaskId("chief", 0) if self.num_tasks("chief") else TaskId("worker", 0)

    def is_chief(self, task: TaskId) -> bool:
        """True when ``task`` is the task that :meth:`chief` names."""
        return task == self.chief()

    def to_dict(self) -> dict[str, list[str]]:
        """``{job: [addresses]}`` in :data:`JOBS` order; :meth:`from_dict` reads it back."""
        return {job: list(addrs) for job, addrs in self.job_tasks}

    def to_json(self) -> str:
        """The spec as a JSON object; :meth:`from_json` reads it back."""
        return json.dumps(self.to_dict())

    def with_address(self, task: TaskId, address: str) -> ClusterSpec:
        """A copy with ``task``'s address replaced (the launcher fills in bound ports this way)."""
        self.check_task(task)
        jobs = self.to_dict()
        jobs[task.job][task.index] = address
        return ClusterSpec.from_dict(jobs, require_ps=self.require_ps, allow_port_zero=self.allow_port_zero)

    def hosts(self) -> set[str]:
        """The distinct hosts of all tasks (IPv6 without brackets)."""
        return {parse_address(a, allow_port_zero=True)[0] for _, addrs in self.job_tasks for a in addrs}


def load_json(text: str, what: str) -> object:
    """``text`` parsed as JSON; ``what`` names it in the error (position and snippet quoted)."""
    if not isinstance(text, str):
        raise ConfigError(f"{what} must be a JSON string. Received: {text!r}.")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        near = e.doc[max(0, e.pos - 20) : e.pos + 20]
        where = f"line {e.lineno} column {e.colno} (char {e.pos})"
        raise ConfigError(f"{what} is not valid JSON: {e.msg} at {where}, near {near!r}. Fix the JSON text.") from e

