"""Honest warnings (issue 25, item 3): a straggler only when a worker is clearly and lastingly slower
(its steps take >= 1.3x the median worker's in >= 3 windows, and most of its windows); a worker a
little below the median, or restarted a window ago, is not one; the stacks hint never blames a task
that was making progress at the dump (a healthy async chief checkpointing while the others push)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from psflow.platform.stragglers import StragglerRules, find_stragglers

RULES = StragglerRules(windows=10, span_s=None)


def _worker(rates: list[float], *, start_s: float = 1000.0, per_window_s: int = 10) -> list[tuple[float, float]]:
    """A worker's (time, local_step) points, one a second, at ``rates[i]`` steps/s in window i."""
    points, step, t = [(start_s, 0.0)], 0.0, start_s
    for rate in rates:
        for _ in range(per_window_s):
            t, step = t + 1, step + rate
            points.append((t, step))
    return points


def test_a_worker_a_little_below_the_median_with_noisy_windows_is_no_straggler():
    # worker:2 averages 0.98x the others; one window in four it dips to 0.75x (a busy core), never for long
    noisy = [75.0 if i % 4 == 1 else 105.0 for i in range(10)]
    found = find_stragglers({"worker:0": _worker([100.0] * 10), "worker:1": _worker([100.0] * 10),
                             "worker:2": _worker(noisy)}, RULES)
    assert found["kind"] != "persistent", found["verdict"]
    assert found["verdict"].startswith("No straggler"), found["verdict"]
    steady = find_stragglers({"worker:0": _worker([100.0] * 10), "worker:1": _worker([100.0] * 10),
                              "worker:2": _worker([82.0] * 10)}, RULES)  # 1.22x the median's step time, all along
    assert (steady["kind"], steady["slowest"]) == (None, None) and steady["verdict"].startswith("No straggler")


def test_a_worker_clearly_slower_over_three_windows_or_more_is_a_persistent_straggler():
    found = find_stragglers({"worker:0": _worker([100.0] * 10), "worker:1": _worker([100.0] * 10),
                             "worker:2": _worker([70.0] * 10)}, RULES)
    assert (found["slowest"], found["kind"]) == ("worker:2", "persistent")
    assert found["verdict"].startswith("worker:2 runs at 0.70x the median worker")
    # slow in 3 windows of 10 only, at full speed in the rest: said, but not a straggler
    spell = find_stragglers({"worker:0": _worker([100.0] * 10), "worker:1": _worker([100.0] * 10),
                             "worker:2": _worker([50.0] * 3 + [100.0] * 7)}, RULES)
    assert spell["kind"] == "transient" and spell["workers"]["worker:2"]["slow_windows"] == 3
    assert spell["verdict"].startswith("No straggler: worker:2"), spell["verdict"]


def test_a_worker_restarted_a_window_ago_is_not_persistent_after_one_window():
    # worker:2 was restarted: its new attempt has reported for one window only, slowly while it warms up
    restarted = [(1090.0 + t, 40.0 * t) for t in range(11)]
    found = find_stragglers({"worker:0": _worker([100.0] * 10), "worker:1": _worker([100.0] * 10),
                             "worker:2": restarted}, RULES)
    assert found["workers"]["worker:2"]["windows"] == 1 and found["workers"]["worker:2"]["slow_windows"] == 1
    assert found["kind"] != "persistent", found["verdict"]
    # ... and its step going back at the restart is not a rate: three slow windows after it are needed
    before = _worker([100.0] * 4)
    again = [(t, s) for t, s in _worker([40.0] * 6, start_s=before[-1][0] + 1)]
    found = find_stragglers({"worker:0": _worker([100.0] * 10), "worker:1": _worker([100.0] * 10),
                             "worker:2": before + again}, RULES)
    assert (found["slowest"], found["kind"]) == ("worker:2", "persistent"), found["verdict"]


_PUSH = [{"file": "psflow/ps/client.py", "line": 80, "function": "push"}]
_SAVE = [{"file": "psflow/checkpoint.py", "line": 210, "function": "save"}]


def test_the_stacks_hint_never_blames_a_task_that_was_making_progress():
    from psflow.platform.stacks import group_stacks, making_progress

    stacks = {"worker:0": _SAVE, "worker:1": _PUSH, "worker:2": _PUSH}
    # async: the chief checkpoints while the others push; everyone's step moved around the dump
    points = [{"task": t, "name": "local_step", "time_unix": 100.0 + i, "value": 10.0 * i}
              for t in stacks for i in range(10)]
    moving = making_progress(points, dict.fromkeys(stacks, 105.0))
    assert moving == {"worker:0": True, "worker:1": True, "worker:2": True}
    (odd,) = group_stacks(stacks, moving)["odd_ones_out"]
    assert odd["task"] == "worker:0" and not odd["blamed"] and "likely the one they wait on" not in odd["why"]
    assert "making progress" in odd["why"]
    # sync, worker:0 hung: its step stands still (or it went quiet), the others wait in push
    stuck = [p if p["task"] != "worker:0" else {**p, "value": 40.0} for p in points]
    moving = making_progress(stuck, dict.fromkeys(stacks, 105.0))
    (odd,) = group_stacks(stacks, moving)["odd_ones_out"]
    assert odd["blamed"] and odd["why"].endswith("likely the one they wait on")
    quiet = making_progress([p for p in points if p["task"] != "worker:0"], dict.fromkeys(stacks, 105.0),
                            reported=["worker:0"])
    assert quiet["worker:0"] is False and group_stacks(stacks, quiet)["odd_ones_out"][0]["blamed"]
    # a task that never reported progress: a hedged hint, not a blame
    (odd,) = group_stacks(stacks, {})["odd_ones_out"]
    assert not odd["blamed"] and "may be the one" in odd["why"]


def test_the_stacks_api_says_the_async_chief_is_moving_not_waited_on(tmp_path):
    """Through GET /api/runs/{run}/stacks: a real job store with a dump's events, real log text."""
    import os
    import time

    from psflow.launch.liveness import process_identity
    from psflow.platform.api import UiSettings, create_app
    from psflow.platform.jobstore import JobStore
    from psflow.platform.sqlrunstore import SqliteRunStore

    logdir = tmp_path / "run"
    (logdir / "logs").mkdir(parents=True)
    tasks = ["ps:0", "worker:0", "worker:1", "worker:2"]
    record = {"id": "run-s", "script": "x.py", "args": [], "logdir": str(logdir), "cluster": {}, "mode": "async",
              "strategy": "ps", "backend": "local", "restart_policy": {}, "launcher": process_identity(os.getpid()),
              "created_unix": 1.0}  # this process launched it: the run reads as running, a dump may be asked
    store = SqliteRunStore(tmp_path / "jobs.db", record, tasks, warn=print)
    now = time.time()
    for i in range(8):
        for w in tasks[1:]:
            store.report(w, {"progress": {"local_step": 10 * i, "global_step": 30 * i}})
        time.sleep(0.05)
    with JobStore(tmp_path / "jobs.db") as db:
        request = db.request_control("run-s", "dump", source="test")
    for w in tasks[1:]:
        where = "save" if w == "worker:0" else "push"
        log = logdir / "logs" / f"{w.replace(':', '-')}.log"
        log.write_text(f"Current thread 0x00007f (most recent call first):\n  File \"psflow/x.py\", line 9 in {where}\n"
                       f"  File \"train.py\", line 3 in <module>\n")
        store.event("stacks_dumped", task=w, attempt=0, request=request, log=str(log), line=1)
    for i in range(8, 12):
        for w in tasks[1:]:
            store.report(w, {"progress": {"local_step": 10 * i, "global_step": 30 * i}})
    store.finished("stopped")
    assert time.time() - now < 15  # the points lie around the dump
    client = TestClient(create_app(UiSettings(home=tmp_path, token="t")), base_url="http://127.0.0.1")
    found = client.get("/api/runs/run-s/stacks").json()
    (odd,) = found["odd_ones_out"]
    assert odd["task"] == "worker:0" and odd["blamed"] is False and odd["making_progress"] is True, odd
