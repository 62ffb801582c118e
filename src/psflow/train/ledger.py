"""The push ledger: what one worker attempt sent and was acknowledged, kept where a SIGKILL cannot erase it.

The worker half of the Jepsen-style ledger that ``psflow chaos`` checks (the ps half is
:attr:`psflow.ps.store.StoreStats.applied_by`, the pushes each attempt had applied). With
``TrainConfig.push_ledger`` on, each trainer attempt owns one file, ``LOGDIR/ledger/<task>.<attempt>``,
holding one fixed-width line ``worker attempt sent acknowledged``, rewritten in place (one
``pwrite``) when a step starts (``sent``: the steps this attempt computed and began to push) and when
shard 0's reply arrives (``acknowledged``: pushes the ps answered as applied). A process killed at
any point leaves the last complete line: the kernel keeps a finished write, and a write of one short
line is never seen half done by a reader after the writer died.

A push is *lost* when its attempt was acknowledged more pushes than shard 0 applied for it; *redone*
when it was sent and never applied (its batch is taken again from the last applied data position).

Written by :class:`psflow.train.trainer.Trainer`; read by :func:`read_ledgers` (``psflow chaos``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from psflow.rundir import RunDir, task_of_stem

_WIDTH = 12  # digits per counter: a line keeps its length, so an in-place rewrite never leaves a tail


@dataclass(frozen=True)
class LedgerEntry:
    """One attempt's counts: ``task`` (``worker:1``), its replica index ``worker`` and ``attempt``."""

    task: str
    worker: int
    attempt: int
    sent: int
    acknowledged: int


class PushLedger:
    """The ledger file of one trainer attempt under ``logdir`` (created at once, with zero counts)."""

    def __init__(self, logdir: str | Path, task: str, worker: int, attempt: int) -> None:
        self.path = RunDir(logdir).ledger_of(task, attempt)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.worker, self.attempt = worker, attempt
        self.sent = self.acknowledged = 0
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._write()

    def step_sent(self) -> None:
        """A step's pushes are about to leave (its gradient may be applied even if no reply comes)."""
        self.sent += 1
        self._write()

    def acknowledged_push(self) -> None:
        """Shard 0 answered this attempt's push as applied."""
        self.acknowledged += 1
        self._write()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write(self) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, render_line(self.worker, self.attempt, self.sent, self.acknowledged), 0)


def render_line(worker: int, attempt: int, sent: int, acknowledged: int) -> bytes:
    """``b"1 0 000000000012 000000000011\\n"``: one attempt's counts, fixed width."""
    return f"{worker} {attempt} {sent:0{_WIDTH}d} {acknowledged:0{_WIDTH}d}\n".encode()


def read_ledgers(logdir: str | Path) -> list[LedgerEntry]:
    """Every attempt's ledger under ``logdir`` (none if no trainer kept one), sorted by task and attempt.

    Raises:
        ValueError: a ledger file that does not hold one ledger line (names the file and what it holds).
    """
    out = []
    for path in sorted(RunDir(logdir).ledger.glob("*.*")):
        stem, _, attempt_text = path.name.rpartition(".")
        text = path.read_text()
        parts = text.split()
        if len(parts) != 4 or not all(p.isdigit() for p in parts) or not attempt_text.isdigit():
            raise ValueError(f"{path} is not a push ledger (expected 'worker attempt sent acknowledged'); it holds "
                             f"{text[:80]!r}. Remove the file or the run's ledger/ folder and run again.")
        worker, attempt, sent, acked = (int(p) for p in parts)
        out.append(LedgerEntry(task_of_stem(stem), worker, attempt, sent, acked))
    return sorted(out, key=lambda e: (e.task, e.attempt))
