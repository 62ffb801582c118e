"""One logdir, one live run, with real launchers: a second `psflow run` into a logdir in use is
refused at once, naming the first, which goes on untouched; a lock a dead launcher left is taken over
with a note; two quick `psflow restart --detach` of one run give one live run, the other refused.
The runs are the small regression script (no MNIST), stopped as soon as they have shown what counts."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, log_tails, pid_alive, psflow_in, task_env, wait_for_run

from psflow.logdirlock import LOCK_FILE, Holder
from psflow.platform.jobstore import JobStore

pytestmark = pytest.mark.timeout(300)
REGRESSION = str(ROOT / "tests" / "integration" / "scripts" / "regression.py")
LONG = ("--ps", "1", "--workers", "1", "--no-live")


def start_run(home: Path, logdir: Path) -> subprocess.Popen:
    """A launcher of a run that trains until it is stopped."""
    return subprocess.Popen([PSFLOW, "run", *LONG, "--logdir", str(logdir), REGRESSION, "--", "--epochs", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=task_env(PSFLOW_HOME=str(home)), cwd=ROOT, start_new_session=True)


def wait_until(check, *, what: str, timeout_s: float = 120.0, context=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)  # a poll, not a synchronisation: the loop ends on the condition or the deadline
    raise AssertionError(f"{what}: not within {timeout_s} s\n{context()}")


def lock_holder(logdir: Path) -> Holder | None:
    try:
        return Holder.from_text((logdir / LOCK_FILE).read_text())
    except OSError:
        return None


def test_a_second_run_into_a_logdir_in_use_is_refused_at_once_and_the_first_goes_on(tmp_path, procs):
    home, logdir = tmp_path / "home", tmp_path / "run"
    first = start_run(home, logdir)
    procs.append(first)
    holder = wait_until(lambda: lock_holder(logdir), what="the first launcher holding its logdir")
    assert (holder.pid, holder.host) == (first.pid, socket.gethostname())
    run = wait_for_run(home / "jobs.db", lambda r: r["id"] == holder.run_id and r["state"] == "running",
                       what="the first run running", context=lambda: log_tails(logdir))

    t0 = time.monotonic()
    second = psflow_in(home, "run", *LONG, "--logdir", str(logdir), REGRESSION, "--", "--epochs", "1", timeout_s=120)
    took_s = time.monotonic() - t0
    assert second.returncode == 1, second.stdout + second.stderr
    said = second.stderr
    assert f"Log directory {logdir} is in use by run {run['id']} (pid {first.pid} on {socket.gethostname()}" in said, said
    assert f"psflow stop {run['id']}" in said and "--logdir NEW" in said
    assert "psflow: run " not in second.stdout  # refused before it announced or started anything
    with JobStore(home / "jobs.db") as store:
        assert [r["id"] for r in store.runs(metrics=False)] == [run["id"]]  # the refused run was never recorded
    assert first.poll() is None and lock_holder(logdir).run_id == run["id"]

    first.send_signal(signal.SIGINT)
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 130, out[-3000:]
    assert json.loads((logdir / "summary.json").read_text())["run_id"] == run["id"]
    assert (logdir / LOCK_FILE).read_text() == ""  # given up at the end
    print(f"second run refused in {took_s:.1f} s")


def test_a_lock_left_by_a_dead_launcher_is_taken_over_with_a_note(tmp_path):
    logdir = tmp_path / "run"
    logdir.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait(timeout=30)
    stale = Holder("20250101-000000-dead00", gone.pid, socket.gethostname(), time.time() - 60)
    (logdir / LOCK_FILE).write_text(stale.to_text())  # what a launcher killed with SIGKILL leaves

    done = psflow_in(tmp_path / "home", "run", *LONG, "--logdir", str(logdir), REGRESSION, "--", "--epochs", "1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    assert (f"psflow: note: {logdir}: took over the lock of run 20250101-000000-dead00 (pid {gone.pid} on "
            f"{socket.gethostname()}") in done.stdout, done.stdout[-3000:]
    assert "which ended without releasing it" in done.stdout
    assert (logdir / LOCK_FILE).read_text() == ""


def test_two_quick_restarts_of_one_run_give_one_live_run(tmp_path, procs):
    home, logdir = tmp_path / "home", tmp_path / "run"
    db = home / "jobs.db"
    first = start_run(home, logdir)
    procs.append(first)
    run = wait_for_run(db, lambda r: r["state"] == "running", what="running", context=lambda: log_tails(logdir))

    restarts = [subprocess.Popen([PSFLOW, "restart", run["id"], "--detach"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=task_env(PSFLOW_HOME=str(home)), cwd=ROOT)
                for _ in range(2)]
    said = [p.communicate(timeout=120)[0] for p in restarts]
    first.communicate(timeout=120)
    assert first.returncode == 130  # stopped by the restarts

    def refused() -> str:
        refusals = [s for s in said if "is in use by run" in s]
        log = (logdir / "launcher.log").read_text() if (logdir / "launcher.log").exists() else ""
        return "\n".join(refusals) + ("\n" + log if "is in use by run" in log else "")

    # The second is refused: by its command (the first launcher already queued), or by its launcher.
    why = wait_until(refused, what="one restart refused", context=lambda: "\n".join(said))
    new = wait_for_run(db, lambda r: r.get("restarted_from") == run["id"] and r["state"] == "running",
                       what="the restart running", context=lambda: why)
    assert f"in use by run {new['id']}" in why or f"run {new['id']} (pid" in why or "restart waiting for" in why, why
    with JobStore(db) as store:
        restarted = [r["id"] for r in store.runs(metrics=False) if r.get("restarted_from") == run["id"]]
    assert restarted == [new["id"]], (restarted, why)
    assert lock_holder(logdir).run_id == new["id"]

    stopped = psflow_in(home, "stop", new["id"])
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    pid = new["launcher"]["pid"]
    wait_until(lambda: not pid_alive(pid), what="the restarted run's launcher ending", timeout_s=60)
