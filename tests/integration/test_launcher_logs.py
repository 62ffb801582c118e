"""A rerun into the same logdir keeps the earlier runs' task logs (logrotate style: NAME.1.log is the
previous run's). Real processes through the real LocalBackend, with a script that only prints."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from psflow.launch.backend import rotate_logs
from psflow.launch.local import LocalBackend
from psflow.launch.plan import make_plan
from psflow.launch.runner import Runner

pytestmark = pytest.mark.timeout(120)


def test_a_rerun_into_the_same_logdir_keeps_the_earlier_logs(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nprint('run', sys.argv[1], os.environ['PSFLOW_TASK'], flush=True)\n")
    logdir = tmp_path / "run"
    for n in ("1", "2", "3"):
        plan = make_plan(str(script), [n], num_ps=1, num_workers=1, logdir=str(logdir))
        result = Runner(LocalBackend(echo=lambda line: None, preload=False, keep_logs=1)).run(plan)
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


def test_a_script_that_raises_at_import_shows_one_traceback_of_its_own_frames(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("import psflow\nraise ValueError('boom at import')\n")
    lines: list[str] = []
    plan = make_plan(str(script), num_ps=1, num_workers=2, logdir=str(tmp_path / "run"))
    result = Runner(LocalBackend(echo=lines.append, preload=True)).run(plan)
    out = click.unstyle("\n".join(lines))
    root = result.root_cause  # every task fails alike: the one whose report is oldest
    assert result.exit_code == 1 and root in plan.task_names(), out
    assert out.count("Traceback (most recent call last):") == 1, out
    assert "forkserver.py" not in out and "runpy" not in out, out  # the user's frames only
    assert f"Root cause: {root} exited with code 1\n  ValueError: boom at import" in out, out
    assert out.count("ValueError: boom at import (the same traceback as ") == 2, out
    # The log files keep every task's whole traceback.
    assert "raise ValueError('boom at import')" in (tmp_path / "run" / "logs" / "worker-1.log").read_text()
