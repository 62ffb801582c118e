"""The cluster: which tasks exist and where each one listens.

Owns :class:`ClusterSpec` (TensorFlow's ``tf.train.ClusterSpec``), :class:`TaskId` (written
``worker:1`` everywhere) and the four ways a cluster reaches a task: a dict, the seed's flags
(``--ps_hosts --worker_hosts --job_name --task_index``), ``TF_CONFIG`` (Kubeflow's TFJob) and
Slurm's environment. Everything here is pure: ``psflow.task``, the launcher and the CLI read the
environment or argv and pass the values in.

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
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from psflow.errors import ConfigError
from psflow.validation import validate

JOBS: tuple[str, ...] = ("chief", "ps", "worker", "evaluator")
_ALIASES = {"master": "chief"}
_HOST_RE = re.compile(r"[A-Za-z0-9_.-]+")
_HOSTS_FLAGS = {"chief_hosts": "chief", "ps_hosts": "ps", "worker_hosts": "worker", "evaluator_hosts": "evaluator"}
_FLAGS = (*_HOSTS_FLAGS, "job_name", "task_index")
_TF_EXAMPLE = '{"cluster": {"ps": ["h0:2222"], "worker": ["h1:2222"]}, "task": {"type": "worker", "index": 0}}'

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
        data = _load_json(text, "Cluster JSON")
        if not isinstance(data, dict):
            raise ConfigError(f"Cluster JSON must be an object of job -> addresses. Received: {text!r}.")
        return cls.from_dict(data, require_ps=require_ps, allow_port_zero=allow_port_zero)

    @classmethod
    def from_tf_config(cls, text: str, *, require_ps: bool = True) -> tuple[ClusterSpec, TaskId | None]:
        """Reads ``TF_CONFIG`` (``{"cluster": {...}, "task": {"type": "worker", "index": 0}}``).

        Other keys (``environment``, ``rpc_layer``) are ignored; ``master`` reads as ``chief``.

        Returns:
            The spec, and this process's task (None when ``task`` is absent or empty).

        Raises:
            ConfigError: malformed JSON (position and snippet quoted), no ``cluster``, an invalid
                spec, a task type not in the cluster or an index out of range.
        """
        cfg: _TfConfig = validate(_TfConfig, _load_json(text, "TF_CONFIG"), what="TF_CONFIG",
                                  fix=f"Example: {_TF_EXAMPLE}")
        spec = cls.from_dict(cfg.cluster, require_ps=require_ps)
        if cfg.task is None:
            return spec, None
        return spec, spec._resolve(cfg.task.type, cfg.task.index, "TF_CONFIG task")

    def _resolve(self, job_name: object, index: object, where: str) -> TaskId:
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


class _TfTask(BaseModel):
    """TF_CONFIG's ``task``: this process's job and index."""

    model_config = ConfigDict(strict=True)
    type: str = Field(description="the job: chief (or master), ps, worker or evaluator")
    index: int = Field(0, ge=0, description="the task's index in its job")


class _TfConfig(BaseModel):
    """The parts of TF_CONFIG psflow reads (others, such as ``environment`` and ``rpc_layer``, are ignored)."""

    model_config = ConfigDict(strict=True)
    cluster: dict[str, Any] = Field(description="job -> addresses")
    task: _TfTask | None = Field(None, description="this process's type and index; absent or empty: none")

    @field_validator("task", mode="before")
    @classmethod
    def _empty_is_none(cls, task: object) -> object:
        return task or None


def _load_json(text: str, what: str) -> object:
    if not isinstance(text, str):
        raise ConfigError(f"{what} must be a JSON string. Received: {text!r}.")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        near = e.doc[max(0, e.pos - 20) : e.pos + 20]
        where = f"line {e.lineno} column {e.colno} (char {e.pos})"
        raise ConfigError(f"{what} is not valid JSON: {e.msg} at {where}, near {near!r}. Fix the JSON text.") from e


@dataclass(frozen=True)
class FlagConfig:
    """What :func:`parse_cluster_flags` found: the spec, this task, and the untouched arguments."""

    cluster: ClusterSpec | None
    task: TaskId | None
    rest: list[str]


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1].strip()
    return value


def parse_cluster_flags(argv: Sequence[str], *, require_ps: bool = True) -> FlagConfig:
    """Extracts the seed's flags from ``argv``; every other argument stays in ``rest``, in order.

    Reads ``--ps_hosts --worker_hosts --chief_hosts --evaluator_hosts`` (comma-separated
    ``host:port``), ``--job_name`` and ``--task_index`` (default 0), as ``--flag=value`` or
    ``--flag value``, hyphens or underscores, quotes around a value stripped. An empty hosts flag
    means no such job. Arguments after ``--`` are left alone.

    Example:
        >>> cfg = parse_cluster_flags(["--ps_hosts=h:1", "--worker_hosts=h:2", "--job_name=worker", "--lr=1"])
        >>> str(cfg.task), cfg.rest
        ('worker:0', ['--lr=1'])

    Raises:
        ConfigError: a flag without value, a role without hosts flags, a job not in the spec, a
            task index not an integer, negative or out of range, or an invalid spec.
    """
    values: dict[str, str] = {}
    rest: list[str] = []
    args, i = list(argv), 0
    while i < len(args):
        arg, i = args[i], i + 1
        if arg == "--":
            rest.extend(args[i - 1 :])
            break
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        name = name.replace("-", "_")
        if name not in _FLAGS:
            rest.append(arg)
            continue
        if not eq:
            if i >= len(args) or args[i].startswith("--"):
                raise ConfigError(f"Flag {arg} needs a value. Write {arg}=VALUE or {arg} VALUE.")
            value, i = args[i], i + 1
        values[name] = _unquote(value)
    role = {k: values[k] for k in ("job_name", "task_index") if k in values}
    if not any(f in values for f in _HOSTS_FLAGS):
        if role:
            raise ConfigError(
                f"{' '.join(f'--{k}={v}' for k, v in role.items())} given without hosts flags. "
                "Add --ps_hosts and --worker_hosts (comma-separated host:port)."
            )
        return FlagConfig(None, None, rest)
    hosts = {job: values[flag] for flag, job in _HOSTS_FLAGS.items() if values.get(flag)}
    spec = ClusterSpec.from_dict(hosts, require_ps=require_ps)
    if "job_name" not in values:
        if "task_index" in values:
            raise ConfigError(f"--task_index={values['task_index']} given without --job_name (one of {spec._names()}).")
        return FlagConfig(spec, None, rest)
    index = values.get("task_index", "0")
    if not re.fullmatch(r"-?[0-9]+", index):
        raise ConfigError(f"--task_index must be an integer. Received: {index!r}.")
    return FlagConfig(spec, spec._resolve(values["job_name"], int(index), "--job_name/--task_index"), rest)


def expand_slurm_nodelist(expr: str) -> list[str]:
    """Expands a Slurm hostlist: ``"n[1-3],gpu5"`` -> n1 n2 n3 gpu5; ``"n[08-10]"`` keeps the padding.

    Raises ConfigError on unbalanced brackets, an empty name or a malformed range.
    """
    parts, depth, start = [], 0, 0
    for pos, ch in enumerate(expr + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ConfigError(f"Slurm node list {expr!r} has unbalanced or nested brackets.")
        if ch == "," and depth == 0:
            parts.append(expr[start:pos].strip())
            start = pos + 1
    if depth:
        raise ConfigError(f"Slurm node list {expr!r} has an unclosed '['.")
    return [name for part in parts for name in _expand_hostlist_part(part, expr)]


def _expand_hostlist_part(part: str, expr: str) -> list[str]:
    m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\](.*)", part)
    if m is None:
        if not part or "[" in part or "]" in part:
            raise ConfigError(f"Slurm node list {expr!r} has a malformed name {part!r}.")
        return [part]
    prefix, ranges, suffix = m.groups()
    tails = _expand_hostlist_part(suffix, expr) if suffix else [""]
    names: list[str] = []
    for r in ranges.split(","):
        rm = re.fullmatch(r"\s*([0-9]+)(?:-([0-9]+))?\s*", r)
        lo, hi = (int(rm[1]), int(rm[2] or rm[1])) if rm else (0, -1)
        if rm is None or not 0 <= hi - lo <= 100_000:  # a typo must not expand to millions of names
            raise ConfigError(f"Slurm node list {expr!r} has a malformed range {r!r}; expected e.g. 'n[1-3,7]'.")
        names.extend(f"{prefix}{str(n).zfill(len(rm[1]))}{t}" for n in range(lo, hi + 1) for t in tails)
    return names


def expand_slurm_tasks_per_node(expr: str) -> list[int]:
    """Expands ``SLURM_TASKS_PER_NODE``: ``"2(x3),1"`` -> [2, 2, 2, 1]. Raises ConfigError if malformed."""
    counts: list[int] = []
    for part in expr.split(","):
        m = re.fullmatch(r"\s*([0-9]+)(?:\(x([0-9]+)\))?\s*", part)
        if m is None:
            raise ConfigError(f"Slurm tasks per node {expr!r} is malformed at {part!r}; expected e.g. '2(x3),1'.")
        counts.extend([int(m[1])] * int(m[2] or 1))
    return counts


_SLURM_VARS = {  # the first one set wins: a step's own view comes before its allocation's
    "procid": ("SLURM_PROCID",),
    "ntasks": ("SLURM_NTASKS", "SLURM_NPROCS"),
    "nodelist": ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "per_node": ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
}
# What to do where psflow cannot derive every task's node from the environment.
_PASS_THE_CLUSTER = ("Pass the cluster yourself, in task order: --ps_hosts/--worker_hosts with --job_name/--task_index "
                     "(or PSFLOW_CLUSTER with PSFLOW_TASK), or run the step with srun -m block, cyclic or plane=N.")


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """Whether ``env`` is a Slurm task's (srun, or an sbatch step): ``SLURM_PROCID`` is set."""
    return bool(env.get("SLURM_PROCID", "").strip())


def _dealt(nodes: Sequence[str], counts: Sequence[int], size: int) -> list[str]:
    """Ranks dealt out ``size`` at a time per node, in the node list's order, round after round, each
    node skipped once it has its count (Slurm's cyclic layout: size 1; plane: the plane size)."""
    placed: list[str] = []
    given = [0] * len(nodes)
    while len(placed) < sum(counts):
        for i, node in enumerate(nodes):
            take = min(size, counts[i] - given[i])
            placed.extend([node] * take)
            given[i] += take
    return placed


def slurm_task_nodes(nodes: Sequence[str], counts: Sequence[int], distribution: str,
                     plane_size: int | None = None) -> list[str]:
    """The node of every task of a Slurm step (index = ``SLURM_PROCID``), as srun laid them out.

    A task sees only its own node (``SLURMD_NODENAME``); the others follow from the step's node list,
    its tasks per node and the distribution's node level (``SLURM_DISTRIBUTION``: ``block``,
    ``cyclic``, ``block:cyclic``, ...; empty or ``*`` is srun's default, block). Block gives each node
    its tasks in one run of ranks; cyclic deals ranks out one per node, in the node list's order,
    round after round, skipping a node once it has its count (Slurm's ``_task_layout_cyclic``);
    plane deals them ``plane_size`` at a time (``SLURM_DIST_PLANESIZE``). Checked against srun
    22.05's own layouts (``srun -l``) for uneven counts.

    Args:
        nodes: the step's nodes in Slurm's order (:func:`expand_slurm_nodelist`).
        counts: tasks on each node (:func:`expand_slurm_tasks_per_node`), same length.
        distribution: ``SLURM_DISTRIBUTION`` as set ("" if unset).
        plane_size: ``SLURM_DIST_PLANESIZE`` for ``plane``.

    Raises:
        ConfigError: a distribution whose layout the environment does not tell (arbitrary: the user's
            host file; plane without its size; anything unknown), naming what to pass instead.

    Example:
        >>> slurm_task_nodes(["a", "b"], [2, 1], "cyclic")
        ['a', 'b', 'a']
    """
    level = re.split(r"[:,]", distribution.strip(), maxsplit=1)[0].strip().lower()
    if level in ("", "*", "block"):
        return [node for node, count in zip(nodes, counts) for _ in range(count)]
    if level == "cyclic":
        return _dealt(nodes, counts, 1)
    if level == "plane" and plane_size is not None and plane_size > 0:
        return _dealt(nodes, counts, plane_size)
    if level == "arbitrary":
        raise ConfigError("SLURM_DISTRIBUTION=arbitrary: srun placed the tasks by its host file (SLURM_HOSTFILE), "
                          f"which a task's environment does not list. {_PASS_THE_CLUSTER}")
    raise ConfigError(f"SLURM_DISTRIBUTION={distribution!r}: psflow derives the tasks' nodes for block, cyclic and "
                      f"plane (with SLURM_DIST_PLANESIZE) only. {_PASS_THE_CLUSTER}")


def _read_slurm_step(env: Mapping[str, str]) -> tuple[int, int, list[str], list[int]]:
    """SLURM_PROCID, SLURM_NTASKS, the step's nodes and its tasks per node, checked against each other."""
    found = {k: next((env[n].strip() for n in names if env.get(n, "").strip()), "") for k, names in _SLURM_VARS.items()}
    missing = [" or ".join(_SLURM_VARS[k]) for k, v in found.items() if not v]
    if missing:
        raise ConfigError(
            f"Slurm environment is incomplete: missing {'; '.join(missing)}. "
            "Run inside srun/sbatch, or give the cluster by flags or TF_CONFIG."
        )
    for key in ("procid", "ntasks"):
        if not re.fullmatch(r"[0-9]+", found[key]):
            raise ConfigError(f"{_SLURM_VARS[key][0]} must be a non-negative integer. Received: {found[key]!r}.")
    procid, ntasks = int(found["procid"]), int(found["ntasks"])
    nodes = expand_slurm_nodelist(found["nodelist"])
    counts = expand_slurm_tasks_per_node(found["per_node"])
    if len(counts) != len(nodes) or sum(counts) != ntasks:
        raise ConfigError(
            f"Slurm variables disagree: node list {found['nodelist']!r} has {len(nodes)} nodes, tasks per node "
            f"{found['per_node']!r} gives {len(counts)} nodes and {sum(counts)} tasks, SLURM_NTASKS={ntasks}."
        )
    if procid >= ntasks:
        raise ConfigError(f"SLURM_PROCID={procid} is out of range for SLURM_NTASKS={ntasks}.")
    return procid, ntasks, nodes, counts


def cluster_from_slurm_env(
    env: Mapping[str, str], *, num_ps: int, base_port: int, require_ps: bool = True
) -> tuple[ClusterSpec, TaskId]:
    """Builds the cluster of a Slurm step and this process's task: tasks ``0..num_ps-1`` are ps, the rest workers.

    Reads SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST, SLURM_NODELIST),
    SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE), SLURM_DISTRIBUTION and SLURMD_NODENAME from
    ``env`` (and SLURM_DIST_PLANESIZE for ``-m plane``). Every task's node follows from the distribution
    (:func:`slurm_task_nodes`); this task's
    must be the node it runs on (``SLURMD_NODENAME``), or it refuses: as every task checks its own,
    a layout derived wrongly stops the step at the tasks it misplaces instead of building a wrong
    cluster. Task i listens on ``base_port + i``, so tasks sharing a node never share a port.
    ``num_ps=0`` needs ``require_ps=False`` (all-reduce).

    Raises:
        ConfigError: missing (named) or malformed variables, counts that disagree, a distribution
            whose layout is not derivable (arbitrary), this task placed on another node than
            SLURMD_NODENAME, ports past 65535.
    """
    procid, ntasks, nodes, counts = _read_slurm_step(env)
    if isinstance(num_ps, bool) or not isinstance(num_ps, int) or not 0 <= num_ps < ntasks:
        raise ConfigError(f"num_ps={num_ps!r} must be in 0..{ntasks - 1} so that SLURM_NTASKS={ntasks} has a worker "
                          "(psflow.init reads it from PSFLOW_NUM_PS).")
    if base_port < 1 or base_port + ntasks - 1 > 65535:
        raise ConfigError(f"base_port={base_port} gives ports {base_port}..{base_port + ntasks - 1}; use 1..65535 "
                          "(psflow.init reads it from PSFLOW_BASE_PORT).")
    distribution = env.get("SLURM_DISTRIBUTION", "")
    plane = env.get("SLURM_DIST_PLANESIZE", "").strip()
    hosts = slurm_task_nodes(nodes, counts, distribution, int(plane) if plane.isdigit() else None)
    here = env.get("SLURMD_NODENAME", "").strip()
    if here and hosts[procid] != here:
        raise ConfigError(
            f"Slurm task {procid} runs on {here!r} (SLURMD_NODENAME) but the step's layout puts it on "
            f"{hosts[procid]!r} (SLURM_DISTRIBUTION={distribution!r}, nodes {nodes}, tasks per node {counts}). "
            f"{_PASS_THE_CLUSTER}"
        )
    addrs = [f"{host}:{base_port + i}" for i, host in enumerate(hosts)]
    jobs = {"ps": addrs[:num_ps], "worker": addrs[num_ps:]} if num_ps else {"worker": addrs}
    task = TaskId("ps", procid) if procid < num_ps else TaskId("worker", procid - num_ps)
    return ClusterSpec.from_dict(jobs, require_ps=require_ps), task
