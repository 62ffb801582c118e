"""The chaos report: the push ledger's halves compared, fault outcomes, the baseline comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

from psflow.chaos.report import build_report, fault_outcomes, ledger_rows, render, serving_shard_stats
from psflow.ps.store import StoreStats
from psflow.train.ledger import LedgerEntry, PushLedger, read_ledgers


def test_the_ledger_file_survives_its_writer_and_reads_back(tmp_path: Path) -> None:
    led = PushLedger(tmp_path, "worker:1", worker=1, attempt=2)
    for _ in range(11):
        led.step_sent()
        led.acknowledged_push()
    led.step_sent()  # in flight when the process died: sent, never acknowledged
    # no close(): a killed process closes nothing; the kernel has the last write
    other = PushLedger(tmp_path, "chief:0", worker=0, attempt=0)
    other.close()
    assert read_ledgers(tmp_path) == [LedgerEntry("chief:0", 0, 0, 0, 0), LedgerEntry("worker:1", 1, 2, 12, 11)]


def test_a_file_that_is_no_ledger_is_named(tmp_path: Path) -> None:
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "worker-0.0").write_text("hello")
    with pytest.raises(ValueError, match=r"worker-0\.0 is not a push ledger.*'hello'"):
        read_ledgers(tmp_path)


def test_applied_by_counts_travel_with_the_stats() -> None:
    stats = StoreStats()
    stats.count_applied(1, 0)
    stats.count_applied(1, 0)
    stats.count_applied(1, 2)
    d = stats.to_dict()
    assert d["applied_by"] == {"1": {"0": 2, "2": 1}}
    assert StoreStats.from_dict(d).applied_by == {1: {0: 2, 2: 1}}


def test_ledger_rows_name_lost_unacknowledged_and_redone_pushes() -> None:
    ledgers = [LedgerEntry("worker:0", 0, 0, 10, 9), LedgerEntry("worker:0", 0, 1, 5, 5), LedgerEntry("worker:1", 1, 0, 7, 7)]
    applied = {"0": {"0": 10, "1": 5}, "1": {"0": 6}, "2": {"0": 3}}
    rows = {(r["worker"], r["attempt"]): r for r in ledger_rows(ledgers, applied)}
    assert (rows[(0, 0)]["lost"], rows[(0, 0)]["unacknowledged"], rows[(0, 0)]["redone"]) == (0, 1, 0)
    assert (rows[(1, 0)]["lost"], rows[(1, 0)]["redone"]) == (1, 1)  # acknowledged 7, the ps holds 6
    assert rows[(2, 0)] == {"task": None, "worker": 2, "attempt": 0, "sent": 0, "acknowledged": 0, "applied": 3,
                            "lost": 0, "unacknowledged": 3, "redone": 0}


def _summary(**extra) -> dict:
    return {
        "status": "succeeded", "mode": "async", "global_step": 100, "wall_s": 10.0, "test_accuracy": 0.9,
        "tasks": [
            {"task": "ps:0", "attempts": 2, "exits": [{"attempt": 0, "code": -9, "signal": "SIGKILL", "restarted": True},
                                                      {"attempt": 1, "code": 0, "signal": None, "restarted": False}]},
            {"task": "ps:1", "attempts": 1, "exits": [{"attempt": 0, "code": 0, "signal": None, "restarted": False}]},
            {"task": "worker:0", "attempts": 1, "exits": [{"attempt": 0, "code": 0, "signal": None, "restarted": False}]},
        ],
        "reports": {
            "ps:0": {"ps_stats": {"applied_updates": 1}, "shards": {"0": {"role": "backup", "applied_updates": 99}}},
            "ps:1": {"shards": {"0": {"role": "serving", "applied_updates": 100, "duplicates": 2,
                                      "applied_by": {"0": {"0": 100}}}}},
        },
        **extra,
    }


def test_the_serving_copy_of_shard_0_is_the_ledgers_ps_half() -> None:
    assert serving_shard_stats(_summary())["applied_updates"] == 100
    plain = {"reports": {"ps:0": {"ps_stats": {"applied_updates": 7}}}}
    assert serving_shard_stats(plain) == {"applied_updates": 7}
    assert serving_shard_stats({"reports": {}}) is None


def test_fault_outcomes_kill_restarted_stop_continued_and_a_kill_not_restarted() -> None:
    summary = _summary()
    summary["tasks"].append({"task": "worker:1", "attempts": 1, "exits": [
        {"attempt": 0, "code": -9, "signal": "SIGKILL", "restarted": False, "not_restarted": "its restart budget is spent"}]})
    faults = [{"task": "ps:0", "attempt": 0, "kind": "kill", "at_s": 1.0},
              {"task": "worker:0", "attempt": 0, "kind": "stop", "at_s": 2.0, "stall_s": 1.0},
              {"task": "worker:1", "attempt": 0, "kind": "kill", "at_s": 3.0}]
    out = fault_outcomes(faults, summary)
    assert [(o["survived"], o["outcome"]) for o in out] == [
        (True, "restarted"), (True, "continued"), (False, "not restarted: its restart budget is spent")]


def test_build_report_compares_with_the_baseline_and_renders_lost_zero() -> None:
    ledgers = [LedgerEntry("worker:0", 0, 0, 100, 100)]
    faults = [{"task": "ps:0", "attempt": 0, "kind": "kill", "at_s": 1.0, "slot": 0}]
    base = _summary(wall_s=8.0, test_accuracy=0.905)
    r = build_report(faults=faults, skipped=[3], summary=_summary(), ledgers=ledgers, settings={"seed": 1}, baseline=base)
    assert r["faults"]["injected"] == r["faults"]["survived"] == 1 and r["faults"]["skipped_slots"] == 1
    assert r["restarts"] == {"ps:0": 1, "ps:1": 0, "worker:0": 0}
    assert (r["ledger"]["acknowledged"], r["ledger"]["applied"], r["ledger"]["lost"]) == (100, 100, 0)
    assert r["ledger"]["duplicates_refused"] == 2
    assert r["visits_per_batch"] == "exactly once"
    assert r["accuracy_delta"] == pytest.approx(-0.005)
    assert r["goodput_ratio"] == pytest.approx(0.8)
    text = render(r)
    assert "lost 0" in text and "LOST" not in text and "exactly once" in text and "ps:0 1" in text


def test_a_lost_update_is_shouted() -> None:
    r = build_report(faults=[], skipped=[], summary=_summary(), ledgers=[LedgerEntry("worker:0", 0, 0, 101, 101)],
                     settings={})
    assert r["ledger"]["lost"] == 1
    assert "LOST UPDATES" in render(r)


def test_after_a_rollback_the_ledger_is_not_compared() -> None:
    summary = _summary()
    summary["reports"] = {"ps:0": {"ps_stats": {"applied_updates": 40, "applied_by": {"0": {"1": 40}}}}}
    r = build_report(faults=[], skipped=[], summary=summary, ledgers=[LedgerEntry("worker:0", 0, 0, 100, 100)], settings={})
    assert r["ledger"]["rolled_back"] == 1 and r["ledger"]["lost"] is None
    assert "not compared: the job rolled back to its newest checkpoint 1 time(s)" in render(r)
