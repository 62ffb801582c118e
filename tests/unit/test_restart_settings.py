"""A restart reuses the backend settings its run was recorded with (ssh hosts, Slurm nodes, the
Kubernetes image and namespace), never a secret's name, and a restart request can override them:
recorded through the real record path into a real job store, read back, and assembled (nothing is
started: no ssh, no Slurm, no cluster is reached)."""

from __future__ import annotations

import dataclasses

import pytest

from psflow.errors import ConfigError
from psflow.launch import make_plan
from psflow.launch.assemble import BackendOptions, make_backend
from psflow.platform.jobstore import JobStore
from psflow.platform.launching import LaunchSpec, backend_options, plan_of, restore_spec, spec_of_run
from psflow.platform.recording import backend_settings
from psflow.platform.sqlrunstore import run_record


def _recorded(tmp_path, options: BackendOptions, run_id: str) -> dict:
    """A run launched with ``options``, recorded as its launcher records it, read back from the job store."""
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    plan = dataclasses.replace(make_plan(str(script), [], num_ps=1, num_workers=2, logdir=str(tmp_path / run_id)),
                               run_id=run_id)
    record = run_record(plan, backend=options.name if options.hosts is None else "ssh", settings=backend_settings(options))
    with JobStore(tmp_path / "jobs.db") as db:
        with db.transaction():
            db.add_run(record, plan.task_names())
        run = db.run(run_id, metrics=False)
    assert run is not None
    return run


def test_an_ssh_run_restarts_on_its_hosts_and_a_slurm_run_on_its_nodes(tmp_path):
    ssh = spec_of_run(_recorded(tmp_path, BackendOptions(hosts="node1:2,node2:1", coordinator_host="head"), "ssh-run"))
    assert (ssh.backend, ssh.hosts, ssh.coordinator_host) == ("ssh", "node1:2,node2:1", "head")
    plan_of(ssh)  # used to be refused: "The ssh backend needs hosts"
    backend = make_backend(backend_options(ssh))
    assert type(backend).__name__ == "SshBackend" and [h.name for h in backend.hosts] == ["node1", "node2"]

    slurm = spec_of_run(_recorded(tmp_path, BackendOptions(name="slurm", nodes=2), "slurm-run"))
    assert (slurm.backend, slurm.nodes) == ("slurm", 2)
    backend = make_backend(backend_options(slurm))
    assert "#SBATCH --nodes=2" in backend.script(plan_of(slurm))  # used to be 1 node
    assert restore_spec(_recorded(tmp_path, BackendOptions(name="slurm", nodes=2), "slurm-2"), tmp_path).nodes == 2

    # the restart request's settings win over the recorded ones
    assert spec_of_run(_recorded(tmp_path, BackendOptions(name="slurm", nodes=2), "slurm-3"), {"nodes": 4}).nodes == 4
    moved = spec_of_run(_recorded(tmp_path, BackendOptions(hosts="node1:3"), "ssh-2"), {"hosts": "node7:3"})
    assert moved.hosts == "node7:3"
    with pytest.raises(ConfigError, match=r"Unknown backend setting\(s\) \['partition'\]"):
        spec_of_run(_recorded(tmp_path, BackendOptions(name="slurm", nodes=2), "slurm-4"), {"partition": "gpu"})


def test_a_slurm_runs_sbatch_options_are_recorded_and_its_restart_submits_with_them(tmp_path):
    options = BackendOptions(name="slurm", nodes=2, sbatch_args=("--partition=gpu", "--time=02:00:00",
                                                                 "--export=ALL,API_TOKEN=abc123"))
    run = _recorded(tmp_path, options, "slurm-sb")
    assert run["launch"]["backend_settings"]["sbatch_args"] == ["--partition=gpu", "--time=02:00:00"]
    assert "abc123" not in str(run)  # an option naming a credential is never kept
    spec = spec_of_run(run)
    assert spec.sbatch_args == ("--partition=gpu", "--time=02:00:00")
    assert LaunchSpec.from_json(spec.to_json()) == spec  # the detached launcher reads it back from JSON
    script = make_backend(backend_options(spec)).script(plan_of(spec))
    assert "#SBATCH --partition=gpu\n#SBATCH --time=02:00:00\n" in script  # used to be lost on restart
    # psflow restart RUN --sbatch-arg / the API's body: the whole list in place of the recorded one
    again = spec_of_run(_recorded(tmp_path, options, "slurm-sb2"), {"sbatch_args": ("--partition=cpu",)})
    assert again.sbatch_args == ("--partition=cpu",)
    assert spec_of_run(_recorded(tmp_path, BackendOptions(name="slurm"), "slurm-none")).sbatch_args == ()
    with pytest.raises(ConfigError, match="--sbatch-arg is for --backend slurm; this run is local"):
        plan_of(dataclasses.replace(spec, backend="local", nodes=None))


def test_psflow_restart_sbatch_arg_replaces_the_recorded_options(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from psflow.cli import main
    from psflow.platform import launching

    monkeypatch.setenv("PSFLOW_HOME", str(tmp_path))  # the job store _recorded writes: tmp_path/jobs.db
    _recorded(tmp_path, BackendOptions(name="slurm", sbatch_args=("--partition=gpu",)), "slurm-cli")
    with JobStore(tmp_path / "jobs.db") as db, db.transaction():
        db.finish_run("slurm-cli", "failed", 1.0)
    launched: list[LaunchSpec] = []

    def run_here(spec, **_):  # the launch as it would run (nothing is submitted to Slurm)
        launched.append(spec)
        raise ConfigError("stopped here by the test")
    monkeypatch.setattr(launching, "run_here", run_here)
    for extra in ([], ["--sbatch-arg=--partition=cpu", "--sbatch-arg=--qos=low"]):
        CliRunner().invoke(main, ["restart", "slurm-cli", *extra])
    assert [s.sbatch_args for s in launched] == [("--partition=gpu",), ("--partition=cpu", "--qos=low")]


def test_a_k8s_run_keeps_its_image_and_options_but_never_a_secret(tmp_path):
    k8s = {"image": "reg.example/train:1", "namespace": "ml", "volume_claim": "runs", "memory": "4Gi",
           "env_secret": "wandb-key", "image_pull_secrets": ("regcred",), "gpus_per_worker": 1}
    run = _recorded(tmp_path, BackendOptions(name="k8s", k8s=k8s), "k8s-run")
    assert "wandb-key" not in str(run) and "regcred" not in str(run)
    spec = spec_of_run(run, {"k8s": {"namespace": "ml-2"}})
    assert spec.backend == "k8s" and spec.k8s == {"image": "reg.example/train:1", "namespace": "ml-2",
                                                  "volume_claim": "runs", "memory": "4Gi", "gpus_per_worker": 1}
    plan_of(spec)  # used to be refused: "--backend k8s needs --image IMAGE"


def test_a_local_run_records_no_backend_settings_and_restarts_locally(tmp_path):
    # psflow run hands every backend the Kubernetes defaults (namespace, ttl): a local run keeps none of them
    run = _recorded(tmp_path, BackendOptions(k8s={"namespace": "default", "ttl_s": 3600}), "local-run")
    assert run["launch"]["backend_settings"] == {}
    spec = spec_of_run(run)
    assert (spec.backend, spec.hosts, spec.nodes, spec.k8s) == ("local", None, None, {})
    assert LaunchSpec.from_json(spec.to_json()) == spec


def test_the_apis_restart_reuses_the_recorded_settings_and_its_body_overrides_them(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from psflow.platform import launching
    from psflow.platform.api import UiSettings, create_app

    _recorded(tmp_path, BackendOptions(name="slurm", nodes=2), "slurm-run")
    launched: list[LaunchSpec] = []

    def start_detached(spec, **_):  # the launch as it would start (nothing is submitted to Slurm)
        launched.append(spec)
        raise ConfigError("stopped here by the test")
    monkeypatch.setattr(launching, "start_detached", start_detached)
    client = TestClient(create_app(UiSettings(home=tmp_path, token="t")), base_url="http://127.0.0.1",
                        headers={"Authorization": "Bearer t"})
    assert client.post("/api/runs/slurm-run/restart").status_code == 409
    assert client.post("/api/runs/slurm-run/restart", json={"nodes": 3}).status_code == 409
    assert client.post("/api/runs/slurm-run/restart", json={"sbatch_args": "--qos=high '--comment=a b'"}).status_code == 409
    assert [(s.backend, s.nodes, s.sbatch_args) for s in launched] == [("slurm", 2, ()), ("slurm", 3, ()),
                                                                        ("slurm", 2, ("--qos=high", "--comment=a b"))]
    refused = client.post("/api/runs/slurm-run/restart", json={"sbatch_args": "-p gpu"})
    assert refused.status_code == 422 and "--sbatch-arg '-p' is not one sbatch option" in refused.text
    refused = client.post("/api/runs/slurm-run/restart", json={"hosts": "node1:2"})
    assert refused.status_code == 422 and "hosts is for the ssh backend" in refused.text
