"""psflow run --strategy allreduce --timeline: each rank's steps split into forward, backward,
all-reduce and optimizer, in the same Chrome trace and summary shares as a ps job's."""

from __future__ import annotations

import json
import re

import pytest
from conftest import ROOT, log_tails, read_summary, run_psflow

pytestmark = pytest.mark.timeout(300)

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "allreduce_params.py")
STEPS = 12


def run(logdir, form: str, *flags: str):
    r = run_psflow(["run", "--strategy", "allreduce", "--workers", "2", "--logdir", str(logdir), *flags, SCRIPT,
                    "--", "--steps", str(STEPS), "--form", form])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log_tails(logdir)
    shas = set(re.findall(r"global_step \d+ param_sha256 (\w+)", r.stdout))
    assert len(shas) == 1, r.stdout[-3000:]  # every rank holds the same parameters
    return shas.pop()


def spans_of(trace: dict) -> dict[str, list[dict]]:
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    out: dict[str, list[dict]] = {n: [] for n in names.values()}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out[names[e["pid"]]].append(e)
    return out


@pytest.mark.parametrize("form", ["closure", "batch"])
def test_allreduce_ranks_record_forward_backward_allreduce_and_optimizer(tmp_path, form):
    """closure: the trainer all-reduces after backward, a phase of the step on the training thread;
    batch: DistributedDataParallel all-reduces buckets during backward, on its own thread, so those
    spans overlap ``backward`` and the step's shares count the training thread's phases only."""
    logdir = tmp_path / form
    run(logdir, form, "--timeline")
    trace = json.loads((logdir / "timeline.json").read_text())
    by_task = spans_of(trace)
    assert set(by_task) == {"worker:0", "worker:1"}
    summary = read_summary(logdir)
    for rank in ("worker:0", "worker:1"):
        spans = by_task[rank]
        steps = [e for e in spans if e["cat"] == "step"]
        assert len(steps) == STEPS
        main_tid = steps[0]["tid"]
        assert {e["cat"] for e in spans} == {"step", "forward", "backward", "allreduce", "optimizer"}
        for cat in ("forward", "backward", "optimizer"):
            phases = [e for e in spans if e["cat"] == cat]
            assert len(phases) == STEPS and all(e["tid"] == main_tid for e in phases)
            for e in phases:  # each inside a step
                assert any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1 for s in steps)
        reduces = [e for e in spans if e["cat"] == "allreduce"]
        shares = summary["timeline"]["tasks"][rank]["shares"]
        assert sum(shares.values()) == pytest.approx(1.0, abs=0.01)
        if form == "closure":
            assert len(reduces) == STEPS and all(e["tid"] == main_tid for e in reduces)
            assert {"forward", "backward", "allreduce", "optimizer"} <= set(shares)
        else:
            assert len(reduces) >= STEPS and all(e["tid"] != main_tid for e in reduces)
            assert all("overlaps backward" in e["name"] for e in reduces)
            assert {"forward", "backward", "optimizer"} <= set(shares) and "allreduce" not in shares
    assert set(summary["timeline"]["step"]) >= {"forward", "backward", "optimizer"}


def test_the_timed_ddp_hook_leaves_the_training_result_unchanged(tmp_path):
    assert run(tmp_path / "on", "batch", "--timeline") == run(tmp_path / "off", "batch")
