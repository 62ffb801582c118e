"""The shard-view protocol stepped through many seeded schedules (tests/unit/viewsim.py).

Each schedule mixes message delays, drops and duplicates, crashes and restarts, pauses, and
partitions between ps and between a ps and the authority; the invariants are checked after every
tick. A failing seed prints its trace; ``Sim(seed).run()`` replays it.
"""

from __future__ import annotations

import time

import pytest
from viewsim import Sim

SCHEDULES = 10_000


def test_no_schedule_breaks_an_invariant() -> None:
    start = time.monotonic()
    promotions = catch_ups = acked = 0
    for seed in range(SCHEDULES):
        sim = Sim(seed, num_ps=2 + seed % 2)
        failure = sim.run()
        assert failure is None, failure
        promotions += sum(1 for cause, v in sim.book.story if " down: " in cause and v.state.value == "alone"
                          and v.backup is None and v.serving is not None)
        catch_ups += sum(1 for cause, _ in sim.book.story if "caught up" in cause)
        acked += sum(len(a) for a in sim.acked.values())
    # The schedules exercise what the invariants are about (not a quiet run passing by default).
    assert promotions > SCHEDULES // 2 and catch_ups > SCHEDULES // 10 and acked > SCHEDULES * 10
    assert time.monotonic() - start < 600, "the simulation outgrew the suite's time"


def test_a_schedule_replays_the_same_trace() -> None:
    a, b = Sim(17), Sim(17)
    a.run(), b.run()
    assert a.trace == b.trace and a.acked == b.acked


@pytest.mark.parametrize("bug", ["worker_takeover", "promote_unsynced"])
def test_the_invariants_catch_a_deliberate_bug(bug: str) -> None:
    """The checks can fail: the old rule (a backup serves when a worker names it) and a promotion
    of a backup still catching up each break an invariant within a few hundred schedules."""
    failures = [f for f in (Sim(seed, broken=bug).run() for seed in range(500)) if f]
    assert failures, f"no schedule caught {bug}"
