"""The worker side of the parameter servers: one authenticated connection per ps shard.

Requests to several shards are pipelined: sent to every shard first, then the replies are read,
so shards work in parallel without a thread per shard. Pulled values are received straight into
the destination tensors (the model's own parameters); pushed gradients are sent straight from
their storage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from psflow.cluster import ClusterSpec, TaskId
from psflow.errors import PsflowError, RemoteError
from psflow.wire.conn import Connection, Frame, connect
from psflow.wire.frame import Limits
from psflow.wire.ops import Op

_MARGIN_S = 15.0  # socket timeout beyond a server-side wait, so the server's clearer error arrives first


class PsClient:
    """Connections from one task to every ps shard of the cluster."""

    def __init__(
        self,
        cluster: ClusterSpec,
        task: TaskId,
        secret: bytes,
        *,
        connect_timeout_s: float = 60.0,
        request_timeout_s: float = 120.0,
        limits: Limits = Limits(),
    ) -> None:
        self.task = task
        self.num_shards = cluster.num_tasks("ps")
        self.request_timeout_s = request_timeout_s
        self.conns: list[Connection] = []
        try:
            for i in range(self.num_shards):
                ps = TaskId("ps", i)
                self.conns.append(
                    connect(
                        cluster.address(ps), secret=secret, task=str(task), peer=str(ps),
                        deadline_s=connect_timeout_s, limits=limits,
                    )
                )
        except BaseException:
            self.close()
            raise

    def _all(
        self,
        op: Op,
        metas: Sequence[dict[str, Any]],
        tensors: Sequence[Sequence[tuple[str, torch.Tensor]]] | None = None,
        dests: Sequence[Mapping[str, torch.Tensor]] | None = None,
        wait_s: float = 0.0,
        shards: Sequence[int] | None = None,
    ) -> list[Frame]:
        shards = list(range(self.num_shards)) if shards is None else list(shards)
        timeout = self.request_timeout_s + wait_s + _MARGIN_S
        for j, i in enumerate(shards):
            self.conns[i].set_timeout(timeout)
            self.conns[i].send(op, metas[j], tensors[j] if tensors else ())
        frames: list[Frame] = []
        first_error: PsflowError | None = None
        for j, i in enumerate(shards):
            dest = dests[j] if dests else None
            frame = self.conns[i].recv(alloc=(lambda spec, d=dest: d.get(spec.name)) if dest else None)
            if frame.op == Op.ERROR and first_error is None:
                first_error = RemoteError(f"ps:{i}: {frame.meta.get('error', 'unknown error')}")
            frames.append(frame)
        if first_error is not None:
            raise first_error
        return frames

    # -- the operations --------------------------------------------------------------------
    def initialize(self, per_shard: Sequence[Mapping[str, torch.Tensor]], meta: dict[str, Any]) -> list[bool]:
        frames = self._all(Op.PS_INIT, [meta] * self.num_shards, [list(v.items()) for v in per_shard])
        return [bool(f.meta.get("initialized")) for f in frames]

    def wait_ready(self, placement_digest: str, timeout_s: float) -> dict[str, Any]:
        meta = {"timeout_s": timeout_s, "placement_digest": placement_digest}
        frames = self._all(Op.PS_READY, [meta] * self.num_shards, wait_s=timeout_s)
        return frames[0].meta

    def pull(
        self,
        dests: Sequence[Mapping[str, torch.Tensor]],
        *,
        min_versions: Sequence[int] | None = None,
        wait_s: float = 0.0,
        averages: bool = False,
    ) -> list[int]:
        """Receive every shard's values into ``dests[shard][key]``. Returns each shard's version.

        ``min_versions[shard]`` makes the shard answer only once it reached that version (sync mode),
        waiting at most ``wait_s``."""
        mins = list(min_versions) if min_versions is not None else [0] * self.num_shards
        metas = [{"min_version": v, "timeout_s": wait_s, "averages": averages} for v in mins]
        frames = self._all(Op.PS_PULL, metas, dests=dests, wait_s=wait_s)
        _land(frames, dests)
        return [int(f.meta["version"]) for f in frames]

    def push(
        self, worker: int, versions: Sequence[int], per_shard: Sequence[Sequence[tuple[str, torch.Tensor]]]
    ) -> list[dict[str, Any]]:
        """Send one worker's gradients; ``versions[shard]`` is the version they were computed from."""
        metas = [{"worker": worker, "version": v} for v in versions]
        return [f.meta for f in self._all(Op.PS_PUSH, metas, per_shard)]

    def push_pull(
        self,
        worker: int,
        versions: Sequence[int],
        per_shard: Sequence[Sequence[tuple[str, torch.Tensor]]],
        dests: Sequence[Mapping[str, torch.Tensor]],
        *,
        wait_s: float,
    ) -> list[dict[str, Any]]:
        """Push gradients and receive the values after the update, one round trip per shard.

        In sync mode each shard answers once the step this gradient belongs to is applied (at most
        ``wait_s``). Returns each shard's reply meta; ``version`` is the version of the values received."""
        for shard in range(self.num_shards):
            self.send_push(shard, worker, versions[shard], per_shard[shard], wait_s=wait_s)
        return self.recv_push_replies(range(self.num_shards), dests)

    def send_push(
        self, shard: int, worker: int, version: int, grads: Sequence[tuple[str, torch.Tensor]], *, wait_s: float,
        position: dict[str, Any] | None = None,
    ) -> None:
        """Send one shard's push-pull request without waiting for the reply (the trainer sends each
        shard's gradients as soon as backward has produced them). ``position``: the worker's data
        position after this batch, which the shard keeps for checkpoints."""
        conn = self.conns[shard]
        conn.set_timeout(self.request_timeout_s + wait_s + _MARGIN_S)
        meta: dict[str, Any] = {"worker": worker, "version": version, "pull": True, "timeout_s": wait_s}
        if position is not None:
            meta["position"] = position
        conn.send(Op.PS_PUSH, meta, grads)

    def recv_push_replies(self, shards: Iterable[int], dests: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, Any]]:
        """Receive the replies of requests sent with :meth:`send_push`, values straight into ``dests``."""
        metas, first_error = [], None
        for shard in shards:
            dest = dests[shard]
            frame = self.conns[shard].recv(alloc=lambda spec, d=dest: d.get(spec.name))
            if frame.op == Op.ERROR and first_error is None:
                first_error = RemoteError(f"ps:{shard}: {frame.meta.get('error', 'unknown error')}")
            _land([frame], [dest])
            metas.append(frame.meta)
        if first_error is not None:
            raise first_error
        return metas

    def clock(self, worker: int, clock: int, timeout_s: float) -> int:
        meta = {"worker": worker, "clock": clock, "timeout_s": timeout_s}
        return int(self._all(Op.PS_CLOCK, [meta], wait_s=timeout_s, shards=[0])[0].meta["slowest"])

    def done(self, worker: int) -> None:
        self._all(Op.PS_DONE, [{"worker": worker}] * self.num_shards)

    def status(self, *, clock_log: bool = False) -> list[dict[str, Any]]:
        return [f.meta for f in self._all(Op.PS_STATUS, [{"clock_log": clock_log}] * self.num_shards)]

    def save(self, meta: dict[str, Any]) -> list[dict[str, Any]]:
        wait_s = float(meta.get("timeout_s", 0.0))  # a shard may wait that long to reach an exact step
        return [f.meta for f in self._all(Op.PS_SAVE, [meta] * self.num_shards, wait_s=wait_s)]

    def shutdown(self) -> None:
        self._all(Op.PS_SHUTDOWN, [{}] * self.num_shards)

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.conns = []


def _land(frames: Sequence[Frame], dests: Sequence[Mapping[str, torch.Tensor]]) -> None:
    """Copy received values into their destinations where they could not be received in place."""
    for f, dest in zip(frames, dests):
        for k, t in f.tensors.items():
            d = dest.get(k)
            if d is not None and d.data_ptr() != t.data_ptr():
                d.copy_(t)
