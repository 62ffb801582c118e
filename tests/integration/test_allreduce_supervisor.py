"""The Supervisor under --strategy allreduce: the chief checkpoints, every rank restores."""

from __future__ import annotations

import pytest
from conftest import ROOT, log_tails, read_summary, run_psflow

pytestmark = pytest.mark.timeout(300)
SCRIPT = str(ROOT / "examples" / "mnist_softmax_supervised.py")


def test_allreduce_run_checkpoints_and_resumes_on_every_rank(tmp_path):
    logdir = tmp_path / "ar"
    args = ["run", "--strategy", "allreduce", "--workers", "2", "--logdir", str(logdir), SCRIPT, "--",
            "--init", "zeros", "--save_steps", "100"]
    first = run_psflow(args + ["--epochs", "1"])
    assert first.returncode == 0, first.stdout[-2000:] + log_tails(logdir)
    assert (logdir / "checkpoints" / "ckpt-0000000300" / "manifest.json").is_file()
    second = run_psflow(args + ["--epochs", "2"])
    assert second.returncode == 0, second.stdout[-2000:] + log_tails(logdir)
    for task in ("worker:0", "worker:1"):
        assert f"[{task}] {task}: restored from {logdir / 'checkpoints' / 'ckpt-0000000300'} at step 300" in second.stdout
    s = read_summary(logdir)
    assert s["strategy"] == "allreduce" and s["mode"] == "sync"
    assert s["global_step"] == 600  # resumed at 300, one more epoch of 300 steps, not two
