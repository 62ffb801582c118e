"""One logdir, one live run: the lock a run holds in its log directory.

Two runs writing into one log directory overwrite each other's logs, events, summary and
checkpoints. So the launcher (:class:`psflow.launch.runner.Runner`, for the run's whole life) and a
chief started by hand (:class:`psflow.supervisor.Supervisor`) hold ``LOGDIR/.psflow.lock``: an
``fcntl.flock`` on it, with its :class:`Holder` (run id, pid, host, since when) written inside. A
second run into that logdir is refused at once (:class:`LogdirInUseError`), naming the holder and
what to do instead.

How a lock is judged (each case, and why: ``docs/design/logdir-lock.md``): the kernel is the judge of
life (a holder killed with SIGKILL leaves its file, not its flock); a flock that lives on in a dead
holder's child is stale and taken over (a new file); a lock held from another host is trusted; a
second short lock (``.psflow.lock.guard``) makes look, judge and take over one step; a process may
take its run's lock again (:func:`hold`); a restart waits for the run it restarts holding the
logdir's one queue place (``.psflow.lock.next``); a URL logdir's lock lies in
``$PSFLOW_HOME/locks/`` (:func:`lock_path`); without ``flock`` the run goes on with a warning.

Pure (tested alone): :class:`Holder`, :func:`is_stale`, :func:`in_use_message`, :func:`lock_path`.
Called by the Runner, ``psflow run``, :mod:`psflow.platform.launching` (URL logdirs, restarts) and
the Supervisor of a chief started by hand.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from psflow.errors import ConfigError

LOCK_FILE = ".psflow.lock"
_GUARD_SUFFIX = ".guard"
_NEXT_SUFFIX = ".next"
_GUARD_WAIT_S = 10.0  # the guard is held for a few system calls; this only bounds a wedged filesystem
_POLL_S = 0.1
BY_HAND = "chief started by hand"  # the role of a Supervisor's lock (no launcher)
_WAITING = "restart waiting for "  # the role of a restart's queue place, before the run it restarts
UNKNOWN_START = -1  # process_start of a process that runs but whose start time cannot be read


class LogdirInUseError(ConfigError):
    """A live run holds the log directory (the message names it and what to do)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a logdir's lock: what its lock file says.

    Args:
        run_id: the run's id (a chief started by hand: its task, ``worker:0``).
        pid: the holding process.
        host: its host name (``socket.gethostname()``).
        since_unix: when it took the lock.
        role: ``launcher``, ``chief started by hand`` or ``restart waiting for <run>``.
        pid_start: the process's start time in clock ticks since boot (Linux; None elsewhere), which
            tells a recycled pid from the holder.
    """

    run_id: str
    pid: int
    host: str
    since_unix: float
    role: str = "launcher"
    pid_start: int | None = None

    def to_text(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Holder | None:
        """The holder a lock file names; None for an empty or unreadable one (being written, or not ours)."""
        try:
            d = json.loads(text)
            return cls(run_id=str(d["run_id"]), pid=int(d["pid"]), host=str(d["host"]),
                       since_unix=float(d["since_unix"]), role=str(d.get("role") or "launcher"),
                       pid_start=None if d.get("pid_start") is None else int(d["pid_start"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since_unix))
        where = f"pid {self.pid} on {self.host}, since {since}"
        if self.is_by_hand:
            return f"a chief started by hand ({self.run_id}; {where})"
        return f"run {self.run_id} ({where}{'; ' + self.role if self.role.startswith(_WAITING) else ''})"

    @property
    def is_by_hand(self) -> bool:
        return self.role == BY_HAND


UNKNOWN_HOLDER = Holder("(unknown)", -1, "(unknown)", 0.0, role="unknown")  # a held lock whose file names nobody


def is_stale(holder: Holder, *, host: str, start_of: Callable[[int], int | None]) -> bool:
    """Whether a lock still held names a holder that is gone: on this host, its pid no longer runs the
    process that took the lock. A holder on another host is never judged stale (its processes are out of sight).

    Args:
        holder: what the lock file says.
        host: this host's name.
        start_of: a pid's start time (:func:`process_start`): None where no such process runs,
            :data:`UNKNOWN_START` where it runs but its start time cannot be read.

    Example:
        >>> is_stale(Holder("r", 123, "h", 0.0), host="h", start_of=lambda pid: None)
        True
    """
    if holder.host != host:
        return False
    start = start_of(holder.pid)
    if start is None:
        return True
    # the pid runs: the holder's own process, unless the pid was recycled for a newer one
    known = start != UNKNOWN_START and holder.pid_start is not None
    return known and start != holder.pid_start


def in_use_message(where: str, holder: Holder | None, *, lock_file: str, host: str, url: bool = False) -> str:
    """The refusal of a second run into ``where``: who holds it and what to do.

    Example:
        >>> "psflow stop r1" in in_use_message("runs/a", Holder("r1", 7, "h", 0.0), lock_file="runs/a/.psflow.lock", host="h")
        True
    """
    what = "URL logdir" if url else "Log directory"
    if holder == UNKNOWN_HOLDER:
        holder = None
    head = f"{what} {where} is in use by {holder.describe() if holder else f'another process ({lock_file} is locked but names no run)'}."
    why = " Two runs in one logdir would overwrite each other's logs, events, summary and checkpoints."
    if holder is None or holder.is_by_hand:
        todo = " Give this run another logdir (--logdir NEW, or Supervisor(logdir=...)), or stop that process first."
    elif holder.role.startswith(_WAITING):
        restarted = holder.role[len(_WAITING):]
        todo = (f" Run {holder.run_id} restarts run {restarted} already (it starts once that one has stopped): follow it "
                f"(psflow status {holder.run_id}), or give this run another logdir (--logdir NEW).")
    else:
        todo = (f" Give this run another logdir (--logdir NEW), or stop that run (psflow stop {holder.run_id}) and resume "
                f"it in place (psflow restart {holder.run_id}).")
    if holder is not None and holder.host != host:
        todo += (f" If {holder.host} is gone, its lock ends when the filesystem's lock lease does; or delete {lock_file} "
                 "once you are sure nothing runs there.")
    return head + why + todo


def lock_path(logdir: str | os.PathLike[str], logdir_url: str | None, home: Path) -> Path:
    """The lock file of a run's logdir: ``LOGDIR/.psflow.lock``, or, for a URL logdir, a file under
    ``HOME/locks`` named after the URL (a bucket has no directory to lock).

    Example:
        >>> lock_path("runs/a", None, Path("/h"))
        PosixPath('runs/a/.psflow.lock')
        >>> lock_path("/tmp/stage", "s3://b/run/", Path("/h")).parent
        PosixPath('/h/locks')
    """
    if logdir_url is None:
        return Path(logdir) / LOCK_FILE
    url = logdir_url.rstrip("/")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", url.rsplit("/", 1)[-1])[:40] or "run"
    return home / "locks" / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:16]}.lock"


def process_start(pid: int) -> int | None:
    """``pid``'s start time in clock ticks since boot (Linux); :data:`UNKNOWN_START` where it runs but
    that cannot be read; None where no such process runs (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return UNKNOWN_START
        return UNKNOWN_START
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return None if fields[0] == "Z" else int(fields[19])


def this_holder(run_id: str, role: str = "launcher") -> Holder:
    """This process as the holder of a lock for ``run_id``."""
    start = process_start(os.getpid())
    return Holder(run_id=run_id, pid=os.getpid(), host=socket.gethostname(), since_unix=time.time(), role=role,
                  pid_start=None if start in (None, UNKNOWN_START) else start)


class LogdirLock:
    """The lock file at ``path``, held for one run (the I/O around the pure rules above).

    Args:
        path: the lock file (:func:`lock_path`).
        holder: what is written in it while held.
        where: the logdir as the user named it (the URL of a URL logdir), for messages.

    Example:
        >>> with LogdirLock(Path("runs/a/.psflow.lock"), this_holder("r1"), where="runs/a"):
        ...     ...  # the run; a second LogdirLock on runs/a raises LogdirInUseError meanwhile
    """

    def __init__(self, path: Path, holder: Holder, *, where: str | None = None) -> None:
        self.path = path
        self.holder = holder
        self.where = where or str(path.parent)
        self._fd: int | None = None
        self._slot: int | None = None  # the queue place, while a restart waits (queue_behind)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, *, wait_for_run: str | None = None, wait_s: float = 0.0) -> str | None:
        """Take the lock, or raise at once. Returns a note when it took over a stale holder's lock.
        A queue place this lock held (:meth:`queue_behind`) is given up either way.

        Args:
            wait_for_run: a run whose lock this one may wait for (the run a restart follows).
            wait_s: the longest such wait.

        Raises:
            LogdirInUseError: a live run holds it (one other than ``wait_for_run``, or that one past ``wait_s``).
        """
        deadline = time.monotonic() + wait_s
        while True:
            fd, other, note = self._take(self.path, self.holder)
            if other is None:
                self._fd = fd
                self.release_queue_place()
                return note
            if other.run_id != wait_for_run or time.monotonic() >= deadline:
                self.release_queue_place()
                raise LogdirInUseError(self._refusal(other))
            time.sleep(_POLL_S)  # a poll of the kernel's lock: the loop ends on its release or the deadline

    def queue_behind(self, run_id: str) -> None:
        """Take the logdir's one queue place while waiting for run ``run_id`` to end (a restart's wait),
        so that a second restart of the same logdir is refused at once, not run after this one.

        Raises:
            LogdirInUseError: another restart waits already, or a run other than ``run_id`` holds the logdir.
        """
        slot = self.path.with_name(self.path.name + _NEXT_SUFFIX)
        fd, other, _ = self._take(slot, replace(self.holder, role=f"{_WAITING}{run_id}"))
        if other is not None:
            raise LogdirInUseError(self._refusal(other))
        self._slot = fd
        current = self.probe()
        if current is not None and current.run_id != run_id:
            self.release_queue_place()
            raise LogdirInUseError(self._refusal(current))

    def release_queue_place(self) -> None:
        """Give up the queue place (:meth:`queue_behind`), if held."""
        if self._slot is not None:
            self._guarded(self._release_slot)

    def check(self, *, after_run: str | None = None) -> None:
        """Raise now where :meth:`acquire` (after :meth:`queue_behind` ``after_run``, for a restart) would
        refuse; takes nothing. A launcher started in the background is refused before it is started.

        Raises:
            LogdirInUseError: a live run other than ``after_run`` holds the logdir, or (a restart) another
                restart waits for it already.
        """
        current = self.probe()
        if current is not None and current.run_id != after_run:
            raise LogdirInUseError(self._refusal(current))
        waiting = self.probe(self.path.with_name(self.path.name + _NEXT_SUFFIX)) if after_run is not None else None
        if waiting is not None:
            raise LogdirInUseError(self._refusal(waiting))

    def probe(self, path: Path | None = None) -> Holder | None:
        """The live holder of the lock (or of ``path``: the queue place); None where it is free or
        stale. Takes nothing."""
        path = path or self.path
        if not path.parent.is_dir() or not _can_lock(self.path):
            return None
        with self._guard():
            fd = _open(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _live_holder(_read(fd))
                return holder
            finally:
                os.close(fd)  # also ends the flock taken for the look
        return None

    def release(self) -> None:
        """Give the lock up (and a queue place). The file is emptied, not removed: a run that opened it
        meanwhile must find it free, not locked on a file nobody sees any more."""

        def close() -> None:
            self._release_slot()
            if self._fd is not None:
                fd, self._fd = self._fd, None
                _close_emptied(fd)

        if self._fd is not None or self._slot is not None:
            self._guarded(close)

    def __enter__(self) -> LogdirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- the I/O ------------------------------------------------------------------------------------
    def _take(self, path: Path, holder: Holder) -> tuple[int | None, Holder | None, str | None]:
        """Under the guard, lock ``path`` and write ``holder`` into it: ``(fd, None, note)``; or
        ``(None, live holder, None)``. A stale holder's lock is taken over, said in the note."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if not _can_lock(path):
            return None, None, None
        with self._guard():
            fd = _open(path)
            note = None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = _read(fd)
                os.close(fd)
                other = _live_holder(text)
                if other is not None:
                    return None, other, None
                old = Holder.from_text(text)
                assert old is not None  # _live_holder judged it stale, so it was readable
                fd = _replace(path)  # the dead holder's descriptor lives on in a child: lock a new inode
                note = (f"{self.where}: took over the lock of {old.describe()}: pid {old.pid} no longer runs on this "
                        "host (a process it left behind still had the old lock file open).")
            else:
                old = Holder.from_text(_read(fd))
                if old is not None:  # a clean release empties the file: this holder ended holding it
                    note = f"{self.where}: took over the lock of {old.describe()}, which ended without releasing it."
            _write(fd, holder)
            return fd, None, note

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """The short lock around each look at, and takeover of, this logdir's lock and queue place."""
        guard = self.path.with_name(self.path.name + _GUARD_SUFFIX)
        fd = _open(guard)
        try:
            deadline = time.monotonic() + _GUARD_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise ConfigError(f"{guard} stayed locked for {_GUARD_WAIT_S:g} s: is the filesystem of "
                                          f"{self.where} hung? Try again, or give the run another logdir.") from None
                    time.sleep(0.01)  # another run looks at the lock for a few system calls
            yield
        finally:
            os.close(fd)

    def _guarded(self, give_up: Callable[[], None]) -> None:
        """``give_up`` under the guard, so that a look at the lock never finds it held and empty; without
        it where the guard is wedged (the lock is given up all the same)."""
        try:
            with self._guard():
                give_up()
        except ConfigError:
            give_up()

    def _release_slot(self) -> None:
        if self._slot is not None:
            slot, self._slot = self._slot, None
            _close_emptied(slot)

    def _refusal(self, holder: Holder) -> str:
        return in_use_message(self.where, holder, lock_file=str(self.path), host=socket.gethostname(),
                              url="://" in self.where)


def _live_holder(text: str) -> Holder | None:
    """The holder of a lock found held, None where it is stale; an unreadable file (being written,
    or not psflow's) counts as a live holder of unknown name."""
    holder = Holder.from_text(text)
    if holder is None:
        return UNKNOWN_HOLDER
    return None if is_stale(holder, host=socket.gethostname(), start_of=process_start) else holder


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # O_CLOEXEC (PEP 446): started tasks do not inherit it


def _replace(path: Path) -> int:
    """A new, locked lock file in ``path``'s place (the old inode stays with whoever still has it open)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh inode: nobody else can hold it
    os.replace(tmp, path)
    return fd


def _close_emptied(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    os.close(fd)  # closing ends the flock


_warned_unlockable: set[str] = set()


def _can_lock(path: Path) -> bool:
    """Whether ``path``'s filesystem takes ``flock`` (some network mounts do not); warns once where not.

    Raises:
        ConfigError: the lock's files cannot be created (the logdir is not writable).
    """
    try:
        fd = _open(path.with_name(path.name + _GUARD_SUFFIX))
    except OSError as e:
        raise ConfigError(f"Cannot create the lock file of {path.parent}: {e}. Check that the logdir is writable.") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True  # another run looks at the lock now: the filesystem takes locks
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        if str(path) not in _warned_unlockable:
            _warned_unlockable.add(str(path))
            print(f"psflow: warning: the filesystem of {path.parent} does not take file locks ({e.strerror}): a second run "
                  "into this logdir would not be refused. Use a local logdir to be safe.", flush=True)
        return False
    finally:
        os.close(fd)
    return True


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode(errors="replace")
    except OSError:
        return ""


def _write(fd: int, holder: Holder) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.to_text().encode(), 0)


# -- re-entrant holds, per process ------------------------------------------------------------------
_held: dict[tuple[str, str], tuple[LogdirLock, int]] = {}
_held_lock = threading.Lock()


@contextlib.contextmanager
def hold(path: Path, run_id: str, *, where: str | None = None, role: str = "launcher", wait_for_run: str | None = None,
         wait_s: float = 0.0, say: Callable[[str], None] | None = None,
         queued: LogdirLock | None = None) -> Iterator[LogdirLock]:
    """Hold ``path``'s lock for ``run_id`` while the block runs; a hold already taken by this process
    for the same run is shared (re-entrant), not taken twice.

    Args:
        path: the lock file (:func:`lock_path`).
        run_id: the run that holds it.
        where: the logdir as named by the user, for messages.
        role: what is holding it (``launcher``, ``chief started by hand``).
        wait_for_run, wait_s: see :meth:`LogdirLock.acquire`.
        say: where a note on a taken-over stale lock goes (default: printed).
        queued: the lock that waited in the queue (:meth:`LogdirLock.queue_behind`): it is the one
            taken, which gives its queue place up.

    Raises:
        LogdirInUseError: a live run holds it.
    """
    key = (os.path.abspath(path), run_id)
    with _held_lock:
        shared = _held.get(key)
        if shared is not None:
            _held[key] = (shared[0], shared[1] + 1)
    if shared is not None:
        lock = shared[0]
    else:
        lock = queued or LogdirLock(path, this_holder(run_id, role), where=where)
        note = lock.acquire(wait_for_run=wait_for_run, wait_s=wait_s)
        if note:
            (say or (lambda m: print(f"psflow: note: {m}", flush=True)))(note)
        with _held_lock:
            _held[key] = (lock, 1)
    try:
        yield lock
    finally:
        with _held_lock:
            lock_now, count = _held[key]
            if count > 1:
                _held[key] = (lock_now, count - 1)
            else:
                del _held[key]
                lock_now.release()


def run_lock(logdir: str, logdir_url: str | None, run_id: str) -> LogdirLock:
    """The (not yet taken) lock of a launcher's run into ``logdir``, or into ``logdir_url`` (see :func:`lock_path`)."""
    from psflow.home import psflow_home

    return LogdirLock(lock_path(logdir, logdir_url, psflow_home()), this_holder(run_id), where=logdir_url or logdir)


def hold_run(logdir: str, logdir_url: str | None, run_id: str, *, wait_for_run: str | None = None, wait_s: float = 0.0,
             say: Callable[[str], None] | None = None,
             queued: LogdirLock | None = None) -> contextlib.AbstractContextManager[LogdirLock]:
    """:func:`hold` for a launcher's run: the lock of ``logdir`` (or of ``logdir_url``, see :func:`lock_path`).

    Raises:
        LogdirInUseError: a live run holds it.
    """
    lock = queued or run_lock(logdir, logdir_url, run_id)
    return hold(lock.path, run_id, where=lock.where, wait_for_run=wait_for_run, wait_s=wait_s, say=say, queued=lock)
