"""The all-reduce rendezvous: where the training tasks meet, and whether that may leave loopback.

Replica 0 (``cluster.chief()``: ``chief:0``, else ``worker:0``) is rank 0 and serves a
``torch.distributed.TCPStore`` (PyTorch's MASTER_ADDR:MASTER_PORT) at its cluster address; every
other rank connects there. ``psflow.init`` binds it before the task registers (under the launcher,
on port 0, so the store's address is the one the cluster learns); the all-reduce trainer binds it
itself for a task made without ``init``.

The store and gloo's connections are not authenticated: :func:`check_exposure` refuses a job whose
such traffic would leave loopback unless the user opted in. ``init`` calls it before the store is
bound, the trainer again before it joins the group.

Sits below ``psflow.task`` and ``psflow.train`` (both call it), so neither imports the other for it.
Light: torch is imported only when a store is bound.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from psflow.cluster import TaskId, is_loopback_host
from psflow.errors import ConfigError

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["OPT_IN", "bind_rendezvous", "check_exposure", "rendezvous_task"]

OPT_IN = ("--allow-unauthenticated-allreduce (PSFLOW_ALLOW_UNAUTHENTICATED_ALLREDUCE=1, "
          "TrainConfig(allow_unauthenticated_allreduce=True))")


def check_exposure(hosts: Iterable[str], *, bind_host: str, gloo_ifname: str | None, allowed: bool) -> None:
    """Refuse an all-reduce whose unauthenticated traffic would leave loopback, unless ``allowed``.

    Args:
        hosts: the hosts of the cluster's tasks (the rendezvous and gloo's peers).
        bind_host: the interface this task binds (PSFLOW_BIND_HOST, else its own cluster host).
        gloo_ifname: GLOO_SOCKET_IFNAME as the user set it (None: psflow pins a loopback job to loopback).
        allowed: the user's opt-in (``TrainConfig.allow_unauthenticated_allreduce``).

    Raises:
        ConfigError: some of that traffic would be off loopback and the user did not opt in.
    """
    exposed = [f"cluster host {h}" for h in sorted(set(hosts)) if not is_loopback_host(h)]
    if not is_loopback_host(bind_host):
        exposed.append(f"bind host {bind_host or '(every interface)'} (PSFLOW_BIND_HOST)")
    if gloo_ifname and not all(name.strip().startswith("lo") for name in gloo_ifname.split(",")):
        exposed.append(f"gloo interface {gloo_ifname} (GLOO_SOCKET_IFNAME)")
    if not exposed or allowed:
        return
    raise ConfigError(
        f"The all-reduce strategy would run off loopback ({'; '.join(exposed)}), and its traffic is not protected "
        "by the job secret: torch.distributed's rendezvous store (TCPStore) and gloo's connections between the "
        "tasks, which carry every gradient and the initial parameters, accept anyone who reaches them, with no "
        "authentication and no encryption. Anyone on that network could join the group, read the model or corrupt "
        "its training. Keep every task on loopback, use --strategy ps (every psflow connection proves the job "
        f"secret), or on a network you trust opt in with {OPT_IN}."
    )


def rendezvous_task(cluster: Any) -> TaskId:
    """The task that serves the rendezvous and is rank 0: the chief (``chief:0`` or ``worker:0``)."""
    return cluster.chief()


def bind_rendezvous(host: str, port: int = 0, *, timeout_s: float = 120.0) -> dist.TCPStore:
    """Rank 0: serve the collective rendezvous (a TCPStore) on ``host:port``; port 0 picks a free one.

    Read the bound port from ``store.port``. The store is unauthenticated: bind it to loopback
    unless every host that can reach it is trusted.

    Raises:
        ConfigError: the address cannot be bound (busy port, unknown interface).
    """
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            host, port, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
    except (RuntimeError, OSError) as e:
        raise ConfigError(
            f"Cannot serve the all-reduce rendezvous on {host}:{port}: {e}. "
            "Pick a free port for the chief's address, or stop the process that uses it."
        ) from e
