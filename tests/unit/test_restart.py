"""Restart policies (psflow.launch.restart): per job, parsed from `psflow run --restart`, with budgets and
backoff; and what the controller records of every exit (cause, attempt, how long it ran, why it was not
restarted), stepped by hand."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from test_controller import GRACE_S, exit_, running

from psflow.errors import ConfigError
from psflow.launch.controller import (
    RestartTask,
    RunFinished,
    StartTask,
    StopTasks,
    TaskExited,
    TaskStarted,
    TimeAdvanced,
    exit_cause,
)
from psflow.launch.restart import RestartPolicy

# -- the --restart syntax ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec,kinds", [
    (None, {"chief": "never", "ps": "never", "worker": "never", "evaluator": "never"}),
    ("on-failure", {"chief": "on-failure", "ps": "on-failure", "worker": "on-failure", "evaluator": "on-failure"}),
    ("worker=on-failure,ps=never", {"chief": "never", "ps": "never", "worker": "on-failure", "evaluator": "never"}),
    (" on-failure , ps=never ", {"chief": "on-failure", "ps": "never", "worker": "on-failure", "evaluator": "on-failure"}),
    ("worker=exit-code,evaluator=always", {"chief": "never", "ps": "never", "worker": "exit-code", "evaluator": "always"}),
])
def test_a_restart_spec_gives_each_job_its_policy(spec: str | None, kinds: dict) -> None:
    policy = RestartPolicy.parse(spec)
    assert {job: policy.kind_for(job) for job in kinds} == kinds


@pytest.mark.parametrize("spec,message", [
    ("sometimes", "'sometimes' is not a restart policy; the policies are never, on-failure, always, exit-code"),
    ("worker=sometimes", "'sometimes' is not a restart policy"),
    ("workers=on-failure", "'workers' (in 'workers=on-failure') is not a job"),
    ("on-failure,always", "two policies for every job ('on-failure', 'always')"),
    ("ps=never,ps=always", "ps is given twice"),
])
def test_a_bad_restart_spec_names_the_value_what_is_allowed_and_the_syntax(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match="--restart ") as info:
        RestartPolicy.parse(spec)
    assert message in str(info.value) and "worker=on-failure,ps=never" in str(info.value)


def test_a_policy_by_job_is_plain_data_equal_however_it_was_written() -> None:
    a = RestartPolicy("on-failure", by_job={"ps": "never", "evaluator": "always"})
    b = RestartPolicy("on-failure", by_job=(("evaluator", "always"), ("ps", "never")))
    assert a == b and a.by_job == (("evaluator", "always"), ("ps", "never")) and hash(a) == hash(b)
    with pytest.raises(ConfigError, match="Restart policy for job 'driver': no such job"):
        RestartPolicy(by_job={"driver": "never"})
    with pytest.raises(ConfigError, match="Restart policy 'again' for ps is not one of"):
        RestartPolicy(by_job={"ps": "again"})


def test_the_last_attempt_a_job_reaches_follows_its_policy_and_the_budgets() -> None:
    policy = RestartPolicy.parse("worker=on-failure", max_restarts=2)
    assert (policy.last_attempt("worker"), policy.last_attempt("ps")) == (2, 0)
    assert RestartPolicy.parse("on-failure", max_restarts_per_run=0).last_attempt("worker") == 0


def test_describe_names_each_jobs_policy_and_the_budgets() -> None:
    assert RestartPolicy().describe() == "never"
    assert RestartPolicy.parse("worker=on-failure", max_restarts=2, backoff_base_s=0.5, backoff_max_s=8).describe(
        ("ps", "worker")) == "ps: never, worker: on-failure; up to 2 restarts per task, backoff 0.5 s doubling to 8 s"


# -- per job in a run ---------------------------------------------------------------------------------


def test_a_worker_is_restarted_while_a_ps_of_the_same_run_is_not() -> None:
    c = running(RestartPolicy.parse("worker=on-failure,ps=never", backoff_base_s=0.5))
    assert exit_(c, "worker:1", -9, at=3.0) == [RestartTask("worker:1", 1, 0.5, "exit code -9 (SIGKILL)")]
    assert c.handle(TimeAdvanced(3.5)) == [StartTask("worker:1", 1)]
    c.handle(TaskStarted("worker:1", 1, at=3.6, handle=300))
    out = exit_(c, "ps:0", -9, at=4.0)
    assert out == [StopTasks(("worker:0", "worker:1"), GRACE_S, "ps:0 failed (exit code -9 (SIGKILL)); stopping the others")]
    assert c.records["ps:0"].exits[-1].not_restarted is None  # never restarted: no budget to speak of


# -- what every exit records -----------------------------------------------------------------------------


@pytest.mark.parametrize("code,oom,cause", [
    (0, False, "exit code 0"), (1, False, "exit code 1"), (137, False, "exit code 137"),
    (-9, False, "killed (SIGKILL)"), (-9, True, "killed (SIGKILL; out of memory?)"), (-15, False, "killed (SIGTERM)"),
])
def test_an_exits_cause_says_signal_by_name_and_out_of_memory_only_on_evidence(code: int, oom: bool, cause: str) -> None:
    assert exit_cause(code, oom) == cause


def test_each_attempt_records_its_cause_how_long_it_ran_and_whether_it_was_restarted() -> None:
    c = running(RestartPolicy("on-failure", max_restarts=1, backoff_base_s=1.0))
    assert c.handle(TaskExited("worker:1", 0, -9, at=12.1, oom_killed=True))[0] == RestartTask(
        "worker:1", 1, 1.0, "exit code -9 (SIGKILL)")
    assert c.handle(TimeAdvanced(13.1)) == [StartTask("worker:1", 1)]
    c.handle(TaskStarted("worker:1", 1, at=13.2, handle=301))
    out = exit_(c, "worker:1", -9, at=20.2)
    assert [type(d) for d in out] == [StopTasks]
    first, second = c.records["worker:1"].exits
    assert (first.attempt, first.cause, first.ran_s, first.restarted, first.not_restarted) == (
        0, "killed (SIGKILL; out of memory?)", pytest.approx(12.0), True, None)
    assert (second.attempt, second.cause, second.ran_s, second.restarted) == (1, "killed (SIGKILL)", pytest.approx(7.0), False)
    assert second.not_restarted == "its restart budget is spent (1 of 1 per task)"
    exit_(c, "ps:0", -15, at=20.3)
    assert exit_(c, "worker:0", -15, at=20.4) == [RunFinished("failed", "worker:1", 1)]


def test_a_restart_the_runs_budget_does_not_allow_says_so() -> None:
    c = running(RestartPolicy("on-failure", max_restarts=5, max_restarts_per_run=1, backoff_base_s=0.0))
    exit_(c, "worker:0", 1, at=1.0)
    c.handle(TaskStarted("worker:0", 1, at=1.0, handle=200))
    exit_(c, "worker:1", 1, at=2.0)
    assert c.records["worker:1"].exits[-1].not_restarted == "the run's restart budget is spent (1 of 1 per run)"


@pytest.mark.parametrize("fields, said", [
    (["on-failure"], "A restart policy must be a mapping of RestartPolicy's fields (kind, max_restarts, "),
    ({"kind": "always", "backoff_max_s": float("inf")}, "A restart policy: RestartPolicy: backoff_max_s must be "
                                                        "a finite number; received inf"),
])
def test_a_policy_read_back_from_a_dict_is_checked_as_the_constructor_checks_it(fields: object, said: str) -> None:
    with pytest.raises(ConfigError) as e:
        RestartPolicy.from_dict(fields, fix="Do this.")
    assert said in str(e.value) and str(e.value).endswith(" Do this."), str(e.value)
    policy = RestartPolicy.parse("on-failure,ps=never", max_restarts=2)
    assert RestartPolicy.from_dict(json.loads(json.dumps(asdict(policy)))) == policy  # as a job store reads it back
