"""The Slurm backend across hosts, its pure parts: which address the launcher's coordinator binds
(:mod:`psflow.launch.nodenet`), and a lost node read from Slurm's answers (:func:`node_failure`).
No Slurm needed; the answers are scontrol's, as Slurm 22.05 printed them on tools/slurm_cluster.sh."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from click.testing import CliRunner

from psflow.cli import main
from psflow.errors import ConfigError
from psflow.launch.nodenet import coordinator_address, local_interfaces, route_source
from psflow.launch.slurm import NodeFailure, is_lost, node_failure, parse_nodes

ROOT = Path(__file__).resolve().parents[2]
SOFTMAX = str(ROOT / "examples" / "mnist_softmax.py")

ITF = ipaddress.IPv4Interface


def no_route(address: str) -> str:
    raise AssertionError(f"no route lookup expected (asked for {address})")


def test_nodes_on_loopback_get_a_coordinator_on_loopback():
    assert coordinator_address(["127.0.0.1", "127.0.0.3"], [ITF("10.0.0.5/24")], no_route) == "127.0.0.1"
    assert coordinator_address([], [ITF("10.0.0.5/24")], no_route) == "127.0.0.1"


def test_the_interface_whose_subnet_holds_every_node_is_chosen():
    interfaces = [ITF("127.0.0.1/8"), ITF("192.168.1.4/24"), ITF("10.77.0.200/24")]
    assert coordinator_address(["10.77.0.1", "10.77.0.3"], interfaces, no_route) == "10.77.0.200"


def test_without_a_shared_subnet_the_routes_source_is_chosen_when_it_is_one():
    interfaces = [ITF("10.1.0.2/24")]
    assert coordinator_address(["10.2.0.7", "10.3.0.9"], interfaces, lambda a: "10.1.0.2") == "10.1.0.2"


def test_nodes_reached_from_different_addresses_are_refused_naming_the_option():
    routes = {"10.2.0.7": "10.2.0.1", "10.3.0.9": "10.3.0.1"}
    with pytest.raises(ConfigError, match="--coordinator-host") as e:
        coordinator_address(list(routes), [ITF("10.2.0.1/24"), ITF("10.3.0.1/24")], routes.__getitem__)
    assert "10.2.0.7 via 10.2.0.1" in str(e.value)


def test_this_hosts_interfaces_include_loopback_and_the_route_to_loopback_is_loopback():
    assert ITF("127.0.0.1/8") in local_interfaces()
    assert route_source("127.0.0.2").startswith("127.")


def test_coordinator_host_is_refused_for_a_local_run(tmp_path):
    r = CliRunner().invoke(main, ["run", "--coordinator-host", "10.0.0.1", "--logdir", str(tmp_path), SOFTMAX])
    assert r.exit_code == 2 and "--coordinator-host is for --backend slurm and --hosts" in r.output


SHOW_NODES = (
    "NodeName=127.0.0.2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=1 NodeAddr=10.77.0.2 NodeHostName=localhost "
    "OS=Linux 6.18.44 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=4000 State=MIXED ThreadsPerCore=1 Partitions=debug\n"
    "NodeName=127.0.0.3 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 NodeAddr=10.77.0.3 NodeHostName=localhost "
    "OS=Linux 6.18.44 #1 SMP  RealMemory=4000 State=DOWN+NOT_RESPONDING ThreadsPerCore=1 Partitions=debug "
    "Reason=power supply [root@2026-11-27T19:02:53]\n"
)


def test_scontrol_node_lines_give_each_nodes_address_state_and_reason():
    nodes = parse_nodes(SHOW_NODES)
    assert nodes["127.0.0.2"] == {"addr": "10.77.0.2", "state": "MIXED", "reason": ""}
    assert nodes["127.0.0.3"] == {"addr": "10.77.0.3", "state": "DOWN+NOT_RESPONDING", "reason": "power supply"}


@pytest.mark.parametrize(("state", "lost"), [("DOWN", True), ("IDLE+NOT_RESPONDING", True), ("down*", True),
                                             ("FAIL", True), ("MIXED", False), ("MIXED+DRAIN", False), ("", False)])
def test_a_node_is_lost_when_down_failing_or_not_responding_not_when_draining(state, lost):
    assert is_lost(state) is lost


def test_a_running_job_that_dropped_a_node_lost_it_and_goes_on():
    f = node_failure("7", "RUNNING", ["n1", "n2", "n3"], ["n1", "n2"], {"n3": {"state": "IDLE", "reason": ""}})
    assert f == NodeFailure("7", ("n3",), "RUNNING", {"n3": ""}) and not f.ends_run
    assert f.message() == "node n3 failed; Slurm job 7 goes on without it"


def test_a_requeued_job_with_a_down_node_lost_it_and_the_run_with_it():
    f = node_failure("7", "PENDING", ["n1", "n2"], [], parse_nodes(SHOW_NODES.replace("127.0.0.3", "n2")))
    assert f is not None and f.ends_run and f.nodes == ("n2",)
    assert f.message() == "node n2 (power supply) failed; Slurm requeued job 7"


def test_a_job_ended_node_fail_lost_a_node_even_if_none_is_down_now():
    f = node_failure("7", "NODE_FAIL", ["n1", "n2"], [], {})
    assert f is not None and f.message() == "nodes n1, n2 failed; Slurm job 7 ended (NODE_FAIL)"


@pytest.mark.parametrize(("state", "current"), [("RUNNING", ["n1", "n2"]), ("RUNNING", []), ("CANCELLED", []),
                                                ("PENDING", []), ("TIMEOUT", [])])
def test_no_node_lost_when_the_job_keeps_its_nodes_or_ends_otherwise(state, current):
    assert node_failure("7", state, ["n1", "n2"], current, {"n1": {"state": "MIXED"}, "n2": {"state": "IDLE"}}) is None


class _LosingCli:
    """Slurm's answers for a job on n1-n3 that then loses nodes: ``job`` and ``nodes`` are set by the test."""

    def __init__(self) -> None:
        self.job_answer = ("RUNNING", "None", "n[1-3]")
        self.node_states: dict[str, dict[str, str]] = {}

    def submit(self, script: Path) -> str:
        return "4242"

    def job(self, job_id: str) -> tuple[str, str, str]:
        return self.job_answer

    def nodes(self, names) -> dict[str, dict[str, str]]:  # noqa: ANN001
        return {n: self.node_states[n] for n in names if n in self.node_states}


def test_the_backend_reports_a_lost_nodes_task_and_fails_the_run_once_the_allocation_goes(tmp_path):
    from psflow.launch.plan import make_plan
    from psflow.launch.slurm import SlurmBackend

    lines: list[str] = []
    cli = _LosingCli()
    backend = SlurmBackend(nodes=3, echo=lines.append, cli=cli)  # type: ignore[arg-type]
    backend.open(make_plan(SOFTMAX, num_ps=1, num_workers=2, logdir=str(tmp_path / "run")))
    backend._task_node = {"ps:0": "n1", "worker:0": "n2", "worker:1": "n3"}  # as start() records them
    # n3 lost: the job goes on without it; worker:1 exits with a report saying so, the others have none.
    cli.job_answer = ("RUNNING", "None", "n[1-2]")
    backend._check_job()
    assert backend.nodes == ["n1", "n2"] and backend.failed_by() is None and backend.ended_by() is None
    report = backend.error_report("worker:1")
    assert report is not None and report["exception"] == "NodeFailure"
    assert report["message"] == "node n3 failed; Slurm job 4242 goes on without it"
    assert backend.error_report("worker:0") is None
    assert sum("node n3 failed" in line for line in lines) == 1
    backend._check_job()  # seen again: said once
    assert sum("node n3 failed" in line for line in lines) == 1
    # n1 lost too, the batch script's: the job ends, the run fails once, ps:0 blamed by the others' reports.
    cli.job_answer, cli.node_states = ("FAILED", "JobLaunchFailure", ""), {"n1": {"state": "DOWN", "reason": "psu"}}
    backend._check_job()
    assert backend.failed_by() == ("ps:0", "node n1 (psu) failed; Slurm job 4242 ended (FAILED)")
    assert backend.failed_by() is None and backend.ended_by() is None  # a failure, told once; never a stop
    assert backend.error_report("worker:0")["blame"] == "ps:0"  # type: ignore[index]
