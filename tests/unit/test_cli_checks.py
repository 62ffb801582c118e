"""`psflow run` checks what it is given before any task starts: usage errors (exit 2) that name the
option, the value and the fix; no task is started (the backend is replaced by one that fails)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import psflow.launch
from psflow.cli import main
from psflow.launch.console import Console
from psflow.launch.runner import Runner


@pytest.fixture
def script(tmp_path: Path) -> str:
    p = tmp_path / "train.py"
    p.write_text("print('hi')\n")
    return str(p)


@pytest.fixture(autouse=True)
def no_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoBackend:
        def __init__(self, **kwargs: object) -> None:
            raise AssertionError("a task was about to start")

    monkeypatch.setattr(psflow.launch, "LocalBackend", NoBackend)


def run(*args: str):
    return CliRunner().invoke(main, ["run", *args])


@pytest.mark.parametrize("spec,expected", [
    ("worker1@30", "Bad fault spec 'worker1@30'"),
    ("worker:9@step=3", "names worker:9, which this run does not have"),
    ("ps:0@step=30", "a ps task takes no steps"),
    ("worker:0@save=1:crash_after=10", "only a ps task writes checkpoint shards"),
    ("ps:3@save=1:crash_after=10", "names ps:3"),
])
def test_fail_at_is_checked_before_any_task_starts(script, spec, expected):
    r = run("--workers", "2", "--fail-at", spec, script)
    assert r.exit_code == 2, r.output
    assert "Usage:" in r.output and expected in r.output, r.output
    assert "Traceback" not in r.output


def test_fail_at_that_can_fire_passes_the_check(script, tmp_path):
    r = run("--workers", "2", "--logdir", str(tmp_path / "run"), "--fail-at",
            "worker:1@step=3:kill,ps:0@save=1:crash_after=5,ps:0@step=7:kill", script)
    assert "a task was about to start" in repr(r.exception)  # got as far as starting the run


@pytest.mark.parametrize("args,expected", [
    (["--workers", "2", "--mode", "sync", "--replicas-to-aggregate", "3"], "replicas_to_aggregate=3 exceeds total_num_replicas=2"),
    (["--workers", "2", "--mode", "sync", "--total-num-replicas", "3"], "total_num_replicas=3 exceeds the 2 workers"),
    (["--strategy", "allreduce", "--mode", "ssp"], "--mode ssp with --strategy allreduce"),
    (["--staleness", "3"], "--staleness 3 applies to --mode ssp only; this run is --mode async"),
    (["--mode", "sync", "--staleness", "3"], "--staleness 3 applies to --mode ssp only"),
    (["--replicas-to-aggregate", "1"], "--replicas-to-aggregate applies to --mode sync only"),
    (["--mode", "ssp", "--total-num-replicas", "2"], "--total-num-replicas applies to --mode sync only"),
    (["--strategy", "allreduce", "--ps", "2"], "--ps 2 with --strategy allreduce"),
    (["--strategy", "allreduce", "--replicas-to-aggregate", "1"], "all-reduce averages every replica"),
])
def test_settings_that_do_not_fit_are_usage_errors(script, args, expected):
    r = run(*args, script)
    assert r.exit_code == 2, r.output
    assert "Usage:" in r.output and expected in r.output, r.output


@pytest.mark.parametrize("args", [
    ["--mode", "ssp", "--staleness", "2"],
    ["--mode", "sync", "--replicas-to-aggregate", "1", "--total-num-replicas", "2"],
    ["--strategy", "allreduce"],
    ["--strategy", "allreduce", "--ps", "0"],
    ["--chief", "--workers", "2", "--mode", "sync", "--total-num-replicas", "3"],
])
def test_settings_that_fit_start_the_run(script, tmp_path, args):
    r = run(*args, "--logdir", str(tmp_path / "run"), script)
    assert "a task was about to start" in repr(r.exception), r.output


@pytest.mark.parametrize("after", [["--ps", "2"], ["--epochs", "3", "--workers=3"], ["--chief"]])
def test_run_options_after_the_script_are_refused_with_both_fixes(script, after):
    r = run(script, *after)
    assert r.exit_code == 2, r.output
    assert "is written after the script" in r.output and "Put it before the script" in r.output and " -- " in r.output, r.output


def test_refusal_quotes_the_option_with_its_value(script):
    r = run(script, "--ps", "2")
    assert f"psflow run --ps 2 ... {script}" in r.output and f"{script} -- --ps 2" in r.output, r.output


def test_misspelled_option_suggests_the_right_one(script):
    r = run("--worker", "2", script)
    assert r.exit_code == 2, r.output
    assert "No such option '--worker'. Did you mean '--workers'?" in r.output, r.output
    assert "does not exist" not in r.output


def test_script_arguments_after_the_script_and_after_the_separator_reach_the_script(script, tmp_path, monkeypatch):
    seen = {}
    real = psflow.launch.make_plan

    def spy(script_path, args, **kw):
        seen["args"] = list(args)
        return real(script_path, args, **kw)

    monkeypatch.setattr(psflow.launch, "make_plan", spy)
    r = run("--ps", "1", "--logdir", str(tmp_path / "r"), script, "--epochs", "3", "--", "--ps", "2", "--", "x")
    assert "a task was about to start" in repr(r.exception), r.output
    assert seen["args"] == ["--epochs", "3", "--ps", "2", "--", "x"]  # only the first -- is psflow's


@pytest.mark.parametrize("args,expected", [
    (["--restart", "sometimes"], "--restart 'sometimes': 'sometimes' is not a restart policy; the policies are "
                                 "never, on-failure, always, exit-code"),
    (["--restart", "worker=on-failure,pss=never"], "'pss' (in 'pss=never') is not a job"),
    (["--restart", "worker=retry"], "'retry' is not a restart policy"),
    (["--restart", "on-failure,never"], "two policies for every job ('on-failure', 'never')"),
    (["--restart", "worker=never,worker=always"], "worker is given twice"),
    (["--max-restarts", "3"], "--max-restarts 3 has no effect: no task is restarted (--restart never)"),
    (["--restart", "never", "--restart-backoff", "2"], "--restart-backoff 2 has no effect"),
    (["--restart", "on-failure", "--restart-backoff", "9", "--restart-backoff-max", "2"],
     "backoff_base_s=9.0, backoff_max_s=2.0"),
    (["--restart", "worker=on-failure", "--max-restarts", "-1"], "-1 is not in the range x>=0"),
    (["--restart", "worker=on-failure", "--fail-at", "worker:1@step=3:kill@attempt=4"],
     "worker:1 reaches attempt 3 at most (--max-restarts 3), so this fault would never fire"),
    (["--restart", "worker=on-failure", "--fail-at", "ps:0@save=1:crash_after=3@attempt=1"],
     "ps:0 reaches attempt 0 at most (it is never restarted)"),
])
def test_restart_options_are_checked_before_any_task_starts(script, args, expected):
    r = run("--workers", "2", *args, script)
    assert r.exit_code == 2, r.output
    assert "Usage:" in r.output and expected in " ".join(r.output.split()), r.output
    assert "Traceback" not in r.output


def test_the_restart_policy_reaches_the_plan(script, tmp_path, monkeypatch):
    seen = {}

    class Recorder:
        def __init__(self, **kwargs: object) -> None:
            self.console = Console()

        def restart_backoff(self, policy):  # the launcher's own, as every backend's but Kubernetes'
            return policy.backoff

    def record(self, plan):
        seen["plan"], seen["store"] = plan, self.make_store
        raise SystemExit(0)

    monkeypatch.setattr(Runner, "run", record)
    monkeypatch.setattr(psflow.launch, "LocalBackend", Recorder)
    r = run("--workers", "2", "--logdir", str(tmp_path / "run"), "--restart", "on-failure,ps=never", "--max-restarts", "2",
            "--max-restarts-per-run", "3", "--restart-backoff", "0.5", "--restart-backoff-max", "4",
            "--fail-at", "worker:1@step=3:kill@attempt=2", script)
    assert r.exit_code == 0, r.output
    policy = seen["plan"].restart
    assert (policy.kind_for("worker"), policy.kind_for("ps"), policy.kind_for("chief")) == ("on-failure", "never", "on-failure")
    assert (policy.max_restarts, policy.max_restarts_per_run, policy.backoff_base_s, policy.backoff_max_s) == (2, 3, 0.5, 4.0)
    assert "restart=ps: never, worker: on-failure; up to 2 restarts per task, 3 per run, backoff 0.5 s doubling to 4 s;" \
        in r.output, r.output
    assert json.loads(seen["plan"].to_json())["restart"]["by_job"] == [["ps", "never"]]  # the plan prints its policy
    assert callable(seen["store"])  # the CLI hands in the store that records the run (launch/ imports no platform)
