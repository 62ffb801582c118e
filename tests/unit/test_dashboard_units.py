"""The dashboard's pure parts: reading a log's tail and following it, the run-directory guard, the
bind rules of psflow ui, the Host names it answers to, and a page of runs from a real SQLite store."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from psflow.errors import ConfigError
from psflow.platform.jobstore import JobStore
from psflow.platform.runfiles import RunFileError, checkpoint_path, inside, log_path, read_log
from psflow.platform.uiserver import is_loopback, settings_for


def test_a_tail_starts_at_a_line_and_following_reads_what_came_after(tmp_path):
    log = tmp_path / "w.log"
    log.write_bytes(b"".join(f"line {i}\n".encode() for i in range(100)))
    tail = read_log(log, offset=None, max_bytes=30)
    assert tail.text.startswith("line ") and tail.text.endswith("line 99\n") and tail.next_offset == tail.size
    with log.open("ab") as f:
        f.write(b"line 100\n")
    more = read_log(log, offset=tail.next_offset, max_bytes=1 << 20)
    assert (more.text, more.offset, more.next_offset) == ("line 100\n", tail.size, tail.size + 9)
    assert read_log(log, offset=10**9, max_bytes=8).offset == 0  # rotated: from the start again
    assert read_log(tmp_path / "none.log", offset=None, max_bytes=8).to_dict() == {"text": "", "offset": 0,
                                                                                    "next_offset": 0, "size": 0}


def test_only_the_runs_own_tasks_and_checkpoints_inside_its_directory_are_served(tmp_path):
    run = {"id": "r", "logdir": str(tmp_path / "run"), "tasks": {"worker:0": {}}}
    (tmp_path / "run" / "checkpoints" / "ckpt-0000000005").mkdir(parents=True)
    assert log_path(run, "worker:0") == (tmp_path / "run" / "logs" / "worker-0.log").resolve()
    for task in ("../../etc/passwd", "worker:1", ""):
        with pytest.raises(RunFileError, match="is not a task of run r"):
            log_path(run, task)
    assert checkpoint_path(run, "ckpt-0000000005").name == "ckpt-0000000005"
    for name in ("../x", "ckpt-1/../..", "ckpt-"):
        with pytest.raises(RunFileError, match="is not a checkpoint name"):
            checkpoint_path(run, name)
    with pytest.raises(RunFileError, match="has no checkpoint ckpt-7"):
        checkpoint_path(run, "ckpt-7")
    with pytest.raises(RunFileError, match="outside the run's directory"):
        inside(tmp_path / "run", tmp_path / "run" / ".." / "elsewhere")


def test_psflow_ui_binds_off_loopback_only_when_told_twice(tmp_path):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")
    local = settings_for("127.0.0.1", allow_remote=False, env={"PSFLOW_HOME": str(tmp_path)})
    assert len(local.token) >= 24 and not local.auth_reads and local.db_path == tmp_path / "jobs.db"
    with pytest.raises(ConfigError, match="add --allow-remote"):
        settings_for("0.0.0.0", allow_remote=False, env={"PSFLOW_UI_TOKEN": "t" * 32})
    with pytest.raises(ConfigError, match="needs a token of your own"):
        settings_for("0.0.0.0", allow_remote=True, env={})
    for short in ("chosen", "x" * 15):  # off loopback a token must be long enough not to be guessed
        with pytest.raises(ConfigError, match=f"is {len(short)} characters long;.* at least 16 characters. Generate one: "
                                              "export PSFLOW_UI_TOKEN=.*secrets.token_urlsafe"):
            settings_for("0.0.0.0", allow_remote=True, env={"PSFLOW_UI_TOKEN": short})
    chosen = "c" * 16
    remote = settings_for("0.0.0.0", allow_remote=True, env={"PSFLOW_UI_TOKEN": chosen, "PSFLOW_HOME": str(tmp_path)})
    assert remote.token == chosen and remote.auth_reads  # reads need the token too
    short_local = settings_for("127.0.0.1", allow_remote=False, env={"PSFLOW_UI_TOKEN": "abc", "PSFLOW_HOME": str(tmp_path)})
    assert short_local.token == "abc"  # on loopback the user's own token is theirs to choose


def test_a_page_of_runs_filters_by_state_and_search_and_counts_them_all(tmp_path):
    with JobStore(tmp_path / "jobs.db") as db, db.transaction():
        for i in range(30):
            db.add_run({"id": f"run-{i:02d}", "script": "cnn.py" if i % 3 else "softmax_50%.py", "args": ["--x"],
                        "logdir": "/tmp/x", "cluster": {}, "created_unix": 1000.0 + i}, ["worker:0"])
            db.finish_run(f"run-{i:02d}", "failed" if i % 2 else "succeeded", 2000.0)
    with JobStore(tmp_path / "jobs.db") as db:
        page, total = db.run_page(limit=5)
        assert total == 30 and [r["id"] for r in page] == ["run-29", "run-28", "run-27", "run-26", "run-25"]
        page, total = db.run_page(state="failed", search="cnn", limit=100, offset=2)
        assert total == len([i for i in range(30) if i % 2 and i % 3]) and all(r["state"] == "failed" for r in page)
        assert len(page) == total - 2
        assert db.run_page(search="50%")[1] == 10 and db.run_page(search="run-_1")[1] == 0  # % and _ are literal
        assert list(page[0]["tasks"]) == ["worker:0"]


def _steady(rate: float, seconds: int = 60, start_s: float = 1000.0) -> list[tuple[float, float]]:
    return [(start_s + t, rate * t) for t in range(seconds + 1)]


def test_a_worker_slow_all_along_is_a_persistent_straggler_and_one_slow_spell_is_transient():
    from psflow.platform.stragglers import StragglerRules, find_stragglers

    rules = StragglerRules(windows=6, span_s=None)
    steady = find_stragglers({"worker:0": _steady(100), "worker:1": _steady(98), "worker:2": _steady(30)}, rules)
    assert (steady["slowest"], steady["kind"]) == ("worker:2", "persistent")
    assert steady["workers"]["worker:2"]["slow_windows"] == 6 and steady["workers"]["worker:2"]["vs_median"] == 0.306
    assert steady["verdict"].startswith("worker:2 runs at 0.31x the median worker")
    # worker:1 stalls for the first 10 s only (one window of six), then runs as the others
    spell = [(1000.0 + t, 0.0 if t <= 10 else 100.0 * (t - 10)) for t in range(61)]
    transient = find_stragglers({"worker:0": _steady(100), "worker:1": spell, "worker:2": _steady(100)}, rules)
    assert (transient["slowest"], transient["kind"]) == ("worker:1", "transient")
    assert transient["workers"]["worker:1"]["slow_windows"] == 1
    even = find_stragglers({"worker:0": _steady(100), "worker:1": _steady(95)}, rules)
    assert even["kind"] is None and even["slowest"] is None and even["verdict"].startswith("No straggler")
    # a restart's step going back does not count as a rate; one worker alone has nothing to compare with
    restarted = _steady(100)[:30] + [(1030.0 + t, 10.0 * t) for t in range(31)]
    assert find_stragglers({"worker:0": restarted, "worker:1": _steady(100)}, rules)["windows"] >= 5
    assert find_stragglers({"worker:0": _steady(100)}, rules)["slowest"] is None


def test_alerts_say_a_restart_a_failure_and_a_stall_once_each():
    from psflow.platform.alerts import AlertBook, check_webhook

    book = AlertBook(stall_s=10)
    events = [{"run_id": "r1", "kind": "restart", "data": {"task": "worker:1", "attempt": 1, "reason": "killed (SIGKILL)"}},
              {"run_id": "r1", "kind": "run_finished", "data": {"status": "succeeded"}},
              {"run_id": "r2", "kind": "run_finished", "data": {"status": "failed"}},
              {"run_id": "r3", "kind": "task_started", "data": {"task": "ps:0"}}]
    said = book.on_events(events, {"r2": "worker:0"})
    assert [(a.kind, a.run_id, a.task) for a in said] == [("restarted", "r1", "worker:1"), ("failed", "r2", "worker:0")]
    assert said[0].text == "psflow: run r1: worker:1 restarted as attempt 1 (killed (SIGKILL))"
    assert said[1].text == "psflow: run r2 failed; root cause: worker:0"
    assert book.on_look({"r5": 0}, now=0.0) == [] and book.on_look({"r5": 0}, now=100.0) == []  # not training yet
    assert book.on_look({"r4": 100}, now=0.0) == []
    assert book.on_look({"r4": 100}, now=9.9) == []
    stalled = book.on_look({"r4": 100}, now=10.0)
    assert [(a.kind, a.detail["global_step"]) for a in stalled] == [("stalled", 100)]
    assert book.on_look({"r4": 100}, now=60.0) == []  # told once per stall
    assert book.on_look({"r4": 101}, now=61.0) == []  # it moved: armed again
    assert [a.kind for a in book.on_look({"r4": 101}, now=71.0)] == ["stalled"]
    assert book.on_look({}, now=72.0) == [] and book.on_look({"r4": 101}, now=200.0) == []  # gone, then new: not stalled yet
    for bad in ("ftp://x/hook", "hook", "http://"):
        with pytest.raises(ConfigError, match="is not an http:// or https:// URL"):
            check_webhook(bad)


_DUMPER = """
import faulthandler, sys, threading, time
ready = threading.Event()
def {name}():
    ready.set()
    time.sleep(60)
threading.Thread(target={name}, daemon=True).start()
ready.wait(10)
print("before the dump", flush=True)
faulthandler.dump_traceback(all_threads=True)
sys.stderr.flush()
print("after the dump", flush=True)
"""


def _real_dump(tmp_path, name: str) -> list[str]:
    """A real faulthandler dump of a process with a second thread (in ``name``), as a task's log has it."""
    import subprocess
    import sys

    script = tmp_path / f"{name}.py"
    script.write_text(_DUMPER.format(name=name))
    out = subprocess.run([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=60)
    return out.stdout.splitlines(keepends=True)


def test_a_real_faulthandler_dump_is_parsed_and_tasks_group_by_their_main_stack(tmp_path):
    from psflow.platform.stacks import group_stacks, main_stack, parse_dump

    lines = _real_dump(tmp_path, "sleeper")
    threads = parse_dump(lines)
    assert len(threads) == 2 and threads[-1]["current"]
    assert threads[0]["frames"][0]["function"] == "sleeper" and not threads[0]["current"]
    assert main_stack(threads)[0]["function"] == "<module>" and main_stack(threads)[0]["file"].endswith("sleeper.py")
    assert not any("after the dump" in str(t) for t in threads)  # the dump ends where the output goes on
    assert parse_dump(["no dump here\n"]) == []

    same = main_stack(threads)
    other = main_stack(parse_dump(_real_dump(tmp_path, "other")))
    grouped = group_stacks({"worker:0": same, "worker:1": same, "worker:2": other, "ps:0": other})
    assert [g["tasks"] for g in grouped["groups"]] == [["ps:0", "worker:2"], ["worker:0", "worker:1"]]
    assert [(o["task"], o["job"]) for o in grouped["odd_ones_out"]] == [("worker:2", "worker")]
    assert group_stacks({"worker:0": same, "worker:1": other})["odd_ones_out"] == []  # two apart: no odd one


def test_a_frame_faulthandler_caught_in_flux_is_kept_with_line_zero_and_the_dump_goes_on():
    from psflow.platform.stacks import parse_dump

    threads = parse_dump(['Thread 0x00007f6b7bfff6c0 (most recent call first):\n',
                          '  File "/src/psflow/cluster.py", line ??? in parse\n',
                          '  File "/src/psflow/server.py", line 12 in _serve\n', '\n',
                          'Thread 0x00007f6b7c000000 (most recent call first):\n',
                          '  File "train.py", line 3 in <module>\n'])
    assert [[(f["line"], f["function"]) for f in t["frames"]] for t in threads] == [
        [(0, "parse"), (12, "_serve")], [(3, "<module>")]]


def test_psflow_own_dump_format_reads_back_as_faulthandler_s_with_the_main_thread_last():
    import sys
    import threading

    from psflow.heartbeat import format_stacks
    from psflow.platform.stacks import main_stack, parse_dump

    here = threading.get_ident()
    frames = {here: sys._getframe(), 1: sys._getframe().f_back}
    threads = parse_dump(format_stacks(frames, current=1, main=here).decode().splitlines(keepends=True))
    assert [t["current"] for t in threads] == [True, False]
    me = main_stack(threads)[0]
    assert me["function"] == "test_psflow_own_dump_format_reads_back_as_faulthandler_s_with_the_main_thread_last"
    assert me["file"] == __file__ and me["line"] > 0


def test_the_placement_table_counts_each_piece_and_shard_bytes():
    from psflow.platform.placementview import placement_table

    table = placement_table({"num_shards": 2, "params": [{"name": "fc.weight", "shape": [100, 10], "dtype": "float32"},
                                                         {"name": "fc.bias", "shape": [10], "dtype": "float16"}],
                             "pieces": [{"param": "fc.weight", "shard": 0, "rows": [0, 60]},
                                        {"param": "fc.weight", "shard": 1, "rows": [60, 100]},
                                        {"param": "fc.bias", "shard": 1, "rows": None}]})
    assert [(r["param"], r["shard"], r["bytes"]) for r in table["rows"]] == [("fc.weight", 0, 2400), ("fc.weight", 1, 1600),
                                                                            ("fc.bias", 1, 20)]
    assert table["shards"] == [{"shard": 0, "bytes": 2400, "pieces": 1, "share": 0.597},
                               {"shard": 1, "bytes": 1620, "pieces": 2, "share": 0.403}]


def test_ps_health_gives_each_workers_lag_behind_the_newest_version_and_the_ps_final_counts():
    from psflow.platform.pshealth import ps_health

    run = {"tasks": {"ps:0": {"state": "running", "attempt": 1, "progress": {"global_step": 120}},
                     "worker:0": {"state": "running", "progress": {"global_step": 118, "pushes": 60, "stale_pushes": 2}},
                     "worker:1": {"state": "starting", "progress": {}}},
           "summary": None}
    live = ps_health(run)
    assert live["version"] == 120 and not live["final"]
    assert live["workers"]["worker:0"]["lag"] == 2 and live["workers"]["worker:1"]["lag"] is None
    assert live["ps"]["ps:0"]["attempt"] == 1 and live["ps"]["ps:0"]["stats"] is None
    ended = ps_health({**run, "summary": {"reports": {"ps:0": {"ps_stats": {"pushes": 240, "stale_dropped": 3}}}}})
    assert ended["final"] and ended["ps"]["ps:0"]["stats"]["pushes"] == 240


def test_the_latency_book_gives_each_windows_rate_and_percentiles_then_starts_afresh():
    from psflow.ps.latency import LatencyBook, quantile

    assert quantile([1.0], 0.99) == 1.0 and quantile([float(i) for i in range(1, 101)], 0.99) == 99.0
    book = LatencyBook(10.0, cap=150)
    for i in range(1, 201):  # 1..200 ms; 150 kept, 50 counted in the rate only
        book.record("push", i / 1000)
    book.record("pull", 0.004)
    first = book.take(12.0)
    assert first["push_rate"] == 100.0 and first["pull_rate"] == 0.5
    assert first["push_p50_ms"] == 75.0 and first["push_p99_ms"] == 149.0 and first["pull_p99_ms"] == 4.0
    quiet = book.take(13.0)  # a window without requests: its rate only
    assert quiet == {"push_rate": 0.0, "pull_rate": 0.0}


def test_ps_health_shows_each_shards_live_requests_and_the_skew_across_shards():
    from psflow.platform.pshealth import ps_health

    def ps(rate: float, p99: float) -> dict:
        return {"state": "running", "progress": {"global_step": 50, "push_rate": rate, "push_p50_ms": 1.0,
                                                 "push_p99_ms": p99, "pull_rate": 0.0}}

    health = ps_health({"tasks": {"ps:0": ps(200.0, 2.0), "ps:1": ps(50.0, 8.0), "worker:0": {"progress": {}}}})
    assert health["ps"]["ps:1"]["push_rate"] == 50.0 and health["ps"]["ps:0"]["pull_p99_ms"] is None
    skew = health["skew"]
    assert skew["push_rate"] == {"max": 200.0, "min": 50.0, "ratio": 4.0, "max_ps": "ps:0"}
    assert skew["push_p99_ms"]["ratio"] == 4.0 and skew["push_p99_ms"]["max_ps"] == "ps:1"
    assert skew["pull_rate"]["ratio"] is None  # both idle: no ratio
    idle = ps_health({"tasks": {"ps:0": {"progress": {"pull_rate": 0.0, "pull_p50_ms": 3.0, "pull_p99_ms": 4.0}}}})
    assert idle["ps"]["ps:0"]["pull_p99_ms"] is None  # no pulls in the last window: an older window's p99 is not shown
    assert "push_rate" not in ps_health({"tasks": {"ps:0": ps(1.0, 1.0)}})["skew"]  # one shard: no skew


def test_each_training_task_gets_its_own_gpus_and_a_machine_short_of_gpus_is_refused():
    from psflow.launch.gpus import assign_gpus

    tasks = ["chief:0", "ps:0", "worker:0", "worker:1", "evaluator:0"]
    assert assign_gpus(tasks, 2, 6) == {"chief:0": "0,1", "worker:0": "2,3", "worker:1": "4,5"}
    assert assign_gpus(tasks, 0, 0) == {}
    with pytest.raises(ConfigError, match=r"GPUs per worker 1 for 3 training task\(s\) needs 3 GPU\(s\), but this "
                                          r"machine has 2"):
        assign_gpus(tasks, 1, 2)
    with pytest.raises(ConfigError, match="0 or more; received -1"):
        assign_gpus(tasks, -1, 8)


def test_a_local_plan_with_gpus_sets_each_trainers_visible_devices(monkeypatch, tmp_path):
    from psflow.launch import gpus
    from psflow.platform.launching import LaunchSpec, plan_of

    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.setattr(gpus, "gpu_count", lambda: 4)  # the plan is pure: the count is the one fact of the machine
    plan = plan_of(LaunchSpec(script=str(script), num_ps=1, num_workers=2, gpus_per_worker=2, logdir=str(tmp_path / "r")))
    env = {t.task: dict(t.env) for t in plan.tasks}
    assert env["worker:0"]["CUDA_VISIBLE_DEVICES"] == "0,1" and env["worker:1"]["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "CUDA_VISIBLE_DEVICES" not in env["ps:0"]
    from psflow.platform.launching import spec_of_run
    from psflow.platform.sqlrunstore import run_record

    record = run_record(plan, backend="local")  # what the job store keeps: a restart asks for the same GPUs
    assert record["launch"]["gpus_per_worker"] == 2 and spec_of_run(record).gpus_per_worker == 2
    monkeypatch.setattr(gpus, "gpu_count", lambda: 0)
    with pytest.raises(ConfigError, match="but this machine has 0"):
        plan_of(LaunchSpec(script=str(script), num_workers=2, gpus_per_worker=1, logdir=str(tmp_path / "r")))


def test_the_live_stream_sends_what_changed_then_ends_with_the_run():
    import asyncio
    import threading

    from psflow.platform.livestream import frame, new_points, run_stream

    assert frame("end", {"state": "stopped"}) == 'event: end\ndata: {"state":"stopped"}\n\n'
    assert frame("metrics", {}, event_id="25").startswith("event: metrics\nid: 25\n")
    rows = [{"task": "worker:0", "name": "loss", "time_unix": t, "step": s, "value": v} for t, s, v in
            ((1.0, 10, 0.9), (2.0, 20, 0.8))]
    assert new_points(rows) == {"worker:0": {"loss": [[1.0, 10, 0.9], [2.0, 20, 0.8]]}}

    # (state, points written so far): the first look sends the history, the later ones what came after the cursor
    pages = iter([("running", 1), ("running", 1), ("running", 2), ("stopped", 2)])
    asked: list[int | None] = []

    def look(cursor: int | None):
        asked.append(cursor)
        state, written = next(pages)
        return {"run": {"state": state, "tasks": {}}}, new_points(rows[cursor or 0:written]), written

    async def collect() -> list[str]:
        async def connected() -> bool:
            return False

        return [m async for m in run_stream(look, cursor=None, is_disconnected=connected, closing=threading.Event(),
                                            poll_s=0.0)]

    messages = "".join(asyncio.run(collect()))
    events = [line[7:] for line in messages.splitlines() if line.startswith("event: ")]
    # the unchanged second look sends nothing; the new point and the stopped run are sent, then `end`
    assert asked == [None, 1, 1, 2]
    assert [line for line in messages.splitlines() if line.startswith("id: ")] == ["id: 1", "id: 2"]
    assert '"series":{"worker:0":{"loss":[[2.0,20,0.8]]}}' in messages
    assert events == ["run", "metrics", "metrics", "run", "end"], messages


def test_with_reads_behind_the_token_the_live_stream_needs_it_too(tmp_path):
    from fastapi.testclient import TestClient

    from psflow.platform.api import UiSettings, create_app
    from psflow.platform.sqlrunstore import SqliteRunStore

    record = {"id": "run-x", "script": "x.py", "args": [], "logdir": str(tmp_path), "cluster": {"worker": ["worker:0"]},
              "mode": "async", "strategy": "ps", "backend": "local", "restart_policy": {}, "launcher": None,
              "created_unix": 1.0}
    SqliteRunStore(tmp_path / "jobs.db", record, ["worker:0"], warn=print).finished("failed")
    client = TestClient(create_app(UiSettings(home=tmp_path, token="chosen-token", auth_reads=True)),
                        base_url="http://127.0.0.1")
    refused = client.get("/api/runs/run-x/stream")
    assert refused.status_code == 401 and "needs the dashboard's token" in refused.json()["detail"]
    ok = client.get("/api/runs/run-x/stream", headers={"Authorization": "Bearer chosen-token"})
    assert ok.status_code == 200 and ok.text.endswith('event: end\ndata: {"state":"failed"}\n\n'), ok.text[-300:]


def test_the_host_header_is_read_and_matched_as_starlette_does():
    from psflow.platform.hosts import check_patterns, host_of, is_allowed

    assert host_of("127.0.0.1:8265") == "127.0.0.1" and host_of("LocalHost") == "localhost"
    assert host_of("[::1]:8265") == "[::1]" and host_of("[::1]") == "[::1]"
    for bad in (None, "", "a b", "[zz::1]", "evil.example:port", "user@evil.example", "x/y"):
        assert host_of(bad) is None, bad
    allowed = ("localhost", "127.0.0.1", "[::1]", "*.corp.example")
    assert all(is_allowed(h, allowed) for h in ("localhost", "[::1]", "dash.corp.example"))
    assert not any(is_allowed(h, allowed) for h in ("evil.example", "corp.example", "127.0.0.1.evil.example", None))
    assert is_allowed("anything", ("*",))
    assert check_patterns(["Dash.Example", "::1", "*.corp.example", "10.0.0.5"]) == (
        "dash.example", "[::1]", "*.corp.example", "10.0.0.5")
    for bad in ("http://dash.example", "dash.example:8265", "dash.example/x", "a*.example", ""):
        with pytest.raises(ConfigError, match="is not a host name"):
            check_patterns([bad])


def test_the_dashboard_answers_its_own_names_only(tmp_path):
    from fastapi.testclient import TestClient

    from psflow.platform.api import create_app

    local = settings_for("127.0.0.1", allow_remote=False, env={"PSFLOW_HOME": str(tmp_path)},
                         allowed_hosts=("dash.example",))
    assert local.allowed_hosts == ("localhost", "127.0.0.1", "[::1]", "dash.example")
    assert settings_for("::1", allow_remote=False, env={"PSFLOW_HOME": str(tmp_path)}).allowed_hosts[:3] == (
        "localhost", "127.0.0.1", "[::1]")
    remote = settings_for("0.0.0.0", allow_remote=True, env={"PSFLOW_UI_TOKEN": "t" * 32, "PSFLOW_HOME": str(tmp_path)})
    assert "0.0.0.0" not in remote.allowed_hosts and socket.gethostname().lower() in remote.allowed_hosts
    bound = settings_for("10.1.2.3", allow_remote=True, env={"PSFLOW_UI_TOKEN": "t" * 32, "PSFLOW_HOME": str(tmp_path)})
    assert "10.1.2.3" in bound.allowed_hosts
    with pytest.raises(ConfigError, match="--allowed-host 'http://x' is not a host name"):
        settings_for("127.0.0.1", allow_remote=False, env={}, allowed_hosts=("http://x",))

    client = TestClient(create_app(local), base_url="http://127.0.0.1:8265")
    for path in ("/api/runs", "/api/health", "/", "/api/runs/r/checkpoints/c/export"):
        refused = client.get(path, headers={"Host": "evil.example"})
        assert refused.status_code == 400, path
        assert refused.json()["detail"].startswith("This dashboard does not answer to Host 'evil.example'; it answers "
                                                   "to localhost, 127.0.0.1, [::1], dash.example.")
    assert client.post("/api/runs", json={}, headers={"Host": "evil.example:8265"}).status_code == 400
    assert client.get("/api/health").status_code == 200
    for host in ("localhost:8265", "[::1]:8265", "dash.example"):
        assert client.get("/api/health", headers={"Host": host}).status_code == 200, host


def test_runs_started_from_the_dashboard_go_under_runs_as_psflow_runs_do_and_it_says_where(tmp_path, monkeypatch):
    from psflow.platform.uiserver import _announce

    monkeypatch.chdir(tmp_path)
    settings = settings_for("127.0.0.1", allow_remote=False, env={"PSFLOW_HOME": str(tmp_path / "home")})
    assert settings.logdirs == tmp_path / "runs"  # as psflow run's runs/<run id>, not under $PSFLOW_HOME
    chosen = settings_for("127.0.0.1", allow_remote=False, env={"PSFLOW_HOME": str(tmp_path / "home")},
                          runs_dir=Path("elsewhere"))
    assert chosen.logdirs == tmp_path / "elsewhere"
    (tmp_path / "home").mkdir()
    said: list[str] = []
    _announce(settings, ("127.0.0.1", 8265), said.append)
    assert f"psflow ui: runs started here keep their logdirs in {tmp_path / 'runs'}/<run id>" in "\n".join(said)
