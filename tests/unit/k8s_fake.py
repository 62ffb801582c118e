"""A stand-in for a Kubernetes API server and its Job controller (no API server can run here).

It implements the ``CoreV1Api``, ``BatchV1Api`` and ``PolicyV1Api`` methods :class:`psflow.launch.k8swatch.K8sBackend`
calls, with their keyword arguments, and answers with the real client's model objects
(``V1PodList``, ``V1JobList``, ``ApiException``). Like the API server it refuses an object that does not
validate against the Kubernetes schema (``kubernetes-validate --strict``) and one that already exists.

Its Job controller follows the rules of an indexed Job with ``restartPolicy: Never`` (the only kind
psflow renders): a failed pod's index is retried as a new pod (annotation
``batch.kubernetes.io/job-index-failure-count`` + 1) while ``backoffLimitPerIndex`` allows and no
``podFailurePolicy`` ``FailIndex`` rule matches its exit code; more failed indexes than
``maxFailedIndexes`` fail the Job; without ``backoffLimitPerIndex``, more failures than
``backoffLimit`` fail it; a failed Job's running pods are terminated; every index succeeded ->
``Complete``; as the real controller does, a retried index's next pod comes ``backoff_steps`` steps
later, doubling per failure of the index (Kubernetes: 10 s doubling to 10 min), and a Job that succeeds or fails
shows ``SuccessCriteriaMet``/``FailureTarget`` first and ``Complete``/``Failed`` one step later
(``tests/integration/test_k8s_cluster.py`` saw both against kube-apiserver and kube-controller-manager
1.36: ``docs/kubernetes.md``); a pod deleted through the API ends with 143 (SIGTERM) and counts as a
failure of its index (no ``DisruptionTarget``: a plain delete is not an eviction);
a pod the test ``disrupts`` (preempted, evicted: it ends with 137 and a ``DisruptionTarget``
condition) is replaced with the same failure count, uncounted, where a ``podFailurePolicy`` ``Ignore``
rule names that condition. Time moves one step per ``list_namespaced_pod``: a pod is Pending, then Running, then
its container ends, ``runs_for`` steps after it was made (per task or job type, default 2), with the exit code
the test scripted for its (task, attempt) (default 0); a ps pod ends cleanly only once no chief or
worker pod is left running or due, as a psflow ps exits when the workers are done (a scripted failure ends it
at its time).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import kubernetes_validate
from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateTerminated,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1Job,
    V1JobCondition,
    V1JobList,
    V1JobStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodList,
    V1PodStatus,
)
from kubernetes.client.exceptions import ApiException

INDEX = "batch.kubernetes.io/job-completion-index"
FAILURES = "batch.kubernetes.io/job-index-failure-count"
SCHEMA = kubernetes_validate.latest_version()
_FINAL = {"SuccessCriteriaMet": "Complete", "FailureTarget": "Failed"}  # interim condition -> the final one


def _api_error(status: int, reason: str, message: str) -> ApiException:
    e = ApiException(status=status, reason=reason)
    e.body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "reason": reason, "code": status})
    return e


def _selects(selector: str | None, labels: dict[str, str]) -> bool:
    if not selector:
        return True
    return all(labels.get(k) == v for k, v in (item.split("=", 1) for item in selector.split(",")))


class FakeCluster:
    """The shared state: objects by kind and name, pods, the clock (one step per pod listing)."""

    def __init__(self, exits: dict[tuple[str, int], int] | None = None, messages: dict[tuple[str, int], str] | None = None,
                 reason: dict[tuple[str, int], str] | None = None,
                 waiting: dict[tuple[str, int], tuple[str, str]] | None = None,
                 runs_for: dict[str, int] | None = None, disrupts: set[tuple[str, int]] | None = None,
                 backoff_steps: int = 2) -> None:
        self.exits = exits or {}
        self.messages = messages or {}
        self.reasons = reason or {}
        self.waiting = waiting or {}  # (task, attempt) -> (reason, message): its container never starts
        self.runs_for = runs_for or {}  # task or job type -> steps from its pod's creation to its exit
        self.disrupts = set(disrupts or ())  # (task, attempt): its first pod is disrupted at its time
        self.backoff_steps = backoff_steps  # a failed index's next pod: this many steps later, doubling per failure
        self.due: list[tuple[int, str, int, int]] = []  # (step, job, index, failures): pods the controller makes then
        self.objects: dict[str, dict[str, dict[str, Any]]] = {"Secret": {}, "Service": {}, "Job": {},
                                                              "PodDisruptionBudget": {}}
        self.jobs: dict[str, dict[str, Any]] = {}  # name -> controller state
        self.pods: dict[str, dict[str, Any]] = {}
        self.deleted: list[tuple[str, str]] = []
        self.step = 0
        self.core = FakeCoreV1Api(self)
        self.batch = FakeBatchV1Api(self)
        self.policy = FakePolicyV1Api(self)

    # -- the API server --------------------------------------------------------------------------
    def create(self, kind: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            kubernetes_validate.validate(body, SCHEMA, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise _api_error(422, "Invalid", f"{kind} is invalid: {e}") from e
        name = body["metadata"]["name"]
        if name in self.objects[kind]:
            raise _api_error(409, "AlreadyExists", f'{kind.lower()}s "{name}" already exists')
        assert body["metadata"].get("namespace", namespace) == namespace
        self.objects[kind][name] = body
        if kind == "Job":
            self.jobs[name] = {"failures": {}, "succeeded": set(), "failed_indexes": set(), "total_failures": 0,
                               "condition": None, "finished_at": 0}
            for i in range(body["spec"]["completions"]):
                self._new_pod(name, i, 0)
        return body

    def delete(self, kind: str, name: str) -> None:
        if name not in self.objects[kind]:
            raise _api_error(404, "NotFound", f'{kind.lower()}s "{name}" not found')
        del self.objects[kind][name]
        self.deleted.append((kind, name))
        if kind == "Job":
            for pod in [p for p in self.pods.values() if p["job"] == name]:
                del self.pods[pod["name"]]

    # -- the Job controller and the kubelet ------------------------------------------------------
    def _new_pod(self, job: str, index: int, failures: int) -> None:
        spec = self.objects["Job"][job]
        labels = dict(spec["spec"]["template"]["metadata"]["labels"])
        labels[INDEX] = str(index)
        annotations = {INDEX: str(index)}
        if "backoffLimitPerIndex" in spec["spec"]:
            annotations[FAILURES] = str(failures)
        name = f"{job}-{index}-{len(self.pods) + len(self.deleted)}x{failures}"
        self.pods[name] = {"name": name, "job": job, "index": index, "attempt": failures, "labels": labels,
                           "annotations": annotations, "phase": "Pending", "code": None, "born": self.step,
                           "created": dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(seconds=self.step)}

    def task_of(self, pod: dict[str, Any]) -> str:
        return f"{pod['labels']['psflow.io/job']}:{pod['index']}"

    def advance(self) -> None:
        self.step += 1
        for due in [d for d in self.due if d[0] <= self.step]:
            self.due.remove(due)
            if due[1] in self.jobs and self.jobs[due[1]]["condition"] is None:
                self._new_pod(*due[1:])
        for state in self.jobs.values():  # Complete/Failed follow their interim condition a step later
            if state["condition"] is not None and state["condition"][0] in _FINAL and state["finished_at"] < self.step:
                state["condition"] = (_FINAL[state["condition"][0]], *state["condition"][1:])
        training_left = any(p["phase"] in ("Pending", "Running") and p["labels"]["psflow.io/job"] in ("chief", "worker")
                            for p in self.pods.values()) or any(
            self.objects["Job"][job]["metadata"]["labels"]["psflow.io/job"] in ("chief", "worker") for _, job, _, _ in self.due)
        for pod in list(self.pods.values()):
            if pod["phase"] == "Pending" and (self.task_of(pod), pod["attempt"]) in self.waiting:
                continue
            if pod["phase"] == "Pending":
                pod["phase"] = "Running"
            elif pod["phase"] == "Running" and self.step - pod["born"] >= self.runs_for.get(
                    self.task_of(pod), self.runs_for.get(pod["labels"]["psflow.io/job"], 2)):
                key = (self.task_of(pod), pod["attempt"])
                if key in self.disrupts:
                    self.disrupts.discard(key)
                    pod["disrupted"] = "PreemptionByScheduler"
                    self._terminate(pod, 137)
                    continue
                code = self.exits.get(key, 0)
                if pod["labels"]["psflow.io/job"] == "ps" and training_left and code == 0:
                    continue
                self._terminate(pod, code)

    def _terminate(self, pod: dict[str, Any], code: int) -> None:
        pod["code"] = code
        pod["phase"] = "Succeeded" if code == 0 else "Failed"
        job = pod["job"]
        state, spec = self.jobs[job], self.objects["Job"][job]["spec"]
        if state["condition"] is not None:
            return
        ignored = pod.get("disrupted") and any(
            r["action"] == "Ignore" and any(c["type"] == "DisruptionTarget" for c in r.get("onPodConditions", []))
            for r in spec.get("podFailurePolicy", {}).get("rules", []))
        if ignored:
            self._new_pod(job, pod["index"], pod["attempt"])
            return
        if code == 0:
            state["succeeded"].add(pod["index"])
            if len(state["succeeded"]) == spec["completions"]:
                state["condition"], state["finished_at"] = ("SuccessCriteriaMet", "CompletionsReached", ""), self.step
            return
        state["total_failures"] += 1
        fails = state["failures"][pod["index"]] = state["failures"].get(pod["index"], 0) + 1
        per_index = spec.get("backoffLimitPerIndex")
        fail_index = any(r["action"] == "FailIndex" and code in r["onExitCodes"]["values"]
                         for r in spec.get("podFailurePolicy", {}).get("rules", []))
        if per_index is None:
            if state["total_failures"] > spec.get("backoffLimit", 6):
                self._fail(job, "BackoffLimitExceeded", "Job has reached the specified backoff limit")
            else:
                self._retry(job, pod["index"], 0, state["total_failures"])
            return
        if fail_index or fails > per_index:
            state["failed_indexes"].add(pod["index"])
            if len(state["failed_indexes"]) > spec.get("maxFailedIndexes", 1 << 30):
                self._fail(job, "MaxFailedIndexesExceeded", "Job has exceeded the specified maximal number of failed indexes")
            return
        if state["total_failures"] > spec.get("backoffLimit", 1 << 30):
            self._fail(job, "BackoffLimitExceeded", "Job has reached the specified backoff limit")
            return
        self._retry(job, pod["index"], fails, fails)

    def _retry(self, job: str, index: int, failures: int, backoffs: int) -> None:
        """The Job controller makes the index's next pod after its back-off: 10 s doubling per failure
        of the index (per failure of the Job without ``backoffLimitPerIndex``), ``backoff_steps`` here."""
        self.due.append((self.step + self.backoff_steps * 2 ** (backoffs - 1), job, index, failures))

    def delete_pod(self, name: str, grace_period_seconds: int | None) -> None:
        if name not in self.pods:
            raise _api_error(404, "NotFound", f'pods "{name}" not found')
        assert grace_period_seconds is None or grace_period_seconds >= 1, "0 force-deletes: no terminal status follows"
        pod = self.pods[name]
        self.deleted.append(("Pod", name))
        if pod["phase"] in ("Pending", "Running"):
            self._terminate(pod, 143)  # SIGTERM, which a psflow task does not outlive by its grace

    def _fail(self, job: str, reason: str, message: str) -> None:
        self.jobs[job]["condition"], self.jobs[job]["finished_at"] = ("FailureTarget", reason, message), self.step
        for pod in self.pods.values():
            if pod["job"] == job and pod["phase"] in ("Pending", "Running"):
                pod["phase"], pod["code"] = "Failed", 143  # terminated by the Job controller (SIGTERM)

    # -- the model objects -----------------------------------------------------------------------
    def pod_model(self, pod: dict[str, Any]) -> V1Pod:
        statuses = None
        key = (self.task_of(pod), pod["attempt"])
        if pod["phase"] == "Pending" and key in self.waiting:
            reason, message = self.waiting[key]
            statuses = [V1ContainerStatus(name=pod["labels"]["psflow.io/job"], image="train:1", image_id="", ready=False,
                                          restart_count=0, state=V1ContainerState(
                                              waiting=V1ContainerStateWaiting(reason=reason, message=message)))]
        if pod["code"] is not None:
            key = (self.task_of(pod), pod["attempt"])
            term = V1ContainerStateTerminated(exit_code=pod["code"], message=self.messages.get(key),
                                              reason=self.reasons.get(key, "Completed" if pod["code"] == 0 else "Error"))
            statuses = [V1ContainerStatus(name=pod["labels"]["psflow.io/job"], image="train:1", image_id="", ready=False,
                                          restart_count=0, state=V1ContainerState(terminated=term))]
        conditions = [V1PodCondition(type="DisruptionTarget", status="True", reason=pod["disrupted"])] \
            if pod.get("disrupted") else None
        return V1Pod(metadata=V1ObjectMeta(name=pod["name"], labels=pod["labels"], annotations=pod["annotations"],
                                           creation_timestamp=pod["created"]),
                     status=V1PodStatus(phase=pod["phase"], container_statuses=statuses, conditions=conditions))

    def job_model(self, name: str) -> V1Job:
        cond = self.jobs[name]["condition"]
        interim = {final: first for first, final in _FINAL.items()}.get(cond[0]) if cond else None
        conditions = [V1JobCondition(type=t, status="True", reason=cond[1] or None, message=cond[2] or None)
                      for t in (interim, cond[0]) if t] if cond else None
        body = self.objects["Job"][name]
        return V1Job(metadata=V1ObjectMeta(name=name, labels=body["metadata"]["labels"]),
                     status=V1JobStatus(conditions=conditions))


class FakeCoreV1Api:
    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any], **kw: Any) -> Any:
        return self.cluster.create("Secret", namespace, body)

    def create_namespaced_service(self, namespace: str, body: dict[str, Any], **kw: Any) -> Any:
        return self.cluster.create("Service", namespace, body)

    def list_namespaced_pod(self, namespace: str, label_selector: str | None = None, **kw: Any) -> V1PodList:
        self.cluster.advance()
        return V1PodList(items=[self.cluster.pod_model(p) for p in self.cluster.pods.values()
                                if _selects(label_selector, p["labels"])])

    def read_namespaced_pod_log(self, name: str, namespace: str, **kw: Any) -> str:
        if name not in self.cluster.pods:
            raise _api_error(404, "NotFound", f'pods "{name}" not found')
        return f"log of {name}\n"

    def delete_namespaced_pod(self, name: str, namespace: str, grace_period_seconds: int | None = None, **kw: Any) -> None:
        self.cluster.delete_pod(name, grace_period_seconds)

    def delete_namespaced_service(self, name: str, namespace: str, **kw: Any) -> None:
        self.cluster.delete("Service", name)

    def delete_namespaced_secret(self, name: str, namespace: str, **kw: Any) -> None:
        self.cluster.delete("Secret", name)


class FakeBatchV1Api:
    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster

    def create_namespaced_job(self, namespace: str, body: dict[str, Any], **kw: Any) -> Any:
        return self.cluster.create("Job", namespace, body)

    def list_namespaced_job(self, namespace: str, label_selector: str | None = None, **kw: Any) -> V1JobList:
        return V1JobList(items=[self.cluster.job_model(n) for n, b in self.cluster.objects["Job"].items()
                                if _selects(label_selector, b["metadata"]["labels"])])

    def delete_namespaced_job(self, name: str, namespace: str, propagation_policy: str | None = None, **kw: Any) -> None:
        assert propagation_policy in ("Background", "Foreground"), "without it the pods would be orphaned"
        self.cluster.delete("Job", name)


class FakePolicyV1Api:
    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster

    def create_namespaced_pod_disruption_budget(self, namespace: str, body: dict[str, Any], **kw: Any) -> Any:
        return self.cluster.create("PodDisruptionBudget", namespace, body)

    def delete_namespaced_pod_disruption_budget(self, name: str, namespace: str, **kw: Any) -> None:
        self.cluster.delete("PodDisruptionBudget", name)
