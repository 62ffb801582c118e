"""Unit tests of psflow.launch.status: the run's live state, status.json and its table."""

from __future__ import annotations

import io
import json
import re

from rich.console import Console

from psflow.launch.status import RunStatus, headline, read_status, render

TASKS = ["ps:0", "worker:0", "worker:1"]


def _status(tmp_path, **kw) -> RunStatus:
    return RunStatus("run-1", TASKS, tmp_path, mode="sync", **kw)


def test_tasks_go_from_starting_to_running_to_exited_and_the_file_follows(tmp_path):
    st = _status(tmp_path, min_interval_s=0.0)
    assert [t["state"] for t in st.snapshot()["tasks"].values()] == ["starting"] * 3
    st.started("worker:0", 101)
    st.on_event("registered", {"task": "worker:0", "address": "127.0.0.1:5000"})
    st.on_event("report", {"task": "worker:0", "metrics": {"progress": {
        "global_step": 7, "local_step": 4, "examples": 400, "examples_per_sec": 1234.5, "loss": 0.5, "junk": 1}}})
    on_disk = read_status(tmp_path)
    w0 = on_disk["tasks"]["worker:0"]
    assert (w0["state"], w0["pid"], w0["address"]) == ("running", 101, "127.0.0.1:5000")
    assert w0["progress"] == {"global_step": 7, "local_step": 4, "examples": 400, "examples_per_sec": 1234.5, "loss": 0.5}
    assert on_disk["global_step"] == 7 and on_disk["running"] == 1 and on_disk["mode"] == "sync"
    st.exited("worker:0", 0)
    st.finished("succeeded")
    on_disk = read_status(tmp_path)
    assert on_disk["state"] == "succeeded"
    assert on_disk["tasks"]["worker:0"]["state"] == "exited" and on_disk["tasks"]["worker:0"]["exit_code"] == 0


def test_final_reports_update_progress_and_unknown_tasks_are_ignored(tmp_path):
    st = _status(tmp_path)
    st.on_event("report", {"task": "worker:1", "metrics": {"trainer": {"global_step": 90, "local_step": 45, "mode": "sync"}}})
    st.on_event("report", {"task": "ps:0", "metrics": {"global_step": 91, "ps_stats": {"pushes": 3}}})
    st.on_event("report", {"task": "worker:9", "metrics": {"progress": {"global_step": 10**6}}})
    snap = st.snapshot()
    assert snap["tasks"]["worker:1"]["progress"] == {"global_step": 90, "local_step": 45}
    assert snap["tasks"]["ps:0"]["progress"] == {"global_step": 91}
    assert "worker:9" not in snap["tasks"] and snap["global_step"] == 91


def test_writes_are_throttled_but_the_last_change_is_published_by_a_later_call(tmp_path):
    st = _status(tmp_path, min_interval_s=3600.0)
    st.started("ps:0", 5)  # the first write goes out
    assert read_status(tmp_path)["tasks"]["ps:0"]["pid"] == 5
    st.started("ps:0", 6)  # within the interval: not written yet
    assert read_status(tmp_path)["tasks"]["ps:0"]["pid"] == 5
    st.write(force=True)
    assert read_status(tmp_path)["tasks"]["ps:0"]["pid"] == 6
    assert not list(tmp_path.glob(".status.json.*"))  # no temporary file left behind


def test_first_write_goes_out_on_a_freshly_booted_machine(tmp_path, monkeypatch):
    # A new machine's monotonic clock starts near 0: "never written" must not read as "written at 0".
    import psflow.launch.status as status_mod

    monkeypatch.setattr(status_mod.time, "monotonic", lambda: 3.0)
    st = _status(tmp_path, min_interval_s=3600.0)
    st.started("ps:0", 7)
    assert read_status(tmp_path)["tasks"]["ps:0"]["pid"] == 7


def test_headline_is_the_jobs_examples_over_the_longest_wall_time_and_the_largest_step():
    state = {"tasks": {
        "worker:0": {"state": "running", "progress": {"global_step": 10, "examples": 300, "train_time_s": 1.0,
                                                      "wall_time_s": 3.0, "examples_per_sec": 100.0}},
        "worker:1": {"state": "exited", "progress": {"global_step": 12, "examples": 300, "train_time_s": 2.0,
                                                     "wall_time_s": 6.0, "examples_per_sec": 50}},
        "ps:0": {"state": "running", "progress": {"global_step": 12}},
    }}
    # Not the sum of the tasks' own rates (150): 600 examples in the slowest worker's 6 s of wall clock;
    # inside the steps, 600 in its 2 s.
    assert headline(state) == {"global_step": 12, "examples_per_sec": 100.0, "step_examples_per_sec": 300.0, "running": 2}


def test_render_shows_every_task_and_does_not_read_names_as_markup(tmp_path):
    st = _status(tmp_path)
    st.on_event("report", {"task": "worker:1", "metrics": {"progress": {"global_step": 1500, "loss": 0.25}}})
    st.exited("ps:0", 0)
    st.exited("worker:0", -15)
    buf = io.StringIO()
    Console(file=buf, width=140, color_system=None).print(render(st.snapshot()))
    out = buf.getvalue()
    assert "psflow run run-1 (running, sync): global step 1,500" in out
    assert "done" in out and "exit -15" in out and "starting" in out and "0.25" in out
    json.dumps(st.snapshot())  # the state stays plain JSON


# -- a live run or an abandoned one (issue 8, item 9) --------------------------------------------

def _dead_identity() -> dict:
    """The identity of a real process that has exited (taken while it lived)."""
    import subprocess
    import sys

    from psflow.launch.liveness import process_identity

    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    identity = process_identity(p.pid)
    p.communicate(b"", timeout=30)
    return identity


def test_status_names_its_launcher_and_a_live_launcher_reads_running(tmp_path):
    import os
    import time

    from psflow.launch.liveness import assess

    st = _status(tmp_path)
    st.started("worker:0", os.getpid())
    on_disk = read_status(tmp_path)
    assert on_disk["launcher"]["pid"] == os.getpid() and on_disk["launcher"]["start_ticks"] is not None
    assert isinstance(on_disk["heartbeat_unix"], float)
    seen = assess(on_disk, now_unix=time.time())
    assert seen["state"] == "running" and "note" not in seen and seen["tasks"]["worker:0"]["alive"] is True


def test_a_run_whose_launcher_died_reads_abandoned_and_names_the_dead_pids(tmp_path):
    from click.testing import CliRunner

    from psflow.cli import main

    st = _status(tmp_path)
    launcher, task = _dead_identity(), _dead_identity()
    st.started("worker:0", task["pid"])
    state = read_status(tmp_path)
    state["launcher"] = launcher
    (tmp_path / "status.json").write_text(json.dumps(state))
    r = CliRunner().invoke(main, ["status", str(tmp_path)], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "(abandoned, sync)" in r.output
    assert f"abandoned: launcher pid {launcher['pid']} is gone" in r.output
    assert f"worker:0 (pid {task['pid']})" in r.output and "gone" in r.output


def test_a_reused_pid_is_not_the_launcher(tmp_path):
    import os
    import time

    from psflow.launch.liveness import assess, process_identity

    st = _status(tmp_path)
    st.write()
    state = read_status(tmp_path)
    state["launcher"] = {**process_identity(os.getpid()), "start_ticks": process_identity(os.getpid())["start_ticks"] - 1}
    assert assess(state, now_unix=time.time())["state"] == "abandoned"
    st.finished("failed")  # a finished run stays what it was
    assert assess(read_status(tmp_path), now_unix=time.time())["state"] == "failed"


def test_a_quiet_run_still_writes_its_heartbeat(tmp_path, monkeypatch):
    import psflow.launch.status as status_mod

    clock = [100.0]
    monkeypatch.setattr(status_mod.time, "monotonic", lambda: clock[0])
    st = _status(tmp_path, min_interval_s=0.5, heartbeat_s=5.0)
    st.write()
    first = read_status(tmp_path)["heartbeat_unix"]
    clock[0] += 1.0
    st.write()  # nothing changed, heartbeat not due: no write
    assert read_status(tmp_path)["heartbeat_unix"] == first
    clock[0] += 5.0
    st.write()
    assert read_status(tmp_path)["heartbeat_unix"] > first


def test_summary_of_a_run_without_summary_json_says_so_and_shows_the_status(tmp_path):
    from click.testing import CliRunner

    from psflow.cli import main

    _status(tmp_path).started("worker:0", 4242)
    r = CliRunner().invoke(main, ["summary", str(tmp_path)], terminal_width=200)
    assert r.exit_code == 1 and not isinstance(r.exception, (KeyError, ValueError, OSError)), r.output
    assert "no summary at" in r.output and "writes it when the run ends" in r.output
    assert "the run is running" in r.output and "worker:0" in r.output and "Traceback" not in r.output
    (tmp_path / "summary.json").write_text('{"run_id": "run-1", "sta')
    r = CliRunner().invoke(main, ["summary", str(tmp_path)], terminal_width=200)
    assert r.exit_code == 1 and "cannot be read" in r.output and "Traceback" not in r.output, r.output


def test_every_exit_is_kept_with_its_cause_and_a_restart_shows_until_the_next_attempt_starts(tmp_path):
    st = _status(tmp_path, min_interval_s=0.0)
    st.started("worker:1", 101)
    st.exited("worker:1", -9, attempt=0, at=st.snapshot()["tasks"]["worker:1"]["started_unix"] + 12.0)
    st.restarting("worker:1", 1, after_s=1.0)
    w1 = read_status(tmp_path)["tasks"]["worker:1"]
    assert w1["state"] == "restarting" and w1["restart_unix"] is not None
    [x] = w1["exits"]
    assert (x["attempt"], x["code"], x["signal"], x["cause"], x["ran_s"], x["restarted"]) == (
        0, -9, "SIGKILL", "killed (SIGKILL)", 12.0, True)
    buf = io.StringIO()
    Console(file=buf, width=160, color_system=None).print(render(st.snapshot()))
    row = next(line for line in buf.getvalue().splitlines() if "worker:1" in line)
    assert re.search(r"worker:1 +│ restarting +│ +0 │", row), buf.getvalue()  # state, attempt
    assert "worker:1 attempt 0: killed (SIGKILL) after 12.0 s; restarted" in buf.getvalue()
    st.started("worker:1", 102, attempt=1)
    st.exited("worker:1", 0, attempt=1)
    w1 = read_status(tmp_path)["tasks"]["worker:1"]
    assert (w1["state"], w1["attempt"], [x["cause"] for x in w1["exits"]]) == ("exited", 1, ["killed (SIGKILL)", "exit code 0"])
    buf = io.StringIO()
    Console(file=buf, width=160, color_system=None).print(render(st.snapshot()))
    row = next(line for line in buf.getvalue().splitlines() if "worker:1" in line)
    assert re.search(r"worker:1 +│ done +│ +1 │", row), buf.getvalue()
    assert "worker:1 attempt 0: killed (SIGKILL) after 12.0 s; restarted" in buf.getvalue()


def test_a_task_killed_for_memory_says_so_in_the_table(tmp_path):
    st = _status(tmp_path)
    st.started("worker:0", 101)
    st.exited("worker:0", -9, oom_killed=True)
    buf = io.StringIO()
    Console(file=buf, width=160, color_system=None).print(render(st.snapshot()))
    assert "exit -9 (SIGKILL; out of memory?)" in buf.getvalue()


def test_the_table_names_every_task_in_full_on_a_narrow_terminal_and_shows_attempts_only_after_a_restart(tmp_path):
    st = RunStatus("20261124-005654-b4020d", TASKS, tmp_path, mode="async")
    for i, t in enumerate(TASKS):
        st.started(t, 14008 + i)
        st.on_event("report", {"task": t, "metrics": {"progress": {
            "global_step": 751, "local_step": 340, "examples_per_sec": 35542.3, "loss": 0.7581}}})
    for restarted in (False, True):
        if restarted:
            st.exited("worker:1", -9)
            st.restarting("worker:1", 1, after_s=1.0)
        buf = io.StringIO()
        Console(file=buf, width=80, color_system=None).print(render(st.snapshot()))
        out = buf.getvalue()
        assert all(f"│ {t} " in out for t in TASKS) and ("│ restarting " in out) is restarted, out
        assert ("attempt" in out) is restarted, out


def test_a_ps_progress_keeps_whether_it_is_resyncing_which_psflow_chaos_waits_for(tmp_path):
    from psflow.chaos.injector import is_ready

    st = _status(tmp_path, min_interval_s=0.0)
    st.started("ps:0", 7)
    for resyncing in (True, False):
        st.on_event("report", {"task": "ps:0", "metrics": {"progress": {
            "global_step": 9, "pushes": 9, "stale_dropped": 0, "resyncing": resyncing, "time_unix": 5.0}}})
        entry = read_status(tmp_path)["tasks"]["ps:0"]
        assert entry["progress"]["resyncing"] is resyncing
        assert is_ready("ps:0", entry, started_at=4.0) is not resyncing
