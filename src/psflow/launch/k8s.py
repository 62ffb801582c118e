"""A run as Kubernetes objects: pure rendering of a launch plan into manifests (no API server, no I/O).

Called by ``psflow run --backend k8s`` (through :class:`psflow.launch.k8swatch.K8sBackend`, which
submits what this module renders and watches it) and by ``psflow k8s tfjob``. The mapping in brief
(each choice, and why: ``docs/design/kubernetes.md``):

- a Secret holds the job secret, mounted read-only in every pod (never in its environment or argv);
- a headless Service gives every pod a stable DNS name, before it is ready;
- one indexed Job per job type: the pod of index *i* is task ``<type>:<i>``, named in ``TF_CONFIG``
  (its index from the downward API); a task binds every interface of its pod;
- restarts are Kubernetes' (:func:`restart_fields` maps the run's policy per job; every attempt is a
  pod of its own, after :data:`POD_FAILURE_BACKOFF`), ``max_restarts_per_run`` held across the run
  by the launcher's run controller (:class:`psflow.launch.k8swatch.K8sBackend`, driven by the runner);
- a failing task's error report is its container's termination message (``/dev/termination-log``);
- the log dir is one ReadWriteMany claim mounted at ``/psflow`` (or each pod's ``emptyDir`` where the
  checkpoints go to an object store, ``env_secret`` then the pods' environment);
- ``cpu`` requested from the plan's threads, ``memory`` requested and limited (``--memory``),
  ``nvidia.com/gpu`` requested and limited for the chief and workers;
- every pod runs under the "restricted" Pod Security profile (non-root, ``fsGroup`` owning the
  secret's file, no privilege escalation, no capabilities, seccomp ``RuntimeDefault``);
- a PodDisruptionBudget (``maxUnavailable: 0``) keeps a ``kubectl drain`` from evicting the ps or the
  chief (they hold the run's state); every Job's ``podFailurePolicy`` ignores a ``DisruptionTarget``
  (a pod preempted or evicted is replaced without spending its restart budget).

The oldest Kubernetes these manifests are for is :data:`MIN_KUBERNETES` (``backoffLimitPerIndex``
and the ``FailIndex`` action are on by default from 1.29); the tests validate them strictly against
its schema and the newest's.

:func:`render_tfjob` renders the same run as one Kubeflow ``TFJob`` (``kubeflow.org/v1``) instead.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from psflow.errors import ConfigError
from psflow.launch.plan import LaunchPlan, TaskPlan
from psflow.launch.restart import Backoff, RestartPolicy

SECRET_DIR = "/var/run/psflow/secret"
SECRET_KEY = "secret"
MOUNT_PATH = "/psflow"
TERMINATION_LOG = "/dev/termination-log"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
FAILURE_COUNT_ANNOTATION = "batch.kubernetes.io/job-index-failure-count"  # set on each pod under backoffLimitPerIndex
RUN_LABEL = "psflow.io/run"
JOB_LABEL = "psflow.io/job"
JOB_ORDER = ("chief", "ps", "worker", "evaluator")
TFJOB_TYPES = {"chief": "Chief", "ps": "PS", "worker": "Worker", "evaluator": "Evaluator"}
_TFJOB_POLICY = {"never": "Never", "on-failure": "OnFailure", "always": "Always", "exit-code": "ExitCode"}
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_IMAGE = re.compile(r"^\S+$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
MIN_KUBERNETES = "1.29"
# The Job controller's wait before a failed index's next pod (DefaultJobPodFailureBackOff, MaxJobPodFailureBackOff):
# 10 s doubling per failure of the index, at most 10 min, never reset by a long healthy run (the failure count only grows).
POD_FAILURE_BACKOFF = Backoff(10.0, 600.0, resets=False, by="Kubernetes' Job controller")
DEFAULT_UID = 10001  # the Dockerfile's user: runAsNonRoot needs a numeric one to check
# psflow's variables the manifests set themselves, per pod, instead of the plan's (which are the launcher's view).
_REPLACED = ("PSFLOW_TASK", "PSFLOW_LOGDIR", "PSFLOW_ERROR_FILE", "PSFLOW_SECRET", "PSFLOW_SECRET_FILE",
             "PSFLOW_COORDINATOR", "PSFLOW_BIND_HOST")


@dataclass(frozen=True)
class K8sSettings:
    """What the manifests ask Kubernetes for.

    Args:
        image: the container image; it holds Python, psflow and the script at the path the plan
            names (relative to the image's working directory).
        volume_claim: a ReadWriteMany PersistentVolumeClaim every pod mounts at ``/psflow``: the
            run's log dir (checkpoints, summaries) lives there. None: an ``emptyDir`` per pod, for
            runs whose checkpoints go to a URL (``PSFLOW_CHECKPOINT_DIR``).
        env_secret: a Secret (the user's) whose keys become every pod's environment variables.
        namespace: where the objects go.
        gpus_per_worker: ``nvidia.com/gpu`` for each chief and worker pod (0: none).
        ttl_s: ``ttlSecondsAfterFinished`` of each Job (its pods and logs go then).
        port: the port every task listens on in its pod.
        python: the interpreter in the image.
        image_pull_policy: ``Always``, ``IfNotPresent`` or ``Never`` (None: Kubernetes' default).
        memory: every pod's memory request and limit, a Kubernetes quantity (``4Gi``; None: none).
        image_pull_secrets: Secrets (``kubernetes.io/dockerconfigjson``) for a private registry.
        service_account: the pods' ServiceAccount (None: the namespace's default, its token unmounted).
        tolerations: ``KEY[=VALUE][:EFFECT]`` each (``nvidia.com/gpu:NoSchedule``): taints the pods tolerate.
        node_selector: ``KEY=VALUE`` each: node labels every pod needs.
        run_as_user: the uid (and gid, and ``fsGroup``) the containers run as; the image's files
            must be readable by it (the repository's Dockerfile makes user 10001).

    Raises:
        ConfigError: an empty image, a claim or namespace that is not a DNS label, a negative count,
            a memory that is not a quantity, a toleration or node selector that does not parse.
    """

    image: str
    volume_claim: str | None
    namespace: str = "default"
    gpus_per_worker: int = 0
    ttl_s: int = 3600
    port: int = 2222
    python: str = "python"
    image_pull_policy: str | None = None
    env_secret: str | None = None
    memory: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    service_account: str | None = None
    tolerations: tuple[str, ...] = ()
    node_selector: tuple[str, ...] = ()
    run_as_user: int = DEFAULT_UID

    def __post_init__(self) -> None:
        for name in ("image_pull_secrets", "tolerations", "node_selector"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.image or not _IMAGE.match(self.image):
            raise ConfigError(f"--image must name a container image, e.g. registry.example.com/train:1.0; received {self.image!r}.")
        for flag, value in (("--volume-claim", self.volume_claim), ("--namespace", self.namespace),
                            ("--env-secret", self.env_secret)):
            if value is None and flag != "--namespace":
                continue
            if not value or not _DNS_LABEL.match(value) or len(value) > 63:
                raise ConfigError(f"{flag} must be a Kubernetes name (lowercase letters, digits and '-', starting with a "
                                  f"letter, at most 63 characters); received {value!r}.")
        if not isinstance(self.gpus_per_worker, int) or self.gpus_per_worker < 0:
            raise ConfigError(f"--gpus-per-worker must be 0 or more; received {self.gpus_per_worker!r}.")
        if not isinstance(self.ttl_s, int) or self.ttl_s < 0:
            raise ConfigError(f"--ttl must be a number of seconds >= 0; received {self.ttl_s!r}.")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"port must be in 1..65535; received {self.port!r}.")
        if self.image_pull_policy not in (None, "Always", "IfNotPresent", "Never"):
            raise ConfigError(f"--image-pull-policy must be Always, IfNotPresent or Never; received {self.image_pull_policy!r}.")
        self._check_scheduling()

    def _check_scheduling(self) -> None:
        if self.memory is not None and not _QUANTITY.match(self.memory):
            raise ConfigError(f"--memory must be a Kubernetes quantity, e.g. 4Gi or 512Mi; received {self.memory!r}.")
        for flag, values in (("--image-pull-secret", self.image_pull_secrets),
                             ("--service-account", (self.service_account,) if self.service_account is not None else ())):
            for value in values:
                if not _DNS_SUBDOMAIN.match(value) or len(value) > 253:
                    raise ConfigError(f"{flag} must name a Kubernetes object (lowercase letters, digits, '-' and '.'); "
                                      f"received {value!r}.")
        for spec in self.tolerations:
            toleration(spec)
        node_selector(self.node_selector)
        if not isinstance(self.run_as_user, int) or self.run_as_user < 1:
            raise ConfigError(f"run_as_user must be a uid >= 1 (the pods run as non-root); received {self.run_as_user!r}.")


def toleration(spec: str) -> dict[str, str]:
    """``--toleration KEY[=VALUE][:EFFECT]`` as a pod's toleration (no VALUE: any value; no EFFECT: any).

    Example:
        >>> toleration("nvidia.com/gpu:NoSchedule")
        {'key': 'nvidia.com/gpu', 'operator': 'Exists', 'effect': 'NoSchedule'}

    Raises:
        ConfigError: a key that is not a label key, an unknown effect.
    """
    head, _, effect = spec.partition(":")
    key, eq, value = head.partition("=")
    if not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value) or (effect and effect not in _EFFECTS):
        raise ConfigError(f"--toleration must be KEY[=VALUE][:EFFECT], EFFECT one of {', '.join(_EFFECTS)} "
                          f"(e.g. nvidia.com/gpu:NoSchedule or pool=training:NoExecute); received {spec!r}.")
    out = {"key": key, "operator": "Equal", "value": value} if eq else {"key": key, "operator": "Exists"}
    return {**out, "effect": effect} if effect else out


def node_selector(specs: Sequence[str]) -> dict[str, str]:
    """``--node-selector KEY=VALUE`` items as a pod's ``nodeSelector``.

    Raises:
        ConfigError: an item without ``=``, a key or value that is not a label's, a key given twice.
    """
    out: dict[str, str] = {}
    for spec in specs:
        key, eq, value = spec.partition("=")
        if not eq or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value) or len(value) > 63 or key in out:
            raise ConfigError(f"--node-selector must be KEY=VALUE, a node label (each key once; e.g. "
                              f"cloud.google.com/gke-nodepool=gpu); received {spec!r}.")
        out[key] = value
    return out


def run_name(plan: LaunchPlan) -> str:
    """The run's name in Kubernetes (the Service's, the prefix of every object): ``psflow-<run id>``."""
    name = "psflow-" + re.sub(r"[^a-z0-9-]+", "-", plan.run_id.lower()).strip("-")
    return name[:40].rstrip("-")  # <job>-<index> pod hostnames stay within 63 characters


def job_name(plan: LaunchPlan, job: str) -> str:
    return f"{run_name(plan)}-{job}"


def jobs_of(plan: LaunchPlan) -> dict[str, list[TaskPlan]]:
    """The plan's tasks by job type, in the order chief, ps, worker, evaluator."""
    by_job: dict[str, list[TaskPlan]] = {}
    for job in JOB_ORDER:
        tasks = [t for t in plan.tasks if t.job == job]
        if tasks:
            by_job[job] = sorted(tasks, key=lambda t: int(t.task.split(":")[1]))
    return by_job


def task_host(plan: LaunchPlan, settings: K8sSettings, job: str, index: int) -> str:
    """The stable DNS name and port of task ``job:index``: its pod's hostname within the headless Service."""
    return f"{job_name(plan, job)}-{index}.{run_name(plan)}.{settings.namespace}.svc:{settings.port}"


def cluster_of(plan: LaunchPlan, settings: K8sSettings) -> dict[str, list[str]]:
    """The cluster every pod's ``TF_CONFIG`` names: job type -> DNS names, by index."""
    return {job: [task_host(plan, settings, job, i) for i in range(len(tasks))] for job, tasks in jobs_of(plan).items()}


def logdir_in_pod(plan: LaunchPlan) -> str:
    """The run's log dir inside a pod: the plan's (relative) log dir under the claim's mount."""
    if PurePosixPath(plan.logdir).is_absolute():
        raise ConfigError(f"--logdir for --backend k8s is a path inside the volume claim (mounted at {MOUNT_PATH}); "
                          f"give a relative one, e.g. runs/mnist. Received: {plan.logdir!r}.")
    return str(PurePosixPath(MOUNT_PATH) / plan.logdir)


def restart_fields(policy: RestartPolicy, job: str) -> dict[str, Any]:
    """The Job spec fields that carry out ``policy`` for ``job``'s tasks (see the module's docstring)."""
    # A pod preempted, evicted or on a node that went away carries DisruptionTarget: not the task's
    # failure, so it is replaced without spending a restart (first rule: the first that matches wins).
    rules: list[dict[str, Any]] = [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
    if not policy.restarts(job):
        return {"backoffLimit": 0, "podFailurePolicy": {"rules": rules}}
    fields: dict[str, Any] = {"backoffLimitPerIndex": policy.max_restarts, "maxFailedIndexes": 0}
    if policy.max_restarts_per_run is not None:
        fields["backoffLimit"] = policy.max_restarts_per_run
    if policy.kind_for(job) == "exit-code":
        rules.append({"action": "FailIndex",
                      "onExitCodes": {"containerName": job, "operator": "In", "values": list(range(1, 128))}})
    return {**fields, "podFailurePolicy": {"rules": rules}}


def _task_env(plan: LaunchPlan, tasks: Sequence[TaskPlan]) -> list[dict[str, Any]]:
    """The environment every pod of a job shares: the plan's psflow variables, less the launcher's
    (see _REPLACED), plus the pod's log dir, error file, secret file and bind host."""
    env = {k: v for k, v in tasks[0].env if k not in _REPLACED}
    env.update(PSFLOW_LOGDIR=logdir_in_pod(plan), PSFLOW_ERROR_FILE=TERMINATION_LOG,
               PSFLOW_SECRET_FILE=f"{SECRET_DIR}/{SECRET_KEY}", PSFLOW_BIND_HOST="0.0.0.0")
    if env.get("PSFLOW_NUM_THREADS"):  # a fresh interpreter's torch reads it at import
        env["OMP_NUM_THREADS"] = env["PSFLOW_NUM_THREADS"]
    return [{"name": k, "value": v} for k, v in sorted(env.items())]


def _container(plan: LaunchPlan, settings: K8sSettings, job: str, tasks: Sequence[TaskPlan],
               extra_env: list[dict[str, Any]], name: str) -> dict[str, Any]:
    requests, limits = {"cpu": str(plan.threads)}, {}
    if settings.memory:  # request = limit: the pod is never OOM-killed for memory the node lent it
        requests["memory"] = limits["memory"] = settings.memory
    if settings.gpus_per_worker and job in ("chief", "worker"):
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(settings.gpus_per_worker)
    resources: dict[str, Any] = {"requests": requests, **({"limits": limits} if limits else {})}
    c: dict[str, Any] = {
        "name": name,
        "image": settings.image,
        "command": [settings.python, *tasks[0].argv[1:]],
        "env": [*extra_env, *_task_env(plan, tasks)],
        "ports": [{"name": "psflow", "containerPort": settings.port}],
        "resources": resources,
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "volumeMounts": [{"name": "secret", "mountPath": SECRET_DIR, "readOnly": True},
                         {"name": "logdir", "mountPath": MOUNT_PATH}],
    }
    if settings.image_pull_policy:
        c["imagePullPolicy"] = settings.image_pull_policy
    if settings.env_secret:
        c["envFrom"] = [{"secretRef": {"name": settings.env_secret}}]
    return c


def _volumes(plan: LaunchPlan, settings: K8sSettings) -> list[dict[str, Any]]:
    return [
        # 0440 and the pod's fsGroup: the non-root user reads it through its group (the kubelet owns it)
        {"name": "secret", "secret": {"secretName": f"{run_name(plan)}-secret", "defaultMode": 0o440,
                                      "items": [{"key": SECRET_KEY, "path": SECRET_KEY}]}},
        {"name": "logdir", "persistentVolumeClaim": {"claimName": settings.volume_claim}} if settings.volume_claim
        else {"name": "logdir", "emptyDir": {}},
    ]


def pod_fields(settings: K8sSettings) -> dict[str, Any]:
    """The pod spec's fields every task's pod shares: who it runs as, where it may run, how it pulls."""
    uid = settings.run_as_user
    fields: dict[str, Any] = {"securityContext": {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid,
                                                  "fsGroup": uid, "seccompProfile": {"type": "RuntimeDefault"}}}
    if settings.service_account:
        fields["serviceAccountName"] = settings.service_account
    else:  # a task never calls the API server: no token in its pod
        fields["automountServiceAccountToken"] = False
    if settings.image_pull_secrets:
        fields["imagePullSecrets"] = [{"name": n} for n in settings.image_pull_secrets]
    if settings.node_selector:
        fields["nodeSelector"] = node_selector(settings.node_selector)
    if settings.tolerations:
        fields["tolerations"] = [toleration(t) for t in settings.tolerations]
    return fields


def _labels(plan: LaunchPlan, job: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "psflow", RUN_LABEL: run_name(plan)}
    return {**labels, JOB_LABEL: job} if job else labels


def render_secret(plan: LaunchPlan, settings: K8sSettings, secret: str) -> dict[str, Any]:
    """The Secret holding the job secret (base64 in ``data``, as Kubernetes stores it)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": f"{run_name(plan)}-secret", "namespace": settings.namespace, "labels": _labels(plan)},
            "data": {SECRET_KEY: base64.b64encode(secret.encode()).decode()}}


def render_service(plan: LaunchPlan, settings: K8sSettings) -> dict[str, Any]:
    """The headless Service that gives every pod of the run its DNS name."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": run_name(plan), "namespace": settings.namespace, "labels": _labels(plan)},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {RUN_LABEL: run_name(plan)},
                     "ports": [{"name": "psflow", "port": settings.port, "targetPort": settings.port}]}}


def render_job(plan: LaunchPlan, settings: K8sSettings, job: str, tasks: Sequence[TaskPlan]) -> dict[str, Any]:
    """The indexed Job of one job type: pod *i* is task ``job:i``."""
    tf_config = json.dumps({"cluster": cluster_of(plan, settings), "task": {"type": job, "index": 0}},
                           separators=(",", ":")).replace('"index":0}}', '"index":$(TASK_INDEX)}}')
    index_env = [
        {"name": "TASK_INDEX", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}},
        {"name": "TF_CONFIG", "value": tf_config},  # after TASK_INDEX: the kubelet expands $(TASK_INDEX) in order
    ]
    if plan.restart.restarts(job):  # which retry of its index a pod is: a restarted ps re-syncs, a fault fires once
        index_env.append({"name": "PSFLOW_ATTEMPT", "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{FAILURE_COUNT_ANNOTATION}']"}}})
    pod_spec = {"subdomain": run_name(plan), "restartPolicy": "Never", **pod_fields(settings),
                "containers": [_container(plan, settings, job, tasks, index_env, job)],
                "volumes": _volumes(plan, settings)}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": job_name(plan, job), "namespace": settings.namespace, "labels": _labels(plan, job)},
            "spec": {"completionMode": "Indexed", "completions": len(tasks), "parallelism": len(tasks),
                     **restart_fields(plan.restart, job), "ttlSecondsAfterFinished": settings.ttl_s,
                     "template": {"metadata": {"labels": _labels(plan, job)}, "spec": pod_spec}}}


def render_budgets(plan: LaunchPlan, settings: K8sSettings) -> list[dict[str, Any]]:
    """The PodDisruptionBudgets of the ps and the chief (``maxUnavailable: 0``): a drain or another
    voluntary eviction waits for the run instead of taking a task that holds its state (a ps's shard,
    the chief's checkpoints). A separate chief, else worker 0 (the chief then). Deleting a pod, or a
    node that fails, is not held back (that is what restarts are for)."""
    jobs = jobs_of(plan)
    selectors = {"ps": {RUN_LABEL: run_name(plan), JOB_LABEL: "ps"}} if "ps" in jobs else {}
    if "chief" in jobs:
        selectors["chief"] = {RUN_LABEL: run_name(plan), JOB_LABEL: "chief"}
    elif "worker" in jobs:
        selectors["chief"] = {RUN_LABEL: run_name(plan), JOB_LABEL: "worker", INDEX_ANNOTATION: "0"}
    return [{"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
             "metadata": {"name": f"{run_name(plan)}-{what}", "namespace": settings.namespace, "labels": _labels(plan)},
             "spec": {"maxUnavailable": 0, "selector": {"matchLabels": labels}}} for what, labels in selectors.items()]


def render_run(plan: LaunchPlan, settings: K8sSettings, secret: str) -> list[dict[str, Any]]:
    """Every object of the run, in the order they are created: Secret, Service, the PodDisruptionBudgets,
    then a Job per job type.

    Example:
        >>> docs = render_run(make_plan("train.py"), K8sSettings(image="train:1", volume_claim="logs"), "s3cret")
        >>> [d["kind"] for d in docs]  # doctest: +SKIP
        ['Secret', 'Service', 'PodDisruptionBudget', 'PodDisruptionBudget', 'Job', 'Job']
    """
    _check_secret(secret)
    _check_shared(plan, settings)
    return [render_secret(plan, settings, secret), render_service(plan, settings), *render_budgets(plan, settings),
            *(render_job(plan, settings, job, tasks) for job, tasks in jobs_of(plan).items())]


def render_tfjob(plan: LaunchPlan, settings: K8sSettings, secret: str) -> list[dict[str, Any]]:
    """The run as a Secret and one Kubeflow TFJob (``kubeflow.org/v1``): the training operator makes
    the pods and the service and injects ``TF_CONFIG``, which ``pf.init()`` reads.

    Raises:
        ConfigError: an evaluator (the operator does not give it a place in every task's ``TF_CONFIG``).
    """
    _check_secret(secret)
    _check_shared(plan, settings)
    jobs = jobs_of(plan)
    if "evaluator" in jobs:
        raise ConfigError("psflow k8s tfjob cannot run an evaluator task: the TFJob operator leaves it out of the other "
                          "tasks' TF_CONFIG. Drop --evaluator.")
    replicas = {}
    for job, tasks in jobs.items():
        kind = plan.restart.kind_for(job) if plan.restart.restarts(job) else "never"
        container = _container(plan, settings, job, tasks, [], "tensorflow")  # the operator's container name
        container["ports"] = [{"name": "tfjob-port", "containerPort": settings.port}]  # the operator's port name
        replicas[TFJOB_TYPES[job]] = {
            "replicas": len(tasks), "restartPolicy": _TFJOB_POLICY[kind],
            "template": {"metadata": {"labels": _labels(plan, job)},
                         "spec": {**pod_fields(settings), "containers": [container],
                                  "volumes": _volumes(plan, settings)}},
        }
    run_policy: dict[str, Any] = {"cleanPodPolicy": "Running", "ttlSecondsAfterFinished": settings.ttl_s}
    if plan.restart.max_restarts_per_run is not None:
        run_policy["backoffLimit"] = plan.restart.max_restarts_per_run
    tfjob = {"apiVersion": "kubeflow.org/v1", "kind": "TFJob",
             "metadata": {"name": run_name(plan), "namespace": settings.namespace, "labels": _labels(plan)},
             "spec": {"runPolicy": run_policy, "tfReplicaSpecs": replicas}}
    return [render_secret(plan, settings, secret), tfjob]


def to_yaml(docs: Sequence[dict[str, Any]]) -> str:
    """The manifests as one YAML stream (``kubectl apply -f`` reads it)."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _list(dumper: yaml.SafeDumper, data: list[Any]) -> Any:  # exit-code lists on one line
        flow = bool(data) and all(isinstance(v, int) for v in data)
        return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)

    _Dumper.add_representer(list, _list)
    return yaml.dump_all(list(docs), Dumper=_Dumper, sort_keys=False, width=1 << 16)


def _check_shared(plan: LaunchPlan, settings: K8sSettings) -> None:
    """Without a claim, nothing on a pod's disk is seen by another: the checkpoints must go to a URL,
    and no evaluator can see the chief's DONE file."""
    if settings.volume_claim:
        return
    where = dict(plan.tasks[0].env).get("PSFLOW_CHECKPOINT_DIR", "") if plan.tasks else ""
    if "://" not in where:
        raise ConfigError("--backend k8s needs --volume-claim NAME: a ReadWriteMany PersistentVolumeClaim every pod "
                          "mounts for the log dir (the ps write checkpoint shards there, the chief the manifest), or "
                          "--checkpoint-dir s3://BUCKET/PATH to keep the checkpoints in an object store.")
    if any(t.job == "evaluator" for t in plan.tasks):
        raise ConfigError("An evaluator on Kubernetes needs --volume-claim: it ends when it sees the chief's DONE file "
                          "in the shared log dir.")


def _check_secret(secret: str) -> None:
    if len(secret) < 16:
        raise ConfigError(f"The job secret must be at least 16 characters; received {len(secret)}.")
