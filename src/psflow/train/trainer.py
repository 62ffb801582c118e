"""The worker's training step (between-graph replication): pull -> forward/backward -> push.

Every worker holds the whole model. Each step it runs the user's closure (forward + loss) and
autograd's backward, and pushes the gradients straight from ``param.grad`` to the shards that own
them; the reply brings the values after the update straight into the model's own tensors (one round
trip per shard, push-pull as ps-lite does; the first values come from a pull in ``prepare()``). The
ps apply the optimizer and the update rule; the trainer follows the rule's protocol by asking its
mode (:mod:`psflow.train.modes`: async, sync, ssp), never its name.

Restarts: a trainer names its task's ``attempt`` (PSFLOW_ATTEMPT) at readiness and on every push,
clock and PS_DONE, and numbers its pushes (``seq``), so a restarted worker takes over from its dead
attempt on every shard and resumes at the data position (and ssp clock) of its last applied batch.
Every shard records each push's data position; shard 0's is the one resumed from, and it gets each
step's push last, so a batch it recorded reached every other shard before (a batch redone after a
kill between two shards' pushes is applied once on each: a shard that took it answers a duplicate).
With a resolver (a launched task), a dropped shard connection is made again: pulls and waits are
repeated, a push whose reply was lost is resent (the ps recognise its number), and a failed step
leaves the other connections in step.

Compression (``compress``, ``compress_pull``, :mod:`psflow.wire.compress`) is the client's. With
``psflow run --timeline`` each phase of a step is a span of :mod:`psflow.timeline`; off, one ``if``.
A step whose gradient a shard refused (NaN or inf, :mod:`psflow.ps.finite`) is not counted; the
first is logged (sync: the next batch is for the same step).

Initialization: the chief sends the initial (or restored) values to every shard once; the others
wait until the shards are ready. A chief that finds every shard initialized (restarted while the ps
trained on) sends nothing and resumes like any restarted worker; a late PS_INIT changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from psflow import errorreport, timeline
from psflow.checkpoint.keys import StateKey, parse_key
from psflow.errors import ConfigError, PsflowError
from psflow.optim import OptimizerSpec
from psflow.ps.client import PsClient
from psflow.ps.placement import ParamInfo, Placement, place, split_tensor
from psflow.ps.progress import StepPlan
from psflow.train.base import TrainerBase
from psflow.train.ledger import PushLedger
from psflow.train.modes import UpdateMode, mode_of
from psflow.train.pipeline import Exchanges, Flight, ReplyBuffers
from psflow.train.sender import PushSender
from psflow.train.towers import Batch, batch_examples, run_step_closure
from psflow.wire.compress import Compression

log = logging.getLogger("psflow")


class Trainer(TrainerBase):
    """Train an ordinary ``torch.nn.Module`` against the job's parameter servers.

    Args:
        model: the model; its parameters are overwritten by the ps values at each step.
        optimizer: the optimizer the ps applies, e.g. ``pf.optim.SGD(lr=0.01)``.
        task: the task from ``pf.init()``; default the current one.
        schedule: learning rate by global step, e.g. ``pf.optim.ExponentialDecay(...)``.
        ema_decay: keep moving averages of the parameters on the ps (read with ``pull(averages=True)``).
        devices: compute on several local devices (in-graph towers, e.g. ``["cuda:0", "cuda:1"]``):
            ``model`` stays the master copy on the CPU; each step's batch is split across one replica
            per device and their averaged gradients are pushed (see :class:`psflow.train.towers.Towers`).
        **settings: TrainConfig fields (``mode``, ``replicas_to_aggregate``, ``staleness``...);
            given here they override the launcher's.

    With ``strategy="allreduce"`` (``psflow run --strategy allreduce``) ``Trainer(...)`` returns an
    :class:`psflow.train.allreduce.AllReduceTrainer` instead: same arguments and surface, no ps.

    Example:
        >>> trainer = pf.Trainer(model, pf.optim.SGD(lr=0.01), task, mode="sync")
        >>> loss = trainer.step(lambda m, x, y: F.cross_entropy(m(x), y), batch=(x, y))  # 1 or N devices
        >>> loss = trainer.step(lambda: F.cross_entropy(model(x), y), batch_size=len(x))  # 1 device
    """

    def __new__(cls, model: torch.nn.Module, optimizer: OptimizerSpec, task: Any = None, **kwargs: Any) -> Any:
        # The strategy picks the implementation, so a script runs unchanged under --strategy ps|allreduce.
        # AllReduceTrainer is not a subclass of Trainer, so Python does not initialize it a second time.
        if cls is Trainer:
            strategy = kwargs.get("strategy")
            if strategy is None:
                if task is None:
                    from psflow.task import current_task

                    task = current_task()
                strategy = task.config.strategy
            if strategy == "allreduce":
                from psflow.train.allreduce import AllReduceTrainer

                return AllReduceTrainer(model, optimizer, task, **kwargs)
        return super().__new__(cls)

    _why_spec = "The parameter servers apply it, so it travels as data, not as a torch.optim object."

    def _init_strategy(self) -> None:
        task, model = self.task, self.model
        for name, p in self.params.items():
            if not p.is_contiguous() or p.device.type != "cpu":
                raise ConfigError(f"Parameter {name!r} must be a contiguous CPU tensor to train against parameter servers.")
        self.placement: Placement = place(
            ParamInfo.from_module(model), task.num_ps, strategy=self.config.placement, split_bytes=self.config.split_bytes
        )
        self.digest = hashlib.sha256(json.dumps(self.placement.to_dict(), sort_keys=True).encode()).hexdigest()
        self._dests = [
            {pc.key: split_tensor(self.params[pc.param].data, pc) for pc in self.placement.pieces_on(s)}
            for s in range(task.num_ps)
        ]
        self.client = PsClient(task.cluster, task.task_id, task.secret, connect_timeout_s=task.connect_timeout_s,
                               resolve=task.resolve, replicas=self.config.ps_replicas,
                               failover_s=self.config.primary_failover_s,
                               compression=Compression.parse(self.config.compress), compress_pull=self.config.compress_pull)
        self.mode: UpdateMode = mode_of(self.config)
        self.client.waiting_for = self.mode.reply_waits_for
        self.versions = [0] * task.num_ps
        self.attempt = int(getattr(task, "attempt", 0) or 0)  # the launcher's restart count (PSFLOW_ATTEMPT)
        self.clock_base = 0  # ssp: the clock this attempt starts at (from readiness: a restarted worker resumes)
        self._push_seq = 0  # this attempt's steps sent: each push carries it, so a resent one is recognised
        self._position: dict[str, Any] | None = None  # the data position after this step's batch (each push carries it)
        self._ledger = (PushLedger(task.logdir, str(task.task_id), self.worker, self.attempt)
                        if self.config.push_ledger and getattr(task, "logdir", None) else None)
        self.stale_pushes = 0
        self.refused_pushes = 0  # steps whose gradient a shard refused for holding NaN or inf
        self._holds_averages = False  # pull(averages=True) put moving averages into the model
        self.step_plan = StepPlan()  # the chief sends it to the ps (Supervisor: max_steps, save_model_steps)
        self.data_source: Any = None  # an iterator with state_dict(): its position rides on each push (see _send_shard)
        self._restored_positions: Mapping[str, Any] | None = None
        self._ps_initialized = False  # every shard answered initialized (a restarted chief takes over)
        # TrainConfig.pipeline (async): the steps whose replies are still on their way, oldest first
        self._flights: list[Flight] = []
        self._reply_buffers = ReplyBuffers(self._dests) if self.config.pipeline else None
        self._buffer = 0  # the reply buffer of the step being computed
        self.pipelined_steps = 0  # steps computed from values that lacked this worker's previous update
        self._install_grad_hooks()

    @property
    def clock(self) -> int:
        """Ssp: the clock of the step about to start, the attempt's first clock plus its steps before
        it: those counted (without the pipeline: a refused step is redone at the same clock) or, with
        the pipeline, those begun (by the time its push thread reports the clock, each one's replies
        are in, or it reached no shard)."""
        return self.clock_base + (self._push_seq if self._exchanges is not None else self.local_step)

    def _log_placement(self) -> None:
        if self.task.is_chief:
            print(self.placement.format_table(), flush=True)
        super()._log_placement()

    # -- readiness -------------------------------------------------------------------------
    def plan_steps(self, *, stop_at: int | None = None, snapshot_every: int | None = None, data: Any = None) -> None:
        """Exact step arithmetic, done by the ps (the Supervisor calls this before ``prepare``).

        Args:
            stop_at: chief: the ps apply no update past this global step (``max_steps``).
            snapshot_every: chief: the ps keep their state at every multiple of this step, so a
                step-based checkpoint holds exactly that many updates.
            data: this worker's batch iterator (``state_dict()``); its position after each batch is
                sent with the batch's gradients, and checkpoints keep it.
        """
        self.step_plan = StepPlan(stop_at, snapshot_every)
        self.data_source = data

    def restore_from(
        self, step: int, tensors: Mapping[str, torch.Tensor], *, data_positions: Mapping[str, Any] | None = None
    ) -> None:
        """Make the chief initialize the ps from a checkpoint instead of the model's own values.

        Args:
            step: the global step to resume at.
            tensors: whole (unsplit) tensors by parameter name, plus optional optimizer slots
                ``opt/<param>/<slot>`` and moving averages ``ema/<param>``. The current placement
                splits them, so a checkpoint restores into any number of ps.
            data_positions: every worker's data position by replica index (``"0"``, ``"1"``...);
                each worker gets its own back in :attr:`ready_info`.

        Raises:
            ConfigError: the checkpoint lacks some of the model's parameters.
        """
        super().restore_from(step, tensors)
        self._restored_positions = data_positions

    def ps_initialized(self) -> bool:
        """Whether every ps shard holds the job's parameters already (asked with PS_STATUS): what a
        restarted chief finds. Once True it stays True, and is not asked again."""
        if not self._ps_initialized:
            self.flush()
            self._ps_initialized = all(bool(s.get("initialized")) for s in self.client.status())
        return self._ps_initialized

    def prepare(self) -> int:
        """Chief: initialize the ps shards, unless every one already is (a restarted chief takes
        over). Others: wait until they are. Returns the global step."""
        if self._ready:
            return self.global_step
        if self.task.is_chief and not self.ps_initialized():
            # Shards that an earlier attempt initialized before it died ignore this (the first wins).
            self._initialize()
        info = self.client.wait_ready(self.digest, self.config.ready_timeout_s, worker=self.worker, attempt=self.attempt)
        self.ready_info = info
        self.chief_logdir = (info.get("meta") or {}).get("logdir") or None
        self.clock_base = int(info.get("clock", 0))
        self.global_step = int(info["version"])
        self.versions = self.client.pull(self._dests)
        self._ready = True
        return self.global_step

    def _initialize(self) -> None:
        step, source = 0, {n: p.detach() for n, p in self.params.items()}
        if self._restore is not None:
            step, source = self._restore
        state_of: dict[str, list[tuple[StateKey, torch.Tensor]]] = {}  # parameter -> its slots and average
        for k, v in source.items():
            key = parse_key(k)
            if key.kind != "value":
                state_of.setdefault(key.name, []).append((key, v))
        per_shard = []
        for s in range(self.task.num_ps):
            values: dict[str, torch.Tensor] = {}
            for pc in self.placement.pieces_on(s):
                full = source[pc.param]
                values[pc.key] = split_tensor(full, pc).contiguous()
                for key, v in state_of.get(pc.param, ()):
                    # Slots shaped like the parameter are split like it; scalars (Adam's step) are shared.
                    piece = split_tensor(v, pc).contiguous() if tuple(v.shape) == tuple(full.shape) else v
                    values[key.renamed(pc.key).key] = piece
            per_shard.append(values)
        meta = {
            "optimizer": self.optimizer.to_dict(),
            "config": self.config.to_dict(),
            "placement_digest": self.digest,
            "version": step,
            "schedule": self.schedule.to_dict() if self.schedule else None,
            "ema_decay": self.ema_decay,
            "meta": {"placement": self.placement.to_dict(), "logdir": self.chief_logdir},  # every task's readiness reply has it
            "step_plan": self.step_plan.to_dict(),
            "data_positions": dict(self._restored_positions or {}),
        }
        self.client.initialize(per_shard, meta)

    # -- the step --------------------------------------------------------------------------
    def step(
        self,
        closure: Callable[..., torch.Tensor],
        *,
        batch: Batch | torch.Tensor | None = None,
        batches: Sequence[Batch | torch.Tensor] | None = None,
        batch_size: int | None = None,
    ) -> float:
        """One training step. ``closure`` runs the forward pass and returns the loss.

        Args:
            closure: with ``batch=``, ``closure(model, *batch)`` (the same line runs on one device or
                split across ``devices``); without, ``closure()`` using the model directly.
            batch: the step's batch, e.g. ``(x, y)``.
            batches: with ``devices``, one batch per device instead of one split batch.
            batch_size: examples in the step, for the throughput figures (default: from the batch).

        Returns the loss as a float. Afterwards the model holds the newest values from the ps.
        """
        t0 = self._begin_step()
        tl = timeline.ACTIVE  # None unless psflow run --timeline: then each phase is a span
        ts = tl.now() if tl is not None else 0.0
        if self._reply_buffers is not None:
            return self._pipelined_step(t0, tl, closure, batch, batches, batch_size)
        # After pull(averages=True) the model holds averages, not values to compute from.
        if self.mode.before_compute(self) or self._holds_averages:
            self._pull_values(tl)
        value, sent = self._compute_and_push(closure, batch, batches, tl)
        with self.mode.awaiting_replies(self):
            replies = self.client.recv_push_replies(range(self.task.num_ps), self._dests)
        early, self._late = len(sent - self._late), set()
        applied = self._settle(replies, early)
        if tl is not None:
            tl.add("step", f"step {self.local_step}", ts, tl.now(), global_step=self.global_step)
        if applied:
            self._end_step(t0, value, batch_size, batch, batches)
        return value

    def _pull_values(self, tl: timeline.Timeline | None) -> None:
        start = tl.now() if tl is not None else 0.0
        self.versions = self.client.pull(self._dests)
        self._holds_averages = False
        if tl is not None:
            tl.add("pull", "pull", start, tl.now())

    # -- the async pipeline (TrainConfig.pipeline; psflow.train.pipeline) ------------------------
    def _pipelined_step(self, t0: float, tl: timeline.Timeline | None, closure: Callable[..., torch.Tensor],
                        batch: Batch | torch.Tensor | None, batches: Sequence[Batch | torch.Tensor] | None,
                        batch_size: int | None) -> float:
        """Land the values of the step before the last, compute this step from them, queue its
        pushes and their replies on the pipeline's threads, and return (the replies land at a later step)."""
        ts = tl.now() if tl is not None else 0.0
        # The previous step stays in flight: this one overlaps it. A pull goes on the connections
        # the pipeline's threads use, so it waits for every step in flight.
        self._settle_flights(keep=0 if self._holds_averages else 1, tl=tl)
        # With nothing in flight (the first step, after a flush) the connections are idle: the mode
        # asks what a step without the pipeline would (ssp: the bound, and a pull after it).
        if (not self._flights and self.mode.before_compute(self)) or self._holds_averages:
            self._pull_values(tl)
        if self._flights:
            self.pipelined_steps += 1
        assert self._reply_buffers is not None and self._exchanges is not None
        self._buffer = self._reply_buffers.take()
        gate = self.mode.before_pipelined_push(self)
        if gate is not None:
            self._exchanges.gate(gate)
        value, sent = self._compute_and_push(closure, batch, batches, tl, wait=False)
        early, self._late = len(sent - self._late), set()
        n = batch_size if batch_size is not None else batch_examples(batch, batches)
        replies = self._exchanges.end_step(self.task.num_ps, complete=True)
        self._flights.append(Flight(replies, self._buffer, early, t0, time.perf_counter(), value, n))
        if tl is not None:
            tl.add("step", f"step {self.local_step}", ts, tl.now(), global_step=self.global_step, pipelined=True)
        return value

    def _receive_reply(self, shard: int, buffer: int) -> dict[str, Any]:
        """The reply to ``shard``'s push, its values into reply buffer ``buffer`` (the reply thread)."""
        assert self._reply_buffers is not None
        return self.client.recv_push_replies([shard], self._reply_buffers[buffer])[0]

    def _settle_flights(self, *, keep: int = 0, tl: timeline.Timeline | None = None) -> None:
        """Wait for the steps in flight but the last ``keep``, oldest first: land each one's values
        in the model and count it. A failed one: wait for the rest (the sends queued after it are
        skipped), land none, and raise its error."""
        start = tl.now() if tl is not None else 0.0
        while len(self._flights) > keep:
            flight = self._flights.pop(0)
            try:
                replies = flight.replies.result()
            except BaseException:
                for later in self._flights:
                    later.replies.exception()  # done soon: its sends are skipped
                self._flights.clear()
                assert self._exchanges is not None
                self._exchanges.reset()
                raise
            if replies is None:
                continue  # its compute failed (raised then); the shards it reached were drained
            assert self._reply_buffers is not None
            self._reply_buffers.land(flight.buffer, self._dests)
            if self._settle(replies, flight.early):
                self._end_step(flight.t0, flight.loss, flight.examples, None, None, end=flight.end)
        if tl is not None:
            tl.add("wait", "wait (pipeline: the step before the last)", start, tl.now())

    def flush(self) -> int:
        """Wait for the steps still in flight (``pipeline``) and land the newest values in the
        model, as a step without the pipeline leaves it. Raises the first failure among them.
        Returns the global step. Nothing to do without the pipeline."""
        self._settle_flights()
        return self.global_step

    def _compute_and_push(self, closure: Callable[..., torch.Tensor], batch: Batch | torch.Tensor | None,
                          batches: Sequence[Batch | torch.Tensor] | None,
                          tl: timeline.Timeline | None, *, wait: bool = True) -> tuple[float, set[int]]:
        """Forward and backward, and the gradients' half of the step's one round trip per shard.
        Returns the loss and the shards sent to. ``wait`` False (the pipeline): the sends are queued,
        not waited for; on an error the replies of the shards sent are read on the reply thread.

        A shard's gradients leave as soon as backward has produced all of them (see _on_grad), on
        the sender's thread (:mod:`psflow.train.sender`), so the transfer to one shard overlaps the
        backward pass of the layers that live on the others.
        """
        t1 = time.perf_counter()
        for p in self.params.values():
            p.grad = None
        if self.towers is not None:
            self.towers.refresh()  # the replicas compute from the values the model holds now
        self._sent = set()
        self._remaining = {s: set(names) for s, names in self._shard_params.items()}
        self._push_seq += 1
        self._position = None  # read at this step's first push (a closure may draw its batch itself)
        if self._ledger is not None:
            self._ledger.step_sent()
        try:
            if tl is None:
                value = run_step_closure(closure, self.model, towers=self.towers, batch=batch, batches=batches)
            else:
                value = self._timed_compute(tl, closure, batch, batches)
            self.compute_s += time.perf_counter() - t1
            for shard in [*range(1, self.task.num_ps), 0]:  # shard 0 (the data position) last
                if shard not in self._sent:
                    self._send_shard(shard)
            if wait:
                self._join_sends(tl)
        except BaseException:
            if not wait:  # the pipeline: the replies of the shards it reached are read on the reply thread
                self._sent, self._late = None, set()
                assert self._exchanges is not None
                now = time.perf_counter()
                self._flights.append(Flight(self._exchanges.end_step(self.task.num_ps, complete=False), self._buffer,
                                            0, now, now, 0.0, None))
                raise
            self._join_sends(None, quiet=True)
            self._drain_sent()
            raise
        sent, self._sent = self._sent, None
        return value, sent

    def _settle(self, replies: Sequence[Mapping[str, Any]], early: int) -> bool:
        """Take in the step's replies (the values are in the model already) and its count of pushes
        sent during backward. Returns whether the job applied the step, so that it counts as one."""
        self.early_pushes += early
        self.versions = [int(r["version"]) for r in replies]
        if replies[0].get("stale"):
            self.stale_pushes += 1
        self.global_step = self.versions[0]
        if replies[0].get("stopped"):
            # The job reached its stop step before this batch: nothing of it was applied or counted.
            self.stopped = True
            return False
        if self._ledger is not None and replies[0].get("applied"):
            self._ledger.acknowledged_push()
        refused = [(s, r) for s, r in enumerate(replies) if r.get("refused")]
        if refused:
            self._refused(refused)  # not a step the job applied: not counted as one
            return False
        return True

    def _refused(self, refused: list[tuple[int, Mapping[str, Any]]]) -> None:
        """A shard refused this step's gradient (it held NaN or inf; nonfinite = refuse): count it,
        say so once, go on with the next batch (sync: for the same step, which still waits for this
        worker). The ps fails the run if it goes on for ``nonfinite_limit`` pushes in a row."""
        self.refused_pushes += 1
        if self.refused_pushes > 1:
            return
        shards = ", ".join(f"ps:{s} ({', '.join(map(str, r.get('nonfinite_keys', [])))})" for s, r in refused)
        log.warning("%s: the gradient of step %d held NaN or inf, and the ps refused it (%s): not applied; training "
                    "goes on with the next batch (nonfinite = refuse). Later refusals are counted (refused_pushes), not "
                    "logged; %d in a row fail the run.", self.task.task_id, self.global_step, shards,
                    self.config.nonfinite_limit)

    def _grads(self, shard: int) -> list[tuple[str, torch.Tensor]]:
        out = []
        for pc in self.placement.pieces_on(shard):
            p = self.params[pc.param]
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out.append((pc.key, split_tensor(g, pc).contiguous()))
        return out

    # -- overlap: send a shard's gradients as soon as backward has produced them --------------
    def _install_grad_hooks(self) -> None:
        self._shard_params = {s: {pc.param for pc in self.placement.pieces_on(s)} for s in range(self.task.num_ps)}
        self._param_shards: dict[str, list[int]] = {}
        for s, names in self._shard_params.items():
            for n in names:
                self._param_shards.setdefault(n, []).append(s)
        self._sent: set[int] | None = None
        self._remaining: dict[int, set[str]] = {}
        self._late: set[int] = set()
        # Sends each push on a thread of its own (PushSender(threaded=False): on this one, the A/B reference).
        self.sender = PushSender(f"psflow-push-{self.task.task_id}")
        self._exchanges = (Exchanges(f"psflow-push-{self.task.task_id}", self._receive_reply)
                           if self.config.pipeline else None)
        self.early_pushes = 0
        if self.towers is not None:
            return  # towers average onto the master's .grad after backward: nothing to overlap with
        for name, p in self.params.items():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _p, name=name: self._on_grad(name))

    def _on_grad(self, name: str) -> None:
        if self._sent is None:
            return  # a backward outside step(): nothing to send
        for shard in self._param_shards.get(name, ()):
            left = self._remaining[shard]
            left.discard(name)
            if not left and shard not in self._sent and shard != 0:
                self._send_early(shard)
        # Shard 0 records the worker's data position: it goes once every other shard has its push,
        # so a batch it recorded is never missing from another shard (see the module docstring).
        if 0 not in self._sent and not self._remaining.get(0) and len(self._sent) == self.task.num_ps - 1:
            self._send_early(0)

    def _send_early(self, shard: int) -> None:
        # "early" only when backward still owes another shard gradients: that is the overlap
        early = any(self._remaining[t] for t in self._remaining if t != shard)
        self._send_shard(shard, during_backward=early)

    def _send_shard(self, shard: int, *, during_backward: bool = False) -> None:
        assert self._sent is not None
        if self._position is None and self.data_source is not None:
            # Every shard records the worker's data position (the iterator has moved past this batch):
            # shard 0's is where a restarted worker resumes, the others' recognise a batch redone.
            self._position = self.data_source.state_dict()
        version, grads, position, seq = self.versions[shard], self._grads(shard), self._position, self._push_seq

        def send() -> None:
            tl = timeline.ACTIVE
            start = tl.now() if tl is not None else 0.0
            self.client.send_push(shard, self.worker, version, grads, wait_s=self.config.sync_timeout_s,
                                  position=position, attempt=self.attempt, seq=seq)
            if tl is not None:
                tl.add("push", f"push ps:{shard}", start, tl.now(), during_backward=during_backward)

        if self._exchanges is not None:  # the pipeline: sent and answered on its threads
            self._exchanges.send(shard, send, self._buffer)
        else:
            self.sender.submit(shard, send, beside_compute=during_backward)
        self._sent.add(shard)
        if not during_backward:
            self._late.add(shard)

    def _join_sends(self, tl: timeline.Timeline | None, *, quiet: bool = False) -> None:
        """Wait until the step's pushes are out (the training thread's share of the sending: a
        ``push`` span, ``sending``); a shard whose push failed is not sent. Raises the first
        failure unless ``quiet`` (a step that fails anyway)."""
        start = tl.now() if tl is not None else 0.0
        failed, error = self.sender.join()
        if self._sent is not None:
            self._sent -= failed
        self._late -= failed
        if tl is not None:
            tl.add("push", "push: sending", start, tl.now())
        if error is not None and not quiet:
            raise error

    def _drain_sent(self) -> None:
        """The step failed after some shards got their gradients: read those replies so the
        connections stay in step. If even that fails, a client that reconnects has already
        forgotten the lost connections (the others are in step) and stays usable; one that does
        not is closed."""
        sent, self._sent = self._sent or set(), None
        self._late.clear()
        try:
            self.client.recv_push_replies(sorted(sent), self._dests)
        except PsflowError:
            if not self.client.reconnects:
                self.client.close()

    def pull(self, *, averages: bool = False) -> int:
        """Load the newest ps values (or their moving averages) into the model. Returns the global step."""
        self.prepare()
        self.flush()
        versions = self.client.pull(self._dests, averages=averages)
        self._holds_averages = averages  # then the next step() pulls the values to compute from
        if not averages:
            self.versions = versions
        self.global_step = versions[0]
        return self.global_step

    # -- what the Supervisor needs (AllReduceTrainer offers the same) ---------------------------
    def save_shards(self, root: str, step: int, *, exact: bool = False) -> list[dict[str, Any]]:
        """Every ps writes its own shard of checkpoint ``step`` under ``root`` (in parallel; no
        parameter passes through this task). With ``exact``, each writes the state it held when it
        reached ``step`` (see :class:`psflow.ps.progress.StepPlan`), else its state now.
        Returns each shard's ``{"record", "version", "data_positions"}``."""
        self.flush()
        return self.client.save({"root": root, "step": step, "num_shards": self.task.num_ps, "exact": exact,
                                 "timeout_s": self.config.sync_timeout_s})

    def job_step(self) -> int:
        """The job's global step now (shard 0's version), not just as of this worker's last push."""
        self.flush()
        return int(self.client.status()[0]["version"])

    def job_status(self) -> Mapping[str, Any]:
        """Shard 0's PS_STATUS: the job's version, its members now, the done and the lost workers."""
        self.flush()  # the request goes on the connections the pipeline's steps use
        return self.client.status()[0]

    def stop_reconnecting(self, reason: str) -> None:
        self.client.stop_reason = reason

    def stats(self) -> dict[str, Any]:
        sent, received = self.client.traffic()
        return {**super().stats(), "stale_pushes": self.stale_pushes, "refused_pushes": self.refused_pushes,
                "early_pushes": self.early_pushes, "mode": self.mode.name,
                "pipelined_steps": self.pipelined_steps, "pipeline_staleness": int(self.config.pipeline),
                "compress": self.config.compress, "bytes_sent": sent, "bytes_received": received}

    def end_training(self) -> None:
        """PS_DONE that says this worker stays: the ps count it done for every step from now on
        (sync quorum, ssp bound) and serve it until :meth:`close` sends the last PS_DONE."""
        if self._ready and not self._closed:
            self.flush()
            self.client.done(self.worker, attempt=self.attempt, stays=True)

    def _release(self) -> None:
        """Tell the ps this worker is done (they exit when every worker is) and disconnect. Steps
        still in flight (``pipeline``) are waited for first; a failure among them is raised after
        the ps were told of it (unless the task is stopping on an error already: that one stands)."""
        in_flight: BaseException | None = None
        try:
            self.flush()
        except BaseException as e:  # noqa: BLE001 -- raised below, once the ps know
            if self.failure is None:
                in_flight, self.failure = e, errorreport.one_line(e)
        try:
            # A chief that never initialized the ps says nothing when it ends normally (nothing trained);
            # one that stopped on an error says so: the ps then wait for it (a restart) or give up naming it.
            if self._ready or not self.task.is_chief or self.failure is not None:
                self.client.done(self.worker, attempt=self.attempt, failed=self.failure)
        finally:
            self.sender.close()
            if self._exchanges is not None:
                self._exchanges.close()
            self.client.close()
            if self._ledger is not None:
                self._ledger.close()
        if in_flight is not None:
            raise in_flight
