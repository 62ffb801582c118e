"""psflow.launch.oomkills: where the OOM-kill counter lies (cgroup v1, v2) and one claim per OOM kill."""

from __future__ import annotations

from pathlib import Path

from psflow.launch.oomkills import OomKills, counter_file, read_count

V1 = "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n"
V2 = "0::/user.slice/session-1.scope\n"


def test_the_counter_is_the_memory_controllers_in_v1_and_memory_events_in_v2(tmp_path: Path) -> None:
    assert counter_file(V1, tmp_path) == tmp_path / "memory" / "process_api" / "abc" / "memory.oom_control"
    assert counter_file(V2, tmp_path) == tmp_path / "user.slice" / "session-1.scope" / "memory.events"
    assert counter_file("", tmp_path) is None


def test_an_exit_is_oom_killed_only_where_the_counter_rose_and_each_rise_is_claimed_once(tmp_path: Path) -> None:
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 1\noom_group_kill 0\n")
    kills = OomKills(events)
    assert kills.claim() is False  # a SIGKILL with no new OOM kill: someone else's kill
    events.write_text("oom 4\noom_kill 3\n")
    assert [kills.claim(), kills.claim(), kills.claim()] == [True, True, False]


def test_no_readable_counter_is_no_evidence(tmp_path: Path) -> None:
    assert read_count(tmp_path / "missing") is None and read_count(None) is None
    kills = OomKills(tmp_path / "missing")
    assert kills.claim() is False
    (tmp_path / "missing").write_text("oom_kill 5\n")  # appears later: still no baseline, no claim
    assert kills.claim() is False
