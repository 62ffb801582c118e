"""A dead ps without a replica (`--ps-replicas 1`, the default): the job rolls back to its newest
checkpoint on every shard at once and continues. ps:0 is SIGKILLed at its shard's version 250
(--fail-at ps:0@step=250:kill); under --restart on-failure the launcher kills the other ps and the
workers at once, restarts all four, the restarted chief restores checkpoint 200 onto both fresh ps,
and each worker resumes from the data position saved with it.

What is proven: the run succeeds with every task at 2 attempts (ps:0's first killed by the fault,
the others stopped for the rollback, all restarted); the chief restored checkpoint 200, once; both
shards went on from step 200 (each ps's applied updates after the restore = the final step - 200:
never a mix of steps); the workers resumed at positions that add up to the checkpoint's 200
batches (a worker that had pushed nothing by then, started late on a busy machine, has no saved
position and starts its shard from the top), and the job ends at exactly one epoch (600 batches over both shards); the accuracy is
that of a softmax epoch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT, log_tails, read_summary, run_psflow

pytestmark = pytest.mark.timeout(300)

SCRIPT = str(ROOT / "examples" / "mnist_softmax_supervised.py")
STEPS = 600  # one epoch: 60,000 examples in batches of 100, over both workers' shards
CHECKPOINT = 200


def test_a_dead_ps_without_a_replica_rolls_every_shard_back_to_the_newest_checkpoint(tmp_path: Path) -> None:
    logdir = tmp_path / "run"
    r = run_psflow(["run", "--ps", "2", "--workers", "2", "--restart", "on-failure", "--restart-backoff", "0.5",
                    "--fail-at", "ps:0@step=250:kill", "--logdir", str(logdir), "--no-live", SCRIPT, "--",
                    "--epochs", "1", "--save_steps", "100", "--init", "zeros"], timeout_s=200)
    context = f"{r.stdout[-4000:]}\n{r.stderr[-2000:]}\n{log_tails(logdir, 30)}"
    s = read_summary(logdir)
    assert r.returncode == 0 and s["status"] == "succeeded", context
    tasks = {t["task"]: t for t in s["tasks"]}
    assert {t: x["attempts"] for t, x in tasks.items()} == {"ps:0": 2, "ps:1": 2, "worker:0": 2, "worker:1": 2}, context
    first = {t: x["exits"][0] for t, x in tasks.items()}
    assert first["ps:0"]["signal"] == "SIGKILL" and not first["ps:0"]["stopped"], first
    assert all(first[t]["stopped"] and first[t]["restarted"] for t in ("ps:1", "worker:0", "worker:1")), first
    assert "every shard back to the newest checkpoint" in r.stdout, context

    logs = {t: (logdir / "logs" / f"{t.replace(':', '-')}.log").read_text() for t in tasks}
    assert re.findall(r"restored from \S+ckpt-(\d+) at step (\d+)", logs["worker:0"]) == [
        (f"{CHECKPOINT:010d}", str(CHECKPOINT))], logs["worker:0"][-3000:]
    for ps in ("ps:0", "ps:1"):  # both shards of the final attempt started from the checkpoint's step
        report = s["reports"][ps]
        assert report["global_step"] == STEPS and report["ps_stats"]["applied_updates"] == STEPS - CHECKPOINT, report
    resumed = [int(b) for t in ("worker:0", "worker:1")
               for b in re.findall(r"resuming its data at epoch 0, batch (\d+)", logs[t])]
    assert len(resumed) in (1, 2) and sum(resumed) == CHECKPOINT, resumed
    assert s["global_step"] == STEPS, context
    assert s["test_accuracy"] > 0.8, s["test_accuracy"]
