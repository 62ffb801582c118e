"""One logdir, one live run (psflow.logdirlock): the pure rules (who holds it, when a holder
is gone, what the refusal says, where a URL logdir's lock lives), then real flocks: held, refused,
released, taken over from a killed holder and from a dead pid whose descriptor lives on, re-entrant
per run, a restart's wait for the run it restarts and its one queue place."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from psflow import logdirlock
from psflow.logdirlock import (
    BY_HAND,
    UNKNOWN_START,
    Holder,
    LogdirInUseError,
    LogdirLock,
    hold,
    in_use_message,
    is_stale,
    lock_path,
    process_start,
    this_holder,
)

HOST = socket.gethostname()
pytestmark = pytest.mark.timeout(60)


def dead_pid() -> int:
    """A pid that ran on this host and no longer does."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    return p.pid


# -- the pure rules ---------------------------------------------------------------------------------
def test_a_holder_round_trips_through_its_file_and_garbage_names_nobody():
    h = Holder("20250101-120000-ab12cd", 4242, "node1", 1.5e9, pid_start=777)
    assert Holder.from_text(h.to_text()) == h
    for text in ("", "{", "[]", '{"run_id": "r"}', '{"run_id": "r", "pid": "x", "host": "h", "since_unix": 0}'):
        assert Holder.from_text(text) is None


def test_only_a_holder_on_this_host_whose_process_is_gone_is_stale():
    h = Holder("r", 123, HOST, 0.0, pid_start=500)
    assert is_stale(h, host=HOST, start_of=lambda pid: None)  # no such process
    assert is_stale(h, host=HOST, start_of=lambda pid: 900)  # the pid now runs a newer process
    assert not is_stale(h, host=HOST, start_of=lambda pid: 500)  # the holder itself
    assert not is_stale(h, host=HOST, start_of=lambda pid: UNKNOWN_START)  # runs; cannot tell: trusted
    assert not is_stale(Holder("r", 123, HOST, 0.0), host=HOST, start_of=lambda pid: 900)  # no start recorded
    assert not is_stale(Holder("r", 123, "node9", 0.0), host=HOST, start_of=lambda pid: None)  # out of sight


def test_process_start_tells_a_live_process_from_a_gone_one():
    assert process_start(os.getpid()) not in (None, UNKNOWN_START)
    assert process_start(dead_pid()) is None


def test_the_refusal_names_the_run_and_what_to_do():
    h = Holder("20250101-120000-ab12cd", 4242, HOST, time.time())
    text = in_use_message("runs/a", h, lock_file="runs/a/.psflow.lock", host=HOST)
    assert text.startswith("Log directory runs/a is in use by run 20250101-120000-ab12cd (pid 4242 on " + HOST)
    assert "overwrite each other's logs, events, summary and checkpoints" in text
    assert "--logdir NEW" in text and "psflow stop 20250101-120000-ab12cd" in text
    assert "psflow restart 20250101-120000-ab12cd" in text and "delete" not in text

    remote = in_use_message("runs/a", Holder("r1", 7, "node9", 0.0), lock_file="runs/a/.psflow.lock", host=HOST)
    assert "If node9 is gone" in remote and "delete runs/a/.psflow.lock" in remote

    by_hand = in_use_message("runs/a", Holder("worker:0", 7, HOST, 0.0, role=BY_HAND), lock_file="x", host=HOST)
    assert "a chief started by hand (worker:0; pid 7 on" in by_hand and "psflow stop" not in by_hand
    queued = in_use_message("runs/a", Holder("run-b", 7, HOST, 0.0, role="restart waiting for run-a"), lock_file="x",
                            host=HOST)
    assert "restart waiting for run-a)" in queued and "Run run-b restarts run run-a already" in queued
    assert "psflow status run-b" in queued and "psflow stop" not in queued
    url = in_use_message("s3://b/run", Holder("r1", 7, HOST, 0.0), lock_file="x", host=HOST, url=True)
    assert url.startswith("URL logdir s3://b/run is in use by run r1")


def test_a_url_logdir_is_locked_by_a_file_named_after_the_url_under_psflow_home(tmp_path):
    assert lock_path("runs/a", None, tmp_path) == Path("runs/a/.psflow.lock")
    one = lock_path("/stage/x-1", "s3://bucket/exp/run1/", tmp_path)
    assert one.parent == tmp_path / "locks" and one.name.startswith("run1-")
    assert lock_path("/stage/x-2", "s3://bucket/exp/run1", tmp_path) == one  # its own staging dir: the same lock
    assert lock_path("/stage/x-1", "s3://bucket/exp2/run1", tmp_path) != one


# -- real locks -------------------------------------------------------------------------------------
def test_a_second_lock_on_a_held_logdir_is_refused_naming_the_first_until_it_is_released(tmp_path):
    path = tmp_path / ".psflow.lock"
    first = LogdirLock(path, this_holder("run-1"), where=str(tmp_path))
    assert first.acquire() is None
    assert Holder.from_text(path.read_text()).run_id == "run-1"
    with pytest.raises(LogdirInUseError, match=f"is in use by run run-1 \\(pid {os.getpid()} on"):
        LogdirLock(path, this_holder("run-2"), where=str(tmp_path)).acquire()
    assert LogdirLock(path, this_holder("run-2")).probe().run_id == "run-1"
    first.release()
    assert path.read_text() == ""  # a clean release: the next run finds no holder to take over from
    with LogdirLock(path, this_holder("run-2")) as second:
        assert second.held and Holder.from_text(path.read_text()).run_id == "run-2"


HOLD_SCRIPT = """
import sys, time
from pathlib import Path
from psflow.logdirlock import LogdirLock, this_holder
lock = LogdirLock(Path(sys.argv[1]), this_holder("run-killed"))
lock.acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_lock_left_by_a_killed_launcher_is_taken_over_with_a_note(tmp_path):
    path = tmp_path / ".psflow.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_SCRIPT, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LogdirInUseError, match=f"run run-killed \\(pid {holder.pid} on {HOST}"):
            LogdirLock(path, this_holder("run-2")).acquire()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    lock = LogdirLock(path, this_holder("run-2"), where="runs/a")
    note = lock.acquire()
    assert note is not None and note.startswith(f"runs/a: took over the lock of run run-killed (pid {holder.pid} on")
    assert note.endswith("which ended without releasing it.")
    lock.release()


def test_a_held_lock_naming_a_dead_pid_on_this_host_is_taken_over_on_a_new_file(tmp_path):
    path = tmp_path / ".psflow.lock"
    # what a child that inherited a dead launcher's descriptor leaves: the flock held, the holder gone
    leftover = os.open(path, os.O_RDWR | os.O_CREAT)
    import fcntl

    fcntl.flock(leftover, fcntl.LOCK_EX)
    gone = dead_pid()
    os.write(leftover, Holder("run-dead", gone, HOST, time.time(), pid_start=1).to_text().encode())
    try:
        lock = LogdirLock(path, this_holder("run-2"), where="runs/a")
        note = lock.acquire()
        assert note is not None and f"pid {gone} no longer runs on this host" in note
        assert os.stat(path).st_ino != os.fstat(leftover).st_ino  # a new lock file, not the leftover's
        assert Holder.from_text(path.read_text()).run_id == "run-2"
        with pytest.raises(LogdirInUseError, match="in use by run run-2"):
            LogdirLock(path, this_holder("run-3")).acquire()
        lock.release()
    finally:
        os.close(leftover)


def test_a_held_lock_on_another_host_or_an_unreadable_one_is_trusted(tmp_path):
    import fcntl

    path = tmp_path / ".psflow.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        os.write(fd, Holder("run-far", dead_pid(), "node9", time.time()).to_text().encode())
        with pytest.raises(LogdirInUseError, match="run run-far .*If node9 is gone"):
            LogdirLock(path, this_holder("run-2")).acquire()
        os.ftruncate(fd, 0)
        with pytest.raises(LogdirInUseError, match="another process .* is locked but names no run"):
            LogdirLock(path, this_holder("run-2")).acquire()
    finally:
        os.close(fd)


def test_hold_is_re_entrant_for_one_run_and_refuses_another(tmp_path):
    path = tmp_path / ".psflow.lock"
    with hold(path, "run-1") as outer:
        with hold(path, "run-1") as inner:
            assert inner is outer
        assert outer.held  # the inner block's end does not give it up
        with pytest.raises(LogdirInUseError, match="in use by run run-1"), hold(path, "run-2"):
            pass
    assert not outer.held and path.read_text() == ""


def test_a_restart_waits_for_the_run_it_restarts_and_refuses_another_at_once(tmp_path):
    path = tmp_path / ".psflow.lock"
    old = LogdirLock(path, this_holder("run-old"))
    old.acquire()
    t0 = time.monotonic()
    with pytest.raises(LogdirInUseError, match="in use by run run-old"):
        LogdirLock(path, this_holder("run-new")).acquire(wait_for_run="run-other", wait_s=30)
    assert time.monotonic() - t0 < 5  # not waited for: not the run it restarts
    threading.Timer(0.3, old.release).start()
    new = LogdirLock(path, this_holder("run-new"))
    assert new.acquire(wait_for_run="run-old", wait_s=30) is None
    new.release()


def test_of_two_restarts_of_one_run_the_second_is_refused(tmp_path):
    path = tmp_path / ".psflow.lock"
    old = LogdirLock(path, this_holder("run-old"))
    old.acquire()
    first, second = LogdirLock(path, this_holder("run-a")), LogdirLock(path, this_holder("run-b"))
    first.check(after_run="run-old")
    first.queue_behind("run-old")
    with pytest.raises(LogdirInUseError, match="run run-a .*restart waiting for run-old"):
        second.check(after_run="run-old")
    with pytest.raises(LogdirInUseError, match="run run-a .*restart waiting for run-old"):
        second.queue_behind("run-old")
    old.release()
    first.acquire(wait_for_run="run-old", wait_s=30)  # gives its queue place up
    with pytest.raises(LogdirInUseError, match=r"in use by run run-a \(pid"):
        second.check(after_run="run-old")
    with pytest.raises(LogdirInUseError, match=r"in use by run run-a \(pid"):
        second.acquire(wait_for_run="run-old", wait_s=30)  # its holder is not the run it waits for: at once
    first.release()


def test_a_filesystem_without_locks_lets_the_run_go_on_with_a_warning(tmp_path, monkeypatch, capsys):
    import errno

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(logdirlock.fcntl, "flock", no_locks)
    with LogdirLock(tmp_path / ".psflow.lock", this_holder("run-1")) as lock:
        assert not lock.held
    assert "does not take file locks (No locks available)" in capsys.readouterr().out


def test_a_url_logdir_is_held_under_psflow_home_whatever_the_staging_dir(tmp_path, monkeypatch):
    from psflow.logdirlock import hold_run

    monkeypatch.setenv("PSFLOW_HOME", str(tmp_path / "home"))
    with hold_run(str(tmp_path / "stage-1"), "s3://bucket/run", "run-1"):
        with pytest.raises(LogdirInUseError, match="URL logdir s3://bucket/run/ is in use by run run-1"), \
                hold_run(str(tmp_path / "stage-2"), "s3://bucket/run/", "run-2"):
            pass
    assert not (tmp_path / "stage-1").exists()  # nothing in a staging dir: the lock is in PSFLOW_HOME/locks
