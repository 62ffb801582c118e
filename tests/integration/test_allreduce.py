"""All-reduce jobs (``--strategy allreduce``) and the seed's CNN in every mode, as real processes.

What is proven:

- the seed's softmax script runs unchanged under ``--strategy allreduce`` (no ps task) and reports
  a test accuracy;
- every rank ends with bit-identical parameters, equal (to 1e-6) to a one-process recomputation
  (rank 0's initial weights, mean of the ranks' gradients, SGD) for each closure form: the bare
  closure (explicit all-reduce), the batch form (DistributedDataParallel) and towers;
- by hand (the seeds' flags, no launcher) worker:0's address is the rendezvous;
- a rank that fails makes the job fail with that rank as the root cause;
- examples/mnist_cnn.py runs 20 steps in async, sync, all-reduce and with two CPU towers.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    PSFLOW,
    ROOT,
    SOFTMAX,
    free_ports,
    log_tails,
    read_summary,
    run_psflow,
    task_env,
)

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "allreduce_params.py")
CNN = str(ROOT / "examples" / "mnist_cnn.py")
sys.path.insert(0, str(Path(SCRIPT).parent))
import allreduce_params as job  # the job's own data and model, for the reference  # noqa: E402 (its folder joins sys.path just above)


def reference_params(world: int, steps: int, lr: float) -> torch.Tensor:
    """One process: rank 0's initial weights; each step the mean of the ranks' gradients, then SGD."""
    model = job.make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        grads = []
        for rank in range(world):
            model.zero_grad()
            x, y = job.batch(step, rank)
            F.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / world
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run_ok(args: list[str], logdir: Path) -> dict:
    r = run_psflow(["run", "--logdir", str(logdir), *args])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log_tails(logdir)
    return read_summary(logdir)


def test_softmax_script_runs_unchanged_under_allreduce(tmp_path):
    s = run_ok(["--strategy", "allreduce", "--workers", "2", SOFTMAX, "--", "--epochs", "1", "--init", "zeros"],
               tmp_path / "run")
    assert s["status"] == "succeeded" and s["strategy"] == "allreduce"
    assert [t["task"] for t in s["tasks"]] == ["worker:0", "worker:1"]  # no ps task
    assert s["test_accuracy"] is not None and s["test_accuracy"] > 0.75, s
    accs = s["test_accuracy_by_task"]
    assert accs["worker:0"] == accs["worker:1"]  # the same parameters on both ranks
    stats = {t: r["trainer"] for t, r in s["reports"].items()}
    assert stats["worker:0"]["global_step"] == stats["worker:1"]["global_step"] == stats["worker:0"]["local_step"] > 0
    assert stats["worker:0"]["strategy"] == "allreduce" and stats["worker:0"]["backend"] == "gloo"


@pytest.mark.parametrize("form", ["closure", "batch", "towers"])
def test_every_rank_ends_with_identical_parameters_equal_to_the_reference(tmp_path, form):
    steps, lr = 5, 0.5
    s = run_ok(["--strategy", "allreduce", "--workers", "2", SCRIPT, "--", "--form", form,
                "--steps", str(steps), "--lr", str(lr)], tmp_path / form)
    reports = s["reports"]
    assert reports["worker:0"]["param_sha256"] == reports["worker:1"]["param_sha256"]
    assert reports["worker:0"]["final_step"] == reports["worker:1"]["final_step"] == steps
    got = torch.tensor(reports["worker:0"]["params"])
    expected = reference_params(2, steps, lr)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_by_hand_with_the_seeds_flags_worker_0_is_the_rendezvous(procs):
    ports = free_ports(2)
    flags = [f"--worker_hosts=localhost:{ports[0]},localhost:{ports[1]}", "--job_name=worker"]
    env = task_env(PSFLOW_TRAIN_CONFIG=json.dumps({"strategy": "allreduce"}), PSFLOW_SECRET="by-hand")
    for i in range(2):
        procs.append(subprocess.Popen(
            [sys.executable, SCRIPT, *flags, f"--task_index={i}", "--steps", "3"], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, start_new_session=True,
        ))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    shas = [re.search(r"global_step 3 param_sha256 (\w+)", out) for out in outs]
    assert all(shas), outs
    assert shas[0].group(1) == shas[1].group(1)


def test_a_failing_rank_fails_the_job_as_the_root_cause(tmp_path):
    logdir = tmp_path / "fail"
    r = run_psflow(["run", "--strategy", "allreduce", "--workers", "2", "--logdir", str(logdir),
                    "--fail-at", "worker:1@step=2", SCRIPT, "--", "--steps", "50"], timeout_s=120)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "Root cause: worker:1" in r.stdout and "Injected failure in worker:1 at step 2" in r.stdout
    assert read_summary(logdir)["root_cause"] == "worker:1"


def test_allreduce_bound_off_loopback_is_refused_until_the_user_opts_in(tmp_path):
    """gloo's store and connections are not covered by the job secret: a launch that would bind them on
    every interface (PSFLOW_BIND_HOST=0.0.0.0) fails before gloo starts, naming what is unprotected;
    ``--allow-unauthenticated-allreduce`` lets it run."""
    def launch(name: str, *flags: str) -> tuple[subprocess.CompletedProcess, Path]:
        logdir = tmp_path / name
        args = [PSFLOW, "run", "--strategy", "allreduce", "--workers", "2", "--logdir", str(logdir), *flags,
                SCRIPT, "--", "--steps", "2"]
        r = subprocess.run(args, capture_output=True, text=True, timeout=120, env=task_env(PSFLOW_BIND_HOST="0.0.0.0"),
                           cwd=ROOT, check=False)
        return r, logdir

    refused, logdir = launch("refused")
    assert refused.returncode == 1, refused.stdout[-3000:]
    assert "would run off loopback (bind host 0.0.0.0 (PSFLOW_BIND_HOST))" in refused.stdout
    assert "rendezvous store (TCPStore) and gloo's connections" in refused.stdout
    assert "opt in with --allow-unauthenticated-allreduce" in refused.stdout
    assert read_summary(logdir)["global_step"] == 0
    allowed, logdir = launch("allowed", "--allow-unauthenticated-allreduce")
    assert allowed.returncode == 0, allowed.stdout[-3000:] + log_tails(logdir)
    assert read_summary(logdir)["reports"]["worker:0"]["final_step"] == 2


CNN_ARGS = ["--max_steps", "20", "--log_every", "10", "--test_examples", "500"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "launch", "script_args"),
    [
        ("async", ["--ps", "1", "--workers", "2"], []),
        ("sync", ["--ps", "1", "--workers", "2", "--mode", "sync"], []),
        ("allreduce", ["--strategy", "allreduce", "--workers", "2"], []),
        ("towers", ["--ps", "1", "--workers", "1"], ["--devices", "cpu,cpu"]),
    ],
)
def test_cnn_example_runs_20_steps_in_each_mode(tmp_path, name, launch, script_args):
    logdir = tmp_path / name
    r = run_psflow(["run", "--logdir", str(logdir), *launch, CNN, "--", *CNN_ARGS, *script_args])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log_tails(logdir)
    assert re.search(r"\[worker:\d\] step 10, loss = \d+\.\d\d \(\d+\.\d examples/sec; \d+\.\d{3} sec/batch\)", r.stdout)
    assert "test accuracy = " in r.stdout
    s = read_summary(logdir)
    assert s["global_step"] >= 20 and s["test_accuracy"] is not None, s


# -- in this process: dispatch, rejected settings, moving averages (world size 1) -------------


class OneTask:
    """The attributes of psflow.task.Task that the trainers read, for worker:0 of a job of ``workers``."""

    def __init__(self, workers: int = 1, **config: object) -> None:
        from psflow.cluster import ClusterSpec, TaskId
        from psflow.config import TrainConfig

        addresses = [f"127.0.0.1:{port}" for port in free_ports(workers)]
        self.cluster = ClusterSpec.from_dict({"worker": addresses}, require_ps=False)
        self.task_id = TaskId("worker", 0)
        self.config = TrainConfig(strategy="allreduce", **config)  # type: ignore[arg-type]
        self.num_replicas, self.replica_index, self.num_ps = workers, 0, 0
        self.connect_timeout_s, self.fail_at, self.rendezvous = 10.0, None, None
        self.trainers: list[object] = []

    def _attach_trainer(self, trainer: object) -> None:
        self.trainers.append(trainer)


def test_trainer_returns_the_allreduce_trainer_for_that_strategy():
    from psflow import optim
    from psflow.train.allreduce import AllReduceTrainer
    from psflow.train.trainer import Trainer

    trainer = Trainer(torch.nn.Linear(2, 2), optim.SGD(lr=0.1), OneTask())
    assert isinstance(trainer, AllReduceTrainer) and trainer.placement.num_shards == 1
    trainer.close()  # never joined a group: nothing to leave


@pytest.mark.parametrize("config", [{"mode": "ssp"}, {"mode": "sync", "replicas_to_aggregate": 1}])
def test_ssp_and_backup_workers_are_rejected_under_allreduce(config):
    from psflow import optim
    from psflow.errors import ConfigError
    from psflow.train.trainer import Trainer

    with pytest.raises(ConfigError, match="needs parameter servers"):
        Trainer(torch.nn.Linear(2, 2), optim.SGD(lr=0.1), OneTask(2, **config))


def test_moving_averages_are_read_without_disturbing_training():
    from psflow import optim
    from psflow.train.trainer import Trainer

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    trainer = Trainer(model, optim.SGD(lr=0.1), OneTask(), ema_decay=0.5)
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    try:
        for _ in range(3):
            trainer.step(lambda m, xb, yb: F.mse_loss(m(xb), yb), batch=(x, y))
            ref_opt.zero_grad()
            F.mse_loss(reference(x), y).backward()
            ref_opt.step()
            live = model.weight.detach().clone()
            trainer.pull(averages=True)
            assert not torch.equal(model.weight, live)  # the averages lag the live values
            trainer.pull()
            assert torch.equal(model.weight, live)
            trainer.pull(averages=True)  # the next step must still start from the live values
        trainer.pull()
        torch.testing.assert_close(model.weight, reference.weight)
        assert trainer.stats()["global_step"] == 3
    finally:
        trainer.close()
