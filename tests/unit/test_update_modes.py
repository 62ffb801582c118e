"""The update modes as strategy objects (psflow.train.modes): one per TrainConfig mode, each asked at
the points where a worker's step differs, with a host that records what the mode asked of it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from psflow.config import MODES as CONFIG_MODES
from psflow.config import TrainConfig
from psflow.train.modes import MODES, AsyncMode, SspMode, SyncMode, UpdateMode, mode_of


class RecordingClient:
    def __init__(self) -> None:
        self.clocks: list[tuple[int, int, float, int]] = []
        self.ahead: list[int] = []

    def clock(self, worker: int, clock: int, timeout_s: float, *, attempt: int = 0, ahead: int = 0) -> int:
        self.clocks.append((worker, clock, timeout_s, attempt))
        self.ahead.append(ahead)
        return clock


@dataclass
class Host:
    """What a mode reads of its trainer; it keeps the waits the mode announced, in order."""

    config: TrainConfig = field(default_factory=TrainConfig)
    client: Any = field(default_factory=RecordingClient)
    worker: int = 2
    attempt: int = 1
    clock_base: int = 10
    local_step: int = 0
    waits: list[str] = field(default_factory=list)
    inside: list[str] = field(default_factory=list)

    @property
    def clock(self) -> int:
        return self.clock_base + self.local_step

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        self.waits.append(what)
        self.inside.append(what)
        try:
            yield
        finally:
            self.inside.remove(what)


def test_every_config_mode_has_one_strategy_object_named_after_it() -> None:
    assert sorted(MODES) == sorted(CONFIG_MODES)
    for name in CONFIG_MODES:
        mode = mode_of(TrainConfig(mode=name))
        assert isinstance(mode, UpdateMode) and mode.name == name
        assert mode is mode_of(TrainConfig(mode=name))  # stateless, shared
    assert [type(mode_of(TrainConfig(mode=m))) for m in ("async", "sync", "ssp")] == [AsyncMode, SyncMode, SspMode]


@pytest.mark.parametrize("local_step", [0, 3])
def test_async_neither_waits_nor_pulls_before_computing(local_step: int) -> None:
    host = Host(config=TrainConfig(mode="async"), local_step=local_step)
    mode = mode_of(host.config)
    assert mode.before_compute(host) is False
    with mode.awaiting_replies(host):
        assert host.inside == []
    assert (host.waits, host.client.clocks) == ([], [])
    assert mode.reply_waits_for == "ps reply"
    assert not mode.steps_wait_for_workers  # a chief may keep checkpointing while the others push


def test_sync_waits_for_the_quorum_around_the_replies_only() -> None:
    host = Host(config=TrainConfig(mode="sync"), local_step=3)
    mode = mode_of(host.config)
    assert mode.before_compute(host) is False
    assert host.waits == []
    with mode.awaiting_replies(host):
        assert host.inside == ["the sync step's quorum"]
    assert host.inside == [] and host.client.clocks == []
    assert mode.reply_waits_for == "sync quorum"
    assert mode.steps_wait_for_workers  # a chief that stops stepping must say so (its gradient is waited for)


def test_ssp_reports_its_clock_under_the_bound_and_pulls_from_the_second_step_on() -> None:
    host = Host(config=TrainConfig(mode="ssp", staleness=2, sync_timeout_s=7.5))
    mode = mode_of(host.config)
    assert mode.before_compute(host) is False  # the first step computes from prepare()'s pull
    host.local_step = 4
    assert mode.before_compute(host) is True  # the last reply predates the wait: pull afresh
    # clock = the attempt's base + its steps, with the worker, the timeout and the attempt
    assert host.client.clocks == [(2, 10, 7.5, 1), (2, 14, 7.5, 1)]
    assert host.waits == ["the ssp staleness bound"] * 2
    with mode.awaiting_replies(host):
        assert host.inside == []
    assert mode.reply_waits_for == "ps reply"
    assert mode.steps_wait_for_workers  # the slowest worker's clock bounds the others
    assert host.client.ahead == [0, 0]


def test_ssp_with_the_pipeline_counts_its_steps_in_flight_against_the_bound() -> None:
    host = Host(config=TrainConfig(mode="ssp", staleness=2, pipeline=True, sync_timeout_s=7.5))
    mode = mode_of(host.config)
    # nothing in flight: the values pulled after the wait serve this step and the next one
    assert mode.before_compute(host) is True
    gate = mode.before_pipelined_push(host)
    assert gate is not None and host.client.clocks == [(2, 10, 7.5, 1)]  # taken now, run on the push thread
    host.local_step = 5
    gate()
    # the push's reply brings the values of the step two later: 2 steps ahead of the clock taken
    assert host.client.clocks == [(2, 10, 7.5, 1)] * 2 and host.client.ahead == [1, 2]
    assert host.waits == ["the ssp staleness bound"] * 2
    for other in ("async", "sync"):
        assert mode_of(TrainConfig(mode=other)).before_pipelined_push(host) is None
