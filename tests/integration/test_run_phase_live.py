"""A real run's drain, seen live: once its worker is done and its ps has not exited yet, status.json,
the job store and psflow status (by logdir and by run id) say ``draining``; the run then ends as
before, and psflow run's console (the runner's subscriber) says the final line and where the logs are."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, psflow_in, task_env, wait_for_run

pytestmark = pytest.mark.timeout(180)

# The ps waits for the test's release file (60 s at most); the worker is done at once.
SCRIPT = """import os, pathlib, sys, time
if os.environ["PSFLOW_TASK"].startswith("ps:"):
    deadline = time.monotonic() + 60
    while not pathlib.Path(sys.argv[1]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
print(os.environ["PSFLOW_TASK"], "done", flush=True)
"""


def test_a_drain_is_said_draining_while_the_ps_is_given_its_time(tmp_path: Path) -> None:
    home, logdir, release = tmp_path / "home", tmp_path / "run", tmp_path / "release"
    script = tmp_path / "drain.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([PSFLOW, "run", "--ps", "1", "--workers", "1", "--no-preload", "--logdir", str(logdir),
                             str(script), "--", str(release)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=task_env(PSFLOW_HOME=str(home)), cwd=ROOT)
    try:
        run = wait_for_run(home / "jobs.db", lambda r: r.get("phase") == "draining", what="draining", timeout_s=90)
        assert run["state"] == "running"
        status = json.loads((logdir / "status.json").read_text())
        assert (status["state"], status["phase"]) == ("running", "draining")
        for ref in (str(logdir), run["id"]):
            shown = psflow_in(home, "status", ref, timeout_s=60)
            assert f"psflow run {run['id']} (draining, " in shown.stdout, shown.stdout + shown.stderr
    finally:
        release.touch()
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "psflow: succeeded: " in out and f"psflow: summary: {logdir}/summary.json   logs: {logdir}/logs/" in out, out
    phases = [e["phase"] for e in map(json.loads, (logdir / "events.jsonl").read_text().splitlines())
              if e["event"] == "run_phase"]
    assert phases == ["running", "draining", "finished"]
