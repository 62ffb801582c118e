"""The Supervisor end to end: restore after a restart, checkpoints that crash or rot, export,
TensorBoard event files, SIGTERM, the evaluator task, and restoring into another number of ps.

Most tests are real processes through the real launcher (`psflow run`) on loopback, with a tmp
logdir, the supervised MNIST softmax example, ``--init zeros`` and at most one epoch. One module-scoped
run is shared by the tests that only read its logdir (or a copy of it). The last test is an
in-process cluster (real servers and sockets, ps tasks as threads) so that three restores stay fast.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    PSFLOW,
    ROOT,
    free_ports,
    log_tails,
    pid_alive,
    read_summary,
    run_psflow,
    task_env,
)
from safetensors.torch import save_file

import psflow as pf
from psflow import checkpoint
from psflow.checkpoint import find_checkpoint, state_dict_from
from psflow.cluster import ClusterSpec, TaskId
from psflow.identity import TaskIdentity
from psflow.server import Server
from psflow.task import Task

pytestmark = pytest.mark.timeout(180)
torch.set_num_threads(1)

SUPERVISED = str(ROOT / "examples" / "mnist_softmax_supervised.py")
COMMON = ["--init", "zeros", "--epochs", "1", "--log_every", "50", "--save_secs", "600"]
INITIAL_LOSS = 2.3026  # ln(10): the loss of the all-zero softmax


def run_job(logdir: Path, *script_args: str, ps: int = 1, fail_at: str | None = None) -> subprocess.CompletedProcess:
    args = ["run", "--ps", str(ps), "--workers", "2", "--logdir", str(logdir)]
    args += ["--fail-at", fail_at] if fail_at else []
    return run_psflow([*args, SUPERVISED, "--", *COMMON, *script_args], timeout_s=120)


def explain(r: subprocess.CompletedProcess, logdir: Path) -> str:
    return r.stdout[-3000:] + r.stderr[-2000:] + "\n" + log_tails(logdir)


def supervisor_report(summary: dict, task: str) -> dict:
    return summary["reports"][task]["supervisor"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One finished run: 2 ps, 2 workers, checkpoints every 100 global steps up to 300."""
    logdir = tmp_path_factory.mktemp("supervised") / "run"
    r = run_job(logdir, "--max_steps", "300", "--save_steps", "100", "--summary_every", "20", "--histogram_every", "50", ps=2)
    assert r.returncode == 0, explain(r, logdir)
    return logdir, r, read_summary(logdir)


def copy_run(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("logs", "errors", "summary.json"))
    return dest


# ------------------------------------------------------------------------- restart / wait


def test_chief_restores_after_a_restart_and_resumes_at_the_checkpointed_step(trained, tmp_path):
    src, _, s1 = trained
    logdir = copy_run(src, tmp_path / "run")
    ckpt = checkpoint.latest_checkpoint(logdir / "checkpoints")
    assert ckpt is not None and ckpt.step >= 300
    chief1 = supervisor_report(s1, "worker:0")
    assert chief1["checkpoints"][-1] == ckpt.step

    r = run_job(logdir, "--max_steps", str(ckpt.step + 150), "--save_steps", "100")

    assert r.returncode == 0, explain(r, logdir)
    assert f"worker:0: restored from {ckpt.path} at step {ckpt.step}" in r.stdout
    s2 = read_summary(logdir)
    chief2, other2 = supervisor_report(s2, "worker:0"), supervisor_report(s2, "worker:1")
    assert chief2["restored_from"] == str(ckpt.path)
    assert chief2["start_step"] == other2["start_step"] == ckpt.step
    assert s2["global_step"] >= ckpt.step + 150
    # Training goes on from the checkpoint's parameters, not from the zero initialization.
    first, last = chief2["first_loss"], chief1["last_loss"]
    assert abs(first - last) < 0.5 and first < INITIAL_LOSS - 0.8, (first, last)


def test_the_final_checkpoint_holds_every_workers_updates(trained):
    logdir, _, s = trained
    # The chief's loop may end first; it keeps checkpointing until the other worker is done.
    assert checkpoint.latest_checkpoint(logdir / "checkpoints").step == s["reports"]["ps:0"]["global_step"]


def test_a_non_chief_worker_waits_for_the_chief_then_trains(trained):
    _, r, s = trained
    assert "worker:1: waiting for the chief to initialize the parameter servers (up to ready_timeout_s=" in r.stdout
    assert "worker:1: parameters ready at step 0" in r.stdout
    assert "worker:0: initialized at step 0" in r.stdout
    assert s["reports"]["worker:1"]["trainer"]["local_step"] > 0
    assert supervisor_report(s, "worker:1")["checkpoints"] == []  # only the chief saves


def test_checkpoints_land_on_multiples_of_save_steps_and_the_job_stops_at_max_steps(trained):
    logdir, r, s = trained
    # Two async workers race past every step; the ps hold the exact ones (--save_steps 100, --max_steps 300).
    steps = [checkpoint.read_checkpoint(p).step for p in checkpoint.list_checkpoints(logdir / "checkpoints")]
    assert steps == [300, 200, 100], r.stdout[-3000:]
    assert s["reports"]["ps:0"]["global_step"] == s["reports"]["ps:1"]["global_step"] == 300
    assert all(checkpoint.read_checkpoint(p).meta["shard_versions"] == [step, step]
               for p, step in zip(checkpoint.list_checkpoints(logdir / "checkpoints"), steps))


def test_every_worker_resumes_its_own_data_position(tmp_path):
    """One epoch split over two runs: each worker trains every batch of its shard exactly once."""
    logdir = tmp_path / "run"
    shard_examples = 60000 // 2
    r1 = run_job(logdir, "--max_steps", "250", "--save_steps", "100")
    assert r1.returncode == 0, explain(r1, logdir)
    s1 = read_summary(logdir)
    saved = checkpoint.latest_checkpoint(logdir / "checkpoints")
    assert saved is not None and saved.step == 250 and set(saved.meta["data_position"]) == {"worker:0", "worker:1"}

    r2 = run_job(logdir)  # the rest of the epoch

    assert r2.returncode == 0, explain(r2, logdir)
    s2 = read_summary(logdir)
    assert f"worker:0: restored from {saved.path} at step 250" in r2.stdout
    for task in ("worker:0", "worker:1"):
        position = saved.meta["data_position"][task]
        assert f"{task}: resuming its data at epoch 0, batch {position['batch_index']}" in r2.stdout, r2.stdout[-3000:]
        first, second = s1["reports"][task]["trainer"]["examples"], s2["reports"][task]["trainer"]["examples"]
        assert first > 0 and second > 0 and first + second == shard_examples, (task, first, second)
    assert s2["reports"]["ps:0"]["global_step"] == 2 * shard_examples // 100  # every batch applied once


def by_hand_run(procs, cwd: Path, *, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, subprocess.Popen]:
    """One ps and one worker started by hand (the seeds' flags, no launcher, no logdir) in ``cwd``."""
    ports = free_ports(2)
    started = []
    for job in ("ps", "worker"):
        flags = [f"--ps_hosts=localhost:{ports[0]}", f"--worker_hosts=localhost:{ports[1]}", f"--job_name={job}", "--task_index=0"]
        p = subprocess.Popen([sys.executable, SUPERVISED, *flags, *COMMON, "--max_steps", "30"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=task_env(**(env or {})), cwd=cwd, start_new_session=True)
        procs.append(p)
        started.append(p)
    return started[0], started[1]


def test_each_run_by_hand_gets_its_own_logdir_and_resuming_names_it(procs, tmp_path):
    logdirs = []
    for _ in range(2):  # the same flags twice, no logdir: two runs, neither sees the other's checkpoints
        ps, worker = by_hand_run(procs, tmp_path)
        out = worker.communicate(timeout=120)[0]
        assert worker.returncode == 0 and "worker:0: initialized at step 0" in out, out[-3000:]
        ps.communicate(timeout=60)
        said = re.search(r"worker:0: logdir (\S+) \(this run's own", out)
        assert said, out[-3000:]
        logdirs.append(tmp_path / said.group(1))
    first, second = logdirs
    assert first != second and first.parent == second.parent == tmp_path / "runs"
    ckpt = checkpoint.latest_checkpoint(first / "checkpoints")
    assert ckpt is not None and ckpt.step == 30
    assert (first / "summaries" / "worker-0").is_dir()

    ps, worker = by_hand_run(procs, tmp_path, env={"PSFLOW_RESUME": "1"})  # resuming, but which run?
    out = worker.communicate(timeout=120)[0]
    assert worker.returncode != 0 and "named no logdir" in out and "--logdir DIR" in out, out[-3000:]
    assert "Traceback" not in out  # one clear error
    ps.kill()
    ps.communicate(timeout=30)

    ps, worker = by_hand_run(procs, tmp_path, env={"PSFLOW_LOGDIR": str(first)})  # naming it resumes it
    out = worker.communicate(timeout=120)[0]
    assert worker.returncode == 0, out[-3000:]
    assert f"worker:0: restored from {ckpt.path} at step 30" in out


def test_allreduce_ranks_by_hand_write_the_logdir_rank_0_made(procs, tmp_path):
    ports = free_ports(2)
    flags = [f"--worker_hosts=localhost:{ports[0]},localhost:{ports[1]}", "--job_name=worker"]
    env = task_env(PSFLOW_TRAIN_CONFIG=json.dumps({"strategy": "allreduce"}))
    for i in range(2):
        procs.append(subprocess.Popen([sys.executable, SUPERVISED, *flags, f"--task_index={i}", *COMMON, "--max_steps", "20"],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
                                      start_new_session=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-2000:] + outs[1][-2000:]
    (logdir,) = (tmp_path / "runs").iterdir()  # one directory for the run, not one per rank
    assert f"worker:0: logdir runs/{logdir.name} (this run's own" in outs[0]
    assert {p.name for p in (logdir / "summaries").iterdir()} == {"worker-0", "worker-1"}
    assert checkpoint.latest_checkpoint(logdir / "checkpoints") is not None


# --------------------------------------------------------------------- broken checkpoints


def test_a_checkpoint_cut_mid_write_is_never_loaded(tmp_path):
    logdir = tmp_path / "run"
    r = run_job(logdir, "--max_steps", "1000", "--save_steps", "100", ps=2, fail_at="ps:1@save=2:crash_after=64")

    assert r.returncode != 0, explain(r, logdir)
    assert "ps:1: injected crash while writing checkpoint 2" in r.stdout, explain(r, logdir)
    saved = [int(m) for m in re.findall(r"worker:0: saved checkpoint \S+ at step (\d+)", r.stdout)]
    assert len(saved) == 1, explain(r, logdir)
    partial = [p for p in (logdir / "checkpoints").iterdir() if p.name.endswith(".partial")]
    assert len(partial) == 1 and [f.stat().st_size for f in partial[0].glob("*.tmp")] == [64]
    ckpt = checkpoint.latest_checkpoint(logdir / "checkpoints")
    assert ckpt is not None and ckpt.step == saved[0]


def test_a_corrupted_shard_falls_back_to_the_previous_checkpoint_with_a_warning(trained, tmp_path):
    logdir = copy_run(trained[0], tmp_path / "run")
    newest, previous = checkpoint.list_checkpoints(logdir / "checkpoints")[:2]
    shard = newest / "shard-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    previous_step = checkpoint.read_checkpoint(previous).step

    r = run_job(logdir, "--max_steps", str(previous_step + 50))

    assert r.returncode == 0, explain(r, logdir)
    warning = next(line for line in r.stdout.splitlines() if "warning: Skipping checkpoint" in line)
    assert str(shard) in warning and "sha256" in warning
    assert f"worker:0: restored from {previous} at step {previous_step}" in r.stdout


def test_a_rerun_whose_checkpoints_are_all_corrupt_fails_naming_them_instead_of_starting_over(trained, tmp_path):
    logdir = copy_run(trained[0], tmp_path / "run")
    shards = []
    for path in checkpoint.list_checkpoints(logdir / "checkpoints"):
        shard = path / "shard-00000-of-00002.safetensors"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        shards.append(shard)

    r = run_job(logdir, "--max_steps", "1000")

    assert r.returncode != 0, explain(r, logdir)
    out = r.stdout + r.stderr
    assert "initialized at step 0" not in out, explain(r, logdir)
    assert len(shards) >= 2 and all(str(s.name) in out and str(s.parent.name) in out for s in shards), explain(r, logdir)
    assert "Every checkpoint in" in out and "another logdir" in out, explain(r, logdir)


# ------------------------------------------------------------------------ export / events


CLEAN_LOAD = """
import json, sys
import torch
from safetensors.torch import load_file

class Softmax(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(784, 10))
        self.b = torch.nn.Parameter(torch.zeros(10))
    def forward(self, x):
        return x @ self.w + self.b

model = Softmax()
model.load_state_dict(load_file(sys.argv[1]))
data = load_file(sys.argv[2])
with torch.no_grad():
    logits = model(data["x"])
print(json.dumps({
    "accuracy": (logits.argmax(1) == data["y"]).float().mean().item(),
    "logits": logits[:3].tolist(),
    "psflow_modules": sorted(m for m in sys.modules if m == "psflow" or m.startswith("psflow.")),
}))
"""


def test_export_loads_in_a_clean_interpreter_with_the_same_outputs(trained, tmp_path):
    logdir = trained[0]
    out = tmp_path / "model.safetensors"
    r = run_psflow(["export", str(logdir), str(out)], timeout_s=60)
    assert r.returncode == 0, r.stdout + r.stderr
    test = pf.data.mnist("test")
    save_file({"x": test.x[:2000].contiguous(), "y": test.y[:2000].contiguous()}, str(tmp_path / "data.safetensors"))

    p = subprocess.run([sys.executable, "-I", "-c", CLEAN_LOAD, str(out), str(tmp_path / "data.safetensors")],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)

    assert p.returncode == 0, p.stderr
    clean = json.loads(p.stdout)
    assert clean["psflow_modules"] == []
    state = state_dict_from(find_checkpoint(logdir))
    logits = test.x[:2000] @ state["w"] + state["b"]
    accuracy = (logits.argmax(1) == test.y[:2000]).float().mean().item()
    assert clean["accuracy"] == accuracy and accuracy > 0.7
    assert torch.allclose(torch.tensor(clean["logits"]), logits[:3], atol=1e-5)


def test_event_files_of_each_worker_hold_the_expected_tags(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = trained[0]
    for task in ("worker-0", "worker-1"):
        acc = EventAccumulator(str(logdir / "summaries" / task), size_guidance={"scalars": 0, "histograms": 0})
        acc.Reload()
        tags = acc.Tags()
        assert {"loss", "examples_per_sec", "global_steps_per_sec", "learning_rate"} <= set(tags["scalars"]), (task, tags)
        assert {"parameters/w", "parameters/b", "gradients/w", "gradients/b"} <= set(tags["histograms"]), (task, tags)
        assert all(e.value == pytest.approx(0.01) for e in acc.Scalars("learning_rate"))
        losses = [e.value for e in acc.Scalars("loss")]
        assert len(losses) >= 3 and losses[-1] < losses[0]
        assert all(e.value > 0 for e in acc.Scalars("examples_per_sec"))


# ------------------------------------------------------------------------------ SIGTERM


def test_sigterm_to_the_launcher_leaves_a_final_checkpoint_and_no_task_process(tmp_path):
    logdir = tmp_path / "run"
    # No periodic checkpoint (save_secs 600 and no save_steps): any checkpoint is the final one.
    cmd = [PSFLOW, "run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), SUPERVISED, "--",
           "--init", "zeros", "--epochs", "100", "--log_every", "20"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=task_env(), cwd=ROOT)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 90
        while not any(re.match(r"\[worker:0\] step [1-9]\d\d+,", line) for line in seen):  # training is under way
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None and time.monotonic() < deadline, "".join(seen[-40:])
            seen.append(line)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    out = "".join(seen)

    assert p.returncode == 130, out[-3000:]
    chief_steps = [int(s) for s in re.findall(r"\[worker:0\] step (\d+), loss", out)]
    assert re.search(r"worker:0: stopped at step \d+ \(SIGTERM\)", out), out[-3000:]
    ckpt = checkpoint.latest_checkpoint(logdir / "checkpoints")
    assert ckpt is not None and chief_steps and ckpt.step >= max(chief_steps)
    saved = re.findall(r"worker:0: saved checkpoint \S+ at step (\d+)", out)
    assert [int(step) for step in saved] == [ckpt.step]
    s = read_summary(logdir)
    assert s["status"] == "stopped"
    assert not [t["task"] for t in s["tasks"] if pid_alive(t["pid"])]


# ---------------------------------------------------------------------------- evaluator


EVAL_JOB = """
import sys
from psflow.launch import LocalBackend, Runner, make_plan
plan = make_plan(sys.argv[1], sys.argv[3:], num_ps=1, num_workers=2, evaluator=True, logdir=sys.argv[2])
sys.exit(Runner(LocalBackend()).run(plan).exit_code)
"""


def test_evaluator_task_evaluates_the_final_checkpoint_and_ends_with_the_job(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", EVAL_JOB, SUPERVISED, str(logdir), *COMMON, "--max_steps", "300",
                        "--save_steps", "100"], capture_output=True, text=True, timeout=120, env=task_env(), cwd=ROOT,
                       check=False)

    assert r.returncode == 0, explain(r, logdir)
    s = read_summary(logdir)
    assert {t["task"]: t["exit_code"] for t in s["tasks"]}["evaluator:0"] == 0
    final = checkpoint.latest_checkpoint(logdir / "checkpoints")
    evaluated = s["reports"]["evaluator:0"]["eval"]
    assert evaluated["step"] == final.step and evaluated["accuracy"] > 0.7
    acc = EventAccumulator(str(logdir / "summaries" / "evaluator-0"))
    acc.Reload()
    assert acc.Scalars("eval/accuracy")[-1].step == final.step


# ------------------------------------------------- restore into another number of ps (in process)


SECRET = b"supervisor-test-secret"
BATCHES = [(torch.randn(16, 8, generator=torch.Generator().manual_seed(i)), torch.arange(16) % 3) for i in range(6)]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def train_in_process(num_ps: int, logdir: Path, until_step: int) -> dict[str, object]:
    """Train one worker against ``num_ps`` in-process ps tasks under a Supervisor, up to ``until_step``."""
    servers = [Server(f"ps:{i}", secret=SECRET, handshake_timeout_s=5.0) for i in range(num_ps)]
    try:
        addresses = [s.start() for s in servers]
        cluster = ClusterSpec.from_dict({"ps": addresses, "worker": ["127.0.0.1:1"]})
        common = {"secret": SECRET, "config": pf.TrainConfig(), "argv": [], "coordinator": None, "logdir": str(logdir),
                  "connect_timeout_s": 5.0}
        for i, server in enumerate(servers):
            Task(TaskIdentity(TaskId("ps", i), cluster), server=server, **common)  # hosts the shard's PsService on its server
        task = Task(TaskIdentity(TaskId("worker", 0), cluster), server=Server("worker:0", secret=SECRET), **common)
        model = make_model()
        trainer = pf.Trainer(model, pf.optim.Adam(lr=0.05), task, ema_decay=0.9, split_bytes=64)
        with pf.Supervisor(task, save_model_secs=None, summary_every_steps=None) as sv:
            trainer.pull()
            restored = {n: p.detach().clone() for n, p in model.named_parameters()}
            for x, y in BATCHES[sv.start_step:until_step]:
                sv.step(lambda x=x, y=y: torch.nn.functional.cross_entropy(model(x), y), batch_size=len(x))
            trainer.pull()
            values = {n: p.detach().clone() for n, p in model.named_parameters()}
            trainer.pull(averages=True)
            averages = {n: p.detach().clone() for n, p in model.named_parameters()}
        return {"start": sv.start_step, "restored": restored, "values": values, "averages": averages,
                "split": any("#" in pc.key for pc in trainer.placement.pieces)}
    finally:
        for s in servers:
            s.stop()


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def test_a_two_ps_checkpoint_restores_into_one_and_three_ps_identically(tmp_path):
    saved = train_in_process(2, tmp_path / "two", until_step=5)  # final checkpoint at step 5
    reference = train_in_process(2, tmp_path / "reference", until_step=6)  # the same job, one step further
    assert saved["split"] and saved["start"] == 0

    for num_ps in (1, 3):
        logdir = shutil.copytree(tmp_path / "two", tmp_path / f"into-{num_ps}")
        resumed = train_in_process(num_ps, logdir, until_step=6)

        assert resumed["start"] == 5
        assert_same(resumed["restored"], saved["values"])
        # One more step agrees exactly with the uninterrupted job: Adam's moments and step, and the
        # moving averages, came back whole too.
        assert_same(resumed["values"], reference["values"])
        assert_same(resumed["averages"], reference["averages"])
