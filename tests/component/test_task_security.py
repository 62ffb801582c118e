"""What ``psflow.init`` refuses before anything listens: no secret off loopback, unauthenticated all-reduce off loopback.

``init`` runs in this process with an explicit ``env`` and the seeds' flags; the by-hand tasks bind
the ports in their flags (free loopback ports). A refused start must leave nothing listening.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
import torch

import psflow as pf
from psflow.errors import ConfigError
from psflow.task import Task, init

pytestmark = pytest.mark.timeout(60)

SECRET = "job-secret"
ALLREDUCE = json.dumps({"strategy": "allreduce", "mode": "sync"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.fixture
def started() -> Iterator[list[Task]]:
    """Tasks a test started; finished (servers stopped) at teardown."""
    tasks: list[Task] = []
    yield tasks
    for t in tasks:
        t.finish()


def flags(job: str, index: int, *, ps: list[str] | None = None, workers: list[str]) -> list[str]:
    out = [f"--worker_hosts={','.join(workers)}", f"--job_name={job}", f"--task_index={index}"]
    return ([f"--ps_hosts={','.join(ps)}"] if ps else []) + out


# --- no secret: the rule follows the address actually bound --------------------------------------


def test_without_a_secret_a_task_bound_off_loopback_refuses_to_start_even_with_a_loopback_spec() -> None:
    port = free_port()
    argv = flags("worker", 0, ps=[f"localhost:{free_port()}"], workers=[f"localhost:{port}"])
    with pytest.raises(ConfigError, match=r"No job secret, and this task would listen on '0\.0\.0\.0' \(PSFLOW_BIND_HOST\), "
                                          r"which is not loopback.*PSFLOW_SECRET=\.\.\. or --secret-file=PATH.*unset PSFLOW_BIND_HOST"):
        init(argv, env={"PSFLOW_BIND_HOST": "0.0.0.0"})
    assert not listening(port)


def test_with_a_secret_a_task_may_listen_on_every_interface(started: list[Task]) -> None:
    port = free_port()
    argv = flags("worker", 0, ps=[f"localhost:{free_port()}"], workers=[f"localhost:{port}"])
    started.append(init(argv, env={"PSFLOW_BIND_HOST": "0.0.0.0", "PSFLOW_SECRET": SECRET}))
    assert started[0].server.host == "0.0.0.0" and listening(port)


# --- all-reduce off loopback: refused unless the user opts in ------------------------------------

UNPROTECTED = (r"its traffic is not protected by the job secret: torch\.distributed's rendezvous store \(TCPStore\) and "
               r"gloo's connections.*--allow-unauthenticated-allreduce \(PSFLOW_ALLOW_UNAUTHENTICATED_ALLREDUCE=1")


@pytest.mark.parametrize(
    ("where", "index", "extra_env", "exposed"),
    [
        pytest.param("chief off loopback", 1, {}, r"cluster host 10\.1\.2\.3", id="spec"),
        pytest.param("loopback spec", 0, {"PSFLOW_BIND_HOST": "0.0.0.0"}, r"bind host 0\.0\.0\.0 \(PSFLOW_BIND_HOST\)", id="bind-host"),
        pytest.param("loopback spec", 0, {"GLOO_SOCKET_IFNAME": "eth0"}, r"gloo interface eth0 \(GLOO_SOCKET_IFNAME\)", id="gloo-ifname"),
    ],
)
def test_allreduce_off_loopback_is_refused_naming_what_is_unprotected_and_the_opt_in(
    where: str, index: int, extra_env: dict[str, str], exposed: str
) -> None:
    ports = [free_port(), free_port()]
    chief = "10.1.2.3" if where == "chief off loopback" else "127.0.0.1"
    argv = flags("worker", index, workers=[f"{chief}:{ports[0]}", f"127.0.0.1:{ports[1]}"])
    env = {"PSFLOW_SECRET": SECRET, "PSFLOW_TRAIN_CONFIG": ALLREDUCE, **extra_env}
    with pytest.raises(ConfigError, match=rf"The all-reduce strategy would run off loopback \({exposed}\), and {UNPROTECTED}"):
        init(argv, env=env)
    assert not listening(ports[index])  # neither the rendezvous store nor the task's server was started


@pytest.mark.parametrize("opt_in", ["env", "train-config"])
def test_allreduce_off_loopback_starts_when_the_user_opts_in(opt_in: str, started: list[Task]) -> None:
    ports = [free_port(), free_port()]
    argv = flags("worker", 1, workers=[f"10.1.2.3:{ports[0]}", f"127.0.0.1:{ports[1]}"])
    if opt_in == "env":
        env = {"PSFLOW_TRAIN_CONFIG": ALLREDUCE, "PSFLOW_ALLOW_UNAUTHENTICATED_ALLREDUCE": "1"}
    else:
        env = {"PSFLOW_TRAIN_CONFIG": json.dumps({**json.loads(ALLREDUCE), "allow_unauthenticated_allreduce": True})}
    started.append(init(argv, env={"PSFLOW_SECRET": SECRET, **env}))
    assert started[0].config.allow_unauthenticated_allreduce and listening(ports[1])


def test_a_trainer_switched_to_allreduce_checks_too_before_joining_the_group(started: list[Task]) -> None:
    """The strategy may be chosen in the script (``pf.Trainer(..., strategy="allreduce")``), after init."""
    ports = [free_port() for _ in range(3)]
    argv = flags("worker", 1, ps=[f"127.0.0.1:{ports[2]}"], workers=[f"10.1.2.3:{ports[0]}", f"127.0.0.1:{ports[1]}"])
    task = init(argv, env={"PSFLOW_SECRET": SECRET})
    started.append(task)
    trainer = pf.Trainer(torch.nn.Linear(2, 1), pf.optim.SGD(lr=0.1), task, strategy="allreduce", mode="sync")
    with pytest.raises(ConfigError, match=rf"cluster host 10\.1\.2\.3\), and {UNPROTECTED}"):
        trainer.prepare()
