"""The update modes (async, sync, ssp) as strategy objects: what a worker's step does per mode.

The ps apply the update rule (:mod:`psflow.ps.rules`); a worker only follows its protocol. The
trainer (:class:`psflow.train.trainer.Trainer`) and the Supervisor ask the run's mode at the points
where the modes differ and never test its name, as Flower's server loop asks its ``Strategy``:

- async: compute, then push the gradients and receive the updated values in the same round trip.
- sync:  the push is tagged with the version the gradients were computed from; the reply comes once
         that step is applied (N gradients averaged) and carries the next version's values.
- ssp:   before computing step c, report clock c, wait until the slowest worker is within s, then
         pull (the push-pull reply of step c - 1 predates the wait, so it may be staler than s).
         With the pipeline (:mod:`psflow.train.pipeline`) step c computes from the reply to step
         c - 2's push: the push thread reports clock c once step c - 1's replies are in, and sends
         step c's push once c + 2 (the step that computes from its reply) is within s of the slowest.

Each mode is one stateless object, shared by every trainer; :func:`mode_of` picks it by
``TrainConfig.mode`` (a :class:`psflow.modes.Mode`; the ps's side of each mode is there too). This
module imports no torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, ClassVar, Protocol

from psflow import timeline
from psflow.config import PIPELINE_SSP_AHEAD, TrainConfig
from psflow.modes import Mode

if TYPE_CHECKING:
    from psflow.ps.client import PsClient


class ModeHost(Protocol):
    """What a mode reads of the trainer it serves (:class:`psflow.train.trainer.Trainer` is one)."""

    client: PsClient
    config: TrainConfig
    worker: int  # the replica index the ps know this worker by
    attempt: int  # the launcher's restart count
    local_step: int

    @property
    def clock(self) -> int:  # ssp: the clock of the step about to start
        ...

    def waiting(self, what: str) -> AbstractContextManager[None]: ...


class UpdateMode:
    """One update mode's side of a worker's step. The hooks' defaults do nothing (async's protocol):
    a mode overrides only where it differs."""

    name: ClassVar[Mode]  # TrainConfig.mode
    # What a push's reply waits for, in the client's words (its timeline spans name it).
    reply_waits_for: ClassVar[str] = "ps reply"
    # The job's steps wait for each worker (its gradient in sync, its clock in ssp), so a worker that
    # takes no more steps must tell the ps (the Supervisor's chief: Trainer.end_training).
    steps_wait_for_workers: ClassVar[bool] = True

    def before_compute(self, host: ModeHost) -> bool:
        """Before a step's forward pass. Returns whether the model's values must be pulled first
        (the push-pull reply of the last step does not do)."""
        return False

    def awaiting_replies(self, host: ModeHost) -> AbstractContextManager[None]:
        """Around the wait for the step's push replies."""
        return contextlib.nullcontext()

    def before_pipelined_push(self, host: ModeHost) -> Callable[[], None] | None:
        """The pipeline: what the push thread does before it sends the pushes of the step about to
        start (at ``host.clock``), once every reply of the step before is in (None: nothing). Taken
        on the training thread, run on the push thread."""
        return None


class AsyncMode(UpdateMode):
    """Every pushed gradient is applied at once; the reply carries the values after it."""

    name = Mode.ASYNC
    steps_wait_for_workers = False


class SyncMode(UpdateMode):
    """The reply comes once the step is applied, i.e. once the other workers' gradients are in."""

    name = Mode.SYNC
    reply_waits_for = "sync quorum"

    def awaiting_replies(self, host: ModeHost) -> AbstractContextManager[None]:
        # the heartbeats say so, and the launcher's watchdog does not take the quorum for a hang
        return host.waiting("the sync step's quorum")


class SspMode(UpdateMode):
    """No worker runs more than ``staleness`` steps ahead of the slowest."""

    name = Mode.SSP

    def before_compute(self, host: ModeHost) -> bool:
        # The pipeline asks only with nothing in flight (its first step, after a flush): the values
        # pulled now serve this step and the next, which computes while this one travels.
        pipelined = host.config.pipeline
        self._wait(host, host.clock, ahead=1 if pipelined else 0)
        # ssp bounds the staleness of the values a step computes from, and the last reply predates the
        # wait (as the values pulled at prepare() do for the pipeline's next step)
        return host.local_step > 0 or pipelined

    def before_pipelined_push(self, host: ModeHost) -> Callable[[], None]:
        # Step c's reply brings the values step c + 2 computes from: counted against the bound now.
        clock = host.clock
        return lambda: self._wait(host, clock, ahead=PIPELINE_SSP_AHEAD)

    @staticmethod
    def _wait(host: ModeHost, clock: int, *, ahead: int) -> None:
        tl = timeline.ACTIVE
        start = tl.now() if tl is not None else 0.0
        with host.waiting("the ssp staleness bound"):
            host.client.clock(host.worker, clock, host.config.sync_timeout_s, attempt=host.attempt, ahead=ahead)
        if tl is not None:
            tl.add("wait", "wait (ssp bound)", start, tl.now(), clock=clock, ahead=ahead)


MODES: Mapping[Mode, UpdateMode] = {m.name: m for m in (AsyncMode(), SyncMode(), SspMode())}


def mode_of(config: TrainConfig) -> UpdateMode:
    """The strategy object of ``config.mode``.

    Example:
        >>> mode_of(TrainConfig(mode="sync")).reply_waits_for
        'sync quorum'
    """
    return MODES[config.mode]
