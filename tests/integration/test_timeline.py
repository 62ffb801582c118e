"""psflow run --timeline: one Chrome trace of every task, and each phase's share of the step.

The sync run's tasks are given clocks that disagree (PSFLOW_CLOCK_SKEW: ps:0 5 s ahead, worker:1 3 s
behind, as on hosts without NTP): every ordering test below holds only because each task measured its
offset to the launcher and the merge shifted its spans by it."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, log_tails, read_summary, run_psflow, task_env

pytestmark = pytest.mark.timeout(300)

WORKER_PHASES = {"step", "forward", "backward", "push", "wait", "pull"}
PS_PHASES = {"receive", "apply", "wait", "send"}
SKEW_US = {"ps:0": 5e6, "worker:1": -3e6}  # these tasks' clocks are off by this much


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("timeline") / "run"
    t0 = time.time() * 1e6
    r = subprocess.run([PSFLOW, "run", "--ps", "2", "--workers", "2", "--mode", "sync", "--timeline", "--logdir",
                        str(logdir), SOFTMAX, "--", "--epochs", "1", "--init", "zeros", "--print_every", "1"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env=task_env(PSFLOW_CLOCK_SKEW=f"ps:0={SKEW_US['ps:0']},worker:1={SKEW_US['worker:1']}"))
    t1 = time.time() * 1e6
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log_tails(logdir)
    trace = json.loads((logdir / "timeline.json").read_text())
    return logdir, read_summary(logdir), trace, (t0, t1)


def spans_by_task(trace: dict) -> dict[str, list[dict]]:
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    out: dict[str, list[dict]] = {n: [] for n in names.values()}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out[names[e["pid"]]].append(e)
    return out


def error_us(trace: dict, *tasks: str) -> float:
    """How far apart two tasks' spans may be misplaced on the merged clock: the sum of their offset
    estimates' error bounds (half the round trip each was measured from; microseconds, well below
    the seconds of skew the run was given)."""
    offsets = trace["otherData"]["clock_offsets"]
    return sum(offsets[f"{t}.0"]["rtt_us"] / 2 for t in tasks)


def test_the_trace_has_a_process_per_task_with_named_threads_and_valid_spans(sync_run):
    _, _, trace, (t0, t1) = sync_run
    by_task = spans_by_task(trace)
    assert set(by_task) == {"worker:0", "worker:1", "ps:0", "ps:1"}
    threads = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    for spans in by_task.values():
        for e in spans:
            assert {"name", "cat", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0
            assert (e["pid"], e["tid"]) in threads
            # Wall-clock microseconds: every span of every process lies within the launch's own window.
            assert t0 <= e["ts"] and e["ts"] + e["dur"] <= t1


def test_every_worker_step_is_split_into_its_phases_and_every_ps_records_its_side(sync_run):
    _, summary, trace, _ = sync_run
    by_task = spans_by_task(trace)
    for worker in ("worker:0", "worker:1"):
        spans = by_task[worker]
        assert {e["cat"] for e in spans} == WORKER_PHASES
        steps = [e for e in spans if e["cat"] == "step"]
        assert len(steps) == summary["reports"][worker]["trainer"]["local_step"]
        # per shard a push (on the push thread when sent during backward) and the training thread's wait for the sends
        pushes = {e["name"] for e in spans if e["cat"] == "push"}
        assert {"push ps:0", "push ps:1"} <= pushes <= {"push ps:0", "push ps:1", "push: sending"}
        assert {e["name"] for e in spans if e["cat"] == "wait"} == {"wait ps:0 (sync quorum)", "wait ps:1 (sync quorum)"}
        for phase in (e for e in spans if e["cat"] != "step"):  # every phase lies inside one of the steps
            assert any(s["ts"] <= phase["ts"] and phase["ts"] + phase["dur"] <= s["ts"] + s["dur"] + 1 for s in steps)
    for ps in ("ps:0", "ps:1"):
        assert {e["cat"] for e in by_task[ps]} == PS_PHASES
        applies = [e for e in by_task[ps] if e["cat"] == "apply"]
        assert len(applies) == 2 * 300  # each worker's push of each of the 300 sync steps


def test_the_ps_applies_a_push_after_the_worker_sent_it_and_before_its_step_ends(sync_run):
    """The processes' clocks agree: a cause never shows after its effect."""
    _, _, trace, _ = sync_run
    by_task = spans_by_task(trace)
    for worker in ("worker:0", "worker:1"):
        steps = sorted((e for e in by_task[worker] if e["cat"] == "step"), key=lambda e: e["ts"])
        pushes = [e for e in by_task[worker] if e["cat"] == "push"]
        for shard in (0, 1):
            applies = [e for e in by_task[f"ps:{shard}"] if e["cat"] == "apply" and e["args"]["peer"] == worker]
            sent = sorted(e["ts"] for e in pushes if e["name"] == f"push ps:{shard}")
            assert len(applies) == len(sent) == len(steps)
            slack = error_us(trace, worker, f"ps:{shard}")
            for push_ts, apply, step in zip(sent, sorted(applies, key=lambda e: e["ts"]), steps):
                assert push_ts - slack <= apply["ts"] <= step["ts"] + step["dur"] + slack


def test_the_summary_gives_each_phase_share_of_the_step_and_psflow_summary_prints_it(sync_run):
    logdir, summary, _, _ = sync_run
    tl = summary["timeline"]
    for worker in ("worker:0", "worker:1"):
        shares = tl["tasks"][worker]["shares"]
        assert set(shares) == {"forward", "backward", "push", "wait", "pull", "other"}
        assert sum(shares.values()) == pytest.approx(1.0, abs=0.01)
        assert shares["other"] < 0.25  # the phases cover the step
        assert tl["tasks"][worker]["steps"] == 300
    for ps in ("ps:0", "ps:1"):
        assert set(tl["tasks"][ps]["shares"]) == PS_PHASES
        assert sum(tl["tasks"][ps]["shares"].values()) == pytest.approx(1.0, abs=0.01)
    assert sum(tl["step"].values()) == pytest.approx(1.0, abs=0.01)
    shown = run_psflow(["summary", str(logdir)], timeout_s=60)
    assert shown.returncode == 0
    assert "step time: forward " in shown.stdout and f"timeline: {logdir / 'timeline.json'}" in shown.stdout


def test_each_task_measured_its_clock_offset_to_the_launcher(sync_run):
    _, _, trace, _ = sync_run
    offsets = trace["otherData"]["clock_offsets"]
    assert set(offsets) == {"worker:0.0", "worker:1.0", "ps:0.0", "ps:1.0"}
    for key, clock in offsets.items():
        skew = SKEW_US.get(key.rsplit(".", 1)[0], 0.0)
        assert clock["samples"] == 16 and clock["rtt_us"] > 0
        # Reference = local + offset, so a clock ahead by the skew has offset -skew, within the round
        # trip's error; the bound is loose for a loaded machine's scheduling, far below the skews.
        assert abs(clock["offset_us"] + skew) <= max(clock["rtt_us"], 100_000), (key, clock)


def test_a_push_is_received_by_the_ps_after_the_worker_started_it_and_before_its_step_ends(sync_run):
    """On the merged (launcher's) clock, each ps-side receive of a push lies inside the worker's
    step that sent it, starting no earlier than the worker's push span."""
    _, _, trace, _ = sync_run
    by_task = spans_by_task(trace)
    for worker in ("worker:0", "worker:1"):
        steps = sorted((e for e in by_task[worker] if e["cat"] == "step"), key=lambda e: e["ts"])
        for shard in (0, 1):
            pushes = sorted((e for e in by_task[worker] if e["name"] == f"push ps:{shard}"), key=lambda e: e["ts"])
            receives = sorted((e for e in by_task[f"ps:{shard}"] if e["name"] == "receive PS_PUSH"
                               and e["args"]["peer"] == worker), key=lambda e: e["ts"])
            assert len(receives) == len(pushes) == len(steps)
            slack = error_us(trace, worker, f"ps:{shard}") + 1  # 1 us: the trace's rounding
            for push, receive, step in zip(pushes, receives, steps):
                assert push["ts"] <= receive["ts"] + slack
                assert receive["ts"] + receive["dur"] <= step["ts"] + step["dur"] + slack
