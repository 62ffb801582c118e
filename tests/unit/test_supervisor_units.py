"""Unit tests of the Supervisor's pure parts: putting checkpoint pieces back together, export,
hooks, argument checks, the checkpoint-crash fault, event files and the evaluator's watch loop.

Everything runs in this process on files under tmp_path, except the crash fault, which must kill a
real process and so runs one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from psflow import checkpoint
from psflow.checkpoint import (
    assemble_pieces,
    export_checkpoint,
    find_checkpoint,
    load_whole_tensors,
    state_dict_from,
)
from psflow.errors import CheckpointError, ConfigError, TrainingError
from psflow.evaluator import load_into, run_evaluator
from psflow.fault import inject, parse_faults
from psflow.ps.placement import ParamInfo, place, split_tensor
from psflow.summary import EventWriter, summary_dir
from psflow.supervisor import LoggingHook, NanGuardHook, Supervisor

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------------------ helpers


def shard_tensors(full: dict[str, torch.Tensor], placement, *, slots=("momentum_buffer",), scalar_slot: str | None = None,
                  ema: bool = True) -> list[dict[str, torch.Tensor]]:
    """What each ps's snapshot holds for ``full`` under ``placement`` (values, opt slots, averages)."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(placement.num_shards)]
    for pc in placement.pieces:
        t = full[pc.param]
        out = shards[pc.shard]
        out[pc.key] = split_tensor(t, pc).clone()
        for slot in slots:
            out[f"opt/{pc.key}/{slot}"] = split_tensor(t * 2 + 1, pc).clone()
        if scalar_slot:
            out[f"opt/{pc.key}/{scalar_slot}"] = torch.tensor(7.0)
        if ema:
            out[f"ema/{pc.key}"] = split_tensor(t - 1, pc).clone()
    return shards


def write_checkpoint(root: Path, step: int, full: dict[str, torch.Tensor], num_shards: int, *, split_bytes: int | None = 16,
                     export: str = "values", ema: bool = True) -> Path:
    infos = [ParamInfo(n, tuple(t.shape)) for n, t in full.items()]
    placement = place(infos, num_shards, split_bytes=split_bytes)
    records = [checkpoint.write_shard(root, step, k, num_shards, tensors)
               for k, tensors in enumerate(shard_tensors(full, placement, ema=ema))]
    meta = {"placement": placement.to_dict(), "global_step": step, "export": export}
    return checkpoint.commit(root, step, records, meta=meta, keep=5)


def tiny_model_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 3, generator=g), "b": torch.randn(3, generator=g)}


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(6, 3))
        self.b = torch.nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b


# ------------------------------------------------------------------ assembling pieces


shapes = st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(shapes=shapes, num_shards=st.integers(1, 4), split_bytes=st.sampled_from([None, 0, 8, 40]))
def test_pieces_assemble_back_into_the_whole_tensors(shapes, num_shards, split_bytes):
    full = {f"p{i}": torch.arange(math.prod(s), dtype=torch.float32).reshape(s) + i for i, s in enumerate(shapes)}
    placement = place([ParamInfo(n, tuple(t.shape)) for n, t in full.items()], num_shards, split_bytes=split_bytes)
    stored = {k: v for shard in shard_tensors(full, placement, scalar_slot="step") for k, v in shard.items()}

    whole = assemble_pieces(stored, placement)

    for name, t in full.items():
        assert torch.equal(whole[name], t)
        assert torch.equal(whole[f"opt/{name}/momentum_buffer"], t * 2 + 1)
        assert torch.equal(whole[f"ema/{name}"], t - 1)
        assert whole[f"opt/{name}/step"].shape == () and float(whole[f"opt/{name}/step"]) == 7.0


def test_a_slot_missing_on_one_piece_is_reported_with_the_piece():
    full = {"w": torch.ones(4, 2)}
    placement = place([ParamInfo("w", (4, 2))], 2, split_bytes=0)
    stored = {k: v for shard in shard_tensors(full, placement, ema=False) for k, v in shard.items()}
    del stored["opt/w#2:4/momentum_buffer"]
    with pytest.raises(CheckpointError, match=r"'momentum_buffer'.*'w'.*w#2:4"):
        assemble_pieces(stored, placement)


def test_a_checkpoint_without_placement_cannot_be_assembled(tmp_path):
    rec = checkpoint.write_shard(tmp_path, 1, 0, 1, {"w": torch.ones(2)})
    ckpt = checkpoint.read_checkpoint(checkpoint.commit(tmp_path, 1, [rec], meta={}))
    with pytest.raises(CheckpointError, match="no placement"):
        load_whole_tensors(ckpt)


# ---------------------------------------------------------------------------- export


def test_export_writes_whole_tensors_that_plain_safetensors_loads(tmp_path):
    full = tiny_model_tensors()
    write_checkpoint(tmp_path / "run" / "checkpoints", 40, full, 2)

    out, ckpt, averages = export_checkpoint(tmp_path / "run", tmp_path / "model.safetensors")

    assert (ckpt.step, averages) == (40, False)
    loaded = load_file(out)
    assert set(loaded) == {"w", "b"} and all(torch.equal(loaded[n], full[n]) for n in full)
    model = Tiny()
    model.load_state_dict(loaded)  # strict: exactly the model's parameters
    assert torch.equal(model.w.detach(), full["w"])


def test_export_of_averages_follows_the_runs_choice_and_can_be_overridden(tmp_path):
    full = tiny_model_tensors()
    write_checkpoint(tmp_path / "checkpoints", 5, full, 3, export="averages")

    _, _, chosen = export_checkpoint(tmp_path, tmp_path / "a.safetensors")
    _, _, forced = export_checkpoint(tmp_path, tmp_path / "v.safetensors", averages=False)

    assert chosen and not forced
    assert torch.equal(load_file(tmp_path / "a.safetensors")["w"], full["w"] - 1)
    assert torch.equal(load_file(tmp_path / "v.safetensors")["w"], full["w"])


def test_export_of_averages_without_any_says_how_to_get_them(tmp_path):
    write_checkpoint(tmp_path / "checkpoints", 5, tiny_model_tensors(), 1, ema=False)
    with pytest.raises(CheckpointError, match="ema_decay"):
        export_checkpoint(tmp_path, tmp_path / "a.safetensors", averages=True)


def test_export_is_fsynced_then_renamed_and_leaves_no_tmp_file(tmp_path, monkeypatch):
    full = tiny_model_tensors()
    write_checkpoint(tmp_path / "checkpoints", 7, full, 2)
    out = (tmp_path / "export" / "model.safetensors").resolve()
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))  # the path the fd is open on, at fsync time
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    path, ckpt, _ = export_checkpoint(tmp_path, out)
    monkeypatch.undo()

    assert path == out and sorted(os.listdir(out.parent)) == ["model.safetensors"]
    loaded = load_file(out)
    state = state_dict_from(ckpt)
    assert set(loaded) == set(state) == {"w", "b"} and all(torch.equal(loaded[n], state[n]) for n in state)
    # The bytes reached the disk under the tmp name (before the rename), then the directory entry did.
    assert any(re.fullmatch(re.escape(str(out)) + r"\.\d+-[0-9a-f]{8}\.tmp", p) for p in synced), synced
    assert str(out.parent) in synced


def test_a_failed_export_leaves_neither_a_tmp_file_nor_a_torn_output(tmp_path, monkeypatch):
    write_checkpoint(tmp_path / "checkpoints", 7, tiny_model_tensors(), 1)
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"the previous export")

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(CheckpointError, match=r"Could not export .*ckpt-0000000007 to .*model\.safetensors: .*No space left"):
        export_checkpoint(tmp_path, out)
    monkeypatch.undo()

    assert out.read_bytes() == b"the previous export"
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["model.safetensors"]


def test_find_checkpoint_accepts_logdir_root_or_directory_and_names_an_empty_one(tmp_path):
    path = write_checkpoint(tmp_path / "checkpoints", 9, tiny_model_tensors(), 1)
    assert {find_checkpoint(p).step for p in (tmp_path, tmp_path / "checkpoints", path)} == {9}
    with pytest.raises(CheckpointError, match=r"No whole checkpoint under .*empty"):
        find_checkpoint(tmp_path / "empty")


# ----------------------------------------------------------------------------- hooks


def fake_sv(model: torch.nn.Module | None = None, **kw):
    trainer = SimpleNamespace(model=model or Tiny(), pull=lambda **_: 0)
    return SimpleNamespace(task=SimpleNamespace(task_id="worker:0"), trainer=trainer, diverged=False, **kw)


def test_logging_hook_prints_the_seeds_progress_line_every_n_steps():
    lines: list[str] = []
    hook = LoggingHook(every_n_steps=2, print_fn=lines.append)
    sv = fake_sv(examples=0, local_step=0)
    hook.begin(sv)
    for local in (1, 2, 3, 4):
        sv.local_step, sv.examples = local, local * 100
        hook.after_step(sv, step=10 * local, loss=0.5)
    assert len(lines) == 2
    pattern = r"step (\d+), loss = 0\.50 \(\d+\.\d examples/sec; \d+\.\d{3} sec/batch\)"
    assert [int(re.fullmatch(pattern, line).group(1)) for line in lines] == [20, 40]


def test_nan_guard_names_the_step_and_the_parameter_that_holds_nan():
    model = Tiny()
    with torch.no_grad():
        model.w[2, 1] = float("nan")
    sv = fake_sv(model)
    with pytest.raises(TrainingError, match=r"nan at global step 17 on worker:0.*\['w'\]"):
        NanGuardHook().after_step(sv, 17, float("nan"))
    assert sv.diverged


def test_nan_guard_with_finite_parameters_blames_the_loss_and_lets_finite_losses_pass():
    sv = fake_sv()
    NanGuardHook().after_step(sv, 3, 0.25)
    assert not sv.diverged
    with pytest.raises(TrainingError, match="inf at global step 4.*Every parameter is finite"):
        NanGuardHook().after_step(sv, 4, float("inf"))


# -------------------------------------------------------------------- argument checks


def fake_task(**members: Any) -> SimpleNamespace:
    """A stand-in for a task with every member the Supervisor uses (psflow.task.SupervisedTask):
    worker:0, the chief of a job of one replica started by hand, no logdir; ``members`` replace them."""
    defaults = {"task_id": "worker:0", "cluster": SimpleNamespace(num_tasks=lambda job: 0), "is_chief": True,
                "num_replicas": 1, "trainers": [], "logdir": None, "checkpoint_dir": None, "resume": None, "attempt": 0,
                "coordinator": None, "report": lambda **_: None}
    return SimpleNamespace(**{**defaults, **members})


def test_the_fake_task_has_every_member_of_a_supervised_task() -> None:
    from psflow.task import SupervisedTask, Task

    members = set(SupervisedTask.__annotations__) | {n for n in vars(SupervisedTask) if not n.startswith("_")}
    assert members == set(vars(fake_task())), "fake_task must stand in for every member the Supervisor uses"
    assert SupervisedTask in Task.__mro__  # explicitly, not only by shape


def task_with_trainer(ema_decay=None):
    return fake_task(trainers=[SimpleNamespace(ema_decay=ema_decay)])


@pytest.mark.parametrize("kwargs, message", [
    ({"save_model_secs": 0}, "save_model_secs must be a positive number of seconds or None; received 0"),
    ({"poll_s": 0}, "poll_s must be a positive number of seconds; received 0"),
    ({"max_steps": -3}, "max_steps must be a positive integer; received -3"),
    ({"keep_checkpoints": 0}, "keep_checkpoints must be a positive integer; received 0"),
    ({"summary_every_steps": 2.5}, "summary_every_steps must be a positive integer; received 2.5"),
    ({"ema_for_export": True}, "ema_for_export=True needs moving averages"),
])
def test_bad_supervisor_settings_are_rejected_with_the_value(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Supervisor(task_with_trainer(), **kwargs)


def test_supervisor_without_a_trainer_says_to_create_one_first():
    task = fake_task(task_id="worker:1", is_chief=False)
    with pytest.raises(ConfigError, match=r"worker:1 has no Trainer.*pf.Trainer\(model"):
        Supervisor(task)


def test_supervisor_defaults_to_the_tasks_logdir_and_first_trainer(tmp_path):
    task = task_with_trainer(ema_decay=0.9)
    task.logdir = str(tmp_path)
    sv = Supervisor(task, ema_for_export=True)
    assert sv.trainer is task.trainers[0]
    assert sv.checkpoint_dir == (tmp_path / "checkpoints").resolve()


# ----------------------------------------------------------------- the crash-save fault


def test_save_fault_parses_and_is_ignored_by_the_step_injector():
    faults = parse_faults("ps:1@save=2:crash_after=100, worker:0@step=3:stall=0")
    assert (faults[0].task, faults[0].step, faults[0].action, faults[0].crash_after_bytes) == ("ps:1", 2, "crash_save", 100)
    inject(faults, "ps:1", 2)  # a save fault never fires on a training step


@pytest.mark.parametrize("spec", ["ps:0@save=0:crash_after=5", "ps:0@save=1", "ps:0@save=1:crash_after=-1"])
def test_bad_save_fault_spec_names_the_syntax(spec):
    with pytest.raises(ConfigError, match=re.escape(spec) + ".*crash_after=BYTES"):
        parse_faults(spec)


def test_crash_fault_kills_the_process_mid_write_and_leaves_no_whole_checkpoint(tmp_path):
    program = f"""
import torch
from psflow import checkpoint
from psflow.fault import crashing_save, parse_faults

def save(meta):
    rec = checkpoint.write_shard(meta["root"], meta["step"], 0, 1, {{"w": torch.ones(1000)}},
                                 _crash_after_bytes=meta.get("crash_after_bytes"))
    return {{"record": rec.to_dict()}}

save = crashing_save(save, parse_faults("ps:0@save=2:crash_after=77"), "ps:0")
r = save({{"root": {str(tmp_path)!r}, "step": 10}})
checkpoint.commit({str(tmp_path)!r}, 10, [checkpoint.ShardRecord.from_dict(r["record"])], meta={{}})
print("first saved", flush=True)
save({{"root": {str(tmp_path)!r}, "step": 20}})
print("still alive", flush=True)
"""
    p = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False)

    assert p.returncode == -9, p.stdout + p.stderr
    assert "first saved" in p.stdout and "injected crash while writing checkpoint 2 (step 20)" in p.stdout
    assert "still alive" not in p.stdout
    leftovers = list((tmp_path / "ckpt-0000000020.partial").glob("*.tmp"))
    assert [f.stat().st_size for f in leftovers] == [77]
    assert checkpoint.latest_checkpoint(tmp_path).step == 10


# ------------------------------------------------------------------------ event files


def read_events(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_event_writer_writes_scalars_and_histograms_per_task_and_skips_nan_histograms(tmp_path):
    w = EventWriter(tmp_path, "worker:1")
    w.scalars(10, {"loss": 0.5, "learning_rate": 0.01})
    w.scalars(20, {"loss": 0.25, "learning_rate": 0.01})
    w.histograms(20, {"w": torch.arange(12.0).reshape(3, 4), "bad": torch.tensor([1.0, float("nan")])}, prefix="parameters/")
    w.close()

    assert summary_dir(tmp_path, "worker:1") == tmp_path / "summaries" / "worker-1" == w.path
    acc = read_events(w.path)
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(10, 0.5), (20, 0.25)]
    assert acc.Tags()["histograms"] == ["parameters/w"]
    assert acc.Histograms("parameters/w")[0].histogram_value.num == 12


# ------------------------------------------------------------------------- evaluator


def eval_task(tmp_path, **members):
    reports: dict = {}
    return fake_task(task_id="evaluator:0", logdir=str(tmp_path), report=lambda **m: reports.update(m), **members), reports


def accuracy_of(model: torch.nn.Module) -> dict[str, float]:
    return {"w_sum": float(model.w.sum()), "b0": float(model.b[0])}


def test_evaluator_evaluates_the_newest_checkpoint_reports_and_writes_events(tmp_path):
    full = tiny_model_tensors()
    write_checkpoint(tmp_path / "checkpoints", 30, full, 2)
    task, reports = eval_task(tmp_path)

    results = run_evaluator(task, Tiny, accuracy_of, poll_s=0.05, once=True)

    expected = {"w_sum": pytest.approx(float(full["w"].sum())), "b0": pytest.approx(float(full["b"][0]))}
    assert results == {30: expected}
    assert reports["eval"] == {"step": 30, **expected}
    acc = read_events(tmp_path / "summaries" / "evaluator-0")
    assert [e.step for e in acc.Scalars("eval/w_sum")] == [30]


def test_evaluator_reads_the_checkpoints_of_the_task_s_checkpoint_dir_not_the_logdir_s(tmp_path):
    full = tiny_model_tensors()
    write_checkpoint(tmp_path / "logdir" / "checkpoints", 5, tiny_model_tensors(), 1)  # not the run's: never read
    write_checkpoint(tmp_path / "elsewhere", 40, full, 2)
    task, _ = eval_task(tmp_path / "logdir", checkpoint_dir=str(tmp_path / "elsewhere"))

    results = run_evaluator(task, Tiny, accuracy_of, poll_s=0.05, once=True)

    assert results == {40: {"w_sum": pytest.approx(float(full["w"].sum())), "b0": pytest.approx(float(full["b"][0]))}}


def test_evaluator_exits_on_a_done_file_written_after_it_started(tmp_path):
    write_checkpoint(tmp_path / "checkpoints", 8, tiny_model_tensors(), 1)
    task, _ = eval_task(tmp_path)
    done = tmp_path / "DONE"

    def eval_and_finish(model):
        done.write_text(json.dumps({"global_step": 8}))  # the chief finishes while we evaluate
        return accuracy_of(model)

    t0 = time.monotonic()
    results = run_evaluator(task, Tiny, eval_and_finish, poll_s=0.05, timeout_s=30)
    assert list(results) == [8] and time.monotonic() - t0 < 25


def test_evaluator_ignores_a_done_file_left_by_an_earlier_run(tmp_path, capsys):
    done = tmp_path / "DONE"
    done.write_text("{}")
    old = time.time() - 3600
    os.utime(done, (old, old))
    task, _ = eval_task(tmp_path)
    results = run_evaluator(task, Tiny, accuracy_of, poll_s=0.05, timeout_s=0.3)
    assert results == {}
    assert "no DONE file" in capsys.readouterr().out  # it watched until timeout_s, not until the stale DONE


def test_load_into_rejects_a_checkpoint_of_another_model():
    with pytest.raises(CheckpointError, match=r"no values for \['w'\]"):
        load_into(Tiny(), {"b": torch.zeros(3)})
    with pytest.raises(CheckpointError, match=r"'w' has shape \(2, 3\); the model's is \(6, 3\)"):
        load_into(Tiny(), {"w": torch.zeros(2, 3), "b": torch.zeros(3)})


def test_state_dict_from_returns_model_order(tmp_path):
    ckpt = checkpoint.read_checkpoint(write_checkpoint(tmp_path, 1, tiny_model_tensors(), 2))
    assert list(state_dict_from(ckpt)) == ["w", "b"]


# ------------------------------------------------------- start: restore, refuse, resume deliberately


class FakeTrainer:
    """What the Supervisor's start and end need from a trainer, with no ps behind it."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(strategy="ps", mode="sync", ready_timeout_s=1.0)
        self.params = dict(Tiny().named_parameters())
        self.ema_decay = None
        self.global_step = self.local_step = 0
        self.worker = 0
        self.restored: int | None = None
        self.prepared = False
        self.chief_logdir: str | None = None  # the chief sets it; prepare() gives every task the ps's
        self.ps_logdir: str | None = None  # what the ps hold (the first chief's), when the test says so
        self.ready_info: dict[str, object] = {}
        self.stopped = False

    def plan_steps(self, **_):
        pass

    def ps_initialized(self):
        return False

    def restore_from(self, step, tensors, **_):
        self.restored = step

    def prepare(self):
        self.prepared = True
        self.global_step = self.restored or 0
        self.chief_logdir = self.ps_logdir or self.chief_logdir
        return self.global_step

    def job_step(self):
        return self.global_step

    def waiting(self, what):
        return contextlib.nullcontext()

    def close(self, failed=None):
        pass

    def stop_reconnecting(self, reason):
        pass


def chief_task(logdir, *, resume=None, index=0):
    trainer = FakeTrainer()
    return fake_task(task_id=f"worker:{index}", trainers=[trainer], logdir=logdir, is_chief=index == 0, resume=resume)


def corrupt(path: Path) -> Path:
    shard = min(path.glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


def test_a_chief_whose_checkpoints_are_all_corrupt_fails_instead_of_starting_at_step_0(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    bad = [corrupt(write_checkpoint(root, step, tiny_model_tensors(), 1)) for step in (100, 200)]
    task = chief_task(str(tmp_path))

    with pytest.raises(CheckpointError) as caught, Supervisor(task, save_model_secs=None, summary_every_steps=None):
        pytest.fail("the loop must not run")

    message = str(caught.value)
    assert all(str(f) in message for f in bad) and "sha256" in message
    assert "another logdir" in message and f"mv {root.resolve()}" in message
    assert not task.trainers[0].prepared  # the ps were never initialized at step 0
    assert "initialized at step 0" not in capsys.readouterr().out


def test_each_run_that_names_no_logdir_gets_its_own_and_says_which(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # runs/ is relative, as psflow run's
    monkeypatch.setattr(sys, "argv", ["examples/mnist_softmax.py"])
    logdirs = []
    for _ in range(2):
        with Supervisor(chief_task(None), save_model_secs=None, summary_every_steps=None) as sv:
            assert sv.start_step == 0 and sv.restored_from is None
        logdirs.append(sv.logdir)
        write_checkpoint(sv.logdir / "checkpoints", 300, tiny_model_tensors(), 1)  # what a run leaves

    first, second = logdirs
    assert first != second and first.parent == second.parent == Path("runs")
    assert all(re.fullmatch(r"mnist_softmax-\d{8}-\d{6}-[0-9a-f]{6}", d.name) for d in logdirs), logdirs
    assert (first / ".psflow.lock").exists() and (second / ".psflow.lock").exists()  # the chief held each
    out = capsys.readouterr().out
    assert f"worker:0: logdir {first} (this run's own" in out and f"worker:0: logdir {second} (" in out


def test_resume_without_a_logdir_is_refused_naming_the_newest_run_of_the_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["examples/mnist_softmax.py"])
    for name in ("mnist_softmax-20260101-100000-aaaaaa", "mnist_softmax-20260102-100000-bbbbbb", "mnist_cnn-20260103-100000-cccccc"):
        (tmp_path / "runs" / name).mkdir(parents=True)
    task = chief_task(None, resume=True)  # PSFLOW_RESUME=1, no logdir

    with pytest.raises(ConfigError) as caught, Supervisor(task, save_model_secs=None, summary_every_steps=None):
        pytest.fail("the loop must not run")

    message = str(caught.value)
    assert "named no logdir" in message and "--logdir DIR" in message and "PSFLOW_LOGDIR=DIR" in message
    assert "The newest run of mnist_softmax here is runs/mnist_softmax-20260102-100000-bbbbbb." in message
    assert not task.trainers[0].prepared


def test_a_worker_that_names_no_logdir_writes_in_the_chiefs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    task = chief_task(None, index=1)
    task.trainers[0].ps_logdir = "runs/the-chiefs"  # what the chief's PS_INIT gave the ps

    with Supervisor(task, save_model_secs=None) as sv:
        assert sv.logdir == Path("runs/the-chiefs")
        assert sv.checkpoint_dir == (tmp_path / "runs" / "the-chiefs" / "checkpoints")

    assert (tmp_path / "runs" / "the-chiefs" / "summaries" / "worker-1").is_dir()
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["the-chiefs"]  # no directory of its own


def test_a_restarted_chief_that_names_no_logdir_goes_on_in_the_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    task = chief_task(None)
    trainer = task.trainers[0]
    trainer.ps_logdir = "runs/first-chiefs"
    trainer.ps_initialized = lambda: True  # the ps kept the job: this chief takes over

    with Supervisor(task, save_model_secs=None, summary_every_steps=None) as sv:
        assert sv.took_over and sv.logdir == Path("runs/first-chiefs")

    assert (tmp_path / "runs" / "first-chiefs" / ".psflow.lock").exists()  # it holds the run's logdir
    assert (tmp_path / "runs" / "first-chiefs" / "DONE").exists()
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["first-chiefs"]
    assert "took over as chief" in capsys.readouterr().out


@pytest.mark.parametrize("how", ["named logdir", "resume=True", "PSFLOW_RESUME=1"])
def test_resuming_is_deliberate_and_says_from_which_checkpoint_and_step(tmp_path, monkeypatch, capsys, how):
    monkeypatch.chdir(tmp_path)
    path = write_checkpoint(tmp_path / "runs" / "mine" / "checkpoints", 300, tiny_model_tensors(), 1)
    task = chief_task("runs/mine", resume=True if how == "PSFLOW_RESUME=1" else None)

    with Supervisor(task, save_model_secs=None, summary_every_steps=None,
                    resume=True if how == "resume=True" else None) as sv:
        assert sv.start_step == 300 and sv.restored_from == path.resolve()

    assert f"worker:0: restored from {path.resolve()} at step 300" in capsys.readouterr().out


def test_an_evaluator_that_names_no_logdir_is_refused(tmp_path):
    task = fake_task(task_id="evaluator:0", logdir=None)
    with pytest.raises(ConfigError, match=r"evaluator:0 has no logdir to follow.*PSFLOW_LOGDIR=DIR"):
        run_evaluator(task, Tiny, accuracy_of, poll_s=0.05, once=True)


def test_resume_false_refuses_a_named_logdir_that_holds_checkpoints(tmp_path):
    write_checkpoint(tmp_path / "checkpoints", 300, tiny_model_tensors(), 1)
    refused = r"resume=False, but .* holds 1 checkpoint\(s\) \(newest ckpt-0000000300\)"
    with pytest.raises(ConfigError, match=refused), Supervisor(chief_task(str(tmp_path)), save_model_secs=None, resume=False):
        pass
    # An empty logdir is a fresh start either way.
    with Supervisor(chief_task(str(tmp_path / "fresh")), save_model_secs=None, summary_every_steps=None, resume=False) as sv:
        assert sv.start_step == 0 and sv.restored_from is None


@pytest.mark.parametrize("raw, value", [("1", True), ("true", True), ("0", False), ("no", False), ("", None)])
def test_psflow_resume_is_read_as_a_flag(raw, value):
    from psflow.taskenv import TaskEnv

    assert TaskEnv.parse({"PSFLOW_RESUME": raw}).resume is value


def test_a_bad_psflow_resume_names_the_value():
    from psflow.taskenv import TaskEnv

    with pytest.raises(ConfigError, match=r"PSFLOW_RESUME must be 1 or 0.*'maybe'"):
        TaskEnv.parse({"PSFLOW_RESUME": "maybe"})


def test_a_step_the_ps_refused_at_the_jobs_stop_ends_the_loop_of_a_worker_without_max_steps(tmp_path):
    task = chief_task(str(tmp_path))
    trainer = task.trainers[0]
    trainer.stopped = False

    def refused_step(closure, batch_size=None):
        trainer.stopped = True  # what the trainer reports when the ps replied "stopped"
        return 0.5

    trainer.step = refused_step
    with Supervisor(task, save_model_secs=None, summary_every_steps=None) as sv:  # no max_steps of its own
        sv.step(lambda: torch.tensor(0.5), batch_size=10)
        assert sv.should_stop() and "stop step" in sv.stop_reason
        assert sv.examples == 0 and sv.last_loss is None  # a refused batch is not counted


def test_a_chief_started_by_hand_holds_its_logdir_and_a_second_one_is_refused(tmp_path):
    from psflow.logdirlock import LOCK_FILE, Holder, LogdirInUseError, LogdirLock, this_holder

    lock = tmp_path / LOCK_FILE
    with Supervisor(chief_task(str(tmp_path)), save_model_secs=None, summary_every_steps=None):
        holder = Holder.from_text(lock.read_text())
        assert (holder.run_id, holder.pid, holder.role) == ("worker:0", os.getpid(), "chief started by hand")
        with pytest.raises(LogdirInUseError, match=r"in use by a chief started by hand \(worker:0; pid"):
            LogdirLock(lock, this_holder("run-2"), where=str(tmp_path)).acquire()
    assert lock.read_text() == ""  # given up at the end
    other = LogdirLock(lock, this_holder("run-2"), where=str(tmp_path))
    other.acquire()
    try:
        with pytest.raises(LogdirInUseError, match=f"{tmp_path} is in use by run run-2"), \
                Supervisor(chief_task(str(tmp_path)), save_model_secs=None, summary_every_steps=None):
            pass
    finally:
        other.release()
    # under a launcher the launcher holds the logdir, not its chief
    task = chief_task(str(tmp_path / "launched"))
    task.coordinator = "127.0.0.1:1"
    with Supervisor(task, save_model_secs=None, summary_every_steps=None):
        assert not (tmp_path / "launched" / LOCK_FILE).exists()
