"""The Slurm backend's pure parts: the batch script (``psflow run --dry-run``), the step commands,
the node of each task, and what it reads from Slurm's answers. No Slurm needed: the batch script's
hold loop is run by bash itself."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from psflow.cli import main
from psflow.errors import ClusterError, ConfigError
from psflow.launch.plan import make_plan
from psflow.launch.slurm import (
    SlurmSettings,
    batch_script,
    exit_code_of,
    node_of,
    parse_job_id,
    parse_scontrol_job,
    sbatch_line,
    signal_argv,
    step_argv,
    step_name,
    tasks_per_node,
)

ROOT = Path(__file__).resolve().parents[2]
SOFTMAX = str(ROOT / "examples" / "mnist_softmax.py")


def plan_in(tmp_path: Path, **kw):
    return make_plan(SOFTMAX, ["--epochs", "1"], logdir=str(tmp_path / "run"), python="/opt/py/bin/python", threads=2,
                     **kw)


def sbatch_options(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_batch_script_asks_for_the_nodes_and_writes_its_output_into_the_logdir(tmp_path):
    plan = plan_in(tmp_path, num_ps=1, num_workers=3)
    script = batch_script(plan, SlurmSettings(nodes=3, sbatch_args=("--partition=gpu", "--time=01:00:00")), cwd="/work")
    assert script.startswith("#!/bin/bash\n")
    assert sbatch_options(script) == [
        f"--job-name=psflow-{plan.run_id}", "--nodes=3", "--ntasks-per-node=2", "--cpus-per-task=2",
        f"--output={tmp_path / 'run' / 'slurm'}/batch-%j.out", "--chdir=/work", "--no-kill", "--no-requeue",
        "--partition=gpu", "--time=01:00:00",
    ]


def test_batch_script_shows_each_tasks_step_on_its_node_round_robin(tmp_path):
    plan = plan_in(tmp_path, num_ps=1, num_workers=3)
    script = batch_script(plan, SlurmSettings(nodes=3), cwd="/work")
    steps = {line.split()[1]: line.split(None, 2)[2] for line in script.splitlines() if line.startswith("#   ")}
    assert list(steps) == ["ps:0", "worker:0", "worker:1", "worker:2"]
    assert steps["worker:2"] == shlex.join(
        ["srun", "--jobid=JOB", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=NODE0", "--cpus-per-task=2",
         "--job-name=worker-2.a0", "--chdir=/work", "--unbuffered", "/opt/py/bin/python", "-u", SOFTMAX, "--epochs", "1"])
    assert [shlex.split(s)[5] for s in steps.values()] == ["--nodelist=NODE0", "--nodelist=NODE1", "--nodelist=NODE2",
                                                           "--nodelist=NODE0"]


def test_batch_script_is_the_same_text_for_the_same_plan_and_is_valid_bash(tmp_path):
    plan = plan_in(tmp_path)
    script = batch_script(plan, SlurmSettings(nodes=2), cwd="/work")
    assert script == batch_script(plan, SlurmSettings(nodes=2), cwd="/work")
    assert subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True, timeout=30).returncode == 0


def hold(tmp_path: Path, beat: str | None, hold_timeout_s: float) -> subprocess.CompletedProcess:
    """Run the batch script's hold loop with bash, the heartbeat file holding ``beat`` (None: absent)."""
    plan = plan_in(tmp_path)
    heartbeat = tmp_path / "run" / "slurm" / "heartbeat"
    heartbeat.parent.mkdir(parents=True)
    if beat is not None:
        heartbeat.write_text(beat)
    script = batch_script(plan, SlurmSettings(nodes=1, hold_timeout_s=hold_timeout_s), cwd=str(tmp_path))
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)


def test_the_batch_script_ends_its_job_when_the_launcher_says_end(tmp_path):
    r = hold(tmp_path, "end", hold_timeout_s=60)
    assert r.returncode == 0, r.stderr


def test_the_batch_script_releases_the_allocation_once_the_heartbeat_stands_still(tmp_path):
    r = hold(tmp_path, "7\n", hold_timeout_s=1)
    assert r.returncode == 1
    assert "no heartbeat from the launcher for 1 s" in r.stderr and "releasing the allocation" in r.stderr


def test_step_argv_runs_one_task_on_one_node_of_the_job():
    plan = make_plan(SOFTMAX, python="/py", threads=1)
    argv = step_argv("42", "n7", plan.tasks[1], 3, threads=1, cwd="/w")
    assert argv[:10] == ["srun", "--jobid=42", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n7",
                         "--cpus-per-task=1", "--job-name=worker-0.a3", "--chdir=/w", "--unbuffered"]
    assert argv[10:] == ["/py", "-u", SOFTMAX]


def test_tasks_go_round_robin_over_the_nodes():
    nodes = ["n1", "n2"]
    assert [node_of(i, nodes) for i in range(5)] == ["n1", "n2", "n1", "n2", "n1"]
    assert [tasks_per_node(t, 3) for t in (1, 3, 4, 7)] == [1, 1, 2, 3]
    assert step_name("ps:1", 0) == "ps-1.a0"


@pytest.mark.parametrize(("srun_code", "task_code"), [(0, 0), (1, 1), (3, 3), (128, 128), (137, -9), (143, -15), (255, 255)])
def test_a_signal_srun_reports_as_128_plus_n_becomes_minus_n(srun_code, task_code):
    assert exit_code_of(srun_code) == task_code


def test_slurm_answers_are_read_or_refused_with_what_was_received():
    assert parse_job_id("1234\n") == "1234" and parse_job_id("77;cluster-a") == "77"
    with pytest.raises(ClusterError, match="did not answer with a job id. Received: 'sbatch: error: x'"):
        parse_job_id("sbatch: error: x")
    line = "JobId=5 JobName=psflow-x UserId=root(0) JobState=CANCELLED Reason=None Dependency=(null) NodeList=n[1-3]"
    assert parse_scontrol_job(line) == ("CANCELLED", "None")
    assert parse_scontrol_job("") == ("UNKNOWN", "None")


def test_settings_refuse_no_nodes():
    with pytest.raises(ConfigError, match="--nodes must be a positive number of Slurm nodes; received 0"):
        SlurmSettings(nodes=0)


def test_dry_run_prints_the_batch_script_and_starts_nothing(tmp_path):
    logdir = tmp_path / "dry"
    r = CliRunner().invoke(main, ["run", "--backend", "slurm", "--nodes", "3", "--dry-run", "--logdir", str(logdir),
                                  SOFTMAX, "--", "--epochs", "2"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("#!/bin/bash\n") and "--nodes=3" in sbatch_options(r.output)
    assert f"{sys.executable} -u {SOFTMAX} --epochs 2" in r.output
    assert not logdir.exists()  # nothing written, nothing submitted


def test_sbatch_args_from_the_cli_go_into_the_batch_script_after_psflows_own(tmp_path):
    r = CliRunner().invoke(main, ["run", "--backend", "slurm", "--sbatch-arg", "--partition=gpu", "--sbatch-arg=--time=02:00:00",
                                  "--sbatch-arg", "--gres=gpu:2", "--dry-run", "--logdir", str(tmp_path / "dry"), SOFTMAX])
    assert r.exit_code == 0, r.output
    assert sbatch_options(r.output)[-3:] == ["--partition=gpu", "--time=02:00:00", "--gres=gpu:2"]


def test_an_sbatch_option_holding_a_space_or_a_quote_is_written_as_sbatch_reads_it_back():
    # sbatch splits an #SBATCH line at whitespace outside double quotes and takes a backslash as an escape:
    # unquoted, "--comment=a b" makes sbatch refuse the script ("Invalid directive found in batch script: b")
    assert sbatch_line("--partition=gpu") == "#SBATCH --partition=gpu"
    assert sbatch_line("--comment=a b") == '#SBATCH "--comment=a b"'
    assert sbatch_line('--comment=say "hi" \\o/') == '#SBATCH "--comment=say \\"hi\\" \\\\o/"'


@pytest.mark.parametrize("arg, says", [
    ("-p gpu", "--sbatch-arg '-p gpu' is not one sbatch option: give sbatch's long form, starting with --, on one line"),
    ("partition=gpu", "--sbatch-arg 'partition=gpu' is not one sbatch option"),
    ("--partition=gpu\nrm -rf /", "is not one sbatch option"),  # a newline would start a line of the script
    ("--nodes=4", "--sbatch-arg '--nodes=4': psflow writes --nodes into the batch script itself (give psflow run --nodes K)"),
    ("--cpus-per-task 8", "psflow writes --cpus-per-task into the batch script itself (give psflow run --threads N)"),
])
def test_a_bad_sbatch_arg_is_one_usage_error_naming_it_and_what_to_write(tmp_path, arg, says):
    r = CliRunner().invoke(main, ["run", "--backend", "slurm", f"--sbatch-arg={arg}", "--dry-run", SOFTMAX])
    assert r.exit_code == 2 and says in " ".join(r.output.split()), r.output
    with pytest.raises(ConfigError, match="sbatch"):
        SlurmSettings(sbatch_args=(arg,))


@pytest.mark.parametrize("option", [["--nodes", "2"], ["--dry-run"]])
def test_slurm_options_on_a_local_run_are_usage_errors(tmp_path, option):
    r = CliRunner().invoke(main, ["run", *option, "--logdir", str(tmp_path / "x"), SOFTMAX])
    assert r.exit_code == 2 and f"{option[0]} is for --backend slurm; this run is local." in r.output


def test_sbatch_args_on_another_backend_are_a_usage_error(tmp_path):
    r = CliRunner().invoke(main, ["run", "--sbatch-arg=--partition=gpu", "--logdir", str(tmp_path / "x"), SOFTMAX])
    assert r.exit_code == 2 and "--sbatch-arg is for --backend slurm; this run is local." in r.output


def test_a_signal_to_a_task_is_scancel_of_its_step_by_name():
    import signal

    assert signal_argv("42.3", signal.SIGSTOP) == ["scancel", "--signal=STOP", "42.3"]
    assert signal_argv("42.3", signal.SIGCONT) == ["scancel", "--signal=CONT", "42.3"]
    assert signal_argv("7.0", signal.SIGUSR1) == ["scancel", "--signal=USR1", "7.0"]
    with pytest.raises(ValueError, match="JOB.STEP.*received '42'"):
        signal_argv("42", signal.SIGKILL)  # the whole job: never what a task's signal means
    with pytest.raises(ValueError, match="not a signal number"):
        signal_argv("42.3", 999)


def test_slurms_invalid_job_id_answer_counts_as_sent_only_while_the_step_runs():
    from psflow.launch.slurm import _delivered_anyway

    err = "scancel: error: Kill job error on job step id 2: Invalid job id specified\n"
    assert _delivered_anyway(err, "2.1", {"2.0", "2.1"})  # Slurm 22.05, a multi-node job: delivered on the step's node
    assert not _delivered_anyway(err, "2.1", {"2.0"})  # the step is gone: nothing received it
    assert not _delivered_anyway("scancel: error: Access/permission denied\n", "2.1", {"2.1"})


class _QueueingCli:
    """Slurm's answers for a job that waits in the queue (Priority, then Resources) and then runs."""

    def __init__(self) -> None:
        self.answers = [("PENDING", "Priority", ""), ("PENDING", "Priority", ""), ("PENDING", "Resources", ""),
                        ("RUNNING", "None", "n[1-2]")]

    def submit(self, script: Path) -> str:
        assert script.is_file()
        return "4242"

    def job(self, job_id: str) -> tuple[str, str, str]:
        assert job_id == "4242"
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_the_slurm_backend_notes_its_job_id_and_each_pending_reason_for_the_run_history(tmp_path: Path) -> None:
    from psflow.launch.slurm import SlurmBackend

    backend = SlurmBackend(nodes=2, echo=lambda _line: None, cli=_QueueingCli())  # type: ignore[arg-type]
    backend.open(make_plan(SOFTMAX, num_ps=1, num_workers=1, logdir=str(tmp_path / "run")))
    notes = backend.take_notes()
    assert [k for k, _ in notes] == ["scheduler_submitted", "scheduler_waiting", "scheduler_waiting", "scheduler_running"]
    assert notes[0][1]["job_id"] == "4242" and notes[0][1]["nodes"] == 2
    # each state and reason once, as it changed
    assert [(d["state"], d["reason"]) for k, d in notes if k == "scheduler_waiting"] == [("PENDING", "Priority"),
                                                                                          ("PENDING", "Resources")]
    assert notes[-1][1] == {"job_id": "4242", "nodes": "n1,n2"}
    assert backend.take_notes() == []  # taken once
