"""``--backend k8s`` against a real Kubernetes API server: opt-in, never in CI (it has no cluster).

Run them against any cluster your kubeconfig reaches (a kind or minikube one, a throw-away namespace
of a real one, or an API server with a stand-in kubelet)::

    PSFLOW_K8S_TESTS=1 KUBECONFIG=~/.kube/config PSFLOW_K8S_NAMESPACE=psflow-test \\
    PSFLOW_K8S_IMAGE=registry.example.com/psflow:0.1.0 PSFLOW_K8S_VOLUME_CLAIM=psflow-logs \\
        .venv/bin/pytest -m k8s tests/integration/test_k8s_cluster.py

- the API server takes every object the manifests hold, in a server-side dry run with strict field
  validation (its own version's schema and feature gates; needs only the kubeconfig);
- with an image (the repository's Dockerfile) and a ReadWriteMany claim: a run succeeds and leaves
  only its Jobs (for their TTL); a ps killed mid-run with one copy of each shard rolls every task back
  to the newest checkpoint (each ends at attempt 1) and the run still succeeds.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, task_env

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.environ.get("PSFLOW_K8S_TESTS") != "1",
                       reason="needs a Kubernetes API server: opt in with PSFLOW_K8S_TESTS=1 and KUBECONFIG "
                              "(CI has no cluster; the fake one in tests/unit/k8s_fake.py stands in there)"),
]
NAMESPACE = os.environ.get("PSFLOW_K8S_NAMESPACE", "default")
IMAGE = os.environ.get("PSFLOW_K8S_IMAGE")
CLAIM = os.environ.get("PSFLOW_K8S_VOLUME_CLAIM")
needs_pods = pytest.mark.skipif(not (IMAGE and CLAIM), reason="a run needs PSFLOW_K8S_IMAGE (built from the "
                                "Dockerfile) and PSFLOW_K8S_VOLUME_CLAIM (a ReadWriteMany claim in the namespace)")


@pytest.fixture(scope="module")
def clients():
    from psflow.launch.k8swatch import load_clients

    return load_clients()


def test_the_api_server_takes_every_object_under_strict_field_validation(clients, monkeypatch):
    from psflow.launch.k8s import K8sSettings, render_run
    from psflow.launch.plan import make_plan
    from psflow.launch.restart import RestartPolicy
    from psflow.taskenv import TaskEnv

    core, batch, policy = clients
    monkeypatch.chdir(ROOT)
    image = IMAGE or "registry.example.com/psflow:0.1.0"
    claim = K8sSettings(image=image, volume_claim=CLAIM or "psflow-logs",
                           namespace=NAMESPACE, gpus_per_worker=1, memory="1Gi", tolerations=("nvidia.com/gpu:NoSchedule",),
                           node_selector=("kubernetes.io/os=linux",))
    # no claim: each pod's emptyDir, the checkpoints in an object store, the user's Secret as environment
    to_s3 = K8sSettings(image=image, volume_claim=None, namespace=NAMESPACE, env_secret="aws-credentials",
                        service_account="trainer", image_pull_secrets=("registry-credentials",), image_pull_policy="Always")
    s3 = TaskEnv(checkpoint_dir="s3://psflow-runs/mnist").render()
    for restart, settings, evaluator, extra_env in (("never", claim, True, None), ("on-failure", claim, False, None),
                                                    ("exit-code,ps=on-failure", claim, False, None),
                                                    ("always", to_s3, False, s3)):
        plan = make_plan("examples/mnist_softmax.py", ["--epochs", "1"], num_ps=2, num_workers=2, chief=True,
                         evaluator=evaluator, logdir="runs/k8s-dry", restart=RestartPolicy.parse(restart), extra_env=extra_env)
        plan = replace(plan, run_id=f"it-{uuid.uuid4().hex[:8]}")
        create = {"Secret": core.create_namespaced_secret, "Service": core.create_namespaced_service,
                  "PodDisruptionBudget": policy.create_namespaced_pod_disruption_budget,
                  "Job": batch.create_namespaced_job}
        for doc in render_run(plan, settings, "0123456789abcdef" * 4):
            create[doc["kind"]](namespace=NAMESPACE, body=doc, dry_run="All", field_validation="Strict")


def run_k8s(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the script's path as in the image (/app/examples)
    logdir = f"runs/it-{uuid.uuid4().hex[:8]}"
    done = subprocess.run([PSFLOW, "run", "--backend", "k8s", "--image", IMAGE, "--volume-claim", CLAIM,
                           "--namespace", NAMESPACE, "--logdir", logdir, "--memory", "2Gi", *args],
                          capture_output=True, text=True, timeout=840, env=task_env(), cwd=tmp_path)
    status = tmp_path / logdir / "status.json"
    return done, json.loads(status.read_text()) if status.exists() else {}


@needs_pods
def test_a_run_succeeds_on_the_cluster(tmp_path):
    done, status = run_k8s(tmp_path, "--ps", "1", "--workers", "2", "examples/mnist_softmax.py", "--", "--epochs", "1")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert status["state"] == "succeeded" and set(status["tasks"]) == {"ps:0", "worker:0", "worker:1"}


@needs_pods
def test_a_killed_worker_is_started_again_by_the_job_controller_and_the_run_succeeds(tmp_path):
    done, status = run_k8s(tmp_path, "--ps", "1", "--workers", "2", "--restart", "on-failure",
                           "--fail-at", "worker:1@step=20:kill", "examples/mnist_softmax.py", "--", "--epochs", "1")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "worker:1: Kubernetes restarted it as attempt 1" in done.stdout + done.stderr
    # the Job controller's own back-off, which the launcher says and waits for (not its --restart-backoff)
    assert "Kubernetes' Job controller replaces it as attempt 1 in ~10 s" in done.stdout + done.stderr
    assert {t: v["attempt"] for t, v in status["tasks"].items()} == {"ps:0": 0, "worker:0": 0, "worker:1": 1}


@needs_pods
def test_a_killed_ps_with_one_copy_rolls_every_task_back_and_the_run_succeeds(tmp_path):
    done, status = run_k8s(tmp_path, "--ps", "2", "--workers", "2", "--restart", "on-failure",
                           "--fail-at", "ps:1@step=30:kill", "examples/mnist_softmax.py", "--", "--epochs", "1")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "restarting the job (every shard back to the newest checkpoint)" in done.stdout + done.stderr
    assert {t: v["attempt"] for t, v in status["tasks"].items()} == {"ps:0": 1, "ps:1": 1, "worker:0": 1, "worker:1": 1}
