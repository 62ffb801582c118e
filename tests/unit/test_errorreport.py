"""Error reports: what a failing task writes, whole or not at all, and what the launcher reads back."""

from __future__ import annotations

import json
import sys

from psflow import errorreport
from psflow.errors import ConfigError


def _raise(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - the test wants the exception with its traceback
        return e


def test_a_written_report_reads_back_with_task_exception_message_and_traceback(tmp_path):
    exc = _raise(ConfigError("bad port 99999"))
    path = errorreport.path_for(tmp_path / "errors", "worker:1")
    assert path == tmp_path / "errors" / "worker-1.json"
    assert errorreport.write(path, "worker:1", exc)  # the directory is made if missing
    report = errorreport.read(tmp_path / "errors", "worker:1")
    assert report is not None
    assert report["task"] == "worker:1" and report["exception"] == "ConfigError" and report["message"] == "bad port 99999"
    assert "raise exc" in report["traceback"] and report["traceback"].rstrip().endswith("ConfigError: bad port 99999")
    assert isinstance(report["time_unix"], float)
    assert errorreport.read(path) == report  # by path, too
    assert [p.name for p in (tmp_path / "errors").iterdir()] == ["worker-1.json"]  # no temporary left behind


def test_an_explicit_traceback_is_the_one_reported(tmp_path):
    outer = _raise(ValueError("outer"))
    inner = _raise(KeyError("inner"))
    errorreport.write(tmp_path / "r.json", "ps:0", outer, inner.__traceback__)
    report = errorreport.read(tmp_path / "r.json")
    assert report is not None and report["exception"] == "ValueError" and "ValueError: outer" in report["traceback"]


def test_a_later_report_replaces_the_earlier_one(tmp_path):
    path = tmp_path / "chief-0.json"
    errorreport.write(path, "chief:0", _raise(RuntimeError("first")))
    errorreport.write(path, "chief:0", _raise(RuntimeError("second")))
    assert errorreport.read(path)["message"] == "second"  # type: ignore[index]


def test_writing_where_the_disk_refuses_returns_false_without_raising(tmp_path):
    blocker = tmp_path / "errors"
    blocker.write_text("a file where the directory should be")
    assert errorreport.write(blocker / "worker-0.json", "worker:0", _raise(RuntimeError("x"))) is False


def test_a_missing_or_unreadable_report_reads_as_none(tmp_path):
    assert errorreport.read(tmp_path, "worker:0") is None
    (tmp_path / "worker-0.json").write_text('{"task": "worker:0", "mess')  # a writer that was not atomic
    assert errorreport.read(tmp_path, "worker:0") is None
    (tmp_path / "worker-0.json").write_text(json.dumps(["not", "a", "report"]))
    assert errorreport.read(tmp_path, "worker:0") is None
    assert errorreport.read(tmp_path) is None  # a directory without a task


def test_the_report_module_stays_light():
    """The task imports it before torch; it must not pull torch in (checked in a fresh interpreter)."""
    import subprocess

    code = "import sys, psflow.errorreport, psflow.taskenv; print('torch' in sys.modules, 'psflow.launch.local' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == ["False", "False"]


_FAILING = """
import os, signal, sys, time
from psflow.errorreport import ignore_stop_requests
ignore_stop_requests()
print("reported", flush=True)
if sys.argv[1] == "stopped-now":
    os.kill(os.getpid(), signal.SIGTERM)
time.sleep(float(sys.argv[2]))  # its teardown, slow on a busy machine
sys.exit(3)
"""


def test_a_failing_task_that_is_asked_to_stop_ends_by_itself_with_its_own_exit_code():
    import subprocess

    r = subprocess.run([sys.executable, "-c", _FAILING, "stopped-now", "0.2"], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (3, "reported\n"), r.stderr


def test_a_stop_during_a_failing_tasks_teardown_does_not_make_it_read_as_killed():
    import signal
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", _FAILING, "stopped-later", "1.0"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "reported\n"
        p.send_signal(signal.SIGTERM)  # as the launcher stops the others on the first exit
        assert p.wait(timeout=30) == 3
    finally:
        p.kill()
        p.wait(timeout=30)
