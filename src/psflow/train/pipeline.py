"""The async one-step pipeline (``TrainConfig.pipeline``): step t+1 computes while step t travels.

Without it a worker's step is compute, then every shard's push, then the replies (the values after
the update): on 100 Mbit/s links the CNN computes ~0.1-0.3 s and then waits ~0.86 s for its bytes,
and the links idle while it computes. With it, ``step()`` returns once its pushes are queued on the
push thread (:mod:`psflow.train.sender`), whose replies land in one of two reply buffers instead of
the model. The next step first waits for the step before the last one (step t-1 at step t+1),
copies those values into the model and computes from them: a worker's step costs about
max(compute, transfer) instead of their sum. Two threads carry the steps (:class:`Exchanges`):
one sends, one reads replies; two pushes in flight per connection, so a ps has a worker's next
push at hand while its reply to the last one travels.

The price is staleness: step t+1 computes from values that lack this worker's own update t (one
step; the other workers' updates as in any async step), counted in the stats (``pipelined_steps``,
``pipeline_staleness``). A sync step waits for the quorum by definition: ``TrainConfig`` refuses it.

Under ssp the bound keeps its meaning (step c computes from values holding every worker's steps
before c - s) with the pipeline's steps counted: step c computes from step c - 2's reply, so the
push thread reports clock c - 2 once the replies before are in and sends that push once c is within
s of the slowest clock (:meth:`Exchanges.gate`; ``ahead`` in :mod:`psflow.ps.rules`). A worker held
there computes one more step and waits, so its lead stays <= s; s must be >= 2 (docs/performance.md).

What stays as without it: each push is applied once and in order (a connection carries them in
order, and one made again carries every push still unanswered, oldest first, which the ps
deduplicates by ``seq``: :mod:`psflow.ps.client`); shard 0, which records the data position, goes last in each step; a
failed send or reply is raised on the training thread at the next step (or flush), and the steps
queued behind it are not sent. After ``step()`` the model holds the values of the
step before, not its own update; :meth:`Trainer.flush` (and ``pull``, checkpoints,
``end_training``, ``close``) waits for every step in flight and lands the newest values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from psflow.train.sender import NotSent

Replies = list[dict[str, Any]] | None  # None: a step whose compute failed (its sent shards were only drained)


@dataclass(frozen=True)
class Flight:
    """One step whose pushes are queued and whose replies land in reply buffer ``buffer``."""

    replies: Future[Replies]
    buffer: int
    early: int  # pushes that left during backward
    t0: float  # the step's start and end on the training thread (perf_counter)
    end: float
    loss: float
    examples: int | None


class ReplyBuffers:
    """Two copies of the values a trainer receives (shaped like its ``dests``), used in turn."""

    def __init__(self, dests: Sequence[Mapping[str, torch.Tensor]]) -> None:
        self._bufs = [[{k: torch.empty_like(v, memory_format=torch.contiguous_format) for k, v in d.items()}
                       for d in dests] for _ in range(2)]
        self._next = 0

    def take(self) -> int:
        """The buffer for the next step's replies (the other one may still be landing)."""
        i, self._next = self._next, 1 - self._next
        return i

    def __getitem__(self, i: int) -> list[dict[str, torch.Tensor]]:
        return self._bufs[i]

    def land(self, i: int, dests: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Copy buffer ``i``'s values into ``dests`` (the model's own tensors)."""
        for buf, dest in zip(self._bufs[i], dests):
            for k, t in dest.items():
                t.copy_(buf[k])


class Exchanges:
    """The pipeline's two threads: one sends each step's pushes in the order given (a shard's push
    once the reply before its last is in), one reads each push's reply in the order sent.

    Args:
        name: the threads' name prefix (stacks, the timeline).
        receive: reads shard's reply into the step's reply buffer; returns the reply's meta.
    """

    def __init__(self, name: str, receive: Callable[[int, int], dict[str, Any]]) -> None:
        self._receive = receive
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-send")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-reply")
        self._last_reply: dict[int, Future[dict[str, Any]]] = {}  # shard -> its latest push's reply
        self._before_last: dict[int, Future[dict[str, Any]]] = {}  # shard -> the reply to the push before
        self._step: dict[int, Future[dict[str, Any]]] = {}  # this step's replies by shard
        self._gate: Future[None] | None = None  # this step's gate (ssp: its clock), before its sends
        self._failed = False  # a send or reply failed: later sends are skipped until reset()

    def send(self, shard: int, send: Callable[[], None], buffer: int) -> None:
        """Queue one shard's push of this step (``send``) and the reading of its reply into ``buffer``.
        It leaves once the reply to the shard's push before the last is in: two pushes in flight per
        connection, so the ps has the next push at hand while its reply to the last one travels."""
        before_last = self._before_last.get(shard)
        sent = self._sender.submit(self._send, before_last, send)
        reply = self._reader.submit(self._read, sent, shard, buffer)
        if shard in self._last_reply:
            self._before_last[shard] = self._last_reply[shard]
        self._last_reply[shard] = self._step[shard] = reply

    def gate(self, call: Callable[[], None]) -> None:
        """Queue ``call`` before this step's sends: it runs on the send thread once every shard's last
        reply is in (the connections are idle: ``call`` may use them). Its failure skips the step's
        sends and is raised at the step's end."""
        self._gate = self._sender.submit(self._pass_gate, list(self._last_reply.values()), call)

    def _pass_gate(self, previous: Sequence[Future[dict[str, Any]]], call: Callable[[], None]) -> None:
        for reply in previous:
            reply.exception()
        self._send(None, call)

    def _send(self, previous: Future[dict[str, Any]] | None, send: Callable[[], None]) -> None:
        if previous is not None:
            previous.exception()  # at most two pushes in flight per connection (a failure sets _failed)
        if self._failed:
            raise NotSent("an earlier push or reply failed")
        try:
            send()
        except BaseException:
            self._failed = True
            raise

    def _read(self, sent: Future[None], shard: int, buffer: int) -> dict[str, Any]:
        sent.result()  # raises the send's failure: there is no reply to read
        try:
            return self._receive(shard, buffer)
        except BaseException:
            self._failed = True
            raise

    def end_step(self, num_shards: int, *, complete: bool) -> Future[Replies]:
        """This step's replies, shard by shard, once all are read. ``complete`` False (the step's
        compute failed): None once the shards it reached answered. Raises the step's first failure."""
        replies, self._step = self._step, {}
        gate, self._gate = self._gate, None
        return self._reader.submit(_gather, replies, num_shards, complete, gate)

    def reset(self) -> None:
        """The caller has taken the failure: later sends go out again."""
        self._failed = False

    def close(self) -> None:
        self._sender.shutdown(wait=True)
        self._reader.shutdown(wait=True)


def _gather(replies: Mapping[int, Future[dict[str, Any]]], num_shards: int, complete: bool,
            gate: Future[None] | None) -> Replies:
    """Every shard's reply meta in shard order (each future is done: it ran before on this thread;
    the step's gate ran before its sends, or is waited for where the step sent nothing)."""
    futures = [*([gate] if gate is not None else []), *replies.values()]
    errors = [e for f in futures if (e := f.exception()) is not None]
    first = next((e for e in errors if not isinstance(e, NotSent)), errors[0] if errors else None)
    if first is not None:
        raise first
    if not complete or len(replies) < num_shards:
        return None
    return [replies[s].result() for s in range(num_shards)]
