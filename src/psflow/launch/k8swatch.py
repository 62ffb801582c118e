"""K8sBackend: a run's tasks as Kubernetes pods, driven by the runner as every backend is.

``psflow run --backend k8s`` (``--dry-run``: :meth:`K8sBackend.script`). The manifests are
:mod:`psflow.launch.k8s`'s; this module is the I/O around them, through the official ``kubernetes``
client (``pip install 'psflow[k8s]'``), and a pure core that reads what the API answers:

- :func:`pod_view` reads one pod (its task from the Job's labels and completion index, its attempt
  from the Job controller's index failure count, how its container ended);
- :class:`PodTracker` takes successive pod listings and says, once each, which attempt started,
  which does not run yet and why (an image that cannot be pulled, no node that fits), which exited
  (exit code, OOM kill, its error report from the termination message) and which attempt is a
  restart Kubernetes made, and after what;
- :func:`outcome` reads the Jobs' conditions: every Job ``Complete`` (or ``SuccessCriteriaMet``, which
  comes first) -> succeeded; one ``Failed`` (or ``FailureTarget``) -> failed.

The seam (:class:`psflow.launch.backend.Backend`): ``open`` submits the objects; the Jobs make every
attempt's pod, and ``start`` binds the runner's attempt to it (its handle: the pod's name); ``poll``
lists the pods every ``poll_s`` and hands the runner their exits (each attempt's log copied into
``LOGDIR/logs/<task>.log``, its termination message into ``LOGDIR/errors/``); ``stop`` deletes a
pod. So the run controller decides as for every backend: the restart budgets (per task and per run),
a restart group rolled back together (Kubernetes starts each deleted member's index again), the run's
end, its summary and root cause. Kubernetes' own Job budgets (:func:`psflow.launch.k8s.restart_fields`)
are the same policy, enforced where the pods are. A pod Kubernetes replaces after a disruption
(preempted, evicted) goes on as the same attempt, unless it held a ps's only copy (then its group
rolls back). ``close`` deletes the objects, a succeeded run's but its Jobs (``ttlSecondsAfterFinished``).
The client calls used, what a test fake implements, and the whole design: ``docs/design/kubernetes.md``.
"""

from __future__ import annotations

import json
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psflow import errorreport
from psflow.errors import ClusterError, ConfigError
from psflow.launch.backend import Backend, prepare_logdir
from psflow.launch.console import Console
from psflow.launch.controller import TaskExited, exit_cause
from psflow.launch.k8s import (
    FAILURE_COUNT_ANNOTATION,
    INDEX_ANNOTATION,
    JOB_LABEL,
    POD_FAILURE_BACKOFF,
    RUN_LABEL,
    K8sSettings,
    job_name,
    render_budgets,
    render_run,
    run_name,
    to_yaml,
)
from psflow.launch.plan import LaunchPlan, TaskPlan
from psflow.launch.restart import Backoff, RestartPolicy, restart_group
from psflow.rundir import RunDir

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
    replaced: bool = False  # the same attempt in a new pod: Kubernetes replaced a disrupted one


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
                out.append(Restarted(p.task, p.attempt, f"{cause}; Kubernetes replaced the pod (no restart spent)",
                                     replaced=True))
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

    def last_failure(self) -> tuple[str, int, int] | None:
        """(task, attempt, code) of the first failed exit whose task was not started again: the root cause."""
        for (task, attempt), code in self._exited.items():
            if code != 0 and (task, attempt + 1) not in self._started and (task, attempt) not in self._disrupted:
                return task, attempt, code
        return None


# The Job controller's verdict: the interim condition (set as it decides; 1.31+ for success) or the final one
# (set once every pod is terminal, a second or more later; a launcher that ended in between must not read
# "not finished" and delete a succeeded run's Jobs).
_FAILED, _SUCCEEDED = ("FailureTarget", "Failed"), ("SuccessCriteriaMet", "Complete")


def outcome(jobs: Iterable[Any]) -> tuple[str | None, str]:
    """``("succeeded" | "failed" | None, why)`` from the run's ``V1Job`` objects' conditions."""
    jobs = list(jobs)
    for job in jobs:
        for c in (job.status.conditions or []) if job.status is not None else []:
            if c.type in _FAILED and c.status == "True":
                return "failed", f"Job {job.metadata.name} failed ({c.reason or 'no reason'}: {c.message or ''})".rstrip(": )") + ")"
    done = [j for j in jobs if any(c.type in _SUCCEEDED and c.status == "True"
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


class K8sBackend(Backend):
    """A plan's tasks as Kubernetes pods, driven by the runner as every backend is (see the module's docstring).

    Args:
        settings: image, volume claim, namespace, GPUs, TTL (:class:`psflow.launch.k8s.K8sSettings`).
        core, batch, policy: a ``CoreV1Api``, a ``BatchV1Api`` and a ``PolicyV1Api`` (default:
            :func:`load_clients`).
        poll_s: how often the pods and Jobs are listed.
        run_timeout_s: the longest the launcher follows the run (None: until it ends); past it the
            run is stopped (:meth:`ended_by`) and its objects deleted.
        secret: the job secret the pods read (default: a fresh random one per run).
        keep_logs: logs of earlier runs into the same log dir kept per task.
        pod_backoff: the Job controller's wait before a failed index's next pod
            (:data:`psflow.launch.k8s.POD_FAILURE_BACKOFF`; a test against a fake controller gives its own).

    Example:
        >>> Runner(K8sBackend(K8sSettings(image="registry/train:1", volume_claim="psflow-logs"))).run(plan).exit_code
        0
    """

    def __init__(self, settings: K8sSettings, *, core: Any = None, batch: Any = None, policy: Any = None,
                 poll_s: float = 2.0, run_timeout_s: float | None = None, echo: Callable[[str], None] | None = None,
                 secret: str | None = None, keep_logs: int = 5, pod_backoff: Backoff = POD_FAILURE_BACKOFF) -> None:
        super().__init__(Console(echo, live=False))
        self.settings = settings
        self._core, self._batch, self._policy = core, batch, policy
        self.poll_s = poll_s
        self.run_timeout_s = run_timeout_s
        self.secret = secret
        self.keep_logs = keep_logs
        self.pod_backoff = pod_backoff
        self._stop_reason: str | None = None
        self._wake = threading.Event()
        self._reset(None)

    def _reset(self, plan: LaunchPlan | None) -> None:
        self._plan = plan
        self._tracker = PodTracker()
        self._created: list[tuple[str, str]] = []
        self._pods: dict[tuple[str, int], str] = {}  # (task, the runner's attempt) -> its pod
        self._offset: dict[str, int] = {}  # the runner's attempt - Kubernetes' (a disrupted ps that rolled its group back)
        self._wanted: dict[str, int] = {}  # task -> the attempt the runner started last
        self._told: set[tuple[str, int]] = set()  # attempts whose exit went to the runner
        self._held: list[TaskExited] = []  # exits of attempts the runner has not started yet (Kubernetes was quicker)
        self._notes: list[tuple[str, dict[str, Any]]] = []
        self._ended: str | None = None
        self._ended_told = self._failed_told = self._just_told = False
        self._failed: tuple[str, str] | None = None
        self._opened_at = self._listed_at = 0.0

    def script(self, plan: LaunchPlan) -> str:
        """The run's manifests as YAML (``psflow run --backend k8s --dry-run``), with a fresh secret."""
        return to_yaml(render_run(plan, self.settings, self.secret or secrets.token_hex(32)))

    def restart_backoff(self, policy: RestartPolicy) -> Backoff:
        """Kubernetes' wait, whatever the policy's backoff: the Job controller makes a failed index's next pod."""
        return self.pod_backoff

    def request_stop(self, reason: str) -> None:
        """Stop the run from another thread: the runner takes it through :meth:`ended_by`."""
        self._stop_reason = reason
        self._wake.set()

    # -- the Backend seam ----------------------------------------------------------------------------
    def open(self, plan: LaunchPlan) -> None:
        """Submit the run's objects (the Jobs make the pods).

        Raises:
            ClusterError: the API server refused an object (the message is the server's); what this
                run created before is deleted.
        """
        if self._core is None or self._batch is None or self._policy is None:
            self._core, self._batch, self._policy = load_clients()
        self._reset(plan)
        prepare_logdir(Path(plan.logdir), self.keep_logs)
        self._opened_at = time.time()
        docs = render_run(plan, self.settings, self.secret or secrets.token_hex(32))
        try:
            self._submit(docs)
        except ClusterError as e:
            self._delete_objects(self._created)  # what this run created before the refusal, nothing else
            self._created = []
            self._note("k8s_refused", error=str(e))
            raise

    def start(self, task: TaskPlan, attempt: int, env: Mapping[str, str]) -> str:
        """Kubernetes makes every attempt's pod (the Jobs' own restarts): the runner's attempt is bound to
        it; returns its pod's name (the Job's index while Kubernetes has not made it yet)."""
        self._wanted[task.task] = attempt
        if (task.task, attempt) not in self._pods:
            self._list()
        job, index = task.task.split(":")
        return self._pods.get((task.task, attempt), f"{job_name(self._require_plan(), job)}-{index}")

    def poll(self, timeout_s: float = 0.0) -> list[TaskExited]:
        deadline = time.monotonic() + timeout_s
        while True:
            if time.monotonic() - self._listed_at >= self.poll_s:
                self._list()
            ready = [e for e in self._held if e.attempt <= self._wanted.get(e.task, -1)]
            left = deadline - time.monotonic()
            if ready or left <= 0 or self._stop_reason is not None:
                self._held = [e for e in self._held if e not in ready]
                self._just_told = bool(ready)  # failed_by waits a turn: the runner handles these exits first
                return ready
            self._wake.wait(min(left, max(self.poll_s - (time.monotonic() - self._listed_at), 0.0)))

    def stop(self, tasks: Sequence[str], grace_s: float) -> None:
        """Delete each task's current pod (its exit is told now: the pod may be gone before a listing
        shows how it ended). The Job controller starts the index again: the runner's next attempt, if it wants one."""
        for t in tasks:
            attempt = self._wanted.get(t)
            if attempt is None or (t, attempt) in self._told:
                continue
            pod = self._pods.get((t, attempt))
            if pod is not None:
                self._delete_pod(t, pod, grace_s)
            self._told.add((t, attempt))
            self._held.append(TaskExited(t, attempt, -15, time.time()))

    def error_report(self, task: str) -> dict[str, Any] | None:
        return errorreport.read(RunDir(self._require_plan().logdir).error_report(task))

    def ended_by(self) -> str | None:
        if self._ended is None and self._stop_reason is not None:
            self._ended = self._stop_reason
        elif self._ended is None and self.run_timeout_s is not None and time.time() - self._opened_at > self.run_timeout_s:
            self.console.warn(f"the run did not end within {self.run_timeout_s:g} s (run_timeout_s); stopping it.")
            self._ended = f"not ended within {self.run_timeout_s:g} s (run_timeout_s)"
        if self._ended is None or self._ended_told:
            return None
        self._ended_told = True
        return self._ended

    def failed_by(self) -> tuple[str, str] | None:
        """A Job that Kubernetes failed (a task out of its retries there): the task whose failure it was; told
        once the runner has handled every exit Kubernetes saw (its own budget then says the same, or more)."""
        if self._failed is None or self._failed_told or self._held or self._just_told:
            return None
        self._failed_told = True
        return self._failed

    def take_notes(self) -> list[tuple[str, dict[str, Any]]]:
        out, self._notes = self._notes, []
        return out

    def close(self) -> None:
        """Delete the run's objects: its Jobs too (their pods with them) unless every Job completed (then
        ``ttlSecondsAfterFinished`` removes them)."""
        if self._plan is None or not self._created:
            return
        selector = f"{RUN_LABEL}={run_name(self._plan)}"
        try:
            done = outcome(self._batch.list_namespaced_job(namespace=self.settings.namespace, label_selector=selector).items)[0]
        except Exception:  # noqa: BLE001 (an API server that cannot answer: the Jobs go too)
            done = None
        self._delete(self._plan, jobs=done != "succeeded")
        self._created = []

    # -- the pods ------------------------------------------------------------------------------------
    def _require_plan(self) -> LaunchPlan:
        if self._plan is None:
            raise RuntimeError("K8sBackend used before open(plan).")
        return self._plan

    def _note(self, kind: str, **data: Any) -> None:
        self._notes.append((kind, data))

    def _list(self) -> None:
        """One listing of the run's pods and Jobs: each change said once (:class:`PodTracker`)."""
        plan = self._require_plan()
        self._listed_at = time.monotonic()
        ns, selector = self.settings.namespace, f"{RUN_LABEL}={run_name(plan)}"
        pods = [v for v in map(pod_view, self._core.list_namespaced_pod(namespace=ns, label_selector=selector).items) if v]
        for change in self._tracker.update(pods):
            self._on(plan, change)
        status, why = outcome(self._batch.list_namespaced_job(namespace=ns, label_selector=selector).items)
        if status == "failed" and self._failed is None:
            last = self._tracker.last_failure()
            self._failed = (last[0] if last else plan.task_names()[0], why)

    def _on(self, plan: LaunchPlan, change: Change) -> None:
        """A change Kubernetes made, in the runner's terms: an attempt's pod, an exit, a note."""
        attempt = change.attempt + self._offset.get(change.task, 0)
        if isinstance(change, Started):
            self._pods[(change.task, attempt)] = change.pod
        elif isinstance(change, Restarted) and change.replaced:
            self.console.warn(f"{change.task}: attempt {attempt} goes on in a new pod ({change.cause}).")
            self._note("task_replaced", task=change.task, attempt=attempt, reason=change.cause)
        elif isinstance(change, Restarted):
            self.console.warn(f"{change.task}: Kubernetes restarted it as attempt {change.attempt} (attempt "
                              f"{change.attempt - 1}: {change.cause}).")
        elif isinstance(change, Waiting):
            self.console.warn(f"{change.task} (attempt {attempt}) is not running yet: {change.reason}")
            self._note("task_waiting", task=change.task, attempt=attempt, reason=change.reason)
        else:
            self._exited(plan, change, attempt)

    def _exited(self, plan: LaunchPlan, change: Exited, attempt: int) -> None:
        self._save_log(plan, change)
        if change.report is not None:
            RunDir(plan.logdir).error_report(change.task).write_text(json.dumps(change.report, indent=1))
        group = restart_group(plan.config.strategy, plan.config.ps_replicas, plan.task_names())
        if change.disrupted:
            if group is None or change.task not in group.triggers:  # Kubernetes replaces it: the same attempt goes on
                return
            # Its replacement starts empty: to the runner an exit (its group rolls back), and the pod its next attempt.
            self._offset[change.task] = self._offset.get(change.task, 0) + 1
        if (change.task, attempt) in self._told:
            return
        self._told.add((change.task, attempt))
        self._held.append(TaskExited(change.task, attempt, change.code, time.time(), oom_killed=change.oom_killed))

    def _submit(self, docs: Sequence[dict[str, Any]]) -> None:
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
            self._created.append((d["kind"], d["metadata"]["name"]))
            self._note("k8s_created", object_kind=d["kind"], name=d["metadata"]["name"], namespace=ns)
            if d["kind"] != "Secret":
                self.console.echo(f"psflow: created {d['kind']} {d['metadata']['name']} (namespace {ns})")

    def _delete_pod(self, task: str, pod: str, grace_s: float | None) -> None:
        # At least 1 s: a 0 would force-delete the pod, and the kubelet's terminal status, which the Job
        # controller waits for under a podFailurePolicy before it starts the index again, might never come.
        grace = {} if grace_s is None else {"grace_period_seconds": max(1, round(grace_s))}
        try:
            self._core.delete_namespaced_pod(name=pod, namespace=self.settings.namespace, **grace)
        except Exception as e:  # noqa: BLE001 (gone already: the Job controller replaces it anyway)
            if getattr(e, "status", None) != 404:
                self.console.warn(f"could not delete pod {pod} of {task} ({_api_message(e)})")

    def _save_log(self, plan: LaunchPlan, change: Exited) -> None:
        log = RunDir(plan.logdir).log(change.task)
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
