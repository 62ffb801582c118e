"""All-reduce data parallelism: the same user script, with PyTorch's collectives instead of ps tasks.

``psflow run --strategy allreduce`` starts only training tasks (no ps). ``pf.Trainer(...)`` then
returns an :class:`AllReduceTrainer`: every task keeps the whole model and a real ``torch.optim``
optimizer built from the same spec; each step the gradients are averaged across tasks (gloo on CPU,
NCCL on CUDA) and every task applies the same update. The surface is the ps Trainer's.

Rendezvous (:mod:`psflow.rendezvous`): replica 0 (``cluster.chief()``) is rank 0, and its cluster
address is where it serves the ``TCPStore`` (PyTorch's MASTER_ADDR:MASTER_PORT); under the launcher
it binds the store on port 0 and registers that address, so every task learns it race-free.

A step reaches the all-reduce through ``DistributedDataParallel`` (``step(closure, batch=...)``: the
closure gets the wrapped model), or, for a closure that calls the bare model or with ``devices``,
through the trainer's own all-reduce of the gradients after backward.

Invariants: every task takes the same number of steps (a task that stops early makes the others fail
after ``sync_timeout_s``); ranks are ``task.replica_index``; parameters, buffers, moving averages and
the step start from rank 0's. ``ssp`` and backup workers need parameter servers and are refused.

Security: the TCPStore and gloo's connections are NOT covered by the job secret: they bind loopback
by default, and off loopback :func:`psflow.rendezvous.check_exposure` refuses to start unless
``allow_unauthenticated_allreduce``. The whole story: ``docs/design/allreduce.md``.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from psflow import checkpoint, timeline
from psflow.checkpoint.keys import ema_key, opt_key_of, split_state
from psflow.cluster import is_loopback_host, parse_address
from psflow.errors import ClusterError, ConfigError, TrainingError
from psflow.optim import (
    MovingAverage,
    load_optimizer_state_tensors,
    optimizer_state_tensors,
    set_lr,
)
from psflow.ps.placement import ParamInfo, place
from psflow.rendezvous import bind_rendezvous, check_exposure, rendezvous_task
from psflow.train.base import TrainerBase
from psflow.train.towers import Batch, run_step_closure

__all__ = ["AllReduceTrainer"]


def _pin_gloo_to_loopback() -> None:
    # gloo listens on the address its host name resolves to, which may face the network; its
    # connections are unauthenticated, so a loopback job keeps them on loopback. An explicit
    # GLOO_SOCKET_IFNAME set by the user wins.
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if names:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", names[0])


class AllReduceTrainer(TrainerBase):
    """Train an ordinary ``torch.nn.Module`` with all-reduced gradients (no parameter servers).

    Created by ``pf.Trainer(...)`` when the task's strategy is ``allreduce``; the arguments are the
    Trainer's. The optimizer spec is built locally (``spec.build(model.parameters())``).

    Example:
        >>> trainer = pf.Trainer(model, pf.optim.Adam(lr=1e-3), task)   # psflow run --strategy allreduce
        >>> loss = trainer.step(lambda m, x, y: F.cross_entropy(m(x), y), batch=(x, y))
    """

    _why_spec = "Every task builds the same torch.optim optimizer from it."

    def _init_strategy(self) -> None:
        task = self.task
        if self.config.mode == "ssp" or self.config.replicas_to_aggregate != task.num_replicas:
            raise ConfigError(
                f"strategy='allreduce' averages every worker's gradient each step; mode={self.config.mode!r} with "
                f"replicas_to_aggregate={self.config.replicas_to_aggregate} of {task.num_replicas} needs parameter "
                "servers. Use --strategy ps for ssp or backup workers."
            )
        self.world_size = task.num_replicas
        self.torch_optimizer = self.optimizer.build(list(self.params.values()))
        self.ema: MovingAverage | None = None
        if self.ema_decay is not None:
            self.ema = MovingAverage(self.ema_decay)
            self.ema.register({n: p.detach() for n, p in self.params.items()})
        # No ps shards in this strategy; the one-shard placement describes rank 0's checkpoints.
        self.placement = place(ParamInfo.from_module(self.model), 1)
        self.backend = "nccl" if self._on_cuda() and dist.is_nccl_available() else "gloo"
        self.ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self.allreduce_s = 0.0
        self._live: dict[str, torch.Tensor] | None = None  # the live values while averages are loaded
        self._owns_group = False
        self._ddp_timed = False  # the timeline's comm hook is registered on self.ddp

    def _on_cuda(self) -> bool:
        return any(p.device.type == "cuda" for p in self.params.values())

    # -- readiness -------------------------------------------------------------------------
    def restore_from(self, step: int, tensors: Mapping[str, torch.Tensor], *,
                     data_positions: Mapping[str, Any] | None = None) -> None:
        """Start from a checkpoint (whole tensors by parameter name, ``opt/<param>/<slot>``, ``ema/<param>``).

        Rank 0's parameters, buffers, moving averages and step reach every task at :meth:`prepare`;
        optimizer slots are restored on each task that calls this (call it on every task).

        Raises:
            ConfigError: the checkpoint lacks some of the model's parameters.
        """
        super().restore_from(step, tensors)

    def prepare(self) -> int:
        """Join the other tasks (rendezvous + process group), start from rank 0's state. Returns the step."""
        if self._ready:
            return self.global_step
        if self._restore is not None:
            self._apply_restore(*self._restore)
        self._init_group()
        self._broadcast_state()
        if self.towers is None:
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.model)
        else:
            self.towers.refresh()
        self._ready = True
        return self.global_step

    @torch.no_grad()
    def _apply_restore(self, step: int, tensors: Mapping[str, torch.Tensor]) -> None:
        for n, p in self.params.items():
            p.copy_(tensors[n])
        if self.ema is not None:
            for n, shadow in self.ema.shadow().items():
                shadow.copy_(tensors.get(ema_key(n), self.params[n]))
        _, slots, _ = split_state(tensors)
        if slots:
            load_optimizer_state_tensors(self.torch_optimizer, list(self.params), slots)
        self.global_step = int(step)

    def _init_group(self) -> None:
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size or dist.get_rank() != self.worker:
                raise ConfigError(
                    f"torch.distributed is already initialized as rank {dist.get_rank()} of {dist.get_world_size()}, "
                    f"but this task is replica {self.worker} of {self.world_size}. Let psflow initialize it."
                )
            return
        cluster = self.task.cluster
        server = getattr(self.task, "server", None)  # a task made by psflow.init has one; its host is the bind host
        bind_host = server.host if server is not None else parse_address(cluster.address(self.task.task_id))[0]
        check_exposure(cluster.hosts(), bind_host=bind_host, gloo_ifname=os.environ.get("GLOO_SOCKET_IFNAME"),
                       allowed=self.config.allow_unauthenticated_allreduce)
        chief = rendezvous_task(cluster)
        host, port = parse_address(cluster.address(chief))
        wait = datetime.timedelta(seconds=self.config.ready_timeout_s)
        store = getattr(self.task, "rendezvous", None) if self.task.task_id == chief else None
        try:
            if store is None and self.task.task_id == chief:
                store = bind_rendezvous(host, port, timeout_s=self.config.ready_timeout_s)
            elif store is None:
                store = dist.TCPStore(host, port, None, False, timeout=wait)
            if self.backend == "gloo" and is_loopback_host(host):
                _pin_gloo_to_loopback()
            dist.init_process_group(
                self.backend, store=store, rank=self.worker, world_size=self.world_size,
                timeout=datetime.timedelta(seconds=self.config.sync_timeout_s),
            )
        except dist.DistError as e:
            raise ClusterError(
                f"{self.task.task_id} could not join the all-reduce group at {host}:{port} (rank {self.worker} of "
                f"{self.world_size}) within {self.config.ready_timeout_s:.0f} s: {e}. Check that every worker started "
                "(their logs); raise ready_timeout_s if they start slowly."
            ) from e
        self._owns_group = True

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        tensors = list(self.params.values()) + list(self.model.buffers())
        if self.ema is not None:
            tensors += list(self.ema.shadow().values())
        logdir = (self.chief_logdir or "").encode() if self.worker == 0 else b""
        step = torch.tensor([self.global_step, len(logdir)], dtype=torch.int64, device=self._comm_device())
        self._collective("broadcasting the initial step", dist.broadcast, step, src=0)
        self.global_step = int(step[0].item())
        if int(step[1].item()):  # rank 0's logdir (the chief's), as UTF-8 bytes: nothing is unpickled
            text = torch.zeros(int(step[1].item()), dtype=torch.uint8)
            if self.worker == 0:
                text = torch.frombuffer(bytearray(logdir), dtype=torch.uint8)
            text = text.to(self._comm_device())
            self._collective("broadcasting the chief's logdir", dist.broadcast, text, src=0)
            self.chief_logdir = bytes(text.cpu().tolist()).decode()
        for bucket in _buckets(tensors):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self._collective("broadcasting rank 0's parameters", dist.broadcast, flat, src=0)
            _unflatten_into(flat, bucket)

    def _comm_device(self) -> torch.device:
        # NCCL communicates on the model's GPU; gloo here on the CPU.
        return next(iter(self.params.values())).device if self.backend == "nccl" else torch.device("cpu")

    # -- the step --------------------------------------------------------------------------
    def step(
        self,
        closure: Callable[..., torch.Tensor],
        *,
        batch: Batch | torch.Tensor | None = None,
        batches: Sequence[Batch | torch.Tensor] | None = None,
        batch_size: int | None = None,
    ) -> float:
        """One synchronous step on every task: gradients, all-reduce (mean), optimizer update.

        Args:
            closure: ``closure(model, *batch)`` with ``batch=``, else ``closure()`` (see the module doc).
            batch: this task's batch, e.g. ``(x, y)`` (split across ``devices`` when given).
            batches: one batch per device (with ``devices``).
            batch_size: examples in this step for the throughput figures (default: from the batch).

        Returns:
            This task's loss as a float. Parameters are identical on every task afterwards.

        Raises:
            TrainingError: a collective failed or timed out (another task died or stalled).
        """
        t0 = self._begin_step()  # joining the group is not training time
        tl = timeline.ACTIVE  # None unless psflow run --timeline: then each phase below is a span
        ts = tl.now() if tl is not None else 0.0
        self._load_live()
        if self.schedule is not None:
            set_lr(self.torch_optimizer, self.schedule.lr_at(self.optimizer.lr, self.global_step))
        self.torch_optimizer.zero_grad(set_to_none=True)
        through_ddp = self.ddp is not None and (batch is not None or batches is not None)
        model = self.ddp if through_ddp else self.model
        if tl is None:
            loss = run_step_closure(closure, model, towers=self.towers, batch=batch, batches=batches)
        else:
            self._time_ddp_buckets(tl)
            loss = self._timed_compute(tl, closure, batch, batches, model=model)
        t1 = time.perf_counter()
        if not through_ddp:
            ta = tl.now() if tl is not None else 0.0
            self._allreduce_grads()
            if tl is not None:
                tl.add("allreduce", "all-reduce", ta, tl.now(), world_size=self.world_size)
        self.allreduce_s += time.perf_counter() - t1
        self.compute_s += t1 - t0
        to = tl.now() if tl is not None else 0.0
        self.torch_optimizer.step()
        self.global_step += 1
        if self.ema is not None:
            self.ema.update({n: p.detach() for n, p in self.params.items()}, num_updates=self.global_step)
        if tl is not None:
            tl.add("optimizer", "optimizer", to, tl.now())
        if self.towers is not None:
            self.towers.refresh()
        if tl is not None:
            tl.add("step", f"step {self.local_step}", ts, tl.now(), global_step=self.global_step)
        self._end_step(t0, loss, batch_size, batch, batches)
        return loss

    def _time_ddp_buckets(self, tl: timeline.Timeline) -> None:
        """With the timeline on, DDP's bucket all-reduces become spans too. DDP launches them during
        backward and they complete on gloo's (NCCL's) thread or inline, so they go on a track of their
        own, overlapping the ``backward`` span (which also holds the wait for the last bucket): the step's
        shares count the training thread only. The hook is torch's default (divide by the world size,
        then all-reduce the bucket), timed: the gradients are the same as without it."""
        if self.ddp is None or self._ddp_timed:
            return
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def timed(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            start, index = tl.now(), bucket.index()

            def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                tl.add("allreduce", f"all-reduce bucket {index} (overlaps backward)", start, tl.now(),
                       track="all-reduce (DDP buckets)", world_size=self.world_size)
                return fut.value()

            return allreduce_hook(state, bucket).then(done)

        # DDP checks the hook's annotations as objects; this module's are strings (postponed evaluation).
        timed.__annotations__ = {"state": Any, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        self.ddp.register_comm_hook(None, timed)
        self._ddp_timed = True

    @torch.no_grad()
    def _allreduce_grads(self) -> None:
        grads = []
        for p in self.params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # every rank must contribute the same layout
            grads.append(p.grad)
        for bucket in _buckets(grads):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self._collective(f"all-reducing the gradients of step {self.global_step}", dist.all_reduce, flat)
            flat.div_(self.world_size)
            _unflatten_into(flat, bucket)

    def _collective(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            call(*args, **kwargs)
        except RuntimeError as e:  # gloo reports a dead peer as a plain RuntimeError, not a DistError
            raise TrainingError(
                f"{self.task.task_id} failed {what}: {e}. Another worker died, stalled or stopped early "
                f"(every worker must take the same number of steps); the wait limit is sync_timeout_s="
                f"{self.config.sync_timeout_s:g}."
            ) from e

    # -- reading the model -----------------------------------------------------------------
    @torch.no_grad()
    def pull(self, *, averages: bool = False) -> int:
        """Load the live parameters, or (``averages=True``) their moving averages, into the model.

        The model already holds the live values after each step; after ``pull(averages=True)``
        the next ``step`` or ``pull()`` puts the live values back. Returns the global step.
        """
        self.prepare()
        self._load_live()
        if averages and self.ema is not None:
            self._live = {n: p.detach().clone() for n, p in self.params.items()}
            for n, shadow in self.ema.shadow().items():
                self.params[n].copy_(shadow)
        return self.global_step

    @torch.no_grad()
    def _load_live(self) -> None:
        if self._live is not None:
            for n, v in self._live.items():
                self.params[n].copy_(v)
            self._live = None

    # -- what the Supervisor needs (the ps Trainer offers the same) ---------------------------
    def save_shards(self, root: str, step: int, *, exact: bool = False) -> list[dict[str, Any]]:
        """The chief writes the whole state as one shard: every rank holds the same values.

        ``exact`` changes nothing here: the steps are synchronous, so the state now is that of the
        step every rank finished last."""
        with torch.no_grad():
            tensors = {n: p.detach().cpu().clone() for n, p in self.params.items()}
            for k, v in optimizer_state_tensors(self.torch_optimizer, list(self.params)).items():
                tensors[opt_key_of(k)] = v.detach().cpu().clone()
            if self.ema is not None:
                for k, v in self.ema.shadow().items():
                    tensors[ema_key(k)] = v.detach().cpu().clone()
        record = checkpoint.write_shard(root, step, 0, 1, tensors)
        return [{"record": record.to_dict(), "version": step}]

    def job_step(self) -> int:
        return self.global_step

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "allreduce_s": round(self.allreduce_s, 4), "stale_pushes": 0, "mode": "sync",
                "strategy": "allreduce", "backend": self.backend}

    def _release(self) -> None:
        """Leave the process group (no collective: a peer that already failed cannot block this)."""
        self.ddp = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Group tensors by (device, dtype), keeping their order, so each group flattens into one buffer."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
