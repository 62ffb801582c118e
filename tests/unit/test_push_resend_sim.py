"""The resend protocol of pushes in flight (psflow.ps.client with the async pipeline), stepped through
many seeded schedules in a deterministic simulation.

A worker keeps up to two pushes in flight on one connection; the ps serves a connection's requests
in order and decides each with its real rules (:class:`psflow.ps.rules.ShardRules`: a push whose
``(attempt, seq)`` is not newer than the last one it decided is a DUPLICATE). A schedule interleaves
sends, the ps serving, replies arriving and connection drops (whatever is in transit either way is
lost). On a drop the client makes the connection again and resends every push still unanswered,
oldest first: the invariant is that every push is applied exactly once, in order, and answered.
The same checker run on the client rule this replaced for one push in flight (resend only the
newest push) finds schedules that lose a push: it can see the protocol fail.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

import pytest

from psflow.ps.rules import Act, RuleSettings, ShardRules

PUSHES = 12
SEEDS = range(3000)

Resend = Callable[[deque[int]], list[int]]


def resend_all(pending: deque[int]) -> list[int]:
    """The client's rule: every unanswered push, oldest first."""
    return list(pending)


def resend_newest(pending: deque[int]) -> list[int]:
    """The rule for one push in flight, wrong for two: only the newest push is kept to resend."""
    return list(pending)[-1:]


def run(seed: int, resend: Resend, in_flight: int = 2) -> list[int]:
    """One schedule; returns the seqs the ps applied, in order. Raises AssertionError where a reply
    answers another push than the oldest unanswered, or the schedule cannot finish."""
    rng = random.Random(seed)
    rules = ShardRules(0, 1)
    rules.configure(RuleSettings(mode="async"), 0)
    applied: list[int] = []
    pending: deque[int] = deque()
    requests: deque[int] = deque()  # on the wire to the ps (the current connection)
    replies: deque[int] = deque()  # on the wire back
    next_seq, answered = 0, 0
    for _ in range(10_000):
        if answered == PUSHES:
            return applied
        moves = []
        if next_seq < PUSHES and len(pending) < in_flight:
            moves.append("send")
        if requests:
            moves.append("serve")
        if replies:
            moves.append("reply")
        moves.append("drop")
        move = rng.choice(moves) if rng.random() > 0.1 else "drop"
        if move == "send":
            pending.append(next_seq)
            requests.append(next_seq)
            next_seq += 1
        elif move == "serve":
            seq = requests.popleft()
            acts = [d.act for d in rules.push(0, rules.version, attempt=0, push_seq=seq)]
            if Act.APPLY in acts:
                applied.append(seq)
            replies.append(seq)
        elif move == "reply":
            seq = replies.popleft()
            assert pending and pending[0] == seq, f"seed {seed}: reply to push {seq}, oldest unanswered {list(pending)}"
            pending.popleft()
            answered += 1
        else:  # the connection drops; the client makes it again and resends
            requests.clear()
            replies.clear()
            kept = resend(pending)
            pending = deque(kept)
            requests.extend(kept)
            answered = next_seq - len(pending)
    raise AssertionError(f"seed {seed}: did not finish")


@pytest.mark.parametrize("in_flight", [1, 2])
def test_every_push_is_applied_exactly_once_in_order_under_any_schedule(in_flight: int):
    for seed in SEEDS:
        applied = run(seed, resend_all, in_flight)
        assert applied == list(range(PUSHES)), f"seed {seed}: applied {applied}"


def test_the_checker_finds_the_one_in_flight_rule_losing_a_push_with_two_in_flight():
    failures = 0
    for seed in SEEDS:
        try:
            applied = run(seed, resend_newest)
        except AssertionError:
            failures += 1
            continue
        failures += applied != list(range(PUSHES))
    assert failures > 0
    for seed in range(300):  # with one push in flight that rule was sound
        assert run(seed, resend_newest, in_flight=1) == list(range(PUSHES))
