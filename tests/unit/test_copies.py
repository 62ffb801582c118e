"""The ledger over every shard and every copy (psflow.launch.copies), and the run's verdict after it.

Summaries are built as tests/unit/test_chaos_report.py builds them: 2 ps, each holding a copy of
both shards (``PsService.copies_report``), or, without replication, each ps's ``ps_stats``.
"""

from __future__ import annotations

from pathlib import Path

from psflow.launch.controller import ExitRecord, RunFinished, TaskRecord
from psflow.launch.copies import (
    BEHIND_KNOWN,
    COPIES_DISAGREE,
    SHARDS_DIFFER,
    TWO_SERVING,
    UNCHECKED,
    check_copies,
    shard_copies,
    verdict,
)
from psflow.launch.plan import make_plan
from psflow.launch.runner import read_ledger
from psflow.launch.summary import build_summary


def _copy(role: str, applied: int, *, version: int | None = None, duplicates: int = 0, applied_by: dict | None = None,
          **extra) -> dict:
    return {"role": role, "version": applied if version is None else version, "applied_updates": applied,
            "duplicates": duplicates, "applied_by": applied_by or {"0": {"0": applied}}, **extra}


def _summary(shard0: tuple[dict, dict], shard1: tuple[dict, dict], mode: str = "async") -> dict:
    """``shardN``: (its copy on ps:0, its copy on ps:1)."""
    return {"status": "succeeded", "mode": mode,
            "tasks": [{"task": "ps:0"}, {"task": "ps:1"}, {"task": "worker:0"}],
            "reports": {"ps:0": {"ps_stats": {"applied_updates": 0}, "shards": {"0": shard0[0], "1": shard1[0]}},
                        "ps:1": {"ps_stats": {"applied_updates": 0}, "shards": {"0": shard0[1], "1": shard1[1]}}}}


def _clean(n: int = 18000) -> dict:
    return _summary((_copy("serving", n, duplicates=3), _copy("backup", n, duplicates=3)),
                    (_copy("backup", n), _copy("serving", n)))


def _kinds(summary: dict) -> list[tuple[int, str, str | None, bool]]:
    return [(f.shard, f.kind, f.task, f.fails) for f in check_copies(summary)]


def test_a_clean_run_has_no_findings_and_keeps_its_verdict() -> None:
    assert check_copies(_clean()) == []
    assert verdict("succeeded", None, check_copies(_clean())) == ("succeeded", None)
    assert [(c.shard, c.task, c.role) for cs in shard_copies(_clean()["reports"]).values() for c in cs] == [
        (0, "ps:0", "serving"), (0, "ps:1", "backup"), (1, "ps:0", "backup"), (1, "ps:1", "serving")]


def test_an_update_lost_on_shard_1_is_found_though_shard_0_holds_every_one() -> None:
    # Issue 22's psflow chaos run: shard 1 ended one update short. Both of its copies agree (the
    # backup followed the serving copy), and shard 0 is whole: only comparing the shards finds it.
    summary = _summary((_copy("serving", 18000), _copy("backup", 18000)),
                       (_copy("backup", 17999), _copy("serving", 17999)))
    (f,) = check_copies(summary)
    assert (f.shard, f.kind, f.task, f.fails, f.lost, f.extra) == (1, SHARDS_DIFFER, "ps:1", True, 1, 0)
    assert f.message == ("shard 1 applied 17999 updates (its serving copy, on ps:1), shard 0 applied 18000: "
                         "1 update lost on shard 1 (async: every push goes to every shard).")
    status, root = verdict("succeeded", None, [f])
    assert (status, root) == ("failed", f.message)


def test_a_shard_with_more_updates_than_shard_0_applied_some_twice() -> None:
    summary = _summary((_copy("serving", 100), _copy("backup", 100)), (_copy("backup", 102), _copy("serving", 102)),
                       mode="ssp")
    (f,) = check_copies(summary)
    assert (f.kind, f.extra, f.lost) == (SHARDS_DIFFER, 2, 0) and "2 updates applied twice, or on shard 1 only" in f.message


def test_per_worker_counts_may_differ_between_shards_when_the_totals_agree() -> None:
    # At a max_steps stop the workers' last pushes race: shard 0 took worker 0's, shard 1 worker 1's.
    summary = _summary((_copy("serving", 100, applied_by={"0": {"0": 51}, "1": {"0": 49}}),
                        _copy("backup", 100, applied_by={"0": {"0": 51}, "1": {"0": 49}})),
                       (_copy("backup", 100, applied_by={"0": {"0": 50}, "1": {"0": 50}}),
                        _copy("serving", 100, applied_by={"0": {"0": 50}, "1": {"0": 50}})))
    assert check_copies(summary) == []


def test_sync_mode_compares_versions() -> None:
    summary = _summary((_copy("serving", 40, version=50), _copy("backup", 40, version=50)),
                       (_copy("backup", 40, version=49), _copy("serving", 40, version=49)), mode="sync")
    assert _kinds(summary) == [(1, SHARDS_DIFFER, "ps:1", True)]
    assert "shard 1 is at version 49 (its serving copy, on ps:1), shard 0 at 50" in check_copies(summary)[0].message


def test_copies_that_disagree_fail_with_the_shard_the_ps_and_the_counts() -> None:
    behind = _summary((_copy("serving", 100), _copy("backup", 100)), (_copy("backup", 90), _copy("serving", 100)))
    (f,) = check_copies(behind)
    assert (f.shard, f.kind, f.task, f.fails) == (1, COPIES_DISAGREE, "ps:0", True)
    assert f.message.startswith("shard 1's copies disagree: its serving copy on ps:1 is at version 100 with 100 updates "
                                "applied, its backup copy on ps:0 at version 90 with 90 (version 100 on ps:1, 90 on ps:0;")
    # Same version, same total, but one (worker, attempt) counted differently: the copies diverged.
    split = _summary((_copy("serving", 100), _copy("backup", 100)),
                     (_copy("backup", 100, applied_by={"0": {"0": 60}, "1": {"0": 40}}),
                      _copy("serving", 100, applied_by={"0": {"0": 61}, "1": {"0": 39}})))
    (f,) = check_copies(split)
    assert f.kind == COPIES_DISAGREE and "worker 0 attempt 0: 61 applied on ps:1, 60 on ps:0" in f.message


def test_a_backup_behind_is_said_but_passes_when_the_copies_said_why() -> None:
    alone = _summary((_copy("serving", 100), _copy("backup", 100)),
                     (_copy("backup", 90), _copy("serving", 100, degraded="its backup ps:0 did not answer for 5 s")))
    (f,) = check_copies(alone)
    assert (f.kind, f.fails) == (BEHIND_KNOWN, False)
    assert "the serving copy went on alone (its backup ps:0 did not answer for 5 s)" in f.message
    assert verdict("succeeded", None, [f]) == ("succeeded", None)
    catching_up = _summary((_copy("serving", 100), _copy("backup", 100)),
                           (_copy("backup", 90, state="catching-up"), _copy("serving", 100)))
    assert _kinds(catching_up) == [(1, BEHIND_KNOWN, "ps:0", False)]
    ahead = _summary((_copy("serving", 100), _copy("backup", 100)),
                     (_copy("backup", 101), _copy("serving", 100, state="alone")))
    assert _kinds(ahead) == [(1, COPIES_DISAGREE, "ps:0", True)]  # going on alone explains a backup behind, never ahead


def test_two_serving_copies_of_one_shard_fail_first() -> None:
    # Issue 22: ps:0 took over shard 1 while ps:1 kept serving it; each copy missed the other's updates.
    summary = _summary((_copy("serving", 36000), _copy("backup", 36000)),
                       (_copy("serving", 14516), _copy("serving", 21484)))
    found = _kinds(summary)
    assert found[0] == (1, TWO_SERVING, "ps:1", True) and (1, SHARDS_DIFFER, "ps:0", True) in found
    assert check_copies(summary)[0].message.startswith("shard 1 has 2 serving copies at the end: ps:0 (version 14516")


def test_without_replication_each_ps_stats_is_its_shard() -> None:
    summary = {"mode": "async", "tasks": [{"task": "ps:0"}, {"task": "ps:1"}],
               "reports": {"ps:0": {"ps_stats": {"applied_updates": 500}, "global_step": 500},
                           "ps:1": {"ps_stats": {"applied_updates": 499}, "global_step": 499}}}
    (f,) = check_copies(summary)
    assert (f.shard, f.task, f.lost) == (1, "ps:1", 1) and "(its serving copy, on ps:1)" in f.message


def test_a_shard_nobody_reported_is_said_unchecked_and_does_not_fail() -> None:
    summary = {"mode": "async", "tasks": [{"task": "ps:0"}, {"task": "ps:1"}],
               "reports": {"ps:0": {"ps_stats": {"applied_updates": 500}, "global_step": 500}, "ps:1": {"progress": {}}}}
    assert _kinds(summary) == [(1, UNCHECKED, None, False)]


def test_a_run_whose_shards_disagree_ends_failed_with_the_finding_as_root_cause(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    plan = make_plan(str(tmp_path / "train.py"), num_ps=2, num_workers=1, logdir=str(tmp_path))
    lost = _summary((_copy("serving", 18000), _copy("backup", 18000)), (_copy("backup", 17999), _copy("serving", 17999)))
    findings, finished = read_ledger(RunFinished("succeeded", None, 0), lost["reports"], plan)
    assert (finished.status, finished.exit_code) == ("failed", 1)
    assert finished.root_cause == findings[0].message and "shard 1 applied 17999" in finished.root_cause
    records = {t: TaskRecord(t, state="exited", handle=1, exits=[ExitRecord(0, 0, 9.0, stopped=False)])
               for t in plan.task_names()}
    summary = build_summary(plan, lost["reports"], {}, records, 9.0, finished.status, finished.root_cause, findings)
    assert (summary["status"], summary["root_cause"]) == ("failed", findings[0].message)
    assert summary["ledger"]["agree"] is False and len(summary["ledger"]["copies"]) == 4
    assert summary["ledger"]["findings"][0]["kind"] == SHARDS_DIFFER
    # A run that failed already keeps its own root cause; a clean one is untouched.
    failed = RunFinished("failed", "worker:0", 1)
    assert read_ledger(failed, lost["reports"], plan)[1] is failed
    clean = RunFinished("succeeded", None, 0)
    assert read_ledger(clean, _clean()["reports"], plan) == ([], clean)


def test_in_sync_mode_with_backup_workers_a_last_step_on_some_shards_only_is_noted_not_failed() -> None:
    """N of M: each shard averages the first N fresh gradients it receives, as TensorFlow's
    per-variable accumulators do, so a last step may land on one shard only; with N = M every shard
    takes every step, and a difference fails the run."""
    from psflow.launch.copies import backup_workers

    reports = {"ps:0": {"ps_stats": {"applied_updates": 231}, "global_step": 231},
               "ps:1": {"ps_stats": {"applied_updates": 232}, "global_step": 232}}
    assert backup_workers("sync", 2, None, 3) == 1 and backup_workers("sync", None, None, 3) == 0
    assert backup_workers("async", 2, None, 3) == 0
    noted = check_copies({"mode": "sync", "reports": reports, "backup_workers": 1})
    assert [(f.kind, f.fails) for f in noted] == [("shards_differ", False)]
    failed = check_copies({"mode": "sync", "reports": reports, "backup_workers": 0})
    assert [(f.kind, f.fails) for f in failed] == [("shards_differ", True)]
