"""Membership of a running job: which training replicas a ps shard counts, as workers join and leave.

Pure rules, no I/O. :class:`psflow.ps.rules.ShardRules` calls :func:`scaled_quorum` for the sync
quorum and keeps the membership itself (its ``resize`` event); :func:`data_shard` is what
:class:`psflow.task.Task` reads its data shard from. ``psflow scale`` (the launcher,
:mod:`psflow.launch.runner`) changes the membership; the ps learns it from the launcher's
coordinator (:mod:`psflow.launch.coordinator`, the ``members`` of its address book).

The semantics of a resize (``psflow scale RUN --workers N``):

The whole design note: ``docs/design/ps-membership.md``.

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
