"""Error reports: what a failing task writes, whole or not at all, and what the launcher reads back."""

from __future__ import annotations

import json
import sys

from psflow.errors import ConfigError
from psflow.launch import errorreport


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

    code = "import sys, psflow.launch.errorreport, psflow.launch.contract; print('torch' in sys.modules, 'psflow.launch.local' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == ["False", "False"]
