"""Restarts through `psflow run --restart`: a worker SIGKILLed at a fixed step (--fail-at) is restarted,
registers again, and the job finishes; every exit is recorded with its cause and attempt in the
launcher's output, status.json, events.jsonl and summary.json; a spent budget fails the run.

What is proven here (docs/failures.md): worker restarts in async mode (every push of the
epoch applied exactly once; worker:0, the chief, too), ssp mode, and sync mode with and without backup workers (the ps's side of
a rejoining worker: tests/component/test_rejoin.py); a restarted chief (worker:0, or a separate chief:0)
under a Supervisor takes over without a second initialization: its checkpoints go on after the ps's
step, the final one is at max_steps and exports (its in-process proof: tests/component/test_chief_restart.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import ROOT, SOFTMAX, log_tails, pid_alive, read_summary, run_psflow

from psflow import checkpoint

pytestmark = pytest.mark.timeout(300)

RESTART = ["--restart", "on-failure", "--max-restarts", "3", "--restart-backoff", "0.5"]
STEPS_PER_EPOCH = 600  # MNIST's 60,000 training examples in batches of 100, over every worker's shard


def launch(logdir: Path, *args: str, epochs: int = 1, workers: int = 2) -> tuple[str, dict]:
    r = run_psflow(["run", "--ps", "1", "--workers", str(workers), "--logdir", str(logdir), *args, SOFTMAX, "--",
                    "--epochs", str(epochs), "--init", "zeros", "--print_every", "1"])
    context = f"{r.stdout[-4000:]}\n{r.stderr[-2000:]}\n{log_tails(logdir)}"
    assert (logdir / "summary.json").exists(), context
    return r.stdout + "\n" + context, read_summary(logdir)


def tasks(s: dict) -> dict[str, dict]:
    return {t["task"]: t for t in s["tasks"]}


def assert_worker_1_was_killed_once_and_restarted(s: dict, context: str) -> None:
    assert s["status"] == "succeeded", context
    by_task = tasks(s)
    w1 = by_task["worker:1"]
    assert w1["attempts"] == 2 and w1["exit_code"] == 0, w1
    first, second = w1["exits"]
    assert (first["attempt"], first["code"], first["signal"], first["cause"], first["restarted"]) == (
        0, -9, "SIGKILL", "killed (SIGKILL)", True), first
    assert (second["attempt"], second["code"], second["cause"], second["restarted"]) == (1, 0, "exit code 0", False)
    assert first["ran_s"] > 0 and second["ran_s"] > 0
    assert all(t["attempts"] == 1 and t["exit_code"] == 0 for name, t in by_task.items() if name != "worker:1"), by_task
    assert s["restarts"] == 1
    assert not any(pid_alive(t["pid"]) for t in s["tasks"]), s["tasks"]


def test_async_worker_killed_is_restarted_registers_again_and_the_job_finishes(tmp_path: Path) -> None:
    logdir = tmp_path / "async"
    out, s = launch(logdir, *RESTART, "--fail-at", "worker:1@step=30:kill")
    assert_worker_1_was_killed_once_and_restarted(s, out)
    assert s["test_accuracy"] > 0.8, out
    # One line when it is restarted (which, why, attempt, after how long), one at the end.
    assert "psflow: worker:1 (attempt 0) was killed (SIGKILL) after " in out, out
    assert "; restarting it as attempt 1 in 0.5 s (restart 1 of 3 for this task)." in out, out
    assert "psflow: worker:1: 2 attempts; attempt 0: killed (SIGKILL) after " in out, out
    # It registered again at a new address, and the run's history says so.
    events = [json.loads(line) for line in (logdir / "events.jsonl").read_text().splitlines()]
    [rereg] = [e for e in events if e["event"] == "task_reregistered"]
    assert (rereg["task"], rereg["attempt"]) == ("worker:1", 1) and rereg["address"] != rereg["previous_address"]
    [restart] = [e for e in events if e["event"] == "restart"]
    assert (restart["task"], restart["attempt"], restart["reason"]) == ("worker:1", 1, "killed (SIGKILL)")
    # Every push of both workers was applied: the fault fired before step 30's push, and the
    # restarted worker went on from its 30th batch (exactly one epoch of updates in all).
    ps = s["reports"]["ps:0"]["ps_stats"]
    assert s["global_step"] == ps["applied_updates"] == ps["pushes"] == STEPS_PER_EPOCH, ps
    # status.json keeps every exit; psflow status shows the attempts.
    status = json.loads((logdir / "status.json").read_text())
    w1 = status["tasks"]["worker:1"]
    assert (w1["attempt"], [x["cause"] for x in w1["exits"]]) == (1, ["killed (SIGKILL)", "exit code 0"]), w1
    shown = run_psflow(["status", str(logdir)], timeout_s=60)
    row = next((line for line in shown.stdout.splitlines() if "worker:1" in line), "")
    assert re.search(r"worker:1 +│ done +│ +1 │", row), shown.stdout  # its state and attempt
    assert "worker:1 attempt 0: killed (SIGKILL) after " in shown.stdout and "; restarted" in shown.stdout, shown.stdout


def test_async_pipelined_worker_killed_with_steps_in_flight_applies_every_batch_once(tmp_path: Path) -> None:
    """--pipeline: worker:1 is SIGKILLed at its step 30 with one or two steps' pushes still in flight
    (sent, perhaps applied, their replies not read). The restarted attempt resumes from the data
    position of its last applied push: exactly one epoch of updates in all, none twice, none lost."""
    logdir = tmp_path / "pipelined"
    out, s = launch(logdir, *RESTART, "--pipeline", "--fail-at", "worker:1@step=30:kill")
    assert_worker_1_was_killed_once_and_restarted(s, out)
    assert s["test_accuracy"] > 0.8, out
    ps = s["reports"]["ps:0"]["ps_stats"]
    assert s["global_step"] == ps["applied_updates"] == ps["pushes"] == STEPS_PER_EPOCH, ps
    trainers = {t: rep["trainer"] for t, rep in s["reports"].items() if "trainer" in rep}
    assert all(t["pipeline_staleness"] == 1 and t["pipelined_steps"] > 0 for t in trainers.values()), trainers


def test_async_chief_worker_killed_is_restarted_and_continues_from_the_ps_without_initializing_it(tmp_path: Path) -> None:
    # worker:0 is the chief: its restart finds the ps initialized and takes their step and values.
    logdir = tmp_path / "chief"
    out, s = launch(logdir, *RESTART, "--fail-at", "worker:0@step=30:kill")
    assert s["status"] == "succeeded", out
    w0 = tasks(s)["worker:0"]
    assert [(x["attempt"], x["cause"], x["restarted"]) for x in w0["exits"]] == [
        (0, "killed (SIGKILL)", True), (1, "exit code 0", False)], w0
    log = (logdir / "logs" / "worker-0.log").read_text()
    assert re.findall(r"worker:0: initialized at step (\d+)", log) == ["0"], log[-3000:]  # attempt 0 only
    [took_over] = re.findall(r"worker:0: took over as chief \(attempt 1\) at step (\d+)", log)
    assert int(took_over) >= 30, took_over  # attempt 1: the ps's step, not 0
    ps = s["reports"]["ps:0"]["ps_stats"]
    assert s["global_step"] == ps["applied_updates"] == ps["pushes"] == STEPS_PER_EPOCH, ps
    assert ps["init_requests"] == 1, ps


SUPERVISED = str(ROOT / "examples" / "mnist_softmax_supervised.py")
MAX_STEPS, SAVE_STEPS = 300, 100


def launch_supervised(logdir: Path, *args: str) -> tuple[str, dict]:
    r = run_psflow(["run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), *RESTART, *args, SUPERVISED, "--",
                    "--init", "zeros", "--epochs", "5", "--max_steps", str(MAX_STEPS), "--save_steps", str(SAVE_STEPS),
                    "--save_secs", "600", "--log_every", "50"])
    context = f"{r.stdout[-4000:]}\n{r.stderr[-2000:]}\n{log_tails(logdir)}"
    assert (logdir / "summary.json").exists(), context
    return context, read_summary(logdir)


def assert_the_chief_took_over(logdir: Path, s: dict, context: str, chief: str = "worker:0") -> tuple[int, list[int]]:
    """The chief killed once and restarted; attempt 1 took over at the ps's step without a second
    PS_INIT, and the final checkpoint is at max_steps. Returns (that step, attempt 1's checkpoints)."""
    assert s["status"] == "succeeded", context
    by_task = tasks(s)
    assert by_task[chief]["attempts"] == 2 and [(x["attempt"], x["cause"]) for x in by_task[chief]["exits"]] == [
        (0, "killed (SIGKILL)"), (1, "exit code 0")], by_task[chief]
    assert all(t["attempts"] == 1 for name, t in by_task.items() if name != chief), by_task
    log = (logdir / "logs" / f"{chief.replace(':', '-')}.log").read_text()
    assert re.findall(rf"{chief}: initialized at step (\d+)", log) == ["0"], context
    _, _, after = log.partition(f"{chief}: took over as chief (attempt 1) at step ")
    assert after, context
    start = int(after.split(":")[0])
    saved = [int(m) for m in re.findall(r"saved checkpoint \S+ at step (\d+)", after)]
    # Never a step older than the ps's: the final one may be the step it took over at (the others reached the stop).
    assert saved and all(step > start for step in saved[:-1]) and saved[-1] == MAX_STEPS >= start, (start, saved)
    assert all(step % SAVE_STEPS == 0 for step in saved), saved
    assert checkpoint.find_checkpoint(logdir / "checkpoints").step == MAX_STEPS
    assert json.loads((logdir / "DONE").read_text())["global_step"] == MAX_STEPS
    ps = s["reports"]["ps:0"]["ps_stats"]
    assert ps["init_requests"] == 1 and s["global_step"] == MAX_STEPS, ps
    return start, saved


@pytest.mark.parametrize("chief", ["worker:0", "chief:0"])
def test_async_chief_killed_under_a_supervisor_takes_over_its_checkpoints_and_the_final_one(tmp_path: Path, chief: str) -> None:
    # The workers train on while the chief is down (they may even reach max_steps before its restart).
    logdir = tmp_path / "async"
    # A separate chief is a third trainer: the two workers, slowed a little, leave it time to reach its
    # step 40 before they take the job to max_steps (under load it could start late and never get there).
    extra = ["--chief", "--slow", "worker:0=0.01s,worker:1=0.01s"] if chief == "chief:0" else []
    out, s = launch_supervised(logdir, *extra, "--fail-at", f"{chief}@step=40:kill")
    start, _ = assert_the_chief_took_over(logdir, s, out, chief)
    assert start >= 40, out
    exported = run_psflow(["export", str(logdir), str(tmp_path / "model.safetensors")], timeout_s=60)
    assert exported.returncode == 0 and f"step {MAX_STEPS}" in exported.stdout, exported.stdout + exported.stderr


def test_sync_chief_killed_under_a_supervisor_is_waited_for_and_takes_over_at_its_step(tmp_path: Path) -> None:
    # N = M = 2: the job stands at step 40 until attempt 1 pushes for it; then 100, 200, 300 are its.
    logdir = tmp_path / "sync"
    out, s = launch_supervised(logdir, "--mode", "sync", "--fail-at", "worker:0@step=40:kill")
    assert assert_the_chief_took_over(logdir, s, out) == (40, [100, 200, 300]), out


@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipeline"])
def test_ssp_worker_killed_is_restarted_and_the_job_finishes(tmp_path: Path, pipeline: bool) -> None:
    out, s = launch(tmp_path / "ssp", *RESTART, "--mode", "ssp", "--staleness", "4", *(["--pipeline"] if pipeline else []),
                    "--fail-at", "worker:1@step=30:kill", epochs=2)
    assert_worker_1_was_killed_once_and_restarted(s, out)
    assert s["mode"] == "ssp" and s["counters"]["stale_dropped"] == 0 and s["test_accuracy"] > 0.8, out


def test_sync_with_a_backup_worker_finishes_when_a_killed_worker_is_restarted(tmp_path: Path) -> None:
    out, s = launch(tmp_path / "syncbackup", *RESTART, "--mode", "sync", "--replicas-to-aggregate", "2",
                    "--total-num-replicas", "3", "--fail-at", "worker:1@step=30:kill", workers=3)
    assert_worker_1_was_killed_once_and_restarted(s, out)
    assert s["mode"] == "sync" and s["test_accuracy"] > 0.8, out


def test_sync_without_backups_finishes_when_a_killed_worker_is_restarted(tmp_path: Path) -> None:
    # The ps holds the step for the lost worker (h/rejoin) instead of failing worker:0's step.
    out, s = launch(tmp_path / "sync", *RESTART, "--mode", "sync", "--fail-at", "worker:1@step=30:kill")
    assert_worker_1_was_killed_once_and_restarted(s, out)
    assert s["mode"] == "sync" and s["test_accuracy"] > 0.8, out


def test_a_worker_that_raised_is_restarted_after_the_others_finished_and_the_ps_waits_for_it(tmp_path: Path) -> None:
    """The README's restart example as a busy machine runs it (issue 23 item 8): worker:1 raises
    (--fail-at's default action) and its restart comes back only after worker:0 has finished (a long
    backoff makes that certain). The ps used to count the failed worker done and end with worker:0,
    and the restart failed with TransportError after 60 s; now it waits, and every batch is applied."""
    logdir = tmp_path / "raised"
    out, s = launch(logdir, "--restart", "on-failure", "--max-restarts", "3", "--restart-backoff", "8",
                    "--fail-at", "worker:1@step=20")
    assert s["status"] == "succeeded", out
    w1 = tasks(s)["worker:1"]
    assert [(x["attempt"], x["code"], x["restarted"]) for x in w1["exits"]] == [(0, 1, True), (1, 0, False)], w1
    w0, restart = tasks(s)["worker:0"]["exits"][-1], w1["exits"][1]
    assert w0["code"] == 0 and w0["time_unix"] < restart["time_unix"] - restart["ran_s"], (w0, w1)  # gone first
    ps_log = (logdir / "logs" / "ps-0.log").read_text()
    assert "worker:1 stopped on an error at global step" in ps_log, ps_log[-3000:]
    assert "waiting for worker:1 to finish" in ps_log, ps_log[-3000:]
    ps = s["reports"]["ps:0"]["ps_stats"]
    assert s["global_step"] == ps["applied_updates"] == STEPS_PER_EPOCH, ps  # the failed batch is redone, once


def test_a_worker_that_keeps_dying_fails_the_run_once_its_budget_is_spent(tmp_path: Path) -> None:
    # Killed on its first attempt (step 5) and on its restart (step 8, from its resumed batch 5):
    # with one restart allowed, the second death fails the run, and says why it was not restarted.
    logdir = tmp_path / "budget"
    out, s = launch(logdir, "--restart", "worker=on-failure", "--max-restarts", "1", "--restart-backoff", "0.2",
                    "--fail-at", "worker:1@step=5:kill,worker:1@step=8:kill@attempt=1")
    assert s["status"] == "failed" and s["root_cause"] == "worker:1", out
    w1 = tasks(s)["worker:1"]
    assert [(x["attempt"], x["cause"], x["restarted"]) for x in w1["exits"]] == [
        (0, "killed (SIGKILL)", True), (1, "killed (SIGKILL)", False)], w1
    assert w1["exits"][1]["not_restarted"] == "its restart budget is spent (1 of 1 per task)"
    assert "psflow: worker:1 (attempt 1) was killed (SIGKILL) after " in out, out
    assert "; not restarted: its restart budget is spent (1 of 1 per task)." in out, out
    assert "Root cause: worker:1 exited with code -9 (SIGKILL), on attempt 1 (after 1 restart)" in out, out
