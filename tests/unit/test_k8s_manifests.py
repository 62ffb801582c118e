"""Kubernetes manifests of a run (psflow.launch.k8s): what they ask for, validated against the real
Kubernetes schemas (kubernetes-validate --strict; no API server can run here) and compared with
golden files (tests/unit/golden/; UPDATE_GOLDEN=1 rewrites them after a deliberate change)."""

from __future__ import annotations

import base64
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from psflow.cli import main
from psflow.config import TrainConfig
from psflow.errors import ConfigError
from psflow.launch.k8s import MIN_KUBERNETES, K8sSettings, render_run, render_tfjob, restart_fields, to_yaml
from psflow.launch.plan import make_plan
from psflow.launch.restart import RestartPolicy
from psflow.resolve.tfconfig import parse_tf_config

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
SCHEMA = kubernetes_validate.latest_version()
# The oldest Kubernetes the manifests are for, and the newest checked: both must take every object.
VERSIONS = (f"{MIN_KUBERNETES}.0", "1.37.0")
IGNORE_DISRUPTION = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
SECRET = "0123456789abcdef" * 4
SETTINGS = K8sSettings(image="registry.example.com/psflow-mnist:1", volume_claim="psflow-logs", namespace="ml",
                       gpus_per_worker=1, ttl_s=600)


@pytest.fixture
def plan(monkeypatch):
    monkeypatch.chdir(ROOT)  # the script's path as the user wrote it, relative: the same in the image

    def make(**kw):
        kw.setdefault("restart", RestartPolicy.parse("on-failure,ps=never", max_restarts=2))
        p = make_plan("examples/mnist_softmax.py", ["--epochs", "1"], logdir="runs/mnist", threads=2, **kw)
        return replace(p, run_id="20260101-120000-abc123")
    return make


def validate(doc, version=SCHEMA):
    kubernetes_validate.validate(doc, version, strict=True)


def jobs(docs):
    return [d for d in docs if d["kind"] == "Job"]


def by_kind(docs):
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def env_of(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


# The whole TrainConfig rides in PSFLOW_TRAIN_CONFIG: every new setting would change the golden file.
# It is compared apart (test_every_pod_gets_the_plans_train_config), and left out of the golden text.
_TRAIN_CONFIG = re.compile(r"(- name: PSFLOW_TRAIN_CONFIG\n\s+value: ).*")


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    text = _TRAIN_CONFIG.sub(r"\1<the plan's TrainConfig>", text)
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; if deliberate, rerun with UPDATE_GOLDEN=1 and review the diff"


def test_run_manifests_validate_strictly_against_the_kubernetes_schema_and_match_the_golden_file(plan):
    docs = render_run(plan(num_ps=2, num_workers=2, chief=True), SETTINGS, SECRET)
    assert [d["kind"] for d in docs] == ["Secret", "Service", *["PodDisruptionBudget"] * 2, "Job", "Job", "Job"]
    for d in docs:
        validate(d)
    check_golden("k8s_run.yaml", to_yaml(docs))
    assert list(yaml.safe_load_all(to_yaml(docs))) == docs


def test_every_pod_gets_the_plans_train_config(plan):
    p = plan(num_ps=2, num_workers=2, chief=True, config=TrainConfig(mode="sync", staleness=7))
    jobs = [d for d in render_run(p, SETTINGS, SECRET) if d["kind"] == "Job"]
    assert len(jobs) == 3
    for job in jobs:
        env = env_of(job["spec"]["template"]["spec"]["containers"][0])
        assert TrainConfig.from_json(env["PSFLOW_TRAIN_CONFIG"]) == p.config


def test_strict_validation_catches_a_misspelled_field(plan):
    job = jobs(render_run(plan(), SETTINGS, SECRET))[0]
    job["spec"]["template"]["spec"]["containers"][0]["evn"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(job)


def test_each_pod_gets_tf_config_with_stable_dns_names_that_psflow_init_reads(plan):
    docs = by_kind(render_run(plan(num_ps=2, num_workers=3), SETTINGS, SECRET))
    job = docs[("Job", "psflow-20260101-120000-abc123-worker")]
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 3
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == "psflow-20260101-120000-abc123"  # the headless Service: <pod hostname>.<service>
    env = env_of(pod["containers"][0])
    names = [e["name"] for e in pod["containers"][0]["env"]]
    assert names.index("TASK_INDEX") < names.index("TF_CONFIG")  # the kubelet expands $(VAR) only from earlier ones
    assert env["TASK_INDEX"] == {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    # what the kubelet gives worker 2's pod, read the way pf.init() reads it
    spec, task = parse_tf_config(env["TF_CONFIG"].replace("$(TASK_INDEX)", "2"))
    assert str(task) == "worker:2"
    assert spec.to_dict() == {
        "ps": [f"psflow-20260101-120000-abc123-ps-{i}.psflow-20260101-120000-abc123.ml.svc:2222" for i in range(2)],
        "worker": [f"psflow-20260101-120000-abc123-worker-{i}.psflow-20260101-120000-abc123.ml.svc:2222" for i in range(3)],
    }
    service = docs[("Service", "psflow-20260101-120000-abc123")]["spec"]
    assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
    assert service["selector"] == {"psflow.io/run": "psflow-20260101-120000-abc123"}
    assert env["PSFLOW_BIND_HOST"] == "0.0.0.0" and env["PSFLOW_LOGDIR"] == "/psflow/runs/mnist"
    assert "PSFLOW_TASK" not in env and "PSFLOW_COORDINATOR" not in env


def test_the_job_secret_is_a_mounted_secret_never_in_plain_env_or_a_command(plan):
    docs = render_run(plan(num_workers=2, chief=True), SETTINGS, SECRET)
    secret = docs[0]
    assert secret["kind"] == "Secret" and base64.b64decode(secret["data"]["secret"]).decode() == SECRET
    for job in jobs(docs):
        text = json.dumps(job)
        assert SECRET not in text and base64.b64encode(SECRET.encode()).decode() not in text
        pod = job["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert env_of(container)["PSFLOW_SECRET_FILE"] == "/var/run/psflow/secret/secret"
        assert "PSFLOW_SECRET" not in env_of(container)
        assert {"name": "secret", "mountPath": "/var/run/psflow/secret", "readOnly": True} in container["volumeMounts"]
        volume = next(v for v in pod["volumes"] if v["name"] == "secret")["secret"]
        # readable by the pod's group only: fsGroup, the uid's own group, owns it (the kubelet writes it as root)
        assert volume["secretName"] == secret["metadata"]["name"] and volume["defaultMode"] == 0o440
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"] == 10001


def test_gpus_are_limits_of_chief_and_workers_only_and_cpu_follows_the_threads(plan):
    docs = by_kind(render_run(plan(num_workers=2, chief=True), SETTINGS, SECRET))
    res = {name.rsplit("-", 1)[1]: d["spec"]["template"]["spec"]["containers"][0]["resources"]
           for (kind, name), d in docs.items() if kind == "Job"}
    assert res["worker"] == res["chief"] == {"requests": {"cpu": "2", "nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}
    assert res["ps"] == {"requests": {"cpu": "2"}}
    none = by_kind(render_run(plan(), replace(SETTINGS, gpus_per_worker=0), SECRET))
    assert all("limits" not in d["spec"]["template"]["spec"]["containers"][0]["resources"]
               for (kind, _), d in none.items() if kind == "Job")


@pytest.mark.parametrize("spec, job, expected", [
    ("never", "worker", {"backoffLimit": 0}),
    ("on-failure", "worker", {"backoffLimitPerIndex": 3, "maxFailedIndexes": 0}),
    ("always", "ps", {"backoffLimitPerIndex": 3, "maxFailedIndexes": 0}),
    ("on-failure,ps=never", "ps", {"backoffLimit": 0}),
])
def test_restart_policy_maps_onto_the_jobs_retry_fields_and_a_disruption_never_counts(spec, job, expected):
    fields = restart_fields(RestartPolicy.parse(spec), job)
    assert fields.pop("podFailurePolicy") == {"rules": [IGNORE_DISRUPTION]}  # a drained or preempted pod: no restart spent
    assert fields == expected


def test_exit_code_policy_fails_the_index_at_once_on_1_to_127_and_retries_the_rest():
    fields = restart_fields(RestartPolicy.parse("exit-code", max_restarts=5, max_restarts_per_run=7), "worker")
    assert fields["backoffLimitPerIndex"] == 5 and fields["backoffLimit"] == 7
    ignore, rule = fields["podFailurePolicy"]["rules"]
    assert ignore == IGNORE_DISRUPTION  # first: a disrupted pod's 137 is no failure of the task
    assert rule["action"] == "FailIndex" and rule["onExitCodes"]["containerName"] == "worker"
    assert rule["onExitCodes"]["values"] == list(range(1, 128))


def test_every_job_has_a_time_to_live_and_pods_are_never_restarted_in_place(plan):
    for d in jobs(render_run(plan(num_workers=2, evaluator=True), SETTINGS, SECRET)):
        assert d["spec"]["ttlSecondsAfterFinished"] == 600
        assert d["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_tfjob_names_the_operators_replica_types_policies_and_container_and_its_pods_validate(plan):
    docs = render_tfjob(plan(num_ps=1, num_workers=2, chief=True, restart=RestartPolicy.parse("exit-code,ps=on-failure")),
                        SETTINGS, SECRET)
    check_golden("k8s_tfjob.yaml", to_yaml(docs))
    secret, tfjob = docs
    validate(secret)
    assert (tfjob["apiVersion"], tfjob["kind"]) == ("kubeflow.org/v1", "TFJob")
    specs = tfjob["spec"]["tfReplicaSpecs"]
    assert {k: (v["replicas"], v["restartPolicy"]) for k, v in specs.items()} == {
        "Chief": (1, "ExitCode"), "PS": (1, "OnFailure"), "Worker": (2, "ExitCode")}
    assert tfjob["spec"]["runPolicy"] == {"cleanPodPolicy": "Running", "ttlSecondsAfterFinished": 600}
    for kind, spec in specs.items():
        # the operator's pods: each template is a core PodTemplateSpec, checked against the real schema
        validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": kind.lower()}, "template": spec["template"]})
        container = spec["template"]["spec"]["containers"][0]
        assert container["name"] == "tensorflow" and container["ports"] == [{"name": "tfjob-port", "containerPort": 2222}]
        env = env_of(container)
        assert "TF_CONFIG" not in env and "PSFLOW_SECRET" not in env  # the operator injects TF_CONFIG
        assert SECRET not in json.dumps(spec)


def test_tfjob_refuses_an_evaluator_with_the_reason(plan):
    with pytest.raises(ConfigError, match="evaluator.*TF_CONFIG.*Drop --evaluator"):
        render_tfjob(plan(evaluator=True), SETTINGS, SECRET)


@pytest.mark.parametrize("kw, message", [
    ({"image": ""}, r"--image must name a container image.*received ''"),
    ({"volume_claim": "Logs_1"}, r"--volume-claim must be a Kubernetes name.*received 'Logs_1'"),
    ({"gpus_per_worker": -1}, r"--gpus-per-worker must be 0 or more; received -1"),
])
def test_bad_settings_are_refused_naming_the_flag_and_value(kw, message):
    with pytest.raises(ConfigError, match=message):
        K8sSettings(**{"image": "train:1", "volume_claim": "logs", **kw})


def test_absolute_logdir_is_refused_for_kubernetes(plan, tmp_path):
    p = replace(plan(), logdir=str(tmp_path / "abs"))
    with pytest.raises(ConfigError, match="relative one"):
        render_run(p, SETTINGS, SECRET)


def test_cli_dry_run_prints_manifests_that_validate_with_a_fresh_secret_each_time(monkeypatch):
    monkeypatch.chdir(ROOT)
    args = ["run", "--backend", "k8s", "--image", "train:1", "--volume-claim", "psflow-logs", "--gpus-per-worker", "1",
            "--restart", "exit-code", "--dry-run", "--ps", "1", "--workers", "2", "examples/mnist_softmax.py", "--", "--epochs", "1"]
    before = sorted((ROOT / "runs").iterdir()) if (ROOT / "runs").is_dir() else []
    outs = [CliRunner().invoke(main, args) for _ in range(2)]
    assert all(r.exit_code == 0 for r in outs), outs[0].output
    docs = list(yaml.safe_load_all(outs[0].output))
    assert [d["kind"] for d in docs] == ["Secret", "Service", "PodDisruptionBudget", "PodDisruptionBudget", "Job", "Job"]
    for d in docs:
        validate(d)
    assert docs[0]["data"] != next(yaml.safe_load_all(outs[1].output))["data"]  # never one secret for two runs
    assert (sorted((ROOT / "runs").iterdir()) if (ROOT / "runs").is_dir() else []) == before  # nothing written


@pytest.mark.parametrize("args, message", [
    (["--backend", "k8s", "--volume-claim", "logs"], "--backend k8s needs --image IMAGE"),
    (["--backend", "k8s", "--image", "train:1"], "--backend k8s needs --volume-claim NAME"),
    (["--image", "train:1"], "--image, --volume-claim, --gpus-per-worker, --env-secret and the other Kubernetes options"),
    (["--memory", "4Gi"], "(--memory, --toleration, ...) are for --backend k8s; this run is local"),
])
def test_cli_says_which_kubernetes_option_is_missing_or_misplaced(monkeypatch, args, message):
    monkeypatch.chdir(ROOT)
    r = CliRunner().invoke(main, ["run", *args, "--dry-run", "examples/mnist_softmax.py"])
    assert r.exit_code == 2 and message in r.output, r.output


def test_cli_tfjob_prints_a_secret_and_a_tfjob(monkeypatch):
    monkeypatch.chdir(ROOT)
    r = CliRunner().invoke(main, ["k8s", "tfjob", "--image", "train:1", "--volume-claim", "logs", "--workers", "3",
                                  "--restart", "on-failure", "examples/mnist_softmax.py", "--", "--epochs", "1"])
    assert r.exit_code == 0, r.output
    secret, tfjob = yaml.safe_load_all(r.output)
    validate(secret)
    assert tfjob["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] == 3
    assert tfjob["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"][2:] == [
        "examples/mnist_softmax.py", "--epochs", "1"]
    assert re.fullmatch(r"psflow-\d{8}-\d{6}-[0-9a-f]{6}", tfjob["metadata"]["name"])


def test_without_a_claim_checkpoints_on_a_url_give_each_pod_an_empty_dir_and_the_users_secret_as_env(plan):
    from psflow.taskenv import TaskEnv

    url_plan = plan(extra_env=TaskEnv(checkpoint_dir="s3://psflow-runs/mnist").render())
    settings = replace(SETTINGS, volume_claim=None, env_secret="aws-credentials")
    docs = render_run(url_plan, settings, SECRET)
    for d in docs:
        validate(d)
    for job in jobs(docs):
        pod = job["spec"]["template"]["spec"]
        assert {"name": "logdir", "emptyDir": {}} in pod["volumes"]
        container = pod["containers"][0]
        assert container["envFrom"] == [{"secretRef": {"name": "aws-credentials"}}]
        assert env_of(container)["PSFLOW_CHECKPOINT_DIR"] == "s3://psflow-runs/mnist"
    (secret, tfjob) = render_tfjob(url_plan, settings, SECRET)
    for spec in tfjob["spec"]["tfReplicaSpecs"].values():
        validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": spec["template"]})


def test_without_a_claim_local_checkpoints_or_an_evaluator_are_refused_saying_why(plan):
    from psflow.taskenv import TaskEnv

    no_claim = replace(SETTINGS, volume_claim=None)
    with pytest.raises(ConfigError, match="needs --volume-claim NAME.*or --checkpoint-dir s3://"):
        render_run(plan(), no_claim, SECRET)
    with pytest.raises(ConfigError, match="An evaluator on Kubernetes needs --volume-claim"):
        render_run(plan(evaluator=True, extra_env=TaskEnv(checkpoint_dir="s3://b/r").render()), no_claim, SECRET)


OPERATOR = replace(SETTINGS, memory="6Gi", image_pull_secrets=("regcred",), service_account="psflow-trainer",
                   tolerations=("nvidia.com/gpu:NoSchedule", "pool=training:NoExecute", "spot"),
                   node_selector=("cloud.google.com/gke-nodepool=gpu", "kubernetes.io/arch=amd64"))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("restart", ["never", "on-failure,ps=never", "exit-code"])
def test_every_object_validates_strictly_against_the_oldest_and_newest_kubernetes(plan, version, restart):
    p = plan(num_ps=2, num_workers=2, chief=True, evaluator=True, restart=RestartPolicy.parse(restart, max_restarts=2))
    docs = render_run(p, OPERATOR, SECRET)
    assert {d["kind"] for d in docs} == {"Secret", "Service", "PodDisruptionBudget", "Job"}
    for d in docs:
        validate(d, version)
    _, tfjob = render_tfjob(plan(num_workers=2, chief=True), OPERATOR, SECRET)
    for kind, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": kind.lower()}, "template": spec["template"]},
                 version)


def test_the_minimum_version_is_the_first_whose_schema_has_every_field_used(plan):
    # 1.28's schema names backoffLimitPerIndex (alpha there, off by default); 1.27's does not know it.
    job = jobs(render_run(plan(restart=RestartPolicy.parse("on-failure")), SETTINGS, SECRET))[0]
    with pytest.raises(kubernetes_validate.ValidationError, match="backoffLimitPerIndex"):
        validate(job, "1.27.0")
    assert MIN_KUBERNETES == "1.29"  # backoffLimitPerIndex and FailIndex on by default (beta) from 1.29
    readme = (ROOT / "docs" / "machines.md").read_text()
    assert f"Kubernetes {MIN_KUBERNETES} or newer" in readme


def test_every_pod_meets_the_restricted_pod_security_profile(plan):
    for job in jobs(render_run(plan(num_workers=2, chief=True, evaluator=True), OPERATOR, SECRET)):
        pod = job["spec"]["template"]["spec"]
        assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                                          "seccompProfile": {"type": "RuntimeDefault"}}
        (container,) = pod["containers"]
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                                "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        assert all(set(v) <= {"name", "secret", "persistentVolumeClaim", "emptyDir"} for v in pod["volumes"])  # no hostPath
        assert "hostNetwork" not in pod and "hostPID" not in pod and "ports" not in pod


def test_memory_scheduling_and_identity_options_reach_every_pod(plan):
    for job in jobs(render_run(plan(num_workers=2, chief=True), OPERATOR, SECRET)):
        pod = job["spec"]["template"]["spec"]
        res = pod["containers"][0]["resources"]
        assert res["requests"]["memory"] == res["limits"]["memory"] == "6Gi"
        gpus = job["metadata"]["labels"]["psflow.io/job"] in ("chief", "worker")
        assert res["requests"].get("nvidia.com/gpu") == res["limits"].get("nvidia.com/gpu") == ("1" if gpus else None)
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert pod["serviceAccountName"] == "psflow-trainer" and "automountServiceAccountToken" not in pod
        assert pod["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "pool", "operator": "Equal", "value": "training", "effect": "NoExecute"},
            {"key": "spot", "operator": "Exists"}]
        assert pod["nodeSelector"] == {"cloud.google.com/gke-nodepool": "gpu", "kubernetes.io/arch": "amd64"}
    plain = jobs(render_run(plan(), replace(SETTINGS, gpus_per_worker=0), SECRET))[0]["spec"]["template"]["spec"]
    assert plain["automountServiceAccountToken"] is False  # no API calls from a task: no token in its pod
    assert not {"imagePullSecrets", "tolerations", "nodeSelector", "serviceAccountName"} & set(plain)


@pytest.mark.parametrize("chief, expected", [
    (True, {"ps": {"psflow.io/job": "ps"}, "chief": {"psflow.io/job": "chief"}}),
    (False, {"ps": {"psflow.io/job": "ps"},
             "chief": {"psflow.io/job": "worker", "batch.kubernetes.io/job-completion-index": "0"}}),
])
def test_disruption_budgets_keep_a_drain_off_the_ps_and_the_chief_only(plan, chief, expected):
    docs = render_run(plan(num_ps=2, num_workers=3, chief=chief), SETTINGS, SECRET)
    budgets = {d["metadata"]["name"].rsplit("-", 1)[1]: d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    run = "psflow-20260101-120000-abc123"
    assert budgets == {k: {"maxUnavailable": 0, "selector": {"matchLabels": {"psflow.io/run": run, **v}}}
                       for k, v in expected.items()}
    templates = {d["metadata"]["labels"]["psflow.io/job"]: d["spec"]["template"]["metadata"]["labels"] for d in jobs(docs)}
    for spec in budgets.values():  # each selects its pods: the template's labels, and the index label the Job controller adds
        want = spec["selector"]["matchLabels"]
        job = want["psflow.io/job"]
        assert {k: v for k, v in want.items() if k != "batch.kubernetes.io/job-completion-index"}.items() <= templates[job].items()


@pytest.mark.parametrize("kw, message", [
    ({"memory": "4GB"}, r"--memory must be a Kubernetes quantity, e.g. 4Gi or 512Mi; received '4GB'"),
    ({"tolerations": ("gpu:Sometimes",)}, r"--toleration must be KEY\[=VALUE\]\[:EFFECT\].*received 'gpu:Sometimes'"),
    ({"node_selector": ("pool",)}, r"--node-selector must be KEY=VALUE.*received 'pool'"),
    ({"node_selector": ("pool=a", "pool=b")}, r"each key once.*received 'pool=b'"),
    ({"image_pull_secrets": ("Reg_Cred",)}, r"--image-pull-secret must name a Kubernetes object.*received 'Reg_Cred'"),
    ({"service_account": "Trainer"}, r"--service-account must name a Kubernetes object.*received 'Trainer'"),
])
def test_bad_scheduling_options_are_refused_naming_the_flag_and_value(kw, message):
    with pytest.raises(ConfigError, match=message):
        K8sSettings(**{"image": "train:1", "volume_claim": "logs", **kw})


def test_cli_takes_the_operators_options_for_run_and_tfjob(monkeypatch):
    monkeypatch.chdir(ROOT)
    more = ["--memory", "2Gi", "--image-pull-secret", "regcred", "--service-account", "trainer", "--run-as-user", "1000",
            "--toleration", "nvidia.com/gpu:NoSchedule", "--node-selector", "pool=gpu", "--node-selector", "zone=a"]
    r = CliRunner().invoke(main, ["run", "--backend", "k8s", "--image", "train:1", "--volume-claim", "logs", *more,
                                  "--dry-run", "examples/mnist_softmax.py"])
    assert r.exit_code == 0, r.output
    docs = list(yaml.safe_load_all(r.output))
    for version in VERSIONS:
        for d in docs:
            validate(d, version)
    pod = jobs(docs)[0]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu", "zone": "a"} and pod["serviceAccountName"] == "trainer"
    assert pod["containers"][0]["resources"]["limits"] == {"memory": "2Gi"}
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["fsGroup"] == 1000
    r = CliRunner().invoke(main, ["k8s", "tfjob", "--image", "train:1", "--volume-claim", "logs", *more,
                                  "examples/mnist_softmax.py"])
    assert r.exit_code == 0, r.output
    _, tfjob = yaml.safe_load_all(r.output)
    spec = tfjob["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}] and spec["tolerations"][0]["key"] == "nvidia.com/gpu"
