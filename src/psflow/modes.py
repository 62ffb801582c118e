"""The update modes (async, sync, ssp): their names, and what a ps does differently in each.

:class:`Mode` is the value of ``TrainConfig.mode``. :class:`PsMode` is a mode's side on the ps, as
small strategy objects (``Mode.SYNC.ps`` ...): the ps's rules (:mod:`psflow.ps.rules`) and its store
ask them at the points where the modes differ and never test the mode's name. A worker's side is in
:mod:`psflow.train.modes` (the ps never imports train/).

- async: each pushed gradient is applied when it arrives; a pull reads the values in place (Hogwild);
- sync:  a push is held until ``replicas_to_aggregate`` gradients of its step are in, then their
         average is applied once; a push-pull's reply waits for its step;
- ssp:   each push is applied when it arrives, and each worker's clock is kept so that none runs
         more than ``staleness`` steps ahead of the slowest.

Pure: no torch, no I/O; imported by psflow.config.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Mode(StrEnum):
    """An update mode; equal to its name as text (``Mode.SYNC == "sync"``)."""

    ASYNC = "async"
    SYNC = "sync"
    SSP = "ssp"

    def __repr__(self) -> str:
        # reads as the text users write (TrainConfig(mode='sync', ...), messages that show mode=...)
        return repr(self.value)

    @property
    def ps(self) -> PsMode:
        """What the ps does in this mode."""
        return _PS[self]


@dataclass(frozen=True)
class PsMode:
    """One mode's rules on the ps."""

    mode: Mode
    # A push is applied when it arrives (async, ssp). Otherwise (sync) it is held until its step's
    # quorum is in, and the step is applied once: a push-pull's reply waits for it, and a worker
    # that leaves may complete the step it held back.
    applies_each_push: bool
    # Each worker's clock is kept and bounds how far the others may run ahead (ssp).
    keeps_clocks: bool = False
    # A pull reads the values without a copy, as TensorFlow's default (use_locking=False) (async).
    reads_in_place: bool = False

    @property
    def waits_for_quorum(self) -> bool:
        """A step is applied once its quorum of gradients is in (sync)."""
        return not self.applies_each_push


_PS = {
    Mode.ASYNC: PsMode(Mode.ASYNC, applies_each_push=True, reads_in_place=True),
    Mode.SYNC: PsMode(Mode.SYNC, applies_each_push=False),
    Mode.SSP: PsMode(Mode.SSP, applies_each_push=True, keeps_clocks=True),
}
