"""All-reduce jobs restart as a group (torchrun's rule), through `psflow run --restart on-failure`:
one rank is SIGKILLed at a fixed step (--fail-at), the controller stops the other, restarts both as
attempt 1, and the group resumes from the newest checkpoint with its data position.

What is proven, for a killed rank 1 (the chief, stopped by SIGTERM, writes a final checkpoint at the
step where the group broke) and a killed rank 0 (nobody checkpoints: the group rolls back to step
100 and redoes the steps after it): the run succeeds; both ranks ran 2 attempts, the killed one
ended by SIGKILL and the other stopped for the restart, both restarted; both attempts 1 restored
the same checkpoint; the job ends at the fault-free run's global step (300: one epoch, each rank's
every batch taken once, none skipped or taken twice in the final state), and its test accuracy is
the fault-free run's exactly (same batches, same order, all-reduce is deterministic).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT, log_tails, read_summary, run_psflow

pytestmark = pytest.mark.timeout(300)

SCRIPT = str(ROOT / "examples" / "mnist_softmax_supervised.py")
STEPS = 300  # one epoch of each rank's 30,000-example shard in batches of 100
KILL_AT = 130


def launch(logdir: Path, *args: str) -> tuple[dict, str]:
    r = run_psflow(["run", "--strategy", "allreduce", "--workers", "2", "--logdir", str(logdir), "--no-live", *args, SCRIPT,
                    "--", "--epochs", "1", "--save_steps", "50", "--init", "zeros"], timeout_s=200)
    context = f"{r.stdout[-4000:]}\n{r.stderr[-2000:]}\n{log_tails(logdir, 30)}"
    assert (logdir / "summary.json").exists(), context
    return read_summary(logdir), context


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    s, context = launch(tmp_path_factory.mktemp("clean") / "run")
    assert s["status"] == "succeeded" and s["global_step"] == STEPS, context
    return s


@pytest.mark.parametrize("killed,restored_step", [("worker:1", KILL_AT), ("worker:0", 100)])
def test_a_killed_rank_restarts_the_whole_group_from_the_newest_checkpoint(tmp_path: Path, clean: dict, killed: str,
                                                                           restored_step: int) -> None:
    s, context = launch(tmp_path / "run", "--restart", "on-failure", "--restart-backoff", "0.5",
                        "--fail-at", f"{killed}@step={KILL_AT}:kill")
    assert s["status"] == "succeeded", context
    tasks = {t["task"]: t for t in s["tasks"]}
    assert {t: x["attempts"] for t, x in tasks.items()} == {"worker:0": 2, "worker:1": 2}, tasks
    other = "worker:0" if killed == "worker:1" else "worker:1"
    first = {t: tasks[t]["exits"][0] for t in tasks}
    assert first[killed]["signal"] == "SIGKILL" and first[killed]["restarted"], first
    assert first[other]["stopped"] and first[other]["restarted"], first
    assert "restarting the all-reduce group from its newest checkpoint" in context, context
    for task in tasks:
        log = (tmp_path / "run" / "logs" / f"{task.replace(':', '-')}.log").read_text()
        restored = re.findall(r"restored from \S+ckpt-(\d+) at step (\d+)", log)
        assert restored == [(f"{restored_step:010d}", str(restored_step))], (task, restored, log[-2000:])
    assert s["global_step"] == STEPS, context
    assert s["test_accuracy_by_task"] == clean["test_accuracy_by_task"], (s["test_accuracy_by_task"], clean)
