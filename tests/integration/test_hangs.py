"""The hang watchdog through `psflow run`: a worker whose main thread stops (--hang-at) while its
heartbeats go on is caught after --hang-timeout, its stacks (faulthandler, every thread) land in its
log where status.json and `psflow status` say, it is killed and restarted, and the job finishes. In
sync mode the watchdog catches it long before the sync timeout, and blames it, not the worker that
waits for it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import SOFTMAX, log_tails, read_summary, run_psflow

pytestmark = pytest.mark.timeout(300)

WATCHDOG = ["--hang-at", "worker:1@step=20", "--hang-timeout", "3", "--restart", "on-failure", "--restart-backoff", "0.5"]
STEPS_PER_EPOCH = 600  # MNIST's 60,000 training examples in batches of 100, over every worker's shard


def launch(logdir: Path, *args: str) -> tuple[str, dict]:
    r = run_psflow(["run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), *WATCHDOG, *args, SOFTMAX, "--",
                    "--epochs", "1", "--init", "zeros", "--print_every", "1"], timeout_s=180)
    context = f"{r.stdout[-4000:]}\n{r.stderr[-2000:]}\n{log_tails(logdir, 60)}"
    assert (logdir / "summary.json").exists(), context
    return r.stdout + "\n" + context, read_summary(logdir)


def assert_worker_1_hung_was_dumped_and_restarted(logdir: Path, s: dict, out: str) -> dict:
    """The checks both modes share; returns worker:1's first exit (from the summary)."""
    assert s["status"] == "succeeded", out
    by_task = {t["task"]: t for t in s["tasks"]}
    first, second = by_task["worker:1"]["exits"]
    assert first["restarted"] and first["cause"].startswith("hung: no progress for "), first
    assert (second["attempt"], second["cause"]) == (1, "exit code 0"), second
    assert all(t["attempts"] == 1 and t["exit_code"] == 0 for name, t in by_task.items() if name != "worker:1"), by_task
    hang = first["hang"]
    log = logdir / "logs" / "worker-1.log"
    assert (hang["kind"], hang["stacks"]["log"]) == ("hung", str(log)), hang
    assert f"stacks in {log} from line {hang['stacks']['line']}" in first["cause"], first
    # The dump is in the log at or after the line the status names: every thread, the hung main thread's
    # frames down to the user's training loop, and the heartbeat thread that kept beating.
    dump = "".join(log.read_text().splitlines(keepends=True)[hang["stacks"]["line"] - 1:])
    assert re.search(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):", dump, re.M), dump[:3000]
    assert re.search(r'File ".*mnist_softmax\.py", line \d+ in main', dump), dump[:3000]
    assert re.search(r'File ".*psflow/fault\.py", line \d+ in inject', dump), dump[:3000]
    assert "in _run" in dump and "heartbeat.py" in dump, dump[:3000]
    # Seen live: status.json keeps the hang with its exit, psflow status shows where the stacks are.
    status = json.loads((logdir / "status.json").read_text())
    assert status["tasks"]["worker:1"]["exits"][0]["hang"] == hang
    shown = run_psflow(["status", str(logdir)], timeout_s=60).stdout
    assert "worker:1 attempt 0: hung: no progress for " in shown and str(hang["stacks"]["line"]) in shown, shown
    events = [json.loads(line) for line in (logdir / "events.jsonl").read_text().splitlines()]
    assert [(e["task"], e["hang"]["kind"]) for e in events if e["event"] == "task_hung"] == [("worker:1", "hung")]
    assert "worker:1 (attempt 0) made no progress for " in out and "; dumping its stacks into its log" in out, out
    assert "psflow: worker:1 (attempt 0) was killed by the watchdog (hung: no progress for " in out, out
    return first


def test_async_hung_worker_is_caught_its_stacks_dumped_into_its_log_and_restarted(tmp_path: Path) -> None:
    logdir = tmp_path / "async"
    out, s = launch(logdir)
    assert_worker_1_hung_was_dumped_and_restarted(logdir, s, out)
    # The hang came before step 20's push; the restarted worker resumed from its last applied batch.
    ps = s["reports"]["ps:0"]["ps_stats"]
    assert s["global_step"] == ps["applied_updates"] == ps["pushes"] == STEPS_PER_EPOCH, ps
    assert s["test_accuracy"] > 0.8, out


def test_sync_hung_worker_is_caught_by_the_watchdog_long_before_the_sync_timeout(tmp_path: Path) -> None:
    logdir = tmp_path / "sync"
    out, s = launch(logdir, "--mode", "sync", "--sync-timeout", "600")
    first = assert_worker_1_hung_was_dumped_and_restarted(logdir, s, out)
    # worker:0 waited for worker:1's gradient all along (its heartbeats said so): never blamed.
    assert first["hang"]["quiet_s"] < 10 and s["wall_s"] < 120, (first, s["wall_s"])
    assert s["mode"] == "sync" and s["test_accuracy"] > 0.8, out
