"""`psflow chaos` end to end: the MNIST softmax job, 2 ps replicated + 2 workers, SIGKILLs and a
SIGSTOP of random tasks (ps included) every 1.5 s of training under the default chaos restart policy.

What is proven: the run succeeds; every fault was injected on a running task and survived (each
killed attempt ended by SIGKILL and was restarted); the restarts per task in chaos.json match the
summary's attempts and cover every kill; the push ledger is kept and no acknowledged update is lost
(every worker attempt's acknowledged pushes are among those shard 0's serving copy applied for it);
every batch of the 8 epochs was applied exactly once on shard 0 (600 batches an epoch), and the
global step (the largest version of any shard) is exactly that count.

And with SIGSTOPs only (1.5 s stalls of workers and ps, below every failover deadline): every
stalled task goes on where it stopped: nothing is restarted, nothing lost, every batch applied once.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import SOFTMAX, log_tails, read_summary, run_psflow

pytestmark = [pytest.mark.timeout(240), pytest.mark.long]  # 40 s of faults per run, 30-80 s a test: make test-long

EPOCHS = 8
STEPS_PER_EPOCH = 600  # 60,000 examples in batches of 100, over both workers' shards


def chaos(logdir: Path, *args: str, epochs: int = EPOCHS) -> tuple[object, str]:
    r = run_psflow(["chaos", "--ps", "2", "--ps-replicas", "2", "--workers", "2", "--every", "1.5", "--for", "40",
                    "--logdir", str(logdir), "--no-live", *args, SOFTMAX, "--",
                    "--epochs", str(epochs), "--init", "zeros", "--print_every", "1"], timeout_s=200)
    return r, f"{r.stdout[-5000:]}\n{r.stderr[-2000:]}\n{log_tails(logdir, 30)}"


@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipeline"])
def test_chaos_kills_and_stops_tasks_and_the_job_loses_nothing_acknowledged(tmp_path: Path, pipeline: bool) -> None:
    """With --pipeline the workers have two pushes in flight per connection when a fault lands."""
    logdir = tmp_path / "chaos"
    r, context = chaos(logdir, "--max-faults", "4", "--seed", "3", *(["--pipeline"] if pipeline else []))
    assert r.returncode == 0, context
    report = json.loads((logdir / "chaos.json").read_text())
    summary = read_summary(logdir)
    assert report["status"] == summary["status"] == "succeeded", context

    faults = report["faults"]
    assert faults["injected"] >= 2 and faults["survived"] == faults["injected"], faults
    kills = Counter(f["task"] for f in faults["list"] if f["kind"] == "kill")
    assert kills, faults  # seed 3 draws kills first
    attempts = {t["task"]: t["attempts"] for t in summary["tasks"]}
    assert report["restarts"] == {t: n - 1 for t, n in attempts.items()}, (report["restarts"], attempts)
    for task, n in kills.items():
        assert report["restarts"][task] >= n, (task, report["restarts"])
    for line in ("faults injected", "restarts per task", "acknowledged updates"):
        assert line in r.stdout, r.stdout[-3000:]

    ledger = report["ledger"]
    assert ledger["kept"], ledger
    assert ledger["lost"] == 0, ledger
    assert ledger["acknowledged"] + ledger["unacknowledged"] == ledger["applied"] == EPOCHS * STEPS_PER_EPOCH, ledger
    assert report["batches_applied"] == EPOCHS * STEPS_PER_EPOCH, report
    # The summary's global step is the largest any task reported, shard 1's version included: a worker
    # killed between its push to shard 1 and its push to shard 0 redoes that batch, and shard 1 answers
    # it as a duplicate (it recorded the batch's data position), so no shard is ever one update ahead.
    assert summary["global_step"] == EPOCHS * STEPS_PER_EPOCH, (summary["global_step"], kills)


def test_stopped_tasks_go_on_where_they_stopped_with_nothing_restarted_or_lost(tmp_path: Path) -> None:
    logdir = tmp_path / "stops"
    r, context = chaos(logdir, "--kinds", "stop", "--stall", "1.5", "--max-faults", "3", "--seed", "5")
    assert r.returncode == 0, context
    report = json.loads((logdir / "chaos.json").read_text())
    faults = report["faults"]
    assert faults["injected"] >= 2 and faults["by_kind"] == {"stop": faults["injected"]}, faults
    assert all(f["outcome"] == "continued" for f in faults["list"]), faults
    assert set(report["restarts"].values()) == {0}, report["restarts"]
    assert report["ledger"]["lost"] == 0 and report["ledger"]["unacknowledged"] == 0, report["ledger"]
    assert report["batches_applied"] == EPOCHS * STEPS_PER_EPOCH, report


def test_partitions_of_ps_copies_past_the_backup_failover_lose_nothing(tmp_path: Path) -> None:
    """The fault that split a shard before: the copies of a shard cut off from each other for longer
    than backup_failover_s (5 s). Every copy of every shard must end equal, nothing lost. (Long
    SIGSTOPs of ps copies are the nemesis benchmark's, beside kills and partitions.)"""
    logdir = tmp_path / "partitions"
    epochs = 30
    r, context = chaos(logdir, "--kinds", "partition", "--targets", "ps", "--stall", "6", "--max-faults", "2",
                       "--seed", "1", epochs=epochs)
    assert r.returncode == 0, context
    report = json.loads((logdir / "chaos.json").read_text())
    faults = report["faults"]
    assert faults["injected"] >= 1 and faults["survived"] == faults["injected"], faults
    assert faults["by_kind"] == {"partition": faults["injected"]}, faults
    assert "cannot reach its backup" in context, context  # a serving copy went on alone, at the launcher's word
    ledger = report["ledger"]
    assert ledger["lost"] == 0 and ledger["applied"] == epochs * STEPS_PER_EPOCH, ledger
    summary = read_summary(logdir)
    assert summary["ledger"]["agree"], summary["ledger"]
    copies = summary["ledger"]["copies"]
    assert sorted((c["shard"], c["role"]) for c in copies) == [(0, "backup"), (0, "serving"), (1, "backup"), (1, "serving")]
    assert {c["version"] for c in copies} == {c["applied"] for c in copies} == {epochs * STEPS_PER_EPOCH}, copies
