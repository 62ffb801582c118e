"""The ledger over every shard and every copy: the ps's final counters, checked against each other.

Pure: reads a run's summary (``mode`` and each ps task's final report) and returns findings. Called
by the launcher's runner once every task has exited (a failing finding fails a run that would have
succeeded, and is its root cause) and by ``psflow chaos``'s report (:mod:`psflow.chaos.report`).

Where the counters come from: with a backup of each shard (``--ps-replicas 2``) each ps reports every
shard copy it holds (``shards``: role, version, ``applied_updates``, ``duplicates``, ``applied_by``
per worker and attempt; :meth:`psflow.ps.service.PsService.copies_report`); with one copy, ps:``i``'s
``ps_stats`` and ``global_step`` are shard ``i``'s.

The rules (each broken one is a :class:`Finding` that fails the run):

- **one serving copy**: two copies that both say ``serving`` at the end served the shard at once;
- **copies agree**: a backup in step with its serving copy holds the same version, updates applied,
  duplicates refused and updates applied per (worker, attempt). A backup *behind* is a disagreement
  unless the copies said why (the backup is ``resyncing`` or ``catching-up``, or the serving copy went
  on ``alone`` / ``degraded``): then it is a finding that does not fail, said, never silent;
- **shards agree**: in async and ssp modes every push goes to every shard, so every shard applies
  as many updates as shard 0 (the ledger's shard): fewer is a lost update, more one applied twice (or
  on that shard only). In sync mode every shard takes every step: the versions are equal. Per-worker
  counts are not compared across shards: at a ``max_steps`` stop the workers' last pushes may land in
  a different order on each shard, so who got the last update differs while the totals do not.

A shard no ps reported (its ps died and never sent a final report) is a finding that does not fail:
it is not checked, and says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

# Kinds of finding, in the order a root cause is chosen: the split first (it explains the rest).
TWO_SERVING, COPIES_DISAGREE, SHARDS_DIFFER, BEHIND_KNOWN, UNCHECKED = (
    "two_serving", "copies_disagree", "shards_differ", "behind_known", "unchecked")
_ORDER = (TWO_SERVING, COPIES_DISAGREE, SHARDS_DIFFER, BEHIND_KNOWN, UNCHECKED)
_CATCHING_UP = ("resyncing", "catching-up")


@dataclass(frozen=True)
class CopyCounts:
    """One copy of one shard as its ps reported it at the end.

    ``role``: ``serving``, ``backup``, ``resyncing``, or ``only`` (no replication). ``state`` and
    ``degraded``: what the copy said about its pair, when its report carries them (``synced``,
    ``catching-up``, ``alone``; why the serving copy went on without its backup)."""

    shard: int
    task: str
    role: str
    version: int | None
    applied: int | None
    duplicates: int = 0
    applied_by: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    state: str | None = None
    degraded: str | None = None

    @property
    def alone(self) -> bool:
        return self.state == "alone" or bool(self.degraded)

    @property
    def catching_up(self) -> bool:
        return self.role in _CATCHING_UP or self.state in _CATCHING_UP

    def row(self) -> dict[str, Any]:
        """The copy as a summary row (without ``applied_by``: the ps's report has it)."""
        return {"shard": self.shard, "task": self.task, "role": self.role, "version": self.version,
                "applied": self.applied, "duplicates": self.duplicates,
                **({"state": self.state} if self.state else {}), **({"degraded": self.degraded} if self.degraded else {})}


@dataclass(frozen=True)
class Finding:
    """What the ledger found on one shard: ``kind`` (see the module constants), one sentence, whether
    it fails the run, the ps task it names, and ``lost`` / ``extra``: updates a shard is short of, or
    has beyond, shard 0's (async)."""

    shard: int
    kind: str
    message: str
    fails: bool
    task: str | None = None
    lost: int = 0
    extra: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def shard_copies(reports: Mapping[str, Mapping[str, Any]]) -> dict[int, list[CopyCounts]]:
    """Every shard copy the ps tasks reported at the end, by shard (copies in ps task order)."""
    ps = sorted((t for t in reports if t.startswith("ps:")), key=_index)
    replicated = any(isinstance(reports[t].get("shards"), Mapping) for t in ps)
    out: dict[int, list[CopyCounts]] = {}
    for task in ps:
        r = reports[task]
        if replicated:
            for shard, c in (r.get("shards") or {}).items():
                if isinstance(c, Mapping):
                    out.setdefault(int(shard), []).append(_copy(int(shard), task, str(c.get("role", "?")), c.get("version"), c))
        elif isinstance(r.get("ps_stats"), Mapping):  # a killed ps sent none: its shard is not reported
            out.setdefault(_index(task), []).append(_copy(_index(task), task, "only", r.get("global_step"), r["ps_stats"]))
    return {s: out[s] for s in sorted(out)}


def check_copies(summary: Mapping[str, Any], num_shards: int | None = None) -> list[Finding]:
    """The ledger's findings over ``summary`` (``mode``, ``reports``, ``tasks``), failing ones first
    in the order a root cause is chosen; empty: every shard and copy agrees.

    Args:
        summary: the run's summary (or the part of it the launcher has when the run ends).
        num_shards: how many shards the run has; by default one per ps task in ``tasks``/``reports``.

    Example:
        >>> ok = {"shards": {"0": {"role": "serving", "version": 9, "applied_updates": 9}}}
        >>> short = {"shards": {"1": {"role": "serving", "version": 8, "applied_updates": 8}}}
        >>> [(f.kind, f.shard, f.task, f.lost) for f in check_copies({"mode": "async", "reports": {"ps:0": ok, "ps:1": short}})]
        [('shards_differ', 1, 'ps:1', 1)]
    """
    reports = summary.get("reports") or {}
    copies = shard_copies(reports)
    tasks = [t["task"] for t in summary.get("tasks") or [] if isinstance(t, Mapping) and "task" in t]
    if num_shards is None:
        num_shards = 1 + max((_index(t) for t in [*tasks, *reports] if t.startswith("ps:")), default=-1)
    findings: list[Finding] = []
    for shard in range(max(num_shards, 1 + max(copies, default=-1))):
        if not copies.get(shard):
            findings.append(Finding(shard, UNCHECKED, f"shard {shard}: no ps reported its final counters "
                                    "(its ps ended without a final report); it was not checked.", False))
            continue
        findings += _check_pair(shard, copies[shard])
    findings += _check_shards(str(summary.get("mode") or "async"), copies, int(summary.get("backup_workers") or 0))
    return sorted(findings, key=lambda f: (not f.fails, _ORDER.index(f.kind), f.shard))


def verdict(status: str, root_cause: str | None, findings: list[Finding]) -> tuple[str, str | None]:
    """A run's status and root cause once the ledger is read: a run that succeeded fails when a
    finding fails, with the first as its root cause; any other verdict stands (its own cause first)."""
    failing = [f for f in findings if f.fails]
    if status == "succeeded" and failing:
        return "failed", failing[0].message
    return status, root_cause


def representative(copies: list[CopyCounts]) -> CopyCounts:
    """The copy that speaks for its shard: the serving one (without replication: the only one), else
    the furthest backup (its serving copy did not report; a backup holds every acknowledged update)."""
    for c in copies:
        if c.role in ("serving", "only"):
            return c
    return max(copies, key=lambda c: (not c.catching_up, c.version or 0))


# -- the rules ------------------------------------------------------------------------------------
def _check_pair(shard: int, copies: list[CopyCounts]) -> list[Finding]:
    serving = [c for c in copies if c.role == "serving"]
    if len(serving) > 1:
        both = " and ".join(f"{c.task} (version {c.version}, {c.applied} updates applied)" for c in serving)
        return [Finding(shard, TWO_SERVING, f"shard {shard} has {len(serving)} serving copies at the end: {both}; "
                        "two copies served it at once, so each missed the other's updates.", True, serving[1].task)]
    if not serving:
        return []
    primary, out = serving[0], []
    for backup in (c for c in copies if c is not primary):
        out += _compare(shard, primary, backup)
    return out


def _compare(shard: int, primary: CopyCounts, backup: CopyCounts) -> list[Finding]:
    p, b = primary, backup
    where = f"its serving copy on {p.task} is at version {p.version} with {p.applied} updates applied, " \
            f"its {b.role} copy on {b.task} at version {b.version} with {b.applied}"
    if (b.version or 0) < (p.version or 0) and (b.catching_up or p.alone):
        why = (f"the serving copy went on alone ({p.degraded or p.state})" if p.alone
               else f"the {b.role} copy is catching up")
        return [Finding(shard, BEHIND_KNOWN, f"shard {shard}: {where}: behind, and known: {why}.", False, b.task)]
    if b.catching_up:
        return []  # a copy still loading its state holds nothing to compare yet, and says so in its role
    differs = [f"{name} {pv} on {p.task}, {bv} on {b.task}" for name, pv, bv in (
        ("version", p.version, b.version), ("updates applied", p.applied, b.applied),
        ("duplicates refused", p.duplicates, b.duplicates)) if pv != bv]
    differs += _applied_by_differs(p, b)
    if not differs:
        return []
    return [Finding(shard, COPIES_DISAGREE, f"shard {shard}'s copies disagree: {where} ({'; '.join(differs[:3])}); "
                    "neither said it went on alone or was catching up.", True, b.task)]


def _applied_by_differs(p: CopyCounts, b: CopyCounts) -> list[str]:
    keys = sorted({(w, a) for c in (p, b) for w, by in c.applied_by.items() for a in by}, key=lambda k: (int(k[0]), int(k[1])))
    return [f"worker {w} attempt {a}: {pn} applied on {p.task}, {bn} on {b.task}" for w, a in keys
            if (pn := p.applied_by.get(w, {}).get(a, 0)) != (bn := b.applied_by.get(w, {}).get(a, 0))]


def backup_workers(mode: str, replicas_to_aggregate: int | None, total_num_replicas: int | None, replicas: int) -> int:
    """Sync mode's backup workers (M - N): 0 in the other modes, and when every gradient is waited for."""
    if mode != "sync":
        return 0
    total = total_num_replicas or replicas
    return max(0, total - (replicas_to_aggregate or total))


def _check_shards(mode: str, copies: Mapping[int, list[CopyCounts]], backups: int = 0) -> list[Finding]:
    speakers = {s: representative(cs) for s, cs in copies.items() if cs}
    if len(speakers) < 2:
        return []
    ref_shard = 0 if 0 in speakers else min(speakers)
    ref = speakers[ref_shard]
    out = []
    for shard, c in speakers.items():
        if shard == ref_shard:
            continue
        which = f"its {'serving copy' if c.role in ('serving', 'only') else c.role + ' copy'}, on {c.task}"
        if mode == "sync":
            if c.version != ref.version and backups:
                out.append(Finding(shard, SHARDS_DIFFER, f"shard {shard} is at version {c.version} ({which}), shard "
                                   f"{ref_shard} at {ref.version}: with backup workers each shard averages the first "
                                   "fresh gradients it receives (as TensorFlow's per-variable accumulators do), so the "
                                   "steps near the end may land on some shards only.", False, c.task))
            elif c.version != ref.version:
                out.append(Finding(shard, SHARDS_DIFFER, f"shard {shard} is at version {c.version} ({which}), shard "
                                   f"{ref_shard} at {ref.version}: in sync mode every shard takes every step.", True, c.task))
            continue
        if c.applied is None or ref.applied is None or c.applied == ref.applied:
            continue
        gap = abs(c.applied - ref.applied)
        what = (f"{gap} update{'s' if gap != 1 else ''} lost on shard {shard}" if c.applied < ref.applied else
                f"{gap} update{'s' if gap != 1 else ''} applied twice, or on shard {shard} only")
        out.append(Finding(shard, SHARDS_DIFFER, f"shard {shard} applied {c.applied} updates ({which}), shard "
                           f"{ref_shard} applied {ref.applied}: {what} ({mode}: every push goes to every shard).", True,
                           c.task, lost=max(0, ref.applied - c.applied), extra=max(0, c.applied - ref.applied)))
    return out


# -- reading the reports ----------------------------------------------------------------------------
def _copy(shard: int, task: str, role: str, version: Any, counts: Mapping[str, Any]) -> CopyCounts:
    by = counts.get("applied_by") or {}
    return CopyCounts(
        shard=shard, task=task, role=role, version=_int_or_none(version), applied=_int_or_none(counts.get("applied_updates")),
        duplicates=int(counts.get("duplicates") or 0),
        applied_by={str(w): {str(a): int(n) for a, n in d.items()} for w, d in by.items() if isinstance(d, Mapping)},
        state=counts.get("state") if isinstance(counts.get("state"), str) else None,
        degraded=counts.get("degraded") if isinstance(counts.get("degraded"), str) else None)


def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _index(task: str) -> int:
    return int(task.split(":")[1])
