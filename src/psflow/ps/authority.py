"""The authority over shard views on the wire: its service (in the launcher) and a ps's client of it.

:class:`ViewAuthority` keeps a :class:`~psflow.ps.views.ViewBook` behind a lock and serves CO_VIEW
on a Server: the launcher's coordinator server for launched runs (the runner tells it of each ps
exit with :meth:`ViewAuthority.ps_down`), a server of their own in the component tests. Only ps
tasks of the run may ask; they ask for the views (``get``, which also renews their lease), say they
(re)started empty (``up``), that their backup does not answer (``unreachable``) or that it caught up
(``caught_up``). Every answer is the whole book, so a copy always acts on the newest views.

:class:`ViewClient` is the ps's side: one short authenticated connection per question (questions
are rare: a poll every fraction of the lease, and a view change).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from psflow.errors import ConfigError, PsflowError
from psflow.ps.views import ShardView, ViewBook
from psflow.server import Reply, Request, Server
from psflow.wire.conn import connect
from psflow.wire.ops import Op

log = logging.getLogger("psflow.ps")

_KINDS = ("get", "up", "unreachable", "caught_up")


class ViewAuthority:
    """Serve the shard views of ``num_ps`` ps on ``server`` (None: in-process only).

    ``on_change(cause, view)`` is called for every view change, outside the lock (the run's event log).
    """

    def __init__(self, server: Server | None, num_ps: int,
                 on_change: Callable[[str, ShardView], None] | None = None) -> None:
        self.book = ViewBook(num_ps)
        self.num_ps = num_ps
        self.on_change = on_change or (lambda cause, view: None)
        self._lock = threading.Lock()
        if server is not None:
            server.register(Op.CO_VIEW, self._serve)

    def views(self) -> dict[str, Any]:
        with self._lock:
            return self.book.snapshot()

    def ps_down(self, ps: int, cause: str) -> list[ShardView]:
        """The backend says ps ``ps`` exited (or the watchdog killed it)."""
        return self._change(lambda: self.book.ps_down(ps, cause))

    def _change(self, fn: Callable[[], list[ShardView]]) -> list[ShardView]:
        with self._lock:
            before = len(self.book.story)
            changed = fn()
            story = self.book.story[before:]
        for cause, view in story:
            log.warning("shard %d: term %d, serving %s, backup %s, %s (%s).", view.shard, view.term,
                        _ps(view.serving), _ps(view.backup), view.state.value, cause)
            self.on_change(cause, view)
        return changed

    def _serve(self, req: Request) -> Reply:
        ps = _ps_index(req.peer, self.num_ps)
        kind = req.meta.get("kind")
        if kind not in _KINDS:
            raise ConfigError(f"A view request names kind {kind!r}; the authority answers {list(_KINDS)}.")
        if kind == "up":
            self._change(lambda: self.book.ps_up(ps, f"{req.peer} started empty"))
        elif kind in ("unreachable", "caught_up"):
            try:
                shard, term = int(req.meta["shard"]), int(req.meta["term"])
            except (KeyError, TypeError, ValueError):
                raise ConfigError(f"A {kind} report needs an integer shard and term; received {dict(req.meta)!r}.") from None
            if kind == "unreachable":
                why = str(req.meta.get("why", "no answer"))[:300]
                self._change(lambda: self.book.unreachable(ps, shard, term, why))
            else:
                self._change(lambda: self.book.caught_up(ps, shard, term))
        return Reply({"views": self.views()})


def _ps(p: int | None) -> str:
    return "none" if p is None else f"ps:{p}"


def _ps_index(peer: str, num_ps: int) -> int:
    job, _, index = peer.partition(":")
    if job == "ps" and index.isdigit() and int(index) < num_ps:
        return int(index)
    raise ConfigError(f"Only the run's ps tasks ask for shard views; {peer!r} asked (the run has {num_ps} ps).")


def views_from(meta: Mapping[str, Any]) -> dict[int, ShardView]:
    views = meta.get("views")
    if not isinstance(views, Mapping):
        raise PsflowError(f"The authority answered no views; received {dict(meta)!r}.")
    return {int(s): ShardView.from_dict(v) for s, v in views.items()}


class ViewClient:
    """A ps's questions to the authority at ``address`` (the launcher's coordinator)."""

    def __init__(self, address: str, *, secret: bytes, task: str, timeout_s: float = 2.0) -> None:
        self.address, self.secret, self.task, self.timeout_s = address, secret, task, timeout_s

    def ask(self, kind: str, **meta: Any) -> dict[int, ShardView]:
        """Raises TransportError or RemoteError when the authority cannot be asked within ``timeout_s``."""
        conn = connect(self.address, secret=self.secret, task=self.task, peer="launcher", deadline_s=self.timeout_s)
        try:
            return views_from(conn.request(Op.CO_VIEW, {"kind": kind, **meta}, timeout_s=self.timeout_s).meta)
        finally:
            conn.close()
