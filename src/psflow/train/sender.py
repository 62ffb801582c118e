"""A step's pushes, sent off the training thread: backward runs on while a shard's bytes go out.

A blocking send holds the thread that calls it until the kernel has taken the last byte. Over a
100 Mbit/s link a shard of the CNN (3.3 MB) holds it ~0.25 s, so a push made from a backward hook
stopped backward for that long: the link and the CPU took turns instead of working at once. Here
each send runs on one thread of its own, in the order submitted (each connection's requests stay in
order; shard 0, which records the data position, still goes last), and :meth:`PushSender.join`
waits for them and raises the first failure on the caller's thread.

After a failed send the later ones are not attempted (as when the send ran in the hook and its
error ended backward): shard 0 never records a batch that another shard missed. The caller reads
the replies of the shards :meth:`PushSender.join` reports sent, and no others.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class NotSent(Exception):
    """A push skipped because an earlier one of the same step failed."""


class PushSender:
    """One thread that sends a step's pushes in order (started on the first push).

    Args:
        name: the thread's name (in stacks and the timeline).
        threaded: False sends each push at once on the caller's thread, as a hook-made send did
            before: the reference that A/B measurements compare against.
    """

    def __init__(self, name: str = "psflow-push", *, threaded: bool = True) -> None:
        self._name, self.threaded = name, threaded
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[tuple[int, Future[None]]] = []
        self._failed = False  # a send of this step failed: the rest are skipped

    def submit(self, shard: int, send: Callable[[], None], *, beside_compute: bool = True) -> None:
        """Queue ``send`` (one shard's push) behind the sends already queued. One with nothing to
        run beside (``beside_compute`` False: backward is over) and nothing queued before it is
        sent at once on the caller's thread, which would only wait for it: a hand-over to the
        thread and back costs two wake-ups, each a wait for a core on a loaded machine."""
        if not self.threaded or (not beside_compute and all(f.done() for _, f in self._pending)):
            self._pending.append((shard, _done(self._run, send)))
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        self._pending.append((shard, self._pool.submit(self._run, send)))

    def _run(self, send: Callable[[], None]) -> None:
        if self._failed:
            raise NotSent("an earlier push of this step failed")
        try:
            send()
        except BaseException:
            self._failed = True
            raise

    def join(self) -> tuple[set[int], BaseException | None]:
        """Wait for every queued send (each ends within its connection's timeout). Returns the
        shards whose push did not go out, and the first error (None when all went)."""
        failed: set[int] = set()
        first: BaseException | None = None
        for shard, fut in self._pending:
            try:
                fut.result()
            except BaseException as e:  # noqa: BLE001 -- handed to the caller, who raises it
                failed.add(shard)
                if first is None and not isinstance(e, NotSent):
                    first = e
        self._pending, self._failed = [], False
        return failed, first

    def close(self) -> None:
        """Finish the queued sends and stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _done(run: Callable[[Callable[[], None]], None], send: Callable[[], None]) -> Future[None]:
    """``run(send)`` now, its outcome as a finished future."""
    fut: Future[None] = Future()
    try:
        run(send)
    except BaseException as e:  # noqa: BLE001 -- kept in the future, raised by join
        fut.set_exception(e)
    else:
        fut.set_result(None)
    return fut
