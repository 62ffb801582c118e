"""A deterministic simulation of shard views and the replication stream (FoundationDB's approach).

Pure: one seeded random schedule drives ps processes, the authority (:class:`psflow.ps.views.ViewBook`)
and a network, one tick at a time. Every decision a copy takes goes through the rules the ps uses
(:func:`~psflow.ps.views.accepts_records`, :func:`~psflow.ps.views.serves`, :class:`~psflow.ps.views.Lease`);
what the simulation abstracts is the data: a copy's state is the list of update ids it applied.

Faults: message delays, drops and duplicates; crashes (the backend reports the exit after a delay)
and restarts (empty, then ``ps_up``); pauses (SIGSTOP: a paused process does nothing; past the hang
timeout the watchdog kills it, or, in a fraction of the schedules, cannot, and the authority gives up
on it anyway); partitions between two ps and between a ps and the authority.

Invariants, checked after every tick (:meth:`Sim.check`):
- at most one copy serves a shard in a term;
- the copy the authority names serving (unless the shard is lost) holds every acknowledged update;
- the version a worker is shown for a shard never goes back.

``Sim(seed).run()`` returns None or the first violation with the trace that led to it (replay: the
same seed gives the same trace).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from psflow.ps.views import (
    Lease,
    ShardView,
    Sync,
    Verdict,
    ViewBook,
    accepts_records,
    initial_views,
    keeps_serving,
    pair_of,
    serves,
    takes_over,
)

SERVING, BACKUP, EMPTY = "serving", "backup", "empty"
LEASE_TICKS = 6  # a copy acting alone needs the authority's word within this many ticks
HANG_TICKS = 10  # the authority gives up on a ps it has not heard from for this long (> LEASE_TICKS)
FAILOVER_TICKS = 5  # a serving copy whose backup has not answered for this long reports it unreachable


@dataclass
class Copy:
    view: ShardView
    role: str
    log: list[int] = field(default_factory=list)
    lease: Lease = field(default_factory=lambda: Lease(LEASE_TICKS))
    shipped: int = 0  # records [0, shipped) were sent to the backup (of this view)
    acked: int = 0  # the backup holds records [0, acked)
    waiting_since: int | None = None  # the tick the oldest unanswered shipment left
    waits: bool = False  # acknowledgements wait for the backup (the view is synced, or catch-up is done here)
    flip: int | None = None  # the log length when acks started to wait during catch-up
    pending: list[tuple[int, int]] = field(default_factory=list)  # (update id, log length after it)
    state_sent: bool = False


@dataclass
class Ps:
    index: int
    alive: bool = True
    paused: bool = False
    kill_fails: bool = False
    copies: dict[int, Copy] = field(default_factory=dict)
    heard: int = 0  # the tick the authority last heard from it


class Sim:
    """One schedule. ``broken`` names a deliberate bug, to show the invariants catch it:
    ``"worker_takeover"`` (a backup serves when a worker's request names it: the old rule),
    ``"promote_unsynced"`` (the authority promotes a backup that is still catching up),
    ``"no_lease"`` (a copy acknowledges alone without a fresh lease)."""

    def __init__(self, seed: int, *, num_ps: int = 2, ticks: int = 80, broken: str | None = None) -> None:
        self.rng = random.Random(seed)
        self.seed, self.num_ps, self.ticks, self.broken = seed, num_ps, ticks, broken
        self.book = ViewBook(num_ps)
        self.now = 0
        self.ps = [Ps(p) for p in range(num_ps)]
        for v in initial_views(num_ps).values():
            self.ps[v.serving].copies[v.shard] = Copy(v, SERVING)
            self.ps[v.backup].copies[v.shard] = Copy(v, BACKUP)
        self.net: list[tuple[int, tuple[Any, ...]]] = []  # (deliver at tick, message)
        self.cut: set[frozenset[int]] = set()  # ps pairs that cannot talk
        self.cut_authority: set[int] = set()
        self.acked: dict[int, set[int]] = {s: set() for s in range(num_ps)}
        self.shown: dict[int, int] = dict.fromkeys(range(num_ps), 0)  # the highest version a worker was shown
        self.route: dict[int, int] = {s: s for s in range(num_ps)}  # where the worker sends shard s
        self.reports: list[tuple[int, int]] = []  # (tick, ps) exits the backend will report
        self.next_uid = 1
        self.trace: list[str] = []
        if broken == "promote_unsynced":
            self._break_promotion()

    # -- the authority ------------------------------------------------------------------------
    def _reach_authority(self, p: int) -> bool:
        ps = self.ps[p]
        if not ps.alive or ps.paused or p in self.cut_authority:
            return False
        ps.heard = self.now
        return True

    def _ask(self, p: int, kind: str, **kw: Any) -> bool:
        """One request of ps p to the authority; then p applies every view it holds a copy of."""
        if not self._reach_authority(p):
            return False
        if kind == "unreachable":
            self.book.unreachable(p, kw["shard"], kw["term"], "no answer")
        elif kind == "caught_up":
            self.book.caught_up(p, kw["shard"], kw["term"])
        elif kind == "up":
            self.book.ps_up(p, "restarted")
        for s in self._shards_of(p):
            self._apply(p, self.book.views[s])
            self.ps[p].copies[s].lease.renewed(self.now)
        return True

    def _shards_of(self, p: int) -> list[int]:
        return [s for s in range(self.num_ps) if p in pair_of(s, self.num_ps)]

    def _break_promotion(self) -> None:
        book = self.book

        def ps_down(ps: int, cause: str) -> list[ShardView]:
            changed = []
            for s, v in sorted(book.views.items()):
                if v.serving == ps and v.backup is not None:
                    changed.append(book._set(ShardView(s, v.term + 1, v.backup, None, Sync.ALONE, v.term + 1), cause))
                elif v.serving == ps or v.backup == ps:
                    changed += [x for x in ViewBook.ps_down(book, ps, cause) if x.shard == s]
            return changed

        book.ps_down = ps_down  # type: ignore[method-assign]

    # -- a copy applies a view ------------------------------------------------------------------
    def _apply(self, p: int, v: ShardView) -> None:
        c = self.ps[p].copies.get(v.shard)
        if c is None:
            c = self.ps[p].copies[v.shard] = Copy(v, EMPTY)
        if v.term < c.view.term:
            return
        if v.term == c.view.term:
            c.view = v
            if v.state is Sync.SYNCED and c.role == SERVING:
                c.waits = True
            return
        old_role = c.role
        if v.serving == p:
            keeps = old_role == SERVING and keeps_serving(c.view, v, p)
            c.role = SERVING if keeps or takes_over(c.view, v, p, old_role == BACKUP) else EMPTY
        else:
            c.role = EMPTY  # a backup of a new term loads the state again; one the view does not name drops out
            c.log = [] if v.backup != p else c.log
        if c.role != SERVING:
            c.pending = []
        c.view, c.shipped, c.acked, c.waiting_since, c.flip, c.state_sent = v, 0, 0, None, None, False
        c.waits = v.state is Sync.SYNCED
        if c.role == SERVING and v.state is Sync.CATCHING_UP:
            c.acked = -1  # nothing confirmed until the backup holds the state
        self.trace.append(f"t{self.now} ps:{p} shard {v.shard}: {old_role} -> {c.role} at {v}")

    # -- the network ------------------------------------------------------------------------------
    def _send(self, src: int, dst: int, msg: tuple[Any, ...]) -> None:
        if frozenset((src, dst)) in self.cut or self.rng.random() < 0.05:
            return  # dropped
        self.net.append((self.now + self.rng.randint(0, 3), msg))
        if self.rng.random() < 0.03:
            self.net.append((self.now + self.rng.randint(0, 5), msg))  # duplicated

    def _deliver(self) -> None:
        due = [m for t, m in self.net if t <= self.now]
        self.net = [(t, m) for t, m in self.net if t > self.now]
        for msg in due:
            dst = msg[2]
            if self.ps[dst].alive and not self.ps[dst].paused:
                getattr(self, f"_on_{msg[0]}")(*msg[1:])
            elif self.ps[dst].alive:
                self.net.append((self.now + 1, msg))  # a paused process reads it when it wakes

    def _on_records(self, src: int, dst: int, shard: int, term: int, start: int, entries: list[int]) -> None:
        c = self.ps[dst].copies[shard]
        verdict = accepts_records(c.view, dst, src, term)
        if verdict is Verdict.ASK and self._ask(dst, "get"):
            verdict = accepts_records(c.view, dst, src, term)
        if verdict is Verdict.STALE:
            self._send(dst, src, ("stale", dst, src, shard, c.view.term))
        if verdict is not Verdict.ACCEPT or c.role != BACKUP or start > len(c.log):
            return
        c.log += entries[len(c.log) - start:]
        self._send(dst, src, ("ack", dst, src, shard, term, len(c.log)))

    def _on_state(self, src: int, dst: int, shard: int, term: int, log: list[int]) -> None:
        c = self.ps[dst].copies[shard]
        verdict = accepts_records(c.view, dst, src, term)
        if verdict is Verdict.ASK and self._ask(dst, "get"):
            verdict = accepts_records(c.view, dst, src, term)
        if verdict is not Verdict.ACCEPT:
            return
        if c.role == EMPTY:
            c.role, c.log = BACKUP, list(log)
        self._send(dst, src, ("ack", dst, src, shard, term, len(c.log)))

    def _on_ack(self, src: int, dst: int, shard: int, term: int, upto: int) -> None:
        c = self.ps[dst].copies[shard]
        if c.role == SERVING and c.view.term == term and c.view.backup == src:
            c.acked = max(c.acked, upto)
            c.waiting_since = None if c.acked >= c.shipped else self.now

    def _on_stale(self, src: int, dst: int, shard: int, term: int) -> None:
        if term > self.ps[dst].copies[shard].view.term:
            self._ask(dst, "get")

    # -- what each ps does on a tick -----------------------------------------------------------
    def _replicate(self, p: int, s: int, c: Copy) -> None:
        v = c.view
        if c.role != SERVING or v.backup is None:
            return
        if v.state is Sync.CATCHING_UP and not c.state_sent:
            self._send(p, v.backup, ("state", p, v.backup, s, v.term, list(c.log)))
            c.state_sent, c.shipped, c.waiting_since = True, len(c.log), self.now
            return
        if c.acked >= 0 and (c.shipped < len(c.log) or (c.acked < c.shipped and self.rng.random() < 0.3)):
            start = max(c.acked, 0)  # resend from what the backup confirmed (a lost batch)
            self._send(p, v.backup, ("records", p, v.backup, s, v.term, start, c.log[start:]))
            c.shipped = len(c.log)
            c.waiting_since = c.waiting_since if c.waiting_since is not None else self.now
        if c.waiting_since is not None and self.now - c.waiting_since > FAILOVER_TICKS:
            self._ask(p, "unreachable", shard=s, term=v.term)
        if v.state is Sync.CATCHING_UP and c.acked >= 0 and not c.waits:
            c.waits, c.flip = True, len(c.log)  # from now on acks wait; everything acked alone must reach it first
        if v.state is Sync.CATCHING_UP and c.flip is not None and c.acked >= c.flip:
            self._ask(p, "caught_up", shard=s, term=v.term)

    def _release_acks(self, p: int, s: int, c: Copy) -> None:
        if c.role != SERVING:
            return
        if not (c.lease.valid(self.now) or self.broken == "no_lease"):
            return  # no acknowledgement without a fresh word from the authority: the view may have moved on
        keep = []
        for uid, version in c.pending:
            if not c.waits or c.acked >= version:
                self.acked[s].add(uid)
                if version < self.shown[s] and self.book.views[s].state is not Sync.LOST:
                    raise Violation(f"shard {s}: a worker was shown version {version} after {self.shown[s]}")
                self.shown[s] = max(self.shown[s], version)
            else:
                keep.append((uid, version))
        c.pending = keep

    def _push(self) -> None:
        s = self.rng.randrange(self.num_ps)
        p = self.route[s]
        ps = self.ps[p]
        if not ps.alive or ps.paused:
            self.route[s] = [q for q in pair_of(s, self.num_ps) if q != p][0]  # no answer: try the other copy
            return
        c = ps.copies.get(s)
        if c is None:
            return
        if self.broken == "worker_takeover" and c.role == BACKUP:
            c.role = SERVING  # the old rule: a backup named by a failed-over worker serves
        verdict = serves(c.view, p, None)
        if c.role != SERVING or verdict is not Verdict.ACCEPT:
            hint = c.view.serving
            self.route[s] = hint if hint is not None and hint != p else [q for q in pair_of(s, self.num_ps) if q != p][0]
            return
        if not c.waits and not c.lease.valid(self.now) and self.broken != "no_lease" and not self._ask(p, "get"):
            return  # alone without a fresh lease, and the authority out of reach: not accepted
        uid, self.next_uid = self.next_uid, self.next_uid + 1
        c.log.append(uid)
        c.pending.append((uid, len(c.log)))

    # -- faults -------------------------------------------------------------------------------
    def _fault(self) -> None:
        r, p = self.rng.random(), self.rng.randrange(self.num_ps)
        ps = self.ps[p]
        if r < 0.04 and ps.alive:
            ps.alive = False
            self.trace.append(f"t{self.now} crash ps:{p}")
            self.reports.append((self.now + self.rng.randint(0, 3), p))
        elif r < 0.08 and not ps.alive and not any(q == p for _, q in self.reports):
            self.ps[p] = Ps(p, heard=self.now)
            self.trace.append(f"t{self.now} restart ps:{p}")
            for s in self._shards_of(p):
                self.ps[p].copies[s] = Copy(ShardView(s, 0, None, None, Sync.LOST), EMPTY)
            self._ask(p, "up")
        elif r < 0.12 and ps.alive:
            ps.paused = not ps.paused
            ps.kill_fails = self.rng.random() < 0.3
            self.trace.append(f"t{self.now} {'pause' if ps.paused else 'resume'} ps:{p}")
        elif r < 0.16:
            pair = frozenset((p, (p + 1) % self.num_ps))
            self.cut ^= {pair}
            self.trace.append(f"t{self.now} {'cut' if pair in self.cut else 'heal'} {sorted(pair)}")
        elif r < 0.19:
            self.cut_authority ^= {p}
            self.trace.append(f"t{self.now} {'cut' if p in self.cut_authority else 'heal'} ps:{p} from the authority")

    def _watch(self) -> None:
        """The backend's exit reports, and the watchdog: a ps silent past the hang timeout is killed
        (or, when the kill cannot reach it, given up on: ps_down all the same)."""
        due = [q for t, q in self.reports if t <= self.now]
        self.reports = [(t, q) for t, q in self.reports if t > self.now]
        for q in due:
            self.book.ps_down(q, "exited")
            self.trace.append(f"t{self.now} authority: ps:{q} down -> {self.book.snapshot()}")
        for ps in self.ps:
            if ps.alive and self.now - ps.heard > HANG_TICKS:
                if not ps.kill_fails:
                    ps.alive = False
                ps.heard = self.now
                self.book.ps_down(ps.index, "hung")
                self.trace.append(f"t{self.now} authority: ps:{ps.index} hung -> {self.book.snapshot()}")

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> None:
        self.now += 1
        self._fault()
        self._watch()
        self._deliver()
        for _ in range(self.rng.randint(0, 3)):
            self._push()
        for ps in self.ps:
            if not ps.alive or ps.paused:
                continue
            if self.rng.random() < 0.5:  # the ps's poll of the authority (and its heartbeat)
                self._ask(ps.index, "up" if any(c.role == EMPTY for c in ps.copies.values()) else "get")
            for s, c in sorted(ps.copies.items()):
                self._replicate(ps.index, s, c)
                self._release_acks(ps.index, s, c)
        self.check()

    def check(self) -> None:
        for s in range(self.num_ps):
            serving = [(ps.index, ps.copies[s].view.term) for ps in self.ps
                       if ps.alive and s in ps.copies and ps.copies[s].role == SERVING]
            terms = [t for _, t in serving]
            if len(terms) != len(set(terms)):
                raise Violation(f"shard {s}: two copies serve in one term: {serving}")
            v = self.book.views[s]
            if v.state is Sync.LOST or v.serving is None:
                continue
            holder = self.ps[v.serving]
            mine = holder.copies.get(s)
            if holder.alive and mine is not None and mine.view == v and mine.role != SERVING:
                raise Violation(f"shard {s}: ps:{v.serving} knows it serves term {v.term} but cannot ({mine.role})")
            log = set(holder.copies[s].log) if holder.alive and s in holder.copies else None
            if log is not None and not self.acked[s] <= log:
                raise Violation(f"shard {s}: ps:{v.serving} serves it in term {v.term} without acknowledged updates "
                                f"{sorted(self.acked[s] - log)[:5]}")

    def run(self) -> str | None:
        try:
            for _ in range(self.ticks):
                self.step()
        except Violation as e:
            return f"seed {self.seed}: {e}\n" + "\n".join(self.trace[-25:])
        return None


class Violation(Exception):
    pass
