"""Membership of a running job: which training replicas a ps shard counts, as workers join and leave.

Pure rules, no I/O. :class:`psflow.ps.rules.ShardRules` calls :func:`scaled_quorum` for the sync
quorum and keeps the membership itself (its ``resize`` event); :func:`data_shard` is what
:class:`psflow.task.Task` reads its data shard from. ``psflow scale`` (the launcher,
:mod:`psflow.launch.runner`) changes the membership; the ps learns it from the launcher's
coordinator (:mod:`psflow.launch.coordinator`, the ``members`` of its address book).

The semantics of a resize (``psflow scale RUN --workers N``):

- **Who**: the training replicas are the chief (if the job has a chief task) then the workers; a
  resize keeps replicas ``0 .. R-1``: it adds the next indices or retires the highest ones. The
  chief (or ``worker:0`` acting as chief) is never retired.
- **Sync quorum** (``replicas_to_aggregate`` N of ``total_num_replicas`` M): the number of backup
  workers, ``M - N`` as launched, is kept; M follows the membership. With R replicas a step needs
  ``N' = max(1, R - (M - N))`` gradients out of ``M' = R``. Without backups (N = M, the default)
  every member contributes to every step. The quorum counts *joined* members only: a worker added
  by a resize counts from its readiness (PS_READY) on, so the job never waits for a process that
  is still starting.
- **A retiring worker's in-flight gradient**: a push that reaches the shard before the shard learns
  of the resize is taken like any other (async: applied; sync: held). At the resize a retired
  worker's gradient still held for the step is dropped with it (as a lost worker's is: its batch is
  not trained), and later requests of a retired worker are refused; its PS_DONE or lost connection
  changes nothing.
- **Ssp**: the slowest clock is taken over joined, live members: a retired worker never holds the
  others back. A joining worker starts at the slowest clock of the live members (the current
  minimum), as a restarted worker does: it pulls the newest values, so it is as fresh as they are.
- **Data shards**: the data is split into as many shards as the job had training replicas at launch
  (S, fixed for the whole run). Replica r reads shard ``r mod S`` with its own data position (kept
  by the ps, as for restarts). So a worker added past S reads the shard of replica ``r mod S``
  again, from that shard's start (those examples are then seen twice per epoch: once per replica
  reading them); a retired replica's shard is not read while it is retired, and a replica added
  back resumes it from its last applied batch (exactly once per replica, across restarts and
  resizes). Re-sharding the data over the new count is not done.
- **A restarted worker** keeps the semantics it had (:mod:`psflow.ps.rules`: REJOINED); a worker
  added back after it was retired is a new attempt of it, and joins as a restarted one does.

Example:
    >>> scaled_quorum(None, None, launch=3, now=5)
    (5, 5)
    >>> scaled_quorum(2, 3, launch=3, now=5)  # one backup worker, kept
    (4, 5)
    >>> data_shard(4, 3)
    (1, 3)
"""

from __future__ import annotations


def scaled_quorum(n: int | None, m: int | None, *, launch: int, now: int) -> tuple[int, int]:
    """The sync quorum ``(N, M)`` with ``now`` joined replicas, for settings ``n``/``m`` (None: every
    worker) written for ``launch`` replicas: the backups ``M - N`` are kept, M follows ``now``.

    Unscaled (``now == launch``) it is exactly the settings' quorum.
    """
    m0 = m or launch
    n0 = n or m0
    if now == launch:
        return n0, m0
    backups = max(0, m0 - n0)
    now = max(1, now)
    return max(1, now - backups), now


def data_shard(replica: int, launch_replicas: int) -> tuple[int, int]:
    """``(shard index, shard count)`` of training replica ``replica`` when the job was launched with
    ``launch_replicas``: the count stays the launch's, a replica past it reads ``replica mod count``."""
    count = max(1, launch_replicas)
    return replica % count, count
