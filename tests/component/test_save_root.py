"""Component tests: a PS_SAVE writes only inside the run's checkpoint directory (issue 23 item 5).

The ps is a real Server + PsService on 127.0.0.1 (tests/component/inproc.py) whose save handler is
given the run's checkpoint directory, as a ps task's is (PSFLOW_CHECKPOINT_DIR, else PSFLOW_LOGDIR);
the chief's PS_SAVE requests come over an authenticated connection. What is proven: a root outside
it (an absolute path elsewhere, a ``..`` escape, a symlink out, a URL elsewhere) is refused with a
ConfigError naming the directory and the root, and nothing is written there; a root inside it (the
directory, a subdirectory) writes the shard as before; a ps given no directory pins the first root
the chief names and refuses the others.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from inproc import SECRET, InprocCluster

from psflow import optim
from psflow.cluster import TaskId
from psflow.config import TrainConfig
from psflow.ps.saveroot import SaveRoot
from psflow.ps.service import default_save
from psflow.wire.conn import connect
from psflow.wire.ops import Op

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)

WAIT_S = 10.0


def save(c: InprocCluster, root: str, step: int = 1) -> tuple[int, dict[str, Any]]:
    """A PS_SAVE from the chief (worker:0); the reply's op and meta."""
    conn = connect(c.cluster.address(TaskId("ps", 0)), secret=SECRET, task="worker:0", peer="ps:0", deadline_s=WAIT_S)
    try:
        conn.set_timeout(WAIT_S)
        conn.send(Op.PS_SAVE, {"root": root, "step": step, "num_shards": 1, "timeout_s": 1.0})
        frame = conn.recv()
        return frame.op, frame.meta
    finally:
        conn.close()


@pytest.fixture
def run(tmp_path: Path) -> tuple[InprocCluster, Path]:
    """A cluster whose ps writes checkpoints under tmp_path/run/checkpoints, with its values initialized."""
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    with InprocCluster(1, 1, TrainConfig()) as c:
        service = c.services[0]
        service.on_save = default_save(service, SaveRoot("ps:0", checkpoint_dir=str(ckpts)))
        trainer = c.trainer(0, torch.nn.Linear(3, 2), optim.SGD(lr=0.1))
        trainer.prepare()
        yield c, ckpts
        trainer.close()


def test_a_save_inside_the_checkpoint_directory_writes_the_shard(run: tuple[InprocCluster, Path]) -> None:
    c, ckpts = run
    for root in (ckpts, ckpts / "nested", ckpts / "nested" / ".." / "again"):
        op, meta = save(c, str(root))
        assert op == Op.OK, meta
        assert list(Path(root).resolve().glob("ckpt-*/*")), f"nothing written under {root}"


@pytest.mark.parametrize("escape", ["elsewhere", "dotdot", "symlink", "sibling", "url"])
def test_a_save_outside_the_checkpoint_directory_is_refused_and_writes_nothing(
        run: tuple[InprocCluster, Path], tmp_path: Path, escape: str, caplog: pytest.LogCaptureFixture) -> None:
    c, ckpts = run
    outside = tmp_path / "outside"
    outside.mkdir()
    root = {
        "elsewhere": str(outside),
        "dotdot": f"{ckpts}/../../outside",
        "symlink": str(ckpts / "link"),
        "sibling": f"{ckpts}-other",  # a name that merely starts with the directory's
        "url": "s3://bucket/other-run/checkpoints",
    }[escape]
    if escape == "symlink":
        (ckpts / "link").symlink_to(outside, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="psflow.ps"):
        op, meta = save(c, root)
    assert op == Op.ERROR and meta["kind"] == "ConfigError", meta
    assert f"PS_SAVE refused: ps:0 writes checkpoints only inside {ckpts}, its checkpoint directory" in meta["error"]
    assert repr(root) in meta["error"], meta["error"]
    if escape in ("dotdot", "symlink"):
        assert f"which resolves to {str(outside)!r}" in meta["error"], meta["error"]
    assert not any(outside.iterdir()) and not Path(f"{ckpts}-other").exists()  # nothing written there
    assert save(c, str(ckpts))[0] == Op.OK  # the ps still saves where it may


def test_a_ps_with_only_a_logdir_saves_inside_it(tmp_path: Path) -> None:
    where = SaveRoot("ps:1", logdir=str(tmp_path / "run"))
    assert where.check(str(tmp_path / "run" / "checkpoints")) == str((tmp_path / "run" / "checkpoints").resolve())
    with pytest.raises(Exception, match=r"only inside .*run, its logdir \(PSFLOW_LOGDIR\); the chief asked for '/etc'"):
        where.check("/etc")


def test_a_url_checkpoint_directory_admits_its_own_prefix_only() -> None:
    where = SaveRoot("ps:0", checkpoint_dir="s3://bucket/run/")
    assert where.check("s3://bucket/run") == "s3://bucket/run"
    assert where.check("s3://bucket/run/checkpoints/") == "s3://bucket/run/checkpoints"
    for bad in ("s3://bucket/run2", "s3://bucket/run/../other", "gs://bucket/run", "/tmp/run"):
        with pytest.raises(Exception, match="PS_SAVE refused"):
            where.check(bad)


def test_a_ps_given_no_directory_pins_the_first_root_the_chief_names(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    with InprocCluster(1, 1, TrainConfig()) as c:  # default_save without a directory, as a ps by hand
        trainer = c.trainer(0, torch.nn.Linear(3, 2), optim.SGD(lr=0.1))
        trainer.prepare()
        first = tmp_path / "a" / "checkpoints"
        with caplog.at_level(logging.WARNING, logger="psflow.ps"):
            assert save(c, str(first))[0] == Op.OK
        assert f"writes checkpoints under {first} only, the first one the chief named" in caplog.text
        assert save(c, str(first), step=2)[0] == Op.OK
        op, meta = save(c, str(tmp_path / "b"), step=3)
        assert op == Op.ERROR and "the first checkpoint directory the chief named (pinned)" in meta["error"], meta
        assert not (tmp_path / "b").exists()
        trainer.close()
