"""examples/mnist_cnn.py under a Supervisor: a worker SIGKILLed at a fixed step resumes its data position.

On a slice of MNIST (400 training images, batches of 20: 10 batches per worker per epoch, 2 epochs,
2 workers), worker:1 is killed before its 4th push (--fail-at) and restarted; it must resume at
epoch 0, batch 4 (the batch after its last applied one), so that shard 0 applies each of the job's
40 batches exactly once (no batch skipped, none taken twice), and the chief evaluates the final
checkpoint's moving averages. The long chaos run of the same example is in BENCHMARKS.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ROOT, log_tails, read_summary, run_psflow

pytestmark = pytest.mark.timeout(300)

CNN = str(ROOT / "examples" / "mnist_cnn.py")
WORKERS, EPOCHS, TRAIN, BATCH = 2, 2, 400, 20
BATCHES = EPOCHS * TRAIN // BATCH  # every worker's shard, every epoch: 40 pushes in the job


def test_cnn_worker_killed_resumes_its_data_position_and_every_batch_is_applied_once(tmp_path: Path) -> None:
    logdir = tmp_path / "cnn"
    r = run_psflow(["run", "--ps", "1", "--workers", str(WORKERS), "--logdir", str(logdir), "--no-live",
                    "--restart", "on-failure", "--max-restarts", "3", "--restart-backoff", "0",
                    "--fail-at", "worker:1@step=4:kill", CNN, "--",
                    "--train_examples", str(TRAIN), "--batch_size", str(BATCH), "--epochs", str(EPOCHS),
                    "--test_examples", "200", "--log_every", "5"])
    out = f"{r.stdout[-4000:]}\n{r.stderr[-2000:]}\n{log_tails(logdir)}"
    assert r.returncode == 0, out
    s = read_summary(logdir)
    assert s["status"] == "succeeded", out
    w1 = next(t for t in s["tasks"] if t["task"] == "worker:1")
    assert w1["attempts"] == 2 and w1["exits"][0]["signal"] == "SIGKILL" and w1["exits"][0]["restarted"], w1
    # The restarted attempt took up its shard at the batch after its last applied one.
    assert "[worker:1] worker:1: resuming its data at epoch 0, batch 4" in r.stdout, out
    ps = s["reports"]["ps:0"]["ps_stats"]
    assert s["global_step"] == ps["applied_updates"] == ps["pushes"] == BATCHES, ps
    assert "global_step 40, test accuracy = " in r.stdout, out  # the final checkpoint holds the whole job
    assert s["test_accuracy"] > 0.3, s  # 40 steps on 400 images; chance is 0.1
