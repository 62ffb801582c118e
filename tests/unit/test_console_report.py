"""The launcher's console is one more subscriber of the run controller (launch/consolereport.py): it
says restarts, budgets spent and retirements as the controller decides them, and the run's end (the
root cause, the final line, where the logs are) from the outcome every subscriber gets; the runner
itself prints none of it."""

from __future__ import annotations

from dataclasses import replace

import click
from k8s_fake import FakeCluster

from psflow.launch.console import Console
from psflow.launch.consolereport import ConsoleReport
from psflow.launch.controller import (
    RestartPolicy,
    RestartTask,
    RunController,
    StartTask,
    TaskExited,
    TaskReported,
    TaskStarted,
    TimeAdvanced,
)
from psflow.launch.k8s import POD_FAILURE_BACKOFF, K8sSettings
from psflow.launch.k8swatch import K8sBackend
from psflow.launch.plan import make_plan
from psflow.launch.restart import Backoff
from psflow.launch.runner import Runner
from psflow.launch.runstore import file_store
from psflow.launch.subscribers import RunOutcome, RunSubscriber, Subscribers

TASKS = ["ps:0", "worker:0", "worker:1"]


def _plan(tmp_path, monkeypatch, restart: RestartPolicy | None = None):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("import psflow\n")
    plan = make_plan("train.py", num_ps=1, num_workers=2, logdir="runs/k", restart=restart)
    return replace(plan, run_id="20260101-120000-abc123")


def _report(tmp_path, monkeypatch, policy: RestartPolicy, backoff: Backoff | None = None) -> tuple[RunController, list[str]]:
    lines: list[str] = []
    plan = _plan(tmp_path, monkeypatch)
    report = ConsoleReport(Console(echo=lambda line: lines.append(click.unstyle(line))), plan,
                           snapshot=lambda: {"tasks": {}}, max_restarts=policy.max_restarts)
    c = RunController(TASKS, grace_s=5, ps_exit_timeout_s=60, policy=policy, subscriber=Subscribers([report], warn=print),
                      backoff=backoff)
    c.start(at=0.0)
    for i, t in enumerate(TASKS):
        c.handle(TaskStarted(t, 0, at=0.5, handle=100 + i))
    return c, lines


def test_a_restart_and_a_spent_budget_are_said_as_the_controller_decides_them(tmp_path, monkeypatch) -> None:
    c, lines = _report(tmp_path, monkeypatch, RestartPolicy("on-failure", max_restarts=1, backoff_base_s=1.0))
    c.handle(TaskExited("worker:1", 0, -9, at=3.0))
    assert lines == ["psflow: worker:1 (attempt 0) was killed (SIGKILL) after 2.5 s; restarting it as attempt 1 in "
                     "1.0 s (restart 1 of 1 for this task)."]
    c.handle(TaskStarted("worker:1", 1, at=4.0, handle=201))
    c.handle(TaskReported("worker:1", 1, {"task": "worker:1", "exception": "ValueError", "message": "loss is nan",
                                          "traceback": "Traceback ...\nValueError: loss is nan\n"}, at=6.0))
    c.handle(TaskExited("worker:1", 1, 1, at=6.0))
    assert lines[1] == ("psflow: worker:1 (attempt 1) ended with exit code 1 after 2.0 s; not restarted: its restart "
                        "budget is spent (1 of 1 per task).")
    c.handle(TaskExited("worker:0", 0, -15, at=6.5))
    c.handle(TaskExited("ps:0", 0, -15, at=6.6))
    assert c.result is not None and c.result.root_cause == "worker:1"
    summary = {"status": "failed", "global_step": 40, "metrics": {"test_accuracy": 0.5}, "examples_per_sec": 10.0,
               "wall_s": 6.6}
    c.subscriber.on_run_end(RunOutcome("failed", 1, "worker:1", None, summary))
    assert lines[2:] == [
        "psflow: worker:1: 2 attempts; attempt 0: killed (SIGKILL) after 2.5 s; attempt 1: exit code 1 after 2.0 s",
        "psflow: the run failed. Root cause: worker:1 exited with code 1, on attempt 1 (after 1 restart)",
        "  ValueError: loss is nan",
        "  Traceback ...\n  ValueError: loss is nan",
        "  then worker:0: exit code -15 (SIGTERM) (stopped after the root cause)",
        "  then ps:0: exit code -15 (SIGTERM) (stopped after the root cause)",
        "psflow: failed: global_step=40 test_accuracy=0.5 examples/sec=10.0 wall=6.6s",
        "psflow: summary: runs/k/summary.json   logs: runs/k/logs/",
    ]


def test_on_kubernetes_a_restart_is_said_and_timed_as_its_job_controllers_with_the_policys_budget(tmp_path, monkeypatch) -> None:
    """The Job controller replaces a failed pod 10 s after it failed, doubling per failure of its index and
    never reset by a long run: the controller's restart waits that long and the console says who restarts it,
    not the launcher's "restarting it ... in 1.0 s" (the policy's backoff, which Kubernetes does not apply)."""
    policy = RestartPolicy("on-failure", max_restarts=3, backoff_base_s=1.0, backoff_max_s=60.0)
    backoff = K8sBackend(K8sSettings(image="train:1", volume_claim="psflow-logs")).restart_backoff(policy)
    assert backoff == POD_FAILURE_BACKOFF
    c, lines = _report(tmp_path, monkeypatch, policy, backoff)
    decided = c.handle(TaskExited("worker:1", 0, 1, at=3.0))
    assert [(d.attempt, d.after_s) for d in decided if isinstance(d, RestartTask)] == [(1, 10.0)]
    assert lines == ["psflow: worker:1 (attempt 0) ended with exit code 1 after 2.5 s; Kubernetes' Job controller "
                     "replaces it as attempt 1 in ~10 s (its own back-off; restart 1 of 3 for this task)."]
    assert c.handle(TimeAdvanced(at=12.9)) == []  # not bound to its pod before Kubernetes makes it
    assert c.handle(TimeAdvanced(at=13.0)) == [StartTask("worker:1", 1)]
    c.handle(TaskStarted("worker:1", 1, at=13.0, handle="psflow-x-worker-1-abcde"))
    decided = c.handle(TaskExited("worker:1", 1, 1, at=13.0 + 120.0))  # ran past the launcher's 60 s: no reset here
    assert [d.after_s for d in decided if isinstance(d, RestartTask)] == [20.0]
    assert lines[-1].endswith("Kubernetes' Job controller replaces it as attempt 2 in ~20 s (its own back-off; restart 2 "
                              "of 3 for this task).")
    assert policy.describe(("ps", "worker"), backoff) == ("ps/worker: on-failure; up to 3 restarts per task, Kubernetes' "
                                                          "Job controller's backoff: 10 s doubling to 600 s")


def test_kubernetes_backoff_doubles_per_failure_of_the_index_up_to_ten_minutes() -> None:
    assert [POD_FAILURE_BACKOFF.wait_s(n) for n in range(1, 9)] == [10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0, 600.0]
    assert not POD_FAILURE_BACKOFF.resets
    assert RestartPolicy("on-failure").backoff == Backoff(1.0, 60.0)  # the launcher's own, said as before
    assert RestartPolicy("on-failure").describe(("worker",)).endswith("backoff 1 s doubling to 60 s")


class Outcomes(RunSubscriber):
    def __init__(self) -> None:
        self.outcomes: list[RunOutcome] = []

    def on_run_end(self, outcome: RunOutcome) -> None:
        self.outcomes.append(outcome)


def test_the_runner_says_a_runs_end_only_through_its_subscribers(tmp_path, monkeypatch) -> None:
    """A run whose worker:0 fails: with the default subscribers the console says the root cause and the
    final line; with a subscriber list that leaves the console's report out, nothing of it is printed."""
    def run(subscribers=None) -> list[str]:
        lines: list[str] = []
        b = K8sBackend(K8sSettings(image="train:1", volume_claim="psflow-logs"), core=cluster.core, batch=cluster.batch,
                       policy=cluster.policy, poll_s=0.001, echo=lambda line: lines.append(click.unstyle(line)))
        result = Runner(b, store=file_store, subscribers=subscribers).run(_plan(tmp_path, monkeypatch))
        assert result.exit_code == 1 and result.root_cause == "worker:0"
        return lines

    cluster = FakeCluster(exits={("worker:0", 0): 3})
    said = run()
    assert "psflow: the run failed. Root cause: worker:0 exited with code 3" in said
    assert any(line.startswith("psflow: failed: global_step=") for line in said)
    assert "psflow: summary: runs/k/summary.json   logs: runs/k/logs/" in said

    cluster = FakeCluster(exits={("worker:0", 0): 3})
    fake = Outcomes()
    quiet = run(lambda plan, store, policy: [*store.members(), fake])
    assert [o.root_cause for o in fake.outcomes] == ["worker:0"]
    assert not [line for line in quiet if "Root cause" in line or line.startswith(("psflow: failed", "psflow: summary"))]
