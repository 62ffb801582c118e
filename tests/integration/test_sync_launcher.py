"""Sync (N-of-M, with and without backups) and ssp jobs end to end: `psflow run` starts real processes.

Each test launches ps:0 + worker:0 + worker:1 on the MNIST softmax example for one epoch (300 steps
per worker) and checks summary.json: the mode, the global step each mode must reach, and the ps's
counters. On failure the assertion prints the launcher's output and each task's log tail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import SOFTMAX, log_tails, pid_alive, read_summary, run_psflow

pytestmark = pytest.mark.timeout(300)

STEPS_PER_WORKER = 300  # 60000 MNIST examples / 2 workers / batch 100, one epoch


def launch(logdir: Path, *mode_flags: str) -> dict[str, Any]:
    """Run the example under ``mode_flags``; return summary.json once the job succeeded."""
    r = run_psflow(["run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), *mode_flags, SOFTMAX, "--",
                    "--epochs", "1", "--init", "zeros"])
    context = f"{r.stdout[-3000:]}\n{r.stderr[-2000:]}\n{log_tails(logdir)}"
    assert r.returncode == 0, context
    s = read_summary(logdir)
    assert s["status"] == "succeeded", context
    assert not any(pid_alive(t["pid"]) for t in s["tasks"]), s["tasks"]
    return s


def trainer_reports(s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t: rep["trainer"] for t, rep in s["reports"].items() if "trainer" in rep}


def test_sync_job_takes_one_global_step_per_sync_step(tmp_path: Path) -> None:
    s = launch(tmp_path / "sync", "--mode", "sync")
    trainers = trainer_reports(s)
    assert s["mode"] == "sync" and {t["mode"] for t in trainers.values()} == {"sync"}
    assert {t: r["local_step"] for t, r in trainers.items()} == {"worker:0": STEPS_PER_WORKER, "worker:1": STEPS_PER_WORKER}
    # N = M = 2: both gradients of each step are averaged into one update, none is stale.
    assert s["global_step"] == STEPS_PER_WORKER
    ps = s["reports"]["ps:0"]["ps_stats"]
    assert ps["applied_updates"] == STEPS_PER_WORKER and ps["pushes"] == 2 * STEPS_PER_WORKER
    assert s["counters"]["stale_dropped"] == 0 and s["counters"]["steps_without_all_workers"] == 0
    assert s["test_accuracy"] > 0.5, s["test_accuracy_by_task"]  # it learned (chance is 0.1)


def test_sync_with_a_backup_worker_reports_its_counters(tmp_path: Path) -> None:
    s = launch(tmp_path / "backup", "--mode", "sync", "--replicas-to-aggregate", "1", "--total-num-replicas", "2")
    trainers = trainer_reports(s)
    ps = s["reports"]["ps:0"]["ps_stats"]
    counters = s["counters"]
    assert s["mode"] == "sync"
    # N = 1 of M = 2: each push is either the one gradient of a step or stale (dropped, counted).
    assert ps["pushes"] == 2 * STEPS_PER_WORKER == ps["applied_updates"] + ps["stale_dropped"]
    assert s["global_step"] == ps["applied_updates"] == s["reports"]["ps:0"]["global_step"]
    assert counters["stale_dropped"] == ps["stale_dropped"] == sum(t["stale_pushes"] for t in trainers.values())
    assert counters["steps_without_all_workers"] == ps["steps_without_all"] >= 1
    assert sum(ps["stale_by_worker"].values()) == ps["stale_dropped"]


@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipeline"])
def test_ssp_job_applies_every_push(tmp_path: Path, pipeline: bool) -> None:
    s = launch(tmp_path / "ssp", "--mode", "ssp", "--staleness", "2", *(["--pipeline"] if pipeline else []))
    trainers = trainer_reports(s)
    ps = s["reports"]["ps:0"]["ps_stats"]
    assert s["mode"] == "ssp" and {t["mode"] for t in trainers.values()} == {"ssp"}
    assert [t["local_step"] for t in trainers.values()] == [STEPS_PER_WORKER] * 2
    # with the pipeline, a step computes while the one before travels (not the first, nor one after a flush)
    pipelined = [t["pipelined_steps"] for t in trainers.values()]
    assert all(STEPS_PER_WORKER // 2 < n < STEPS_PER_WORKER for n in pipelined) if pipeline else pipelined == [0, 0]
    assert s["global_step"] == ps["applied_updates"] == ps["pushes"] == 2 * STEPS_PER_WORKER
    assert s["counters"]["stale_dropped"] == 0


def test_sync_worker_killed_is_the_root_cause_not_the_survivor(tmp_path: Path) -> None:
    # The survivor fails with the ps's "worker:1 lost its connection" error, often before the
    # launcher sees worker:1's exit: the root cause is still the killed worker.
    logdir = tmp_path / "synckill"
    r = run_psflow(["run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), "--mode", "sync",
                    "--fail-at", "worker:1@step=20:kill", SOFTMAX, "--", "--epochs", "1", "--init", "zeros"])
    context = f"{r.stdout[-3000:]}\n{r.stderr[-2000:]}\n{log_tails(logdir)}"
    assert r.returncode == 1, context
    assert "Root cause: worker:1 exited with code -9" in r.stdout, context
    s = read_summary(logdir)
    assert s["status"] == "failed" and s["root_cause"] == "worker:1", context
    assert not any(pid_alive(t["pid"]) for t in s["tasks"]), s["tasks"]


def test_sync_worker_stalled_past_the_sync_timeout_is_the_root_cause(tmp_path: Path) -> None:
    # worker:0's step times out naming the missing worker:1; the launcher then stops worker:1.
    logdir = tmp_path / "syncstall"
    r = run_psflow(["run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), "--mode", "sync", "--sync-timeout", "3",
                    "--fail-at", "worker:1@step=20:stall=60", SOFTMAX, "--", "--epochs", "1", "--init", "zeros"])
    context = f"{r.stdout[-3000:]}\n{r.stderr[-2000:]}\n{log_tails(logdir)}"
    assert r.returncode == 1, context
    assert "Root cause: worker:1" in r.stdout and "then worker:0: RemoteError" in r.stdout, context
    assert read_summary(logdir)["root_cause"] == "worker:1", context
