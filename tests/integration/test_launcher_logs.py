"""A rerun into the same logdir keeps the earlier runs' task logs (logrotate style: NAME.1.log is the
previous run's). Real processes through the real LocalBackend, with a script that only prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from psflow.launch.local import LocalBackend, rotate_logs
from psflow.launch.plan import make_plan

pytestmark = pytest.mark.timeout(120)


def test_a_rerun_into_the_same_logdir_keeps_the_earlier_logs(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nprint('run', sys.argv[1], os.environ['PSFLOW_TASK'], flush=True)\n")
    logdir = tmp_path / "run"
    for n in ("1", "2", "3"):
        plan = make_plan(str(script), [n], num_ps=1, num_workers=1, logdir=str(logdir))
        result = LocalBackend(echo=lambda line: None, preload=False, keep_logs=1).run(plan)
        assert result.exit_code == 0, result.summary
    logs = logdir / "logs"
    assert (logs / "worker-0.log").read_text() == "run 3 worker:0\n"
    assert (logs / "worker-0.1.log").read_text() == "run 2 worker:0\n"  # the previous run's, kept
    assert (logs / "ps-0.1.log").read_text() == "run 2 ps:0\n"
    assert not (logs / "worker-0.2.log").exists()  # keep_logs=1: run 1's is gone


def test_rotation_shifts_each_older_log_and_drops_beyond_keep(tmp_path: Path) -> None:
    for name, text in (("worker-0.log", "c"), ("worker-0.1.log", "b"), ("worker-0.2.log", "a"), ("ps-0.log", "p")):
        (tmp_path / name).write_text(text)
    rotate_logs(tmp_path, keep=2)
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {
        "worker-0.1.log": "c", "worker-0.2.log": "b", "ps-0.1.log": "p"}
