"""K8sBackend: submit a run's manifests to Kubernetes, follow its pods, record it, stop it.

``psflow run --backend k8s`` calls :meth:`K8sBackend.run` (``--dry-run``: :meth:`K8sBackend.script`).
The manifests are :mod:`psflow.launch.k8s`'s; this module is the I/O around them, through the
official ``kubernetes`` client (``pip install 'psflow[k8s]'``), and a pure core that turns what the
API answers into the run's history:

- :func:`pod_view` reads one pod (its task from the Job's labels and completion index, its attempt
  from the Job controller's index failure count, how its container ended);
- :class:`PodTracker` takes successive pod listings and says, once each, which attempt started,
  which does not run yet and why (an image that cannot be pulled, no node that fits), which exited
  (exit code, OOM kill, its error report from the termination message) and which attempt is a
  restart Kubernetes made, and after what;
- :func:`outcome` reads the Jobs' conditions: every Job ``Complete`` -> succeeded; one ``Failed``
  (a task out of retries, or a permanent exit code) -> failed.

Restarts are Kubernetes' (:func:`psflow.launch.k8s.restart_fields`); the launcher records them in
the same run store as every other backend (``LOGDIR/status.json``, ``events.jsonl``, the job store)
and applies one rule itself, as locally: a run's restart group (a ps with one copy of its shard, an
all-reduce rank) restarts together (:meth:`K8sBackend._restart_group`). It lists the pods every
``poll_s`` and copies each attempt's log into ``LOGDIR/logs/<task>.log``. A failed or stopped run's
objects are deleted, a succeeded one's but its Jobs (``ttlSecondsAfterFinished``). The client calls
used, what a test fake implements, and the whole design: ``docs/design/kubernetes.md``.
"""

from __future__ import annotations

import json
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psflow.errors import ClusterError, ConfigError
from psflow.launch.backend import RunResult
from psflow.launch.console import Console
from psflow.launch.controller import exit_cause
from psflow.launch.k8s import (
    FAILURE_COUNT_ANNOTATION,
    INDEX_ANNOTATION,
    JOB_LABEL,
    RUN_LABEL,
    K8sSettings,
    render_budgets,
    render_run,
    run_name,
    to_yaml,
)
from psflow.launch.plan import LaunchPlan
from psflow.launch.restart import RestartGroup, restart_group
from psflow.launch.runstore import RunStore, file_store

# ------------------------------------------------------------------------------------ pure core


@dataclass(frozen=True)
class PodView:
    """One pod of the run, as the watcher needs it."""

    name: str
    task: str  # "worker:1"
    attempt: int
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    created: float = 0.0
    exit_code: int | None = None  # once its container terminated; -N for a death by signal N
    reason: str | None = None  # the container's: Completed, Error, OOMKilled
    message: str | None = None  # its termination message: the task's error report
    waiting: str | None = None  # why its container does not run yet: "ErrImagePull: <message>", ...
    disrupted: str | None = None  # its DisruptionTarget condition's reason: preempted, evicted, its node gone


@dataclass(frozen=True)
class Started:
    task: str
    attempt: int
    pod: str


@dataclass(frozen=True)
class Restarted:
    """Kubernetes started ``attempt`` of ``task`` after attempt - 1 ended with ``cause``."""

    task: str
    attempt: int
    cause: str


@dataclass(frozen=True)
class Waiting:
    """``task``'s pod does not run yet, for a reason worth telling (an image that cannot be pulled,
    a missing Secret or claim, no node that fits): said once per reason."""

    task: str
    attempt: int
    reason: str


@dataclass(frozen=True)
class Exited:
    task: str
    attempt: int
    code: int
    oom_killed: bool
    report: dict[str, Any] | None
    pod: str
    disrupted: str | None = None  # a disruption ended it: Kubernetes replaces the pod without spending a restart


Change = Started | Restarted | Waiting | Exited


def exit_code_of(container_code: int) -> int:
    """A task's exit code from its container's: 128+N (killed by signal N) becomes -N, as locally."""
    if 128 < container_code < 128 + signal.NSIG:
        return -(container_code - 128)
    return container_code


def parse_report(message: str | None) -> dict[str, Any] | None:
    """The task's error report from its termination message (JSON, as the task wrote it), or the
    message itself (the log's last lines, Kubernetes' fallback; or a report cut at 4 KiB)."""
    if not message or not message.strip():
        return None
    try:
        report = json.loads(message)
    except ValueError:
        return {"exception": "TerminationMessage", "message": message.strip()[-2000:]}
    return report if isinstance(report, dict) else {"exception": "TerminationMessage", "message": message.strip()}


def pod_view(pod: Any) -> PodView | None:
    """A ``V1Pod`` of the run as a :class:`PodView`; None for a pod that is not a task's."""
    meta = pod.metadata
    labels, annotations = meta.labels or {}, meta.annotations or {}
    job = labels.get(JOB_LABEL)
    index = annotations.get(INDEX_ANNOTATION, labels.get(INDEX_ANNOTATION))
    if job is None or index is None or not str(index).isdigit():
        return None
    attempt = annotations.get(FAILURE_COUNT_ANNOTATION, "0")
    status = pod.status
    code = reason = message = waiting = disrupted = None
    for cs in (status.container_statuses or []) if status is not None else []:
        term = cs.state.terminated if cs.state is not None else None
        wait = cs.state.waiting if cs.state is not None else None
        if term is not None:
            code, reason, message = exit_code_of(term.exit_code), term.reason, term.message
        elif wait is not None and wait.reason not in (None, "ContainerCreating", "PodInitializing"):
            waiting = f"{wait.reason}: {wait.message}" if wait.message else wait.reason
    for c in (status.conditions or []) if status is not None else []:
        if c.type == "DisruptionTarget" and c.status == "True":
            disrupted = c.reason or "DisruptionTarget"
        if waiting is None and c.type == "PodScheduled" and c.status == "False" and c.reason:
            waiting = f"{c.reason}: {c.message}" if c.message else c.reason  # Unschedulable: no node fits
    created = meta.creation_timestamp.timestamp() if meta.creation_timestamp is not None else 0.0
    return PodView(meta.name, f"{job}:{index}", int(attempt) if str(attempt).isdigit() else 0,
                   (status.phase if status is not None else None) or "Pending", created, code, reason, message, waiting,
                   disrupted)


class PodTracker:
    """Successive pod listings -> each attempt's start, restart and exit, each said once, in order.

    A task's attempts are told apart by the Job controller's index failure count; an attempt seen
    after its task's earlier one ended is a restart Kubernetes made (:class:`Restarted` first, with
    the earlier attempt's cause). A second pod of the same attempt is Kubernetes replacing a disrupted
    one (``podFailurePolicy`` ignores ``DisruptionTarget``): a :class:`Restarted` of the same attempt,
    and the disrupted exit is no failure. A pod that disappears without an exit seen says nothing.
    """

    def __init__(self) -> None:
        self._started: set[tuple[str, int]] = set()
        self._exited: dict[tuple[str, int], int] = {}
        self._causes: dict[tuple[str, int], str] = {}
        self._waiting: dict[tuple[str, int], str] = {}
        self._pods: dict[tuple[str, int], str] = {}  # each attempt's current pod
        self._replaced: set[str] = set()  # pods Kubernetes replaced (a disruption): no longer followed
        self._disrupted: set[tuple[str, int]] = set()

    def update(self, pods: Iterable[PodView]) -> list[Change]:
        out: list[Change] = []
        for p in sorted(pods, key=lambda p: (p.created, p.task, p.attempt)):
            key = (p.task, p.attempt)
            if p.name in self._replaced:
                continue
            current = self._pods.setdefault(key, p.name)
            if current != p.name:  # the same attempt again: Kubernetes replaced a disrupted pod
                self._replaced.add(current)
                self._pods[key] = p.name
                self._exited.pop(key, None)
                self._disrupted.discard(key)
                cause = self._causes.get(key, "its pod went away")
                out.append(Restarted(p.task, p.attempt, f"{cause}; Kubernetes replaced the pod (no restart spent)"))
                out.append(Started(p.task, p.attempt, p.name))
            elif key not in self._started:
                self._started.add(key)
                before = (p.task, p.attempt - 1)
                if p.attempt > 0:
                    out.append(Restarted(p.task, p.attempt, self._causes.get(before, "an earlier attempt failed")))
                out.append(Started(p.task, p.attempt, p.name))
            if p.waiting and p.exit_code is None and self._waiting.get(key) != p.waiting:
                self._waiting[key] = p.waiting
                out.append(Waiting(p.task, p.attempt, p.waiting))
            if p.exit_code is not None and key not in self._exited:
                self._exited[key] = p.exit_code
                oom = p.reason == "OOMKilled"
                self._causes[key] = exit_cause(p.exit_code, oom) + (f" ({p.disrupted})" if p.disrupted else "")
                if p.disrupted:
                    self._disrupted.add(key)
                report = parse_report(p.message) if p.exit_code != 0 else None
                out.append(Exited(p.task, p.attempt, p.exit_code, oom, report, p.name, p.disrupted))
        return out

    def stopped(self, view: PodView, code: int, cause: str) -> Exited | None:
        """The launcher stopped ``view``'s pod (a group restart): its exit, recorded now with ``cause``
        (the pod may be gone before a listing shows how it ended); None if its exit was seen already."""
        key = (view.task, view.attempt)
        if key in self._exited:
            return None
        self._started.add(key)
        self._exited[key], self._causes[key] = code, cause
        return Exited(view.task, view.attempt, code, False, None, view.name)

    def tasks(self) -> list[dict[str, Any]]:
        """Each task's attempts and exits so far, for the run's summary."""
        out: dict[str, dict[str, Any]] = {}
        for task, attempt in sorted(self._started):
            t = out.setdefault(task, {"task": task, "attempts": 0, "exits": []})
            t["attempts"] = max(t["attempts"], attempt + 1)
            if (task, attempt) in self._exited:
                t["exits"].append({"attempt": attempt, "code": self._exited[(task, attempt)],
                                   "cause": self._causes[(task, attempt)]})
        return list(out.values())

    def last_failure(self) -> tuple[str, int, int] | None:
        """(task, attempt, code) of the first failed exit whose task was not started again: the root cause."""
        for (task, attempt), code in self._exited.items():
            if code != 0 and (task, attempt + 1) not in self._started and (task, attempt) not in self._disrupted:
                return task, attempt, code
        return None

    def failures(self) -> list[tuple[str, int, int]]:
        """Every failed exit seen, (task, attempt, code), in the order seen: each one a restart asked
        of the run's budget (Kubernetes restarts it if its own per-index budget allows)."""
        return [(task, attempt, code) for (task, attempt), code in self._exited.items()
                if code != 0 and (task, attempt) not in self._disrupted]


def run_budget_spent(failures: Sequence[tuple[str, int, int]], max_restarts_per_run: int | None) -> tuple[str, int, int] | None:
    """The failed exit that a run's restart budget cannot pay for, if any: the (cap + 1)-th failure
    across all tasks. A Job's ``backoffLimit`` caps each job type's Job; the run's cap
    (``--max-restarts-per-run``, which the local backend applies across every task) is held by the
    launcher that follows the run, which fails it and deletes its Jobs at that failure."""
    if max_restarts_per_run is None or len(failures) <= max_restarts_per_run:
        return None
    return failures[max_restarts_per_run]


def outcome(jobs: Iterable[Any]) -> tuple[str | None, str]:
    """``("succeeded" | "failed" | None, why)`` from the run's ``V1Job`` objects' conditions."""
    jobs = list(jobs)
    for job in jobs:
        for c in (job.status.conditions or []) if job.status is not None else []:
            if c.type == "Failed" and c.status == "True":
                return "failed", f"Job {job.metadata.name} failed ({c.reason or 'no reason'}: {c.message or ''})".rstrip(": )") + ")"
    done = [j for j in jobs if any(c.type == "Complete" and c.status == "True"
                                   for c in ((j.status.conditions or []) if j.status is not None else []))]
    if jobs and len(done) == len(jobs):
        return "succeeded", "every Job completed"
    return None, ""


# ------------------------------------------------------------------------------------ the I/O shell


def load_clients() -> tuple[Any, Any, Any]:
    """``(CoreV1Api, BatchV1Api, PolicyV1Api)`` configured from the cluster the launcher runs in, or kubeconfig.

    Raises:
        ConfigError: the ``kubernetes`` package is missing.
        ClusterError: no cluster configuration found.
    """
    try:
        from kubernetes import client, config
    except ImportError as e:
        raise ConfigError("--backend k8s needs the Kubernetes client: pip install 'psflow[k8s]'.") from e
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as e:
            raise ClusterError(f"No Kubernetes cluster configured ({e}). Set KUBECONFIG or ~/.kube/config (kubectl's), "
                               "or run the launcher in a pod; `psflow run --backend k8s --dry-run ...` prints the "
                               "manifests for `kubectl apply -f -` instead.") from e
    return client.CoreV1Api(), client.BatchV1Api(), client.PolicyV1Api()


class K8sBackend:
    """Runs a plan as Kubernetes objects and follows it to its end (see the module's docstring).

    Args:
        settings: image, volume claim, namespace, GPUs, TTL (:class:`psflow.launch.k8s.K8sSettings`).
        core, batch, policy: a ``CoreV1Api``, a ``BatchV1Api`` and a ``PolicyV1Api`` (default:
            :func:`load_clients`).
        poll_s: how often the pods and Jobs are listed.
        run_timeout_s: the longest the launcher follows the run (None: until it ends); past it the
            run is stopped and its objects deleted.
        store: makes the run store for a plan (default: its files in the log dir; the platform's
            :func:`psflow.platform.recording.recording` records it in the job store too); ``run``'s
            own ``store`` comes first.
        secret: the job secret (default: a fresh random one per run).

    Example:
        >>> K8sBackend(K8sSettings(image="registry/train:1", volume_claim="psflow-logs")).run(plan).exit_code
        0
    """

    def __init__(self, settings: K8sSettings, *, core: Any = None, batch: Any = None, policy: Any = None,
                 poll_s: float = 2.0,
                 run_timeout_s: float | None = None, echo: Callable[[str], None] | None = None,
                 store: Callable[[LaunchPlan], RunStore] | None = None, secret: str | None = None) -> None:
        self.settings = settings
        self.console = Console(echo, live=False)
        self._core, self._batch, self._policy = core, batch, policy
        self.poll_s = poll_s
        self.run_timeout_s = run_timeout_s
        self.make_store = store
        self.secret = secret
        self._stop = threading.Event()
        self._stop_reason: str | None = None
        self._group = _GroupRestarts(None)

    def script(self, plan: LaunchPlan) -> str:
        """The run's manifests as YAML (``psflow run --backend k8s --dry-run``), with a fresh secret."""
        return to_yaml(render_run(plan, self.settings, self.secret or secrets.token_hex(32)))

    def request_stop(self, reason: str) -> None:
        """Stop the run from another thread (or a signal handler): its objects are deleted."""
        self._stop_reason = reason
        self._stop.set()

    # -- a run -------------------------------------------------------------------------------------
    def run(self, plan: LaunchPlan, *, store: Callable[[LaunchPlan], RunStore] | None = None) -> RunResult:
        """Submit ``plan``, follow it to its end, record it; exit code 0 succeeded, 1 failed, 130 stopped.

        Raises:
            ClusterError: the API server refused an object (the message is the server's).
        """
        if self._core is None or self._batch is None or self._policy is None:
            self._core, self._batch, self._policy = load_clients()
        logdir = Path(plan.logdir)
        (logdir / "logs").mkdir(parents=True, exist_ok=True)
        return self._run(plan, (store or self.make_store or file_store)(plan))

    def _run(self, plan: LaunchPlan, store: RunStore) -> RunResult:
        docs = render_run(plan, self.settings, self.secret or secrets.token_hex(32))
        t0 = time.time()
        created: list[tuple[str, str]] = []
        try:
            self._submit(docs, store, created)
        except ClusterError as e:
            self._delete_objects(created)  # what this run created before the refusal, nothing else
            store.event("k8s_refused", error=str(e))
            store.finished("failed")
            raise
        tracker = PodTracker()
        status, why = None, ""
        self._group = _GroupRestarts(restart_group(plan.config.strategy, plan.config.ps_replicas, plan.task_names()))
        with _stop_on_signals(self):
            try:
                status, why = self._follow(plan, tracker, store, t0)
            finally:
                self._delete(plan, jobs=status != "succeeded")
        spent = run_budget_spent(tracker.failures(), plan.restart.max_restarts_per_run)
        last = (self._group.root, 0, 0) if self._group.root else tracker.last_failure()
        root = (spent or last) if status == "failed" else None
        # The pods report to no coordinator (the launcher may be outside the cluster): no global step
        # or throughput here; the chief's summaries and checkpoints in the claim's log dir have them.
        summary = {"run_id": plan.run_id, "backend": "k8s", "status": status or "stopped", "reason": why,
                   "root_cause": root[0] if root else None, "mode": plan.config.mode, "strategy": plan.config.strategy,
                   "global_step": None, "metrics": {}, "examples_per_sec": None, "wall_s": round(time.time() - t0, 3),
                   "tasks": tracker.tasks(), "namespace": self.settings.namespace, "k8s_name": run_name(plan)}
        store.summary(summary)
        store.finished(status or "stopped")
        code = {"succeeded": 0, "failed": 1}.get(status or "", 130)
        self.console.echo(f"psflow: run {plan.run_id} {status or 'stopped'}: {why}")
        return RunResult(code, summary, root[0] if root else None)

    def _submit(self, docs: Sequence[dict[str, Any]], store: RunStore, created: list[tuple[str, str]]) -> None:
        ns = self.settings.namespace
        create = {"Secret": self._core.create_namespaced_secret, "Service": self._core.create_namespaced_service,
                  "PodDisruptionBudget": self._policy.create_namespaced_pod_disruption_budget,
                  "Job": self._batch.create_namespaced_job}
        for d in docs:
            try:
                create[d["kind"]](namespace=ns, body=d)
            except Exception as e:  # noqa: BLE001 (the client's ApiException, or its transport's errors)
                raise ClusterError(f"Kubernetes refused {d['kind']} {d['metadata']['name']} in namespace {ns}: "
                                   f"{_api_message(e)}") from e
            created.append((d["kind"], d["metadata"]["name"]))
            store.event("k8s_created", object_kind=d["kind"], name=d["metadata"]["name"], namespace=ns)
            if d["kind"] != "Secret":
                self.console.echo(f"psflow: created {d['kind']} {d['metadata']['name']} (namespace {ns})")

    def _follow(self, plan: LaunchPlan, tracker: PodTracker, store: RunStore, t0: float) -> tuple[str | None, str]:
        ns, selector = self.settings.namespace, f"{RUN_LABEL}={run_name(plan)}"
        while True:
            pods = [v for v in map(pod_view, self._core.list_namespaced_pod(namespace=ns, label_selector=selector).items) if v]
            changes = tracker.update(pods)
            for change in changes:
                self._record(plan, change, store)
            spent = run_budget_spent(tracker.failures(), plan.restart.max_restarts_per_run)
            if spent is not None:
                cap = plan.restart.max_restarts_per_run
                store.event("restart_budget_spent", task=spent[0], attempt=spent[1], max_restarts_per_run=cap)
                return "failed", (f"the run's restart budget is spent: {len(tracker.failures())} failed attempts "
                                  f"across its tasks, {spent[0]} (attempt {spent[1]}) the one past "
                                  f"--max-restarts-per-run {cap}")
            refused = self._restart_group(plan, pods, changes, tracker, store)
            if refused is not None:
                return "failed", refused
            status, why = outcome(self._batch.list_namespaced_job(namespace=ns, label_selector=selector).items)
            store.tick()
            if status is not None:
                return status, why
            if self.run_timeout_s is not None and time.time() - t0 > self.run_timeout_s:
                self.console.warn(f"the run did not end within {self.run_timeout_s:g} s (run_timeout_s); stopping it.")
                store.event("stop", reason="run_timeout_s")
                return None, f"not ended within {self.run_timeout_s:g} s"
            if self._stop.wait(self.poll_s):
                store.event("stop", reason=self._stop_reason)
                return None, f"stopped by {self._stop_reason}"

    def _restart_group(self, plan: LaunchPlan, pods: Sequence[PodView], changes: Sequence[Change], tracker: PodTracker,
                       store: RunStore) -> str | None:
        """A trigger of the run's restart group failed and Kubernetes restarts it: delete the other
        members' pods (the Job controller starts each as its next attempt; the chief restores the newest
        checkpoint). The same budgets as the local controller's; the reason the run fails when one is spent."""
        group, policy = self._group.group, plan.restart
        # A disrupted trigger is replaced by Kubernetes whatever the policy (and empty, for a ps).
        triggers = [c for c in changes if isinstance(c, Exited) and group is not None and c.task in group.triggers
                    and c.code != 0 and (c.task, c.attempt) not in self._group.stopped
                    and (c.disrupted or policy.is_retryable(c.task.split(":")[0], c.code))]
        if not triggers or group is None:
            return None
        first, failed = triggers[0], {c.task for c in triggers}
        cause = f"{first.task} (attempt {first.attempt}) {exit_cause(first.code, first.oom_killed)}" + (
            f" ({first.disrupted})" if first.disrupted else "")
        attempts = {c.task: c.attempt for c in triggers}
        for p in pods:
            if p.task not in failed:
                attempts[p.task] = max(attempts.get(p.task, 0), p.attempt)
        spent = max(group.members, key=lambda t: attempts.get(t, 0))
        cap = policy.max_restarts_per_run
        kept = [t for t in group.members if t not in failed and not policy.restarts(t.split(":")[0])]
        if kept:
            self._group.root = first.task
            return (f"{cause}; {group.what} restarts together, and --restart {policy.kind_for(kept[0].split(':')[0])} "
                    f"does not restart {', '.join(kept)}")
        if attempts.get(spent, 0) >= policy.max_restarts:
            self._group.root = first.task
            return (f"{cause}; {group.what} restarts together and {spent}'s restart budget is spent "
                    f"({attempts.get(spent, 0)} of {policy.max_restarts} per task)")
        if cap is not None and len(tracker.failures()) - len(triggers) + len(group.members) > cap:
            self._group.root = first.task
            store.event("restart_budget_spent", task=first.task, attempt=first.attempt, max_restarts_per_run=cap)
            return (f"the run's restart budget is spent: {cause}, and {group.what} restarts {len(group.members)} "
                    f"tasks, past --max-restarts-per-run {cap}")
        live = [p for p in pods if p.task in group.members and p.task not in failed and p.exit_code is None
                and p.phase in ("Pending", "Running")]
        why = f"{cause}: restarting {group.what} from its newest checkpoint"
        self.console.warn(f"{why}; stopping {', '.join(p.task for p in live) or 'nothing else'}")
        store.event("group_restart", cause=cause, group=group.what, stopped=[p.task for p in live])
        for p in live:
            self._delete_pod(p, group.grace_s)
            self._group.stopped.add((p.task, p.attempt))
            exited = tracker.stopped(p, -15, f"stopped: {why}")
            if exited is not None:
                self._record(plan, exited, store)
        return None

    def _delete_pod(self, pod: PodView, grace_s: float | None) -> None:
        # At least 1 s: a 0 would force-delete the pod, and the kubelet's terminal status, which the Job
        # controller waits for under a podFailurePolicy before it starts the index again, might never come.
        grace = {} if grace_s is None else {"grace_period_seconds": max(1, round(grace_s))}
        try:
            self._core.delete_namespaced_pod(name=pod.name, namespace=self.settings.namespace, **grace)
        except Exception as e:  # noqa: BLE001 (gone already: the Job controller replaces it anyway)
            if getattr(e, "status", None) != 404:
                self.console.warn(f"could not delete pod {pod.name} of {pod.task} ({_api_message(e)})")

    def _record(self, plan: LaunchPlan, change: Change, store: RunStore) -> None:
        if isinstance(change, Restarted):
            self.console.warn(f"{change.task}: Kubernetes restarted it as attempt {change.attempt} (attempt "
                              f"{change.attempt - 1}: {change.cause}).")
            store.task_restarting(change.task, change.attempt, 0.0, change.cause)
        elif isinstance(change, Started):
            store.task_started(change.task, change.attempt, change.pod)
        elif isinstance(change, Waiting):
            self.console.warn(f"{change.task} (attempt {change.attempt}) is not running yet: {change.reason}")
            store.event("task_waiting", task=change.task, attempt=change.attempt, reason=change.reason)
        else:
            store.task_exited(change.task, change.attempt, change.code, time.time(), oom_killed=change.oom_killed)
            self._save_log(plan, change)
            if change.code != 0:
                what = f": {change.report.get('exception')}: {change.report.get('message')}" if change.report else ""
                self.console.warn(f"{change.task} (attempt {change.attempt}, pod {change.pod}) "
                                  f"{exit_cause(change.code, change.oom_killed)}{what}")
                if change.report is not None:
                    errors = Path(plan.logdir) / "errors"
                    errors.mkdir(parents=True, exist_ok=True)
                    (errors / f"{change.task.replace(':', '-')}.json").write_text(json.dumps(change.report, indent=1))

    def _save_log(self, plan: LaunchPlan, change: Exited) -> None:
        log = Path(plan.logdir) / "logs" / f"{change.task.replace(':', '-')}.log"
        try:
            text = self._core.read_namespaced_pod_log(name=change.pod, namespace=self.settings.namespace)
        except Exception as e:  # noqa: BLE001 (a log that cannot be read must not end the watch)
            text = f"(psflow: the log of pod {change.pod} could not be read: {_api_message(e)})\n"
        with log.open("a") as f:
            f.write(f"--- psflow: {change.task} attempt {change.attempt}, pod {change.pod}\n{text}")

    def _delete(self, plan: LaunchPlan, *, jobs: bool) -> None:
        """Delete the run's objects: the Jobs too (their pods with them) unless it succeeded."""
        name = run_name(plan)
        objects = [("Job", f"{name}-{job}") for job in dict.fromkeys(t.job for t in plan.tasks)] if jobs else []
        budgets = [("PodDisruptionBudget", d["metadata"]["name"]) for d in render_budgets(plan, self.settings)]
        self._delete_objects([*objects, *budgets, ("Service", name), ("Secret", f"{name}-secret")])

    def _delete_objects(self, objects: Sequence[tuple[str, str]]) -> None:
        ns = self.settings.namespace
        calls = {"Job": lambda n: self._batch.delete_namespaced_job(name=n, namespace=ns, propagation_policy="Background"),
                 "Service": lambda n: self._core.delete_namespaced_service(name=n, namespace=ns),
                 "PodDisruptionBudget": lambda n: self._policy.delete_namespaced_pod_disruption_budget(name=n, namespace=ns),
                 "Secret": lambda n: self._core.delete_namespaced_secret(name=n, namespace=ns)}
        for kind, name in objects:
            try:
                calls[kind](name)
            except Exception as e:  # noqa: BLE001
                if getattr(e, "status", None) != 404:
                    self.console.warn(f"could not delete {kind} {name} ({_api_message(e)}); "
                                      f"`kubectl delete -n {ns} {kind.lower()} {name}` does.")


def _api_message(e: BaseException) -> str:
    """The API server's own message of an ``ApiException`` (its JSON body), else the exception's text."""
    body = getattr(e, "body", None)
    if body:
        try:
            return str(json.loads(body).get("message") or body)
        except (ValueError, AttributeError):
            return str(body)
    return f"{type(e).__name__}: {e}"


class _GroupRestarts:
    """What one run's group restarts have done: the members' attempts the launcher stopped (their exits
    are no trigger), and the task whose failure the group could not restart (the run's root cause)."""

    def __init__(self, group: RestartGroup | None) -> None:
        self.group = group
        self.stopped: set[tuple[str, int]] = set()
        self.root: str | None = None


class _stop_on_signals:
    """Ctrl-C and SIGTERM stop the run (in the main thread; elsewhere nothing is installed)."""

    def __init__(self, backend: K8sBackend) -> None:
        self.backend = backend
        self.old: dict[int, Any] = {}

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            names = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
            self.old = {s: signal.signal(s, lambda n, f: self.backend.request_stop(names[n])) for s in names}

    def __exit__(self, *exc: object) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)
