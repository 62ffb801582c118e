"""Pure pieces around the launcher: TrainConfig validation, launch plans, fault specs."""

from __future__ import annotations

import json

import pytest

from psflow.config import TrainConfig
from psflow.errors import ConfigError
from psflow.fault import Fault, for_attempt, parse_faults
from psflow.launch.plan import make_plan
from psflow.launch.restart import RestartPolicy


def test_train_config_rejects_unknown_mode_with_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"TrainConfig: mode must be 'async', 'sync' or 'ssp'; received 'fast'"):
        TrainConfig(mode="fast")


@pytest.mark.parametrize("field,value", [("replicas_to_aggregate", 0), ("total_num_replicas", -1), ("staleness", -2),
                                         ("sync_timeout_s", 0), ("ready_timeout_s", float("inf")),
                                         ("progress_every_s", 0.0)])
def test_train_config_rejects_bad_numbers_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{field: value})


def test_resolved_fills_n_and_m_from_the_worker_count():
    cfg = TrainConfig(mode="sync").resolved(3)
    assert (cfg.replicas_to_aggregate, cfg.total_num_replicas) == (3, 3)
    cfg = TrainConfig(mode="sync", replicas_to_aggregate=2).resolved(3)
    assert (cfg.replicas_to_aggregate, cfg.total_num_replicas) == (2, 3)


def test_resolved_refuses_more_replicas_than_workers_and_n_above_m():
    with pytest.raises(ConfigError, match="total_num_replicas=4 exceeds the 3 workers"):
        TrainConfig(total_num_replicas=4).resolved(3)
    with pytest.raises(ConfigError, match="replicas_to_aggregate=3 exceeds total_num_replicas=2"):
        TrainConfig(replicas_to_aggregate=3, total_num_replicas=2).resolved(3)


def test_train_config_json_round_trip_and_unknown_keys():
    cfg = TrainConfig(mode="ssp", staleness=2)
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ConfigError, match=r"TrainConfig has no setting 'speed' \(received 3\). Known: mode, strategy"):
        TrainConfig.from_dict({"mode": "sync", "speed": 3})
    with pytest.raises(ConfigError, match="not valid JSON"):
        TrainConfig.from_json("{mode")


def test_plan_lists_every_task_with_its_environment(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    plan = make_plan(str(script), ["--epochs", "2"], num_ps=2, num_workers=3, logdir=str(tmp_path / "run"),
                     config=TrainConfig(mode="sync"), fail_at="worker:1@step=3")
    assert plan.task_names() == ["ps:0", "ps:1", "worker:0", "worker:1", "worker:2"]
    t = plan.tasks[3]
    env = dict(t.env)
    assert t.argv[-3:] == (str(script), "--epochs", "2")
    assert env["PSFLOW_TASK"] == "worker:1" and env["PSFLOW_FAIL_AT"] == "worker:1@step=3"
    assert TrainConfig.from_json(env["PSFLOW_TRAIN_CONFIG"]).mode == "sync"
    assert env["PSFLOW_ERROR_FILE"].endswith("errors/worker-1.json")
    assert json.loads(plan.to_json())["tasks"][0]["task"] == "ps:0"


def test_plan_is_pure_data_equal_for_equal_inputs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    a = make_plan(str(script), num_ps=1, num_workers=2, logdir="x")
    b = make_plan(str(script), num_ps=1, num_workers=2, logdir="x")
    assert a.tasks == b.tasks


def test_plan_refuses_a_missing_script_and_no_ps():
    with pytest.raises(ConfigError, match="does not exist"):
        make_plan("/nonexistent/train.py")


def test_plan_without_ps_for_parameter_servers_is_refused(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(ConfigError, match="--ps must be at least 1"):
        make_plan(str(script), num_ps=0)


def test_fault_specs_parse_and_bad_ones_name_the_syntax():
    assert parse_faults("worker:1@step=30:kill, worker:0@step=2:stall=1.5") == [
        Fault("worker:1", 30, "kill"), Fault("worker:0", 2, "stall", 1.5)]
    assert parse_faults("worker:0@step=5") == [Fault("worker:0", 5, "raise")]
    assert parse_faults(None) == []
    with pytest.raises(ConfigError, match="Bad fault spec 'worker1@30'"):
        parse_faults("worker1@30")


def test_a_fault_fires_on_the_first_attempt_unless_it_names_another():
    assert parse_faults("worker:1@step=30:kill@attempt=2, ps:0@save=1:crash_after=5@attempt=1") == [
        Fault("worker:1", 30, "kill", attempt=2), Fault("ps:0", 1, "crash_save", crash_after_bytes=5, attempt=1)]
    assert parse_faults("worker:1@step=30:stall=1.5")[0].attempt == 0
    spec = "worker:1@step=30:kill,worker:1@step=40@attempt=1,worker:0@step=5:delay=0.1"
    # Each attempt of a task reads only its own faults (PSFLOW_FAIL_AT through for_attempt).
    assert for_attempt(spec, 0) == "worker:1@step=30:kill,worker:0@step=5:delay=0.1"
    assert for_attempt(spec, 1) == "worker:1@step=40@attempt=1"
    assert for_attempt(spec, 2) is None and for_attempt(None, 0) is None
    with pytest.raises(ConfigError, match="@attempt=K"):
        parse_faults("worker:1@step=30:kill@attempt=x")


def test_a_plan_refuses_a_fault_on_an_attempt_its_restart_policy_never_reaches(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    policy = RestartPolicy.parse("worker=on-failure", max_restarts=1)
    plan = make_plan(str(script), logdir=str(tmp_path / "a"), fail_at="worker:1@step=3:kill@attempt=1", restart=policy)
    assert plan.restart == policy
    with pytest.raises(ConfigError, match="worker:1 reaches attempt 1 at most"):
        make_plan(str(script), logdir=str(tmp_path / "b"), fail_at="worker:1@step=3@attempt=2", restart=policy)
    with pytest.raises(ConfigError, match="it is never restarted"):
        make_plan(str(script), logdir=str(tmp_path / "c"), fail_at="worker:1@step=3@attempt=1")


def test_the_launcher_side_of_psflow_starts_without_torch():
    """`psflow run` and `psflow --help` must not pay torch's ~2 s import: the launcher, its
    coordinator server and the wire's JSON frames work without it; torch loads on first tensor use."""
    import subprocess
    import sys

    code = (
        "import sys, psflow, psflow.cli, psflow.launch, psflow.launch.local, psflow.launch.coordinator\n"
        "from psflow.wire.frame import HEADER_SIZE, decode_meta, encode_head, Limits, tensor_specs\n"
        "head = encode_head(1, {'hello': 'world'}, 0)\n"
        "meta, specs = decode_meta(head[HEADER_SIZE:], 0, Limits())\n"
        "assert meta == {'hello': 'world'} and specs == [] and tensor_specs([]) == []\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert psflow.Trainer.__name__ == 'Trainer' and 'torch' in sys.modules\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr


def test_plan_shares_the_cores_out_as_threads_per_task(tmp_path):
    from psflow.launch.plan import threads_per_task

    script = tmp_path / "t.py"
    script.write_text("")
    plan = make_plan(str(script), num_ps=1, num_workers=3, logdir="x", cores=16)
    assert plan.threads == 4 and {dict(t.env)["PSFLOW_NUM_THREADS"] for t in plan.tasks} == {"4"}
    assert make_plan(str(script), num_ps=1, num_workers=3, logdir="x", cores=2).threads == 1  # never 0
    assert make_plan(str(script), num_ps=1, num_workers=3, logdir="x", cores=16, threads=7).threads == 7
    assert threads_per_task(3, 55) == 18
    with pytest.raises(ConfigError, match=r"--threads must be a positive number.*received 0"):
        make_plan(str(script), logdir="x", threads=0)
