"""A Slurm step's environment: its first ``num_ps`` tasks are ps, the rest workers; task i listens on ``base_port + i``.

Every task's node follows from the step's node list, its tasks per node and the distribution
(:func:`slurm_task_nodes`); :func:`cluster_from_slurm_env` builds the cluster and this task from
them, and :func:`resolve` is this source's answer. The hostlist expansion
(:func:`expand_slurm_nodelist`) is the launcher's Slurm backend's too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from psflow.cluster import ClusterSpec, TaskId
from psflow.errors import ConfigError
from psflow.resolve import Resolved


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


def resolve(env: Mapping[str, str], *, num_ps: int | None, base_port: int, require_ps: bool) -> Resolved | None:
    """The cluster and task of the Slurm step ``env`` is a task of; None outside one. ``num_ps``
    (``PSFLOW_NUM_PS``) None: 1 ps with ``require_ps``, else none.

    Raises:
        ConfigError: as :func:`cluster_from_slurm_env`.
    """
    if not in_slurm_step(env):
        return None
    num_ps = num_ps if num_ps is not None else int(require_ps)
    spec, task = cluster_from_slurm_env(env, num_ps=num_ps, base_port=base_port, require_ps=require_ps)
    return Resolved(spec, task, "Slurm's environment")
