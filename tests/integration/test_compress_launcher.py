"""Gradient compression through the launcher: ``psflow run --compress`` reaches every task."""

from __future__ import annotations

import pytest
from conftest import SOFTMAX, log_tails, read_summary, run_psflow

pytestmark = pytest.mark.timeout(300)

GRAD_BYTES = (784 * 10 + 10) * 4  # the softmax's gradients, uncompressed, per step


def test_a_sync_run_with_topk_compression_trains_and_sends_a_fraction_of_the_bytes(tmp_path):
    logdir = tmp_path / "run"
    r = run_psflow(["run", "--ps", "2", "--workers", "2", "--mode", "sync", "--compress", "topk:0.05",
                    "--logdir", str(logdir), SOFTMAX, "--", "--epochs", "2", "--init", "zeros", "--print_every", "1",
                    "--learning_rate", "0.5"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log_tails(logdir)
    s = read_summary(logdir)
    assert s["status"] == "succeeded" and s["test_accuracy"] >= 0.85, s
    for task in ("worker:0", "worker:1"):
        stats = s["reports"][task]["trainer"]
        assert stats["compress"] == "topk:0.05"
        # 5% of the entries, 8 bytes each (index and value), plus headers: well under a fifth of the dense push.
        assert stats["bytes_sent"] / stats["local_step"] < 0.2 * GRAD_BYTES, stats
    # Without --timeline nothing of it is recorded.
    assert "timeline" not in s and not (logdir / "timeline.json").exists() and not (logdir / "timeline").exists()


def test_a_bad_compress_setting_is_refused_before_any_task_starts(tmp_path):
    r = run_psflow(["run", "--compress", "topk:2", "--logdir", str(tmp_path / "run"), SOFTMAX], timeout_s=60)
    assert r.returncode == 2
    assert "compress='topk:2': the top-k ratio must be a number in (0, 1]; received '2'." in r.stderr
    assert not (tmp_path / "run" / "logs").exists()
