"""The chaos report: what a chaos run injected, what it survived, and what it lost (must be nothing).

Pure: built by ``psflow chaos`` from the faults its injector carried out, the run's ``summary.json``
(each task's attempts and exits; the ps's counters), the workers' push ledgers
(:mod:`psflow.train.ledger`) and, with ``--baseline``, the fault-free run's summary.

The ledger, Jepsen style: every push carries (worker, attempt, seq); each worker attempt counted the
pushes shard 0 acknowledged as applied (its ledger file survives a SIGKILL), and the shard counted
the pushes of each (worker, attempt) it applied (``applied_by``, carried by replication and re-sync
to whichever copy serves the shard at the end). Per attempt:

- ``lost``      = acknowledged - applied, where positive: an acknowledged update the ps does not hold;
- ``unacknowledged`` = applied - acknowledged, where positive: applied, but the attempt died before
  the reply (allowed: its data position moved on with it, so the batch is not taken again);
- ``redone``    = sent - applied: steps computed whose update never landed (their batches are taken
  again from the last applied data position).

With one copy of each shard (``--ps-replicas 1``) a ps's death rolls the job back to its newest
checkpoint: the updates acknowledged after it are done again by design, so the two halves are not
compared (``lost`` is None, ``rolled_back`` counts the rollbacks).

Shard 0 is the ledger's shard: it records the data positions and receives each step's push last.
``batches applied`` (async): shard 0's updates; with a baseline, every batch was applied exactly once
when they equal the fault-free run's (the same data, the same epochs).

Every other shard, and every copy of each, is checked against it by :mod:`psflow.launch.copies` (the
ledger the launcher also reads): a shard that applied fewer updates than shard 0 lost them (they count
in ``lost``), copies of one shard that disagree are named. One row per shard shows each copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from psflow.launch.copies import SHARDS_DIFFER, check_copies, shard_copies
from psflow.train.ledger import LedgerEntry


def serving_shard_stats(summary: Mapping[str, Any], shard: int = 0) -> dict[str, Any] | None:
    """The final counters of the copy that served ``shard`` at the end of the run (None: no ps
    reported it). With replication: the ps whose report lists the shard's copy as ``serving``;
    without: ps:``shard``'s own ``ps_stats``."""
    reports = summary.get("reports") or {}
    for task in sorted(reports):
        copies = reports[task].get("shards") if task.startswith("ps:") else None
        if isinstance(copies, Mapping):
            copy = copies.get(str(shard))
            if isinstance(copy, Mapping) and copy.get("role") == "serving":
                return dict(copy)
    own = reports.get(f"ps:{shard}", {}).get("ps_stats")
    return dict(own) if isinstance(own, Mapping) else None


def ledger_rows(ledgers: Sequence[LedgerEntry], applied_by: Mapping[str, Mapping[str, int]]) -> list[dict[str, Any]]:
    """One row per (worker, attempt) in either half of the ledger: sent, acknowledged, applied, and
    the lost, unacknowledged and redone pushes of that attempt."""
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for e in ledgers:
        rows[(e.worker, e.attempt)] = {"task": e.task, "worker": e.worker, "attempt": e.attempt, "sent": e.sent,
                                       "acknowledged": e.acknowledged, "applied": 0}
    for w, by_attempt in applied_by.items():
        for a, n in by_attempt.items():
            row = rows.setdefault((int(w), int(a)), {"task": None, "worker": int(w), "attempt": int(a), "sent": 0,
                                                     "acknowledged": 0, "applied": 0})
            row["applied"] = int(n)
    for row in rows.values():
        row["lost"] = max(0, row["acknowledged"] - row["applied"])
        row["unacknowledged"] = max(0, row["applied"] - row["acknowledged"])
        row["redone"] = max(0, row["sent"] - row["applied"])
    return [rows[k] for k in sorted(rows)]


def fault_outcomes(faults: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each fault with ``survived`` and ``outcome``: a kill survived when the attempt it hit ended by
    SIGKILL and was restarted; a stop or a partition when the attempt it hit went on (it ended
    cleanly, or a later fault's restart replaced it)."""
    exits = {(t["task"], x["attempt"]): x for t in summary.get("tasks", []) for x in t.get("exits", [])}
    out = []
    for f in faults:
        x = exits.get((f["task"], f["attempt"]))
        if f["kind"] == "kill":
            ok = x is not None and x.get("signal") == "SIGKILL" and bool(x.get("restarted"))
            why = ("restarted" if ok else "not restarted: " + (x.get("not_restarted") or x.get("cause") or "?")
                   if x is not None else "its attempt has no recorded exit")
        else:
            ok = x is None or x.get("code") == 0 or bool(x.get("restarted"))
            why = "continued" if ok else f"its attempt then failed: {x.get('cause') if x else '?'}"
        out.append({**f, "survived": ok, "outcome": why})
    return out


def build_report(
    *, faults: Sequence[Mapping[str, Any]], skipped: Sequence[int], summary: Mapping[str, Any],
    ledgers: Sequence[LedgerEntry], settings: Mapping[str, Any], baseline: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """chaos.json: the settings, the faults and their outcomes, restarts per task, the ledger, the
    batches and steps, and the accuracy and goodput against the baseline (when there is one)."""
    shard0 = serving_shard_stats(summary)
    applied_by = (shard0 or {}).get("applied_by") or {}
    rows = ledger_rows(ledgers, applied_by)
    outcomes = fault_outcomes(faults, summary)
    by_kind: dict[str, int] = {}
    for f in faults:
        by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1
    restarts = {t["task"]: int(t["attempts"]) - 1 for t in summary.get("tasks", [])}
    replicated = any("shards" in r for t, r in (summary.get("reports") or {}).items() if t.startswith("ps:"))
    rollbacks = 0 if replicated else max((n for t, n in restarts.items() if t.startswith("ps:")), default=0)
    findings = check_copies(summary)
    # A shard short of shard 0's updates lost them, whatever shard 0's half of the ledger says (and
    # after a rollback too: every shard rolled back together, so their counts still compare).
    lost_elsewhere = sum(f.lost for f in findings if f.kind == SHARDS_DIFFER)
    lost0 = None if rollbacks else sum(r["lost"] for r in rows)
    ledger = {
        "kept": bool(ledgers) and shard0 is not None,
        "rolled_back": rollbacks,
        "acknowledged": sum(r["acknowledged"] for r in rows),
        "applied": sum(r["applied"] for r in rows),
        "lost": lost0 if not lost_elsewhere else (lost0 or 0) + lost_elsewhere,
        "lost_on_other_shards": lost_elsewhere,
        "applied_twice_on_other_shards": sum(f.extra for f in findings if f.kind == SHARDS_DIFFER),
        "unacknowledged": sum(r["unacknowledged"] for r in rows),
        "duplicates_refused": int((shard0 or {}).get("duplicates", 0)),
        "attempts": rows,
    }
    report: dict[str, Any] = {
        "status": summary.get("status"),
        "root_cause": summary.get("root_cause"),
        "settings": dict(settings),
        "faults": {"injected": len(faults), "survived": sum(1 for o in outcomes if o["survived"]), "by_kind": by_kind,
                   "skipped_slots": len(skipped), "list": outcomes},
        "restarts": restarts,
        "ledger": ledger,
        "shards": [{"shard": sh, "copies": [c.row() for c in cs]} for sh, cs in shard_copies(summary.get("reports") or {}).items()],
        "findings": [f.to_dict() for f in findings],
        "steps_redone": sum(r["redone"] for r in rows),
        "global_step": summary.get("global_step"),
        "batches_applied": (shard0 or {}).get("applied_updates"),
        "test_accuracy": summary.get("test_accuracy"),
        "wall_s": summary.get("wall_s"),
    }
    if baseline is not None:
        base0 = serving_shard_stats(baseline)
        base_batches = (base0 or {}).get("applied_updates")
        report["baseline"] = {"status": baseline.get("status"), "global_step": baseline.get("global_step"),
                              "batches_applied": base_batches, "test_accuracy": baseline.get("test_accuracy"),
                              "wall_s": baseline.get("wall_s")}
        if summary.get("mode") == "async" and base_batches is not None and report["batches_applied"] is not None:
            report["visits_per_batch"] = "exactly once" if report["batches_applied"] == base_batches else (
                f"{report['batches_applied']} batches applied against {base_batches} in the fault-free run")
        acc, base_acc = summary.get("test_accuracy"), baseline.get("test_accuracy")
        if isinstance(acc, (int, float)) and isinstance(base_acc, (int, float)):
            report["accuracy_delta"] = round(acc - base_acc, 4)
        rate, base_rate = _steps_per_s(summary), _steps_per_s(baseline)
        if rate and base_rate:
            report["goodput_ratio"] = round(rate / base_rate, 3)
    return report


def _steps_per_s(summary: Mapping[str, Any]) -> float | None:
    step, wall = summary.get("global_step"), summary.get("wall_s")
    if isinstance(step, (int, float)) and isinstance(wall, (int, float)) and wall > 0:
        return step / wall
    return None


def render(report: Mapping[str, Any]) -> str:
    """The report as the table ``psflow chaos`` prints."""
    f, led = report["faults"], report["ledger"]
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(f["by_kind"].items())) or "none"
    lines = [
        f"psflow chaos: {report['status']}" + (f" (root cause {report['root_cause']})" if report.get("root_cause") else ""),
        f"  faults injected      {f['injected']} ({kinds}); survived {f['survived']} of {f['injected']}"
        + (f"; {f['skipped_slots']} slot(s) skipped, no task eligible" if f["skipped_slots"] else ""),
    ]
    for o in f["list"]:
        what = {"kill": "SIGKILL", "partition": f"partition {o.get('stall_s', 0):g} s"}.get(
            o["kind"], f"SIGSTOP {o.get('stall_s', 0):g} s")
        lines.append(f"    {o['at_s']:7.1f} s  {what:<14} {o['task']} (attempt {o['attempt']}): {o['outcome']}")
    restarted = {t: n for t, n in report["restarts"].items() if n}
    lines.append("  restarts per task    " + (", ".join(f"{t} {n}" for t, n in restarted.items()) or "none"))
    if led["kept"] and led["rolled_back"]:
        lines.append(f"  acknowledged updates not compared: the job rolled back to its newest checkpoint "
                     f"{led['rolled_back']} time(s) (one copy per ps shard: the updates after it were done again)")
    elif led["kept"]:
        elsewhere = led.get("lost_on_other_shards") or 0
        lines.append(f"  acknowledged updates {led['acknowledged']} acknowledged, {led['applied']} applied on shard 0: "
                     f"lost {led['lost']}" + (f" ({elsewhere} on the other shards)" if elsewhere else "")
                     + ("" if led["lost"] == 0 else "  <-- LOST UPDATES"))
        lines.append(f"  applied, not acked   {led['unacknowledged']} (the sender died before the reply; its batch "
                     f"is not taken again); {led['duplicates_refused']} resent push(es) recognised, not applied twice")
        lines.append(f"  steps redone         {report['steps_redone']} (computed, never applied: taken again from the "
                     "last applied data position)")
    else:
        lines.append("  acknowledged updates not checked (no push ledger or no ps counters in the summary)")
    lines += _shard_lines(report)
    base = report.get("baseline")
    batches = report.get("batches_applied")
    if "visits_per_batch" in report:
        lines.append(f"  visits per batch     {report['visits_per_batch']} ({batches} batches on shard 0)")
    elif batches is not None:
        lines.append(f"  batches applied      {batches} on shard 0 (--baseline compares them with the fault-free run)")
    acc = report.get("test_accuracy")
    if base is not None:
        delta = report.get("accuracy_delta")
        lines.append(f"  test accuracy        {_num(acc)} against {_num(base.get('test_accuracy'))} without faults"
                     + (f" ({delta:+.4f})" if delta is not None else ""))
        if "goodput_ratio" in report:
            lines.append(f"  goodput              {report['goodput_ratio']:.2f}x the fault-free run's steps per second "
                         f"({report['wall_s']:.1f} s against {base['wall_s']:.1f} s)")
    elif acc is not None:
        lines.append(f"  test accuracy        {_num(acc)} (--baseline runs the job without faults to compare)")
    return "\n".join(lines)


def _shard_lines(report: Mapping[str, Any]) -> list[str]:
    """A row per shard (each copy: its ps, role, version, updates applied, duplicates refused), then
    what the ledger over every shard and copy found."""
    lines = []
    for row in report.get("shards") or []:
        copies = "; ".join(f"{c['role']} {c['task']}: version {c['version']}, {c['applied']} applied, "
                           f"{c['duplicates']} duplicates" + (f" ({c['state']})" if c.get("state") else "")
                           for c in row["copies"])
        lines.append(f"  {'shard ' + str(row['shard']):<20} {copies}")
    marks = {"two_serving": "  <-- TWO SERVING COPIES", "copies_disagree": "  <-- COPIES DISAGREE"}
    for f in report.get("findings") or []:
        mark = marks.get(f["kind"], "  <-- LOST UPDATES" if f.get("lost") else "  <-- APPLIED TWICE" if f.get("extra") else "")
        lines.append(f"  ledger               {f['message']}" + (mark if f["fails"] else ""))
    if report.get("shards") and not any(f["fails"] for f in report.get("findings") or []):
        lines.append("  ledger               every shard and copy agree")
    return lines


def _num(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, (int, float)) else "n/a"
