"""The timeline's pure parts (psflow.timeline): spans, exclusive phase time, shares, the merged trace."""

from __future__ import annotations

import json
import threading
import time

import pytest

from psflow import timeline
from psflow.timeline import Timeline, busy_shares, job_shares, merge, step_shares, write_trace


def span(cat: str, ts: float, dur: float, tid: int = 1, name: str | None = None) -> dict:
    return {"name": name or cat, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "tid": tid}


def test_a_push_made_during_backward_counts_as_push_and_the_rest_as_other() -> None:
    events = [span("step", 0, 100), span("forward", 0, 20), span("backward", 20, 40), span("push", 30, 10),
              span("push", 60, 10), span("wait", 70, 20), span("pull", 90, 5)]
    out = step_shares(events)
    assert out == {"steps": 1, "step_s": 0.0001,
                   "shares": {"forward": 0.2, "backward": 0.3, "push": 0.2, "wait": 0.2, "pull": 0.05, "other": 0.05}}


def test_spans_outside_every_step_or_on_another_thread_do_not_count() -> None:
    events = [span("step", 0, 10), span("forward", 0, 10), span("pull", 50, 10), span("backward", 0, 10, tid=2)]
    assert step_shares(events)["shares"] == {"forward": 1.0, "other": 0.0}


def test_a_ps_gets_shares_of_its_busy_time_across_threads() -> None:
    events = [span("receive", 0, 10, tid=1), span("apply", 10, 30, tid=1), span("send", 40, 10, tid=1),
              span("receive", 0, 10, tid=2), span("wait", 10, 40, tid=2)]
    assert busy_shares(events) == {"busy_s": 0.0001, "shares": {"receive": 0.2, "apply": 0.3, "wait": 0.4, "send": 0.1}}
    assert busy_shares([]) == {"busy_s": 0.0, "shares": {}}


def test_the_recorder_names_the_threads_and_keeps_time_in_order() -> None:
    tl = Timeline("worker:3", attempt=1)
    a = tl.now()
    tl.add("forward", "forward", a, tl.now(), extra=1)
    t = threading.Thread(target=lambda: tl.add("pull", "pull", tl.now(), tl.now()), name="other-thread")
    t.start()
    t.join(10)
    assert [e["cat"] for e in tl.events] == ["forward", "pull"]
    assert tl.events[0]["args"] == {"extra": 1} and tl.events[1]["ts"] >= tl.events[0]["ts"]
    assert sorted(tl.threads.values()) == sorted([threading.current_thread().name, "other-thread"])


def test_the_merged_trace_has_a_named_process_per_task_attempt_in_job_order(tmp_path) -> None:
    for task, attempt in (("ps:0", 0), ("worker:1", 0), ("worker:0", 0), ("worker:0", 1)):
        tl = Timeline(task, attempt)
        tl.add("pull", "pull", tl.now(), tl.now())
        tl.write(tmp_path)
    (tmp_path / "timeline" / "ps-1.0.json").write_text("{not json")  # a task killed mid-write: skipped
    path = write_trace(tmp_path)
    trace = json.loads(path.read_text())
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == ["worker:0", "worker:0 (attempt 1)", "worker:1", "ps:0"]
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["pid"] for e in xs) == [1, 2, 3, 4]
    assert write_trace(tmp_path / "nothing") is None


def test_merge_keeps_each_files_threads_under_its_own_process() -> None:
    files = [{"task": "ps:0", "threads": {"7": "ps:0-conn"}, "events": [span("apply", 0, 1, tid=7)]}]
    trace = merge(files)
    assert {"name": "thread_name", "ph": "M", "pid": 1, "tid": 7, "args": {"name": "ps:0-conn"}} in trace["traceEvents"]


def test_the_jobs_step_shares_are_the_workers_weighted_by_their_steps() -> None:
    reports = {"worker:0": {"timeline": {"steps": 30, "shares": {"wait": 0.5, "other": 0.5}}},
               "worker:1": {"timeline": {"steps": 10, "shares": {"wait": 0.1, "other": 0.9}}},
               "ps:0": {"timeline": {"busy_s": 1.0, "shares": {"apply": 1.0}}}, "chief:0": {}}
    out = job_shares(reports)
    assert out["step"] == {"wait": 0.4, "other": 0.6} and set(out["tasks"]) == {"worker:0", "worker:1", "ps:0"}
    assert job_shares({"worker:0": {}}) == {}


def test_off_by_default_and_start_stop_switch_the_process_recorder() -> None:
    assert timeline.ACTIVE is None
    try:
        assert timeline.start("worker:0") is timeline.ACTIVE
    finally:
        timeline.stop()
    assert timeline.ACTIVE is None


@pytest.mark.parametrize("bad", ["yes", 1])
def test_the_timeline_setting_must_be_a_bool(bad) -> None:
    from psflow.config import TrainConfig
    from psflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"timeline must be a valid boolean; received .* \(true or false"):
        TrainConfig(timeline=bad)


# -- clock offsets ------------------------------------------------------------------------------

def _round_trips(offset_us: float, legs: list[tuple[float, float]], start: float = 1_000.0):
    """(sent, reference, received) samples of a local clock that is ``offset_us`` behind the
    reference, each round trip taking (out, back) microseconds."""
    out, t = [], start
    for up, down in legs:
        out.append((t, t + up + offset_us, t + up + down))
        t += up + down + 50.0
    return out


def test_the_offset_comes_from_the_shortest_round_trip_and_is_exact_when_its_legs_are_equal() -> None:
    samples = _round_trips(5_000_000.0, [(900.0, 30.0), (20.0, 20.0), (15.0, 400.0)])
    est = timeline.estimate_offset(samples)
    assert est.offset_us == pytest.approx(5_000_000.0)
    assert est.rtt_us == pytest.approx(40.0) and est.error_us == pytest.approx(20.0) and est.samples == 3


@pytest.mark.parametrize("offset_us", [-3e6, 0.0, 123.5, 7e9])
def test_the_offset_error_is_at_most_half_the_round_trip_whatever_the_asymmetry(offset_us) -> None:
    samples = _round_trips(offset_us, [(300.0, 10.0), (25.0, 5.0), (60.0, 2.0)])
    est = timeline.estimate_offset(samples)
    assert abs(est.offset_us - offset_us) <= est.error_us + 1e-6
    assert est.rtt_us == pytest.approx(30.0)


def test_a_round_trip_that_ends_before_it_starts_is_ignored_and_none_usable_is_an_error() -> None:
    good = (100.0, 1_100.0, 120.0)
    assert timeline.estimate_offset([(500.0, 0.0, 400.0), good]).offset_us == pytest.approx(990.0)
    with pytest.raises(ValueError, match="No usable round trip"):
        timeline.estimate_offset([(500.0, 0.0, 400.0)])
    with pytest.raises(ValueError, match="No usable round trip"):
        timeline.estimate_offset([])


def test_align_asks_the_reference_each_round_and_keeps_the_estimate() -> None:
    tl = timeline.Timeline("worker:1", skew_us=-2_000_000.0)  # this host's clock is 2 s behind
    asked = []

    def reference() -> float:
        asked.append(1)
        return time.time() * 1e6  # the reference host's true wall clock

    est = tl.align(reference, rounds=5)
    assert len(asked) == 5 and est.samples == 5 and tl.clock is est
    assert abs(est.offset_us - 2_000_000.0) < 50_000  # within 50 ms: a loaded 2-core machine's scheduling


def test_merge_moves_each_tasks_spans_onto_the_reference_clock() -> None:
    ps = {"task": "ps:0", "attempt": 0, "clock": {"offset_us": -5_000_000.0, "rtt_us": 40.0, "samples": 8},
          "threads": {"7": "conn"}, "events": [{"name": "receive", "cat": "receive", "ph": "X", "ts": 5_000_150.0,
                                                 "dur": 10.0, "tid": 7}]}
    worker = {"task": "worker:0", "attempt": 0, "clock": None, "threads": {"3": "main"},
              "events": [{"name": "push ps:0", "cat": "push", "ph": "X", "ts": 100.0, "dur": 100.0, "tid": 3}]}
    trace = timeline.merge([worker, ps])
    spans = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert spans["receive"]["ts"] == pytest.approx(150.0)  # inside the push span once shifted
    assert spans["push ps:0"]["ts"] == 100.0
    assert trace["otherData"]["clock_offsets"]["ps:0.0"]["offset_us"] == -5_000_000.0


def test_clock_skew_names_tasks_and_refuses_what_it_cannot_read() -> None:
    from psflow.cluster import TaskId
    from psflow.errors import ConfigError
    from psflow.taskenv import clock_skew_us

    raw = "ps:0=5e6, worker:1=-3000000"
    assert clock_skew_us(raw, TaskId("ps", 0)) == 5e6
    assert clock_skew_us(raw, TaskId("worker", 1)) == -3e6
    assert clock_skew_us(raw, TaskId("worker", 0)) == 0.0 and clock_skew_us(None, TaskId("ps", 0)) == 0.0
    with pytest.raises(ConfigError, match="PSFLOW_CLOCK_SKEW entry 'ps:0=soon'"):
        clock_skew_us("ps:0=soon", TaskId("ps", 0))
