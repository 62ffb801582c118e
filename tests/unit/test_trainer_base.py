"""Unit tests of TrainerBase, the part every trainer shares: construction checks, step counting,
the launcher's progress reports and their interval, restore_from's check, stats, close-once.

A strategy with no transport (it applies nothing) stands in for the ps and all-reduce trainers, so
everything runs in this process without a cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import psflow as pf
from psflow.config import TrainConfig
from psflow.errors import ConfigError
from psflow.train.base import TrainerBase


@dataclass
class LocalTask:
    """What TrainerBase reads of a task; it keeps the progress reports it is sent."""

    config: TrainConfig = field(default_factory=TrainConfig)
    num_replicas: int = 1
    replica_index: int = 0
    task_id: str = "worker:0"
    trainers: list[Any] = field(default_factory=list)
    reports: list[dict[str, Any]] = field(default_factory=list)

    def _attach_trainer(self, trainer: Any) -> None:
        self.trainers.append(trainer)

    def report_progress(self, **figures: Any) -> None:
        self.reports.append(figures)


class NoTransportTrainer(TrainerBase):
    """Runs the closure and counts the step; nothing travels anywhere."""

    _why_spec = "Tests only."

    def _init_strategy(self) -> None:
        self.prepared = 0
        self.released = 0

    def prepare(self) -> int:
        if not self._ready:
            self.prepared += 1
            self._ready = True
        return self.global_step

    def step(self, closure: Callable[..., torch.Tensor], *, batch: Any = None, batches: Sequence[Any] | None = None,
             batch_size: int | None = None) -> float:
        t0 = self._begin_step()
        loss = float((closure(self.model, *batch) if batch is not None else closure()).detach())
        self.global_step += 1
        self._end_step(t0, loss, batch_size, batch, batches)
        return loss

    def pull(self, *, averages: bool = False) -> int:
        return self.prepare()

    def save_shards(self, root: str, step: int, *, exact: bool = False) -> list[dict[str, Any]]:
        return []

    def job_step(self) -> int:
        return self.global_step

    def _release(self) -> None:
        self.released += 1


def make(task: LocalTask | None = None, **settings: Any) -> NoTransportTrainer:
    return NoTransportTrainer(torch.nn.Linear(3, 1), pf.optim.SGD(lr=0.1), task or LocalTask(), **settings)


def mse(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(m(x), y)


def test_a_torch_optimizer_is_refused_with_the_strategy_s_reason() -> None:
    model = torch.nn.Linear(3, 1)
    with pytest.raises(ConfigError, match=r"psflow optimizer spec .* received SGD\. Tests only\."):
        NoTransportTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), LocalTask())  # type: ignore[arg-type]


def test_an_unknown_setting_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"TrainConfig has no setting 'speed' \(received 3\)\. Known: mode"):
        make(speed=3)


def test_settings_override_the_task_s_and_the_trainer_attaches_itself() -> None:
    task = LocalTask()
    trainer = make(task, mode="sync", progress_every_s=5.0)
    assert (trainer.config.mode, trainer.config.progress_every_s) == ("sync", 5.0)
    assert task.trainers == [trainer]


def test_steps_count_examples_from_the_batch_or_the_given_size_and_get_ready_once() -> None:
    trainer = make()
    x, y = torch.zeros(4, 3), torch.zeros(4, 1)
    trainer.step(mse, batch=(x, y))
    trainer.step(lambda: mse(trainer.model, x, y), batch_size=7)
    trainer.step(lambda: mse(trainer.model, x, y))  # no size known: the step counts, its examples do not
    stats = trainer.stats()
    assert (stats["global_step"], stats["local_step"], stats["examples"]) == (3, 3, 11)
    assert trainer.prepared == 1
    assert set(stats) == {"global_step", "local_step", "examples", "train_time_s", "wall_time_s", "compute_s",
                          "examples_per_sec", "step_examples_per_sec"}


def test_the_headline_rate_is_wall_clock_from_the_first_step_to_the_last_and_the_step_rate_keeps_its_own_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 10.5, 13.0, 13.5])  # two steps of 0.5 s, 2 s of the script's own work between them
    trainer = make()
    trainer.prepare()  # before the clock: getting ready counts in neither time
    monkeypatch.setattr("psflow.train.base.time.perf_counter", lambda: next(clock))
    x, y = torch.zeros(50, 3), torch.zeros(50, 1)
    trainer.step(mse, batch=(x, y))
    trainer.step(mse, batch=(x, y))
    monkeypatch.undo()
    stats = trainer.stats()
    assert (stats["train_time_s"], stats["wall_time_s"]) == (1.0, 3.5)
    assert (stats["examples_per_sec"], stats["step_examples_per_sec"]) == (round(100 / 3.5, 1), 100.0)


def test_progress_goes_to_the_launcher_at_most_every_progress_every_s() -> None:
    task = LocalTask()
    trainer = make(task, progress_every_s=3600.0)
    x, y = torch.zeros(2, 3), torch.zeros(2, 1)
    for _ in range(5):
        trainer.step(mse, batch=(x, y))
    assert len(task.reports) == 1  # the first step reports; the next are within the interval
    first = task.reports[0]
    assert (first["global_step"], first["local_step"], first["examples"]) == (1, 1, 2)
    assert set(first) == {"global_step", "local_step", "examples", "train_time_s", "wall_time_s", "examples_per_sec",
                          "step_examples_per_sec", "loss"}


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "1"])
def test_progress_every_s_must_be_a_positive_number_of_seconds(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"progress_every_s must be (> 0|a finite number|a valid number); received .* \(seconds: "):
        make(progress_every_s=value)


def test_restore_from_refuses_a_checkpoint_of_another_model_and_keeps_a_whole_one() -> None:
    trainer = make()
    with pytest.raises(ConfigError, match=r"no values for \['bias'\]"):
        trainer.restore_from(4, {"weight": torch.zeros(1, 3)})
    trainer.restore_from(4, {"weight": torch.zeros(1, 3), "bias": torch.zeros(1)})
    assert trainer._restore is not None and trainer._restore[0] == 4


def test_close_releases_once_and_the_context_manager_closes() -> None:
    with make() as trainer:
        pass
    trainer.close()
    assert trainer.released == 1
