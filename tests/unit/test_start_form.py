"""The start form's backends: every one offered, each with its own fields, refused naming the field
when they do not fit (in process: FastAPI's TestClient; nothing here is started); and which runs can
be scaled, said instead of offered."""

from __future__ import annotations

import pytest

from psflow.platform.runcontrol import scale_refusal
from psflow.platform.startform import FormError, launch_fields

TOKEN = "form-token-0123456789abcdef"


@pytest.fixture
def client(tmp_path):  # noqa: ANN201
    from fastapi.testclient import TestClient

    from psflow.platform.api import UiSettings, create_app

    (tmp_path / "train.py").write_text("print('hi')\n")
    app = create_app(UiSettings(home=tmp_path / "home", token=TOKEN, script_roots=(tmp_path,), runs_root=tmp_path / "runs"))
    return TestClient(app, base_url="http://127.0.0.1", headers={"Authorization": f"Bearer {TOKEN}"})


def test_each_backend_takes_its_own_fields_and_refuses_the_others():
    assert launch_fields("local", {}, 2) == {"hosts": None, "coordinator_host": None, "nodes": None, "k8s": {},
                                             "gpus_per_worker": 2}
    assert launch_fields("slurm", {"nodes": 4, "coordinator_host": "head-1"}, 0)["nodes"] == 4
    slurm = launch_fields("slurm", {"sbatch_args": "--partition=gpu  --comment='two words'"}, 0)
    assert slurm["sbatch_args"] == ("--partition=gpu", "--comment=two words")
    k8s = launch_fields("k8s", {"image": "reg.example/train:1", "namespace": "ml", "volume_claim": "runs"}, 1)
    assert k8s["k8s"] == {"image": "reg.example/train:1", "namespace": "ml", "volume_claim": "runs", "gpus_per_worker": 1}
    assert k8s["gpus_per_worker"] == 0  # Kubernetes places a pod's GPUs, not psflow
    refused = [("local", {"nodes": 2}, "nodes", "nodes is for the slurm backend; this run's backend is local"),
               ("slurm", {"hosts": "a:1"}, "hosts", "hosts is for the ssh backend"),
               ("ssh", {"image": "x"}, "image", "image is for the k8s backend"),
               ("ssh", {}, "hosts", "The ssh backend needs hosts: HOST:SLOTS,..."),
               ("k8s", {}, "image", "The k8s backend needs image: a container image"),
               ("ssh", {"hosts": "-oProxyCommand=touch /tmp/x:1"}, "hosts", "is not HOST or HOST:SLOTS"),
               ("ssh", {"hosts": "node1:two"}, "hosts", "is not HOST or HOST:SLOTS"),
               ("ssh", {"hosts": "a:1", "coordinator_host": "-x"}, "coordinator_host", "is not a host name"),
               ("k8s", {"image": "x", "namespace": "Bad_Name"}, "namespace", "is not a Kubernetes name"),
               ("slurm", {"sbatch_args": "--partition=gpu -t 10"}, "sbatch_args", "'-t' is not one sbatch option"),
               ("slurm", {"sbatch_args": "--comment='open"}, "sbatch_args", "No closing quotation"),
               ("local", {"sbatch_args": "--partition=gpu"}, "sbatch_args", "sbatch_args is for the slurm backend")]
    for backend, given, field, says in refused:
        with pytest.raises(FormError, match="") as e:
            launch_fields(backend, given, 0)
        assert e.value.field == field and says in str(e.value), (backend, given, str(e.value))


def test_the_form_offers_every_backend_and_says_which_field_is_wrong(client):
    form = client.get("/openapi.json").json()["components"]["schemas"]["StartRun"]["properties"]
    assert form["backend"]["enum"] == ["local", "slurm", "ssh", "k8s"]
    assert {"nodes", "hosts", "coordinator_host", "sbatch_args", "image", "namespace", "volume_claim"} <= set(form)
    base = {"script": "train.py", "ps": 1, "workers": 2}
    for body, field, says in (
            ({"backend": "ssh"}, "hosts", "The ssh backend needs hosts"),
            ({"backend": "ssh", "hosts": "node1:2"}, "hosts", "--hosts gives 2 slot(s) (node1:2) for 3 tasks"),
            ({"backend": "ssh", "hosts": "--help"}, "hosts", "is not HOST or HOST:SLOTS"),
            ({"backend": "k8s"}, "image", "The k8s backend needs image"),
            ({"backend": "local", "hosts": "node1:4"}, "hosts", "hosts is for the ssh backend"),
            ({"backend": "slurm", "gpus_per_worker": 1}, "gpus_per_worker", "placed by psflow on local runs only"),
            ({"backend": "slurm", "nodes": 0}, "nodes", "greater than or equal to 1")):
        r = client.post("/api/runs", json={**base, **body})
        assert r.status_code == 422, (body, r.text)
        (detail,) = r.json()["detail"]
        assert detail["loc"] == ["body", field] and says in detail["msg"], (body, detail)
    assert not (client.app.state.settings.logdirs).exists()  # nothing refused was started


def test_the_page_says_why_a_run_cannot_be_scaled():
    assert scale_refusal({"backend": "local", "strategy": "ps"}) is None
    assert scale_refusal({"backend": "slurm", "strategy": "ps"}) is None  # one more job step per added worker
    assert scale_refusal({"backend": "k8s"}).startswith("it runs on the k8s backend, and a TFJob's replica counts")
    assert "all-reduce ranks cannot join or leave" in scale_refusal({"backend": "local", "strategy": "allreduce"})


def test_an_ssh_run_scales_onto_free_host_slots_and_refuses_more_workers_than_they_hold(tmp_path):
    from psflow.launch.plan import make_plan
    from psflow.launch.ssh import Host, SshBackend, grow_placement

    hosts = [Host("a", 1), Host("b", 1), Host("c", 2)]
    placed = {"ps:0": "a", "worker:0": "b", "worker:1": "c"}
    assert grow_placement(placed, ["ps:0", "worker:0", "worker:1", "worker:2"], hosts)["worker:2"] == "c"
    # worker:0's process ended (retired): its slot on b is free again for a new worker
    grown = grow_placement({**placed, "worker:2": "c"}, [*placed, "worker:2", "worker:3"], hosts, ended={"worker:0"})
    assert grown["worker:3"] == "b" and grown["worker:0"] == "b"  # a task placed before keeps its host

    backend = SshBackend("a:1,b:1,c:2")
    (tmp_path / "train.py").write_text("")
    plan = make_plan(str(tmp_path / "train.py"), num_ps=1, num_workers=2)
    backend.replan(plan)  # the run's plan, as the runner hands it over
    assert backend.scale_refusal() is None and backend.scale_refusal(3) is None
    assert backend.scale_refusal(4).startswith("the ssh backend's hosts have 4 slot(s) (a:1, b:1, c:2) for this run's "
                                               "1 other task(s) and 4 workers; ask for at most 3 workers")
    assert scale_refusal({"backend": "ssh", "strategy": "ps"}) is None  # the dashboard offers Scale for ssh runs
