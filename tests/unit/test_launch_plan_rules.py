"""What a launch plan holds for the tasks it starts: which tasks, their command line and environment,
the run's id and logdir, and the plan as JSON. A plan is pure data, so these are plain comparisons."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from psflow.config import TrainConfig
from psflow.errors import ConfigError
from psflow.launch.plan import LaunchPlan, host_cores, make_plan, threads_per_task


@pytest.fixture()
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def test_default_cluster_is_one_ps_and_two_workers(script: str) -> None:
    assert make_plan(script).task_names() == ["ps:0", "worker:0", "worker:1"]


def test_chief_comes_first_and_the_evaluator_last(script: str) -> None:
    plan = make_plan(script, num_ps=1, num_workers=1, chief=True, evaluator=True)
    assert plan.task_names() == ["chief:0", "ps:0", "worker:0", "evaluator:0"]


def test_allreduce_runs_no_ps_tasks(script: str) -> None:
    plan = make_plan(script, num_workers=2, config=TrainConfig(strategy="allreduce"))
    assert plan.task_names() == ["worker:0", "worker:1"]


def test_a_chief_may_train_alone_but_without_a_chief_one_worker_is_needed(script: str) -> None:
    assert make_plan(script, num_workers=0, chief=True).task_names() == ["chief:0", "ps:0"]
    assert make_plan(script, num_workers=1).task_names() == ["ps:0", "worker:0"]
    with pytest.raises(ConfigError, match=re.escape("--workers must be at least 1; received 0.")):
        make_plan(script, num_workers=0)
    with pytest.raises(ConfigError, match=re.escape("--workers must be at least 1; received -1.")):
        make_plan(script, num_workers=-1, chief=True)


def test_each_task_runs_the_script_unbuffered_with_its_arguments(script: str) -> None:
    plan = make_plan(script, ["--epochs", "2"], python="/opt/py")
    assert {t.argv for t in plan.tasks} == {("/opt/py", "-u", script, "--epochs", "2")}
    assert make_plan(script).tasks[0].argv[0] == sys.executable


def test_each_task_is_told_its_name_logdir_config_and_error_file(script: str, tmp_path: Path) -> None:
    logdir = str(tmp_path / "run")
    cfg = TrainConfig(mode="ssp", staleness=2)
    plan = make_plan(script, num_workers=1, logdir=logdir, config=cfg, extra_env={"MY_VAR": "1"})
    assert (plan.logdir, plan.config) == (logdir, cfg)
    env = dict(plan.tasks[1].env)
    assert env["PSFLOW_TASK"] == "worker:0"
    assert env["PSFLOW_LOGDIR"] == logdir
    assert TrainConfig.from_json(env["PSFLOW_TRAIN_CONFIG"]) == cfg
    assert env["PSFLOW_ERROR_FILE"] == str(Path(logdir) / "errors" / "worker-0.json")
    assert env["MY_VAR"] == "1"
    assert "PSFLOW_FAIL_AT" not in env  # no fault asked for: the variable is absent, not empty


def test_a_run_without_a_logdir_gets_its_own_under_runs_named_by_time_and_a_random_suffix(script: str) -> None:
    a, b = make_plan(script), make_plan(script)
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", a.run_id), a.run_id
    assert a.run_id != b.run_id
    assert a.logdir == str(Path("runs") / a.run_id)
    assert dict(a.tasks[0].env)["PSFLOW_LOGDIR"] == a.logdir


def test_plan_json_holds_the_plan_fields_and_the_config_as_a_dict(script: str) -> None:
    cfg = TrainConfig(mode="sync")
    plan = make_plan(script, config=cfg, logdir="x")
    d = json.loads(plan.to_json())
    assert set(d) == {f.name for f in fields(LaunchPlan)}
    assert TrainConfig.from_dict(d["config"]) == cfg
    assert (d["run_id"], d["logdir"]) == (plan.run_id, "x")
    assert [t["task"] for t in d["tasks"]] == plan.task_names()


def test_threads_are_the_cores_shared_out_evenly_at_least_one_and_may_be_set(script: str) -> None:
    assert threads_per_task(1, 8) == 8 and threads_per_task(3, 8) == 2 and threads_per_task(9, 8) == 1
    plan = make_plan(script, num_workers=2, cores=8)  # 3 tasks
    assert (plan.threads, plan.cores) == (2, 8)
    assert {dict(t.env)["PSFLOW_NUM_THREADS"] for t in plan.tasks} == {"2"}
    assert make_plan(script, threads=1, cores=8).threads == 1
    with pytest.raises(ConfigError, match=re.escape(
            "--threads must be a positive number of threads per task; received 0.")):
        make_plan(script, threads=0)
    assert make_plan(script).cores == host_cores() >= 1


# -- a worker added to a running plan (psflow scale) ------------------------------------------


def _env(task_plan) -> dict[str, str]:  # noqa: ANN001
    return dict(task_plan.env)


def test_an_added_worker_copies_a_workers_command_and_environment_with_its_own_id_and_shards(script: str, tmp_path: Path) -> None:
    from psflow.launch.plan import added_worker

    plan = make_plan(script, ["--epochs", "3"], num_ps=1, num_workers=2, logdir=str(tmp_path / "run"))
    new = added_worker(plan, "worker:2")
    template = next(t for t in plan.tasks if t.task == "worker:1")
    assert new.task == "worker:2" and new.argv == template.argv
    env, base = _env(new), _env(template)
    assert env["PSFLOW_TASK"] == "worker:2"
    assert env["PSFLOW_ERROR_FILE"] == str(tmp_path / "run" / "errors" / "worker-2.json")
    assert env["PSFLOW_DATA_SHARDS"] == "2"  # the training tasks the launch started with
    assert {k: v for k, v in env.items() if k not in {"PSFLOW_TASK", "PSFLOW_ERROR_FILE", "PSFLOW_DATA_SHARDS"}} == \
        {k: v for k, v in base.items() if k not in {"PSFLOW_TASK", "PSFLOW_ERROR_FILE", "PSFLOW_DATA_SHARDS"}}


def test_an_added_worker_counts_the_chief_among_the_data_shards_and_copies_it_without_workers(script: str, tmp_path: Path) -> None:
    from dataclasses import replace

    from psflow.launch.plan import added_worker

    plan = make_plan(script, num_ps=1, num_workers=2, chief=True, logdir=str(tmp_path / "run"))
    assert _env(added_worker(plan, "worker:2"))["PSFLOW_DATA_SHARDS"] == "3"
    chief_only = replace(plan, tasks=tuple(t for t in plan.tasks if t.task in ("ps:0", "chief:0")))
    new = added_worker(chief_only, "worker:0")
    assert new.argv == next(t for t in plan.tasks if t.task == "chief:0").argv
    assert _env(new)["PSFLOW_TASK"] == "worker:0" and _env(new)["PSFLOW_DATA_SHARDS"] == "1"
    with pytest.raises(ConfigError, match=r"has no worker or chief task to copy for worker:0"):
        added_worker(replace(plan, tasks=tuple(t for t in plan.tasks if t.task == "ps:0")), "worker:0")


# -- what make_plan refuses, and what it lets through ------------------------------------------


def test_the_ps_count_is_checked_for_parameter_server_training_only(script: str) -> None:
    with pytest.raises(ConfigError, match=re.escape("--ps must be at least 1 for parameter-server training; received 0.")):
        make_plan(script, num_ps=0)
    plan = make_plan(script, num_ps=0, num_workers=2, config=TrainConfig(strategy="allreduce"))
    assert plan.task_names() == ["worker:0", "worker:1"]


def test_a_logdir_that_is_a_file_is_refused_before_any_task_is_planned(script: str, tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match=re.escape(f"--logdir {str(afile)!r} is a file, not a directory.")):
        make_plan(script, logdir=str(afile))


def test_a_fault_on_a_task_the_plan_lacks_is_refused_naming_the_tasks(script: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "--fail-at names worker:2, which this run does not have. Its tasks: ps:0, worker:0, worker:1.")):
        make_plan(script, num_workers=2, logdir=str(tmp_path / "run"), fail_at="worker:2@step=1")
    with pytest.raises(ConfigError, match=re.escape("--fail-at names chief:0, which this run does not have.")):
        make_plan(script, num_workers=2, logdir=str(tmp_path / "run"), fail_at="chief:0@step=1")
    plan = make_plan(script, num_workers=2, chief=True, logdir=str(tmp_path / "run"), fail_at="chief:0@step=1")
    assert dict(plan.tasks[0].env)["PSFLOW_FAIL_AT"] == "chief:0@step=1"


def test_a_hang_fault_needs_the_watchdog_and_the_message_lists_every_hang(script: str, tmp_path: Path) -> None:
    from psflow.launch.watchdog import HangPolicy

    fail_at = "worker:0@step=3:hang,worker:1@step=5:hang,worker:1@step=2:kill"
    with pytest.raises(ConfigError, match=re.escape(
            "--hang-at worker:0@step=3,worker:1@step=5: nothing would catch the hang (the watchdog is off), so the "
            "run would wait for ever. Add --hang-timeout S (e.g. --hang-timeout 10).")):
        make_plan(script, logdir=str(tmp_path / "run"), fail_at=fail_at)
    watchdog = HangPolicy(hang_timeout_s=10, heartbeat_timeout_s=5)
    plan = make_plan(script, logdir=str(tmp_path / "run"), fail_at=fail_at, hangs=watchdog)
    assert plan.hangs == watchdog
    assert make_plan(script, logdir=str(tmp_path / "run")).hangs == HangPolicy()  # default: no watchdog


def test_a_plan_refuses_a_deadline_shorter_than_two_of_the_reports_it_watches(script: str, tmp_path: Path) -> None:
    from psflow.launch.watchdog import HangPolicy

    slow_reports = TrainConfig(progress_every_s=5.0, heartbeat_every_s=2.0)
    with pytest.raises(ConfigError, match=re.escape("--hang-timeout 6 is shorter than two progress reports (progress_every_s=5)")):
        make_plan(script, logdir=str(tmp_path / "run"), config=slow_reports, hangs=HangPolicy(hang_timeout_s=6))
    with pytest.raises(ConfigError, match=re.escape("The heartbeat deadline 3 s is shorter than two heartbeats (heartbeat_every_s=2)")):
        make_plan(script, logdir=str(tmp_path / "run"), config=slow_reports, hangs=HangPolicy(hang_timeout_s=10, heartbeat_timeout_s=3))
    plan = make_plan(script, logdir=str(tmp_path / "run"), config=slow_reports, hangs=HangPolicy(hang_timeout_s=10, heartbeat_timeout_s=4))
    assert plan.hangs.heartbeat_deadline_s == 4


@pytest.mark.parametrize("threads", [0, -2, 1.5, "2"])
def test_threads_that_are_not_a_positive_integer_are_refused_naming_the_value(script: str, threads: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(
            f"--threads must be a positive number of threads per task; received {threads!r}.")):
        make_plan(script, threads=threads)  # type: ignore[arg-type]


def test_an_added_worker_copies_a_training_task_never_a_ps_or_the_evaluator(script: str, tmp_path: Path) -> None:
    from dataclasses import replace

    from psflow.launch.plan import TaskPlan, added_worker

    plan = make_plan(script, num_ps=1, num_workers=1, chief=True, evaluator=True, logdir=str(tmp_path / "run"))
    # Each job with a command and a variable of its own, so the copy shows whose it is.
    tasks = tuple(TaskPlan(t.task, (*t.argv, f"--as-{t.job}"), (*t.env, ("ONLY_" + t.job.upper(), "1"))) for t in plan.tasks)
    plan = replace(plan, tasks=tasks)
    new = added_worker(plan, "worker:1")
    assert new.argv[-1] == "--as-worker" and "ONLY_WORKER" in _env(new)
    assert not {"ONLY_PS", "ONLY_CHIEF", "ONLY_EVALUATOR"} & set(_env(new))
    no_workers = replace(plan, tasks=tuple(t for t in tasks if t.job != "worker"))
    new = added_worker(no_workers, "worker:0")
    assert new.argv[-1] == "--as-chief" and "ONLY_CHIEF" in _env(new)
    assert _env(new)["PSFLOW_DATA_SHARDS"] == "1"  # the chief alone trains
