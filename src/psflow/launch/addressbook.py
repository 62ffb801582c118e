"""The run's address book: where each task of the run listens now, under a version number.

Pure data and rules: no I/O, no threads, no clock. The coordinator (``launch/coordinator.py``)
holds one under its lock and answers the wire with it; tests step it by hand.

State: the run's ``expected`` tasks (in plan order); one :class:`Entry` (address, pid, attempt) per
task that has registered; ``version``, which goes up by one with every registration.

Transitions::

    register(task never seen)  -> "registered"    its entry is added
    register(task seen before) -> "reregistered"  a restart: its entry is replaced (the previous one is returned)
    assembling (missing() not empty) --last missing task registers--> complete

The first round is complete once every expected task has registered once; a complete book stays
complete (entries are replaced, never removed), so a task that registers after the first round is
answered at once with the current cluster. Readers compare ``version`` to know whether anything
moved since they last looked.

Membership (``psflow scale``): :meth:`AddressBook.scale` replaces the expected tasks (workers added
or retired); a retired task's entry is removed, an added one is awaited like a first-round task (a
registration is answered once every expected task has registered). :meth:`AddressBook.members` is
what a ps reads to learn the membership: the training replicas now and at launch, and a version that
goes up with every scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psflow.errors import ClusterError, ConfigError

REGISTERED = "registered"
REREGISTERED = "reregistered"


@dataclass(frozen=True)
class Entry:
    """One task's registration: where it listens, its process and attempt, and the book's version it was written at."""

    address: str
    pid: int
    attempt: int
    version: int

    def to_dict(self) -> dict[str, Any]:
        return {"address": self.address, "pid": self.pid, "attempt": self.attempt, "version": self.version}


@dataclass(frozen=True)
class Registration:
    """What one registration did: ``kind`` is REGISTERED or REREGISTERED; ``previous`` the entry it replaced."""

    task: str
    kind: str
    entry: Entry
    previous: Entry | None
    complete: bool


class AddressBook:
    """Addresses of the ``expected`` tasks of one run, as they register and re-register."""

    def __init__(self, expected: Sequence[str]) -> None:
        if len(set(expected)) != len(expected):
            raise ConfigError(f"The expected tasks must be distinct. Received: {list(expected)}.")
        self.expected = list(expected)
        self.version = 0
        self._entries: dict[str, Entry] = {}
        self.launch_replicas = _replicas(self.expected)
        self.members_version = 0

    def scale(self, expected: Sequence[str]) -> list[str]:
        """The run's tasks are ``expected`` now (workers added or retired by ``psflow scale``).
        Returns the tasks retired (their entries removed)."""
        if len(set(expected)) != len(expected):
            raise ConfigError(f"The expected tasks must be distinct. Received: {list(expected)}.")
        retired = [t for t in self.expected if t not in expected]
        for t in retired:
            self._entries.pop(t, None)
        self.expected = list(expected)
        self.version += 1
        self.members_version += 1
        return retired

    def members(self) -> dict[str, int]:
        """``{"replicas": R, "launch_replicas": R0, "version": v}``: the training replicas (chief and
        workers) now and at launch; ``version`` goes up with every :meth:`scale`."""
        return {"replicas": _replicas(self.expected), "launch_replicas": self.launch_replicas,
                "version": self.members_version}

    def register(self, task: str, address: str, *, pid: int = 0, attempt: int | None = None) -> Registration:
        """Record that ``task`` listens at ``address`` now, replacing what it registered before.

        Args:
            task: an expected task, e.g. "ps:0".
            address: where it listens, "host:port".
            pid: its process id (0: unknown).
            attempt: its attempt number as the launcher counts them; None counts registrations
                (0 for the first, one more for each re-registration).

        Raises:
            ConfigError: ``task`` is not part of this run, or ``address`` is empty.
        """
        self._check_expected(task)
        if not address:
            raise ConfigError(f"Task {task} registered without an address. Received: {address!r}. It must send its host:port.")
        previous = self._entries.get(task)
        if attempt is None:
            attempt = previous.attempt + 1 if previous is not None else 0
        self.version += 1
        entry = Entry(address=address, pid=int(pid), attempt=int(attempt), version=self.version)
        self._entries[task] = entry
        kind = REGISTERED if previous is None else REREGISTERED
        return Registration(task=task, kind=kind, entry=entry, previous=previous, complete=self.is_complete)

    def resolve(self, task: str) -> Entry:
        """The current entry of ``task``.

        Raises:
            ConfigError: ``task`` is not part of this run.
            ClusterError: ``task`` has not registered yet.
        """
        self._check_expected(task)
        entry = self._entries.get(task)
        if entry is None:
            raise ClusterError(f"Task {task} has not registered with the launcher yet (book version {self.version}); "
                               "ask again once it has started.")
        return entry

    def missing(self) -> list[str]:
        """The expected tasks that have never registered, in plan order."""
        return [t for t in self.expected if t not in self._entries]

    @property
    def is_complete(self) -> bool:
        """Every expected task has registered at least once (the first round is over)."""
        return len(self._entries) == len(self.expected)

    def behind(self, attempt: int, members: Sequence[str]) -> list[str]:
        """The ``members`` that have not registered ``attempt`` (or a later one) yet: a group that
        restarts together meets again once this is empty (see ``Coordinator(rounds=...)``)."""
        return [t for t in members if t not in self._entries or self._entries[t].attempt < attempt]

    def addresses(self) -> dict[str, str]:
        """task -> its current address, for the tasks that have registered."""
        return {t: e.address for t, e in self._entries.items()}

    def pids(self) -> dict[str, int]:
        return {t: e.pid for t, e in self._entries.items()}

    def cluster_dict(self) -> dict[str, list[str]]:
        """job -> its tasks' current addresses in index order (a ClusterSpec's dict).

        Raises:
            ClusterError: some expected task has not registered yet.
        """
        missing = self.missing()
        if missing:
            raise ClusterError(f"The cluster is not assembled yet: {', '.join(missing)} never registered.")
        jobs: dict[str, list[str]] = {}
        for t in self.expected:
            jobs.setdefault(t.split(":")[0], []).append(self._entries[t].address)
        return jobs

    def snapshot(self) -> dict[str, Any]:
        """The whole book as plain data: ``{"version": v, "tasks": {task: entry dict}}``."""
        return {"version": self.version, "tasks": {t: e.to_dict() for t, e in self._entries.items()},
                "members": self.members()}

    def _check_expected(self, task: str) -> None:
        if task not in self.expected:
            raise ConfigError(f"Task {task!r} is not part of this run; expected one of {self.expected}.")


def _replicas(tasks: Sequence[str]) -> int:
    return sum(1 for t in tasks if t.split(":")[0] in ("chief", "worker"))
