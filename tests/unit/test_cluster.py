"""Unit tests of psflow.cluster (ClusterSpec invariants, TaskId) and psflow.resolve's flag / TF_CONFIG / Slurm sources."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from psflow.cluster import JOBS, ClusterSpec, TaskId, is_loopback_host, parse_address
from psflow.errors import ConfigError
from psflow.resolve.flags import parse_cluster_flags
from psflow.resolve.slurm import cluster_from_slurm_env, expand_slurm_nodelist, expand_slurm_tasks_per_node, slurm_task_nodes
from psflow.resolve.tfconfig import parse_tf_config

SEED_ARGV = [
    "--ps_hosts=localhost:9001",
    "--worker_hosts=localhost:9002,localhost:9003,localhost:9004",
    "--job_name=worker",
    "--task_index=1",
]


def spec(**jobs: list[str] | str) -> ClusterSpec:
    return ClusterSpec.from_dict(jobs)


# --- TaskId -------------------------------------------------------------------------------------


def test_task_id_prints_and_parses_as_job_colon_index() -> None:
    assert str(TaskId("worker", 1)) == "worker:1"
    assert TaskId.parse("worker:1") == TaskId("worker", 1)
    assert TaskId.parse("master:0") == TaskId("chief", 0)


@pytest.mark.parametrize("text", ["worker", "worker:", "worker:-1", "worker:x", ":1", "worker:1:2"])
def test_task_id_parse_rejects_malformed_text_naming_it(text: str) -> None:
    with pytest.raises(ConfigError, match="expected 'job:index'") as e:
        TaskId.parse(text)
    assert repr(text) in str(e.value)


def test_task_id_parse_rejects_unknown_job_naming_it() -> None:
    with pytest.raises(ConfigError, match="'learner'.*Allowed: chief, ps, worker, evaluator"):
        TaskId.parse("learner:0")


def test_task_id_rejects_negative_index() -> None:
    with pytest.raises(ConfigError, match="Received: -1"):
        TaskId("worker", -1)


# --- addresses ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("addr", "expected"),
    [("localhost:2222", ("localhost", 2222)), ("10.0.0.1:1", ("10.0.0.1", 1)), ("[::1]:2222", ("::1", 2222)),
     ("node-1.cluster_a:65535", ("node-1.cluster_a", 65535))],
)
def test_parse_address_splits_host_and_port(addr: str, expected: tuple[str, int]) -> None:
    assert parse_address(addr) == expected


@pytest.mark.parametrize("addr", ["localhost", ":2222", "::1:2222", "[::1]2222", "[nothost]:1", "my host:1", "h/x:1"])
def test_parse_address_rejects_malformed_address_naming_it(addr: str) -> None:
    with pytest.raises(ConfigError, match="Malformed address") as e:
        parse_address(addr)
    assert repr(addr) in str(e.value)


@pytest.mark.parametrize("addr", ["localhost:http", "localhost: 2223", "localhost:-1", "localhost:1.5"])
def test_parse_address_rejects_port_that_is_not_an_integer(addr: str) -> None:
    with pytest.raises(ConfigError, match="is not an integer") as e:
        parse_address(addr)
    assert repr(addr) in str(e.value)


@pytest.mark.parametrize("addr", ["localhost:0", "localhost:65536", "localhost:9999999"])
def test_parse_address_rejects_port_out_of_range(addr: str) -> None:
    with pytest.raises(ConfigError, match=r"out of range\. Use a port in 1\.\.65535"):
        parse_address(addr)


def test_parse_address_allows_port_zero_only_when_asked() -> None:
    assert parse_address("localhost:0", allow_port_zero=True) == ("localhost", 0)


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST", "127.0.0.1", "127.3.2.1", "::1", "[::1]", "::ffff:127.0.0.1"])
def test_loopback_hosts_are_recognised(host: str) -> None:
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["10.0.0.1", "128.0.0.1", "::2", "node1", "localhost.example.com", ""])
def test_other_hosts_are_not_loopback(host: str) -> None:
    assert not is_loopback_host(host)


# --- ClusterSpec validation ---------------------------------------------------------------------


def test_unknown_job_is_rejected_naming_it() -> None:
    with pytest.raises(ConfigError, match="Unknown job name 'local'.*Allowed: chief, ps, worker, evaluator"):
        spec(local=["localhost:2222"], worker=["localhost:2223"])


def test_master_is_read_as_chief_and_cannot_appear_beside_chief() -> None:
    s = ClusterSpec.from_dict({"master": ["h:1"], "ps": ["h:2"]})
    assert s.to_dict() == {"chief": ["h:1"], "ps": ["h:2"]}
    with pytest.raises(ConfigError, match="'chief' is given twice"):
        ClusterSpec.from_dict({"master": ["h:1"], "chief": ["h:3"], "ps": ["h:2"]})


def test_more_than_one_chief_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"has 2 'chief' tasks\. Received: .*'h:1', 'h:2'.*At most one"):
        spec(chief=["h:1", "h:2"], ps=["h:3"])


def test_duplicate_address_is_rejected_with_both_tasks_named() -> None:
    with pytest.raises(ConfigError, match="'localhost:2222' is used by both ps:0 and worker:1"):
        spec(ps=["localhost:2222"], worker=["localhost:2223", "localhost:2222"])


def test_duplicate_address_check_ignores_host_case() -> None:
    with pytest.raises(ConfigError, match="used by both worker:0 and worker:1"):
        spec(ps=["h:1"], worker=["Node1:2", "node1:2"])


def test_malformed_address_is_rejected_naming_task_and_value() -> None:
    with pytest.raises(ConfigError, match="Task worker:1: Malformed address 'localhost'"):
        spec(ps=["localhost:1"], worker=["localhost:2", "localhost"])


def test_non_integer_port_is_rejected_naming_it() -> None:
    with pytest.raises(ConfigError, match="Port 'abc' in address 'localhost:abc' is not an integer"):
        spec(ps=["localhost:abc"], worker=["localhost:2"])


def test_port_out_of_range_is_rejected_naming_it() -> None:
    with pytest.raises(ConfigError, match="Port 70000 in address 'h:70000' is out of range"):
        spec(ps=["h:1"], worker=["h:70000"])


def test_port_zero_is_a_placeholder_only_when_allowed() -> None:
    with pytest.raises(ConfigError, match="Port 0 in address 'h:0' is out of range"):
        spec(ps=["h:0"], worker=["h:1"])
    placeholders = ClusterSpec.from_dict({"ps": ["h:0"], "worker": ["h:0", "h:0"]}, allow_port_zero=True)
    assert placeholders.num_tasks("worker") == 2  # placeholders may repeat: they are not addresses yet


def test_empty_job_list_is_rejected_naming_the_job() -> None:
    with pytest.raises(ConfigError, match=r"Job 'ps' has no tasks\. Received: \{'ps': \[\], 'worker': \['h:1'\]\}"):
        spec(ps=[], worker=["h:1"])


def test_spec_without_worker_or_chief_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"neither a 'worker' nor a 'chief'.*Received: \{'ps': \['h:1'\]\}"):
        spec(ps=["h:1"])


def test_missing_ps_is_rejected_unless_not_required() -> None:
    with pytest.raises(ConfigError) as e:
        spec(worker=["127.0.0.1:2223"])
    assert str(e.value) == (
        "ClusterSpec has no 'ps' task. Received: {'worker': ['127.0.0.1:2223']}. "
        "Parameter-server training needs at least one."
    )
    assert ClusterSpec.from_dict({"worker": ["127.0.0.1:2223"]}, require_ps=False).num_tasks("ps") == 0


def test_addresses_that_are_neither_list_nor_string_are_rejected() -> None:
    with pytest.raises(ConfigError, match="Tasks of job 'worker' must be a list.*Received: 2222"):
        ClusterSpec.from_dict({"ps": ["h:1"], "worker": 2222})  # type: ignore[dict-item]


def test_comma_separated_string_is_read_as_a_list() -> None:
    s = spec(ps="h:1", worker=" h:2, h:3 ")
    assert s.jobs["worker"] == ("h:2", "h:3")


def test_jobs_are_kept_in_canonical_order_and_equality_ignores_input_order() -> None:
    a = ClusterSpec.from_dict({"evaluator": ["h:4"], "worker": ["h:3"], "ps": ["h:2"], "chief": ["h:1"]})
    b = ClusterSpec.from_dict({"chief": ["h:1"], "ps": ["h:2"], "worker": ["h:3"], "evaluator": ["h:4"]})
    assert list(a.jobs) == list(JOBS) and a == b and hash(a) == hash(b)
    assert [str(t) for t in a.tasks()] == ["chief:0", "ps:0", "worker:0", "evaluator:0"]


def test_spec_is_immutable() -> None:
    s = spec(ps=["h:1"], worker=["h:2"])
    with pytest.raises(TypeError):
        s.jobs["worker"] = ("h:9",)  # type: ignore[index]
    with pytest.raises(AttributeError):
        s.job_tasks = ()  # type: ignore[misc]


# --- ClusterSpec queries ------------------------------------------------------------------------


def test_address_and_out_of_range_message() -> None:
    s = spec(ps=["h:1"], worker=["h:2", "h:3", "h:4"])
    assert s.address(TaskId("worker", 2)) == "h:4"
    with pytest.raises(ConfigError) as e:
        s.address(TaskId("worker", 5))
    assert str(e.value) == "worker:5 is out of range: job 'worker' has 3 tasks (worker:0..worker:2)."


def test_check_task_rejects_job_not_in_spec_naming_jobs_that_exist() -> None:
    s = spec(ps=["h:1"], worker=["h:2"])
    with pytest.raises(ConfigError, match="job 'evaluator' is not in the cluster. Jobs that exist: ps, worker"):
        s.check_task(TaskId("evaluator", 0))
    with pytest.raises(ConfigError, match=r"ps:1 is out of range: job 'ps' has 1 task \(ps:0\)"):
        s.check_task(TaskId("ps", 1))


def test_num_tasks_is_zero_for_absent_job() -> None:
    s = spec(ps=["h:1"], worker=["h:2", "h:3"])
    assert (s.num_tasks("worker"), s.num_tasks("chief"), s.num_tasks("nonsense")) == (2, 0, 0)


def test_chief_is_chief_0_when_present_else_worker_0() -> None:
    with_chief = spec(chief=["h:9"], ps=["h:1"], worker=["h:2"])
    without = spec(ps=["h:1"], worker=["h:2", "h:3"])
    assert with_chief.chief() == TaskId("chief", 0) and not with_chief.is_chief(TaskId("worker", 0))
    assert without.chief() == TaskId("worker", 0) and without.is_chief(TaskId("worker", 0))
    assert not without.is_chief(TaskId("worker", 1))


def test_with_address_replaces_one_task_and_keeps_policy() -> None:
    placeholders = ClusterSpec.from_dict({"ps": ["h:0"], "worker": ["h:0", "h:0"]}, allow_port_zero=True)
    filled = placeholders.with_address(TaskId("worker", 1), "h:5001")
    assert filled.to_dict() == {"ps": ["h:0"], "worker": ["h:0", "h:5001"]}
    assert placeholders.to_dict() == {"ps": ["h:0"], "worker": ["h:0", "h:0"]}
    with pytest.raises(ConfigError, match="'h:5001' is used by both ps:0 and worker:1"):
        filled.with_address(TaskId("ps", 0), "h:5001")
    with pytest.raises(ConfigError, match="worker:2 is out of range"):
        filled.with_address(TaskId("worker", 2), "h:5002")


def test_hosts_are_the_distinct_hosts_without_brackets() -> None:
    s = spec(ps=["a:1", "[::1]:2"], worker=["a:3", "b:4"])
    assert s.hosts() == {"a", "::1", "b"}


# --- JSON and round trips -----------------------------------------------------------------------

_host = st.sampled_from(["localhost", "127.0.0.1", "node-1", "[::1]", "10.1.2.3"])


@st.composite
def valid_specs(draw: st.DrawFn) -> dict[str, list[str]]:
    sizes = {
        "chief": draw(st.integers(0, 1)),
        "ps": draw(st.integers(1, 3)),
        "worker": draw(st.integers(0, 4)),
        "evaluator": draw(st.integers(0, 1)),
    }
    if sizes["chief"] + sizes["worker"] == 0:
        sizes["worker"] = 1
    total = sum(sizes.values())
    ports = draw(st.lists(st.integers(1, 65535), min_size=total, max_size=total, unique=True))
    addrs = iter(f"{draw(_host)}:{p}" for p in ports)
    return {job: [next(addrs) for _ in range(n)] for job, n in sizes.items() if n}


@given(valid_specs())
def test_json_and_dict_round_trip_for_any_valid_spec(d: dict[str, list[str]]) -> None:
    s = ClusterSpec.from_dict(d)
    assert ClusterSpec.from_json(s.to_json()) == s
    assert ClusterSpec.from_dict(s.to_dict()) == s
    assert s.to_dict() == {job: d[job] for job in JOBS if job in d}
    assert len(s.tasks()) == sum(len(v) for v in d.values())
    assert all(s.address(t) == d[t.job][t.index] for t in s.tasks())
    assert all(TaskId.parse(str(t)) == t for t in s.tasks())


def test_from_json_reports_position_and_snippet_of_malformed_json() -> None:
    with pytest.raises(ConfigError) as e:
        ClusterSpec.from_json('{"ps": ["h:1"], "worker" ["h:2"]}')
    assert "Expecting ':' delimiter at line 1 column 26 (char 25), near ': [\"h:1\"], \"worker\" [\"h:2\"]}'" in str(e.value)


def test_from_json_rejects_non_object() -> None:
    with pytest.raises(ConfigError, match=r"must be an object.*Received: '\[1, 2\]'"):
        ClusterSpec.from_json("[1, 2]")


# --- TF_CONFIG ----------------------------------------------------------------------------------


def tf_config(cluster: dict[str, list[str]], task: dict[str, object] | None = None, **extra: object) -> str:
    cfg: dict[str, object] = {"cluster": cluster, **extra}
    if task is not None:
        cfg["task"] = task
    return json.dumps(cfg)


def test_tf_config_reads_master_as_chief_and_tolerates_extra_keys() -> None:
    text = tf_config(
        {"master": ["m:2222"], "ps": ["p:2222"], "worker": ["w0:2222", "w1:2222"]},
        {"type": "master", "index": 0},
        environment="cloud",
        rpc_layer="grpc",
    )
    s, task = parse_tf_config(text)
    assert task == TaskId("chief", 0) and s.is_chief(task)
    assert s.to_dict() == {"chief": ["m:2222"], "ps": ["p:2222"], "worker": ["w0:2222", "w1:2222"]}


def test_tf_config_without_chief_makes_worker_0_chief() -> None:
    s, task = parse_tf_config(tf_config({"ps": ["p:1"], "worker": ["w:1", "w:2"]}, {"type": "worker", "index": 1}))
    assert task == TaskId("worker", 1) and s.chief() == TaskId("worker", 0) and not s.is_chief(task)


def test_tf_config_without_task_gives_no_task() -> None:
    assert parse_tf_config(tf_config({"ps": ["p:1"], "worker": ["w:1"]}))[1] is None


def test_tf_config_all_reduce_without_ps_when_not_required() -> None:
    s, task = parse_tf_config(tf_config({"worker": ["w:1"]}, {"type": "worker", "index": 0}), require_ps=False)
    assert task == TaskId("worker", 0) and s.num_tasks("ps") == 0
    with pytest.raises(ConfigError, match="has no 'ps' task"):
        parse_tf_config(tf_config({"worker": ["w:1"]}))


def test_tf_config_malformed_json_quotes_position_and_snippet() -> None:
    with pytest.raises(ConfigError, match=r"TF_CONFIG is not valid JSON: .*line 1 column \d+ .*near '.*worker"):
        parse_tf_config('{"cluster": {"worker": ["w:1"],}')


def test_tf_config_without_cluster_is_rejected_with_example() -> None:
    with pytest.raises(ConfigError, match=r"^TF_CONFIG: cluster is required and missing \(job -> addresses\)\. Example: "):
        parse_tf_config('{"task": {"type": "worker", "index": 0}}')


def test_tf_config_unknown_task_type_is_rejected_naming_jobs_that_exist() -> None:
    with pytest.raises(ConfigError, match="job 'evaluator' is not in the cluster. Jobs that exist: ps, worker"):
        parse_tf_config(tf_config({"ps": ["p:1"], "worker": ["w:1"]}, {"type": "evaluator", "index": 0}))


def test_tf_config_task_index_out_of_range_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"TF_CONFIG task: worker:2 is out of range: job 'worker' has 2 tasks"):
        parse_tf_config(tf_config({"ps": ["p:1"], "worker": ["w:1", "w:2"]}, {"type": "worker", "index": 2}))


@pytest.mark.parametrize("index", ["1", -1, 1.0, True])
def test_tf_config_task_index_must_be_a_non_negative_int(index: object) -> None:
    with pytest.raises(ConfigError, match=rf"TF_CONFIG: task.index must be (a valid integer|>= 0); received {re.escape(repr(index))}"):
        parse_tf_config(tf_config({"ps": ["p:1"], "worker": ["w:1", "w:2"]}, {"type": "worker", "index": index}))


def test_tf_config_task_without_type_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"^TF_CONFIG: task.type is required and missing \(the job: chief \(or master\), ps"):
        parse_tf_config(tf_config({"ps": ["p:1"], "worker": ["w:1"]}, {"index": 0}))


# --- seed flags ---------------------------------------------------------------------------------


def test_seed_flags_parse_to_worker_1_with_rest_preserved() -> None:
    cfg = parse_cluster_flags(["--lr", "0.1", *SEED_ARGV[:2], "train.py", *SEED_ARGV[2:], "--epochs=3"])
    assert cfg.task == TaskId("worker", 1)
    assert cfg.cluster is not None and cfg.cluster.to_dict() == {
        "ps": ["localhost:9001"],
        "worker": ["localhost:9002", "localhost:9003", "localhost:9004"],
    }
    assert cfg.rest == ["--lr", "0.1", "train.py", "--epochs=3"]


def test_flags_accept_space_form_hyphens_and_literal_quotes() -> None:
    argv = ["--ps-hosts", "'localhost:9001'", "--worker-hosts", '"localhost:9002"', "--job_name='ps'", "--task-index", "0"]
    cfg = parse_cluster_flags(argv)
    assert cfg.task == TaskId("ps", 0) and cfg.rest == []
    assert cfg.cluster is not None and cfg.cluster.address(cfg.task) == "localhost:9001"


def test_flags_chief_and_evaluator_hosts_and_master_job_name() -> None:
    cfg = parse_cluster_flags(["--chief_hosts=h:1", "--ps_hosts=h:2", "--worker_hosts=h:3", "--evaluator_hosts=h:4", "--job_name=master"])
    assert cfg.task == TaskId("chief", 0)
    assert cfg.cluster is not None and list(cfg.cluster.jobs) == list(JOBS)


def test_flags_without_hosts_flags_give_no_cluster() -> None:
    cfg = parse_cluster_flags(["--lr=0.1", "x"])
    assert cfg == parse_cluster_flags(["--lr=0.1", "x"]) and (cfg.cluster, cfg.task, cfg.rest) == (None, None, ["--lr=0.1", "x"])


def test_flags_with_only_hosts_give_no_task() -> None:
    cfg = parse_cluster_flags(SEED_ARGV[:2])
    assert cfg.cluster is not None and cfg.task is None


def test_job_name_defaults_task_index_to_zero() -> None:
    assert parse_cluster_flags([*SEED_ARGV[:2], "--job_name=worker"]).task == TaskId("worker", 0)


def test_arguments_after_double_dash_are_left_alone() -> None:
    cfg = parse_cluster_flags([*SEED_ARGV, "--", "--job_name=ps"])
    assert cfg.task == TaskId("worker", 1) and cfg.rest == ["--", "--job_name=ps"]


def test_empty_hosts_flag_means_no_such_job() -> None:
    cfg = parse_cluster_flags(["--chief_hosts=", "--worker_hosts=h:1"], require_ps=False)
    assert cfg.cluster is not None and list(cfg.cluster.jobs) == ["worker"]
    with pytest.raises(ConfigError, match="has no 'ps' task"):
        parse_cluster_flags(["--ps_hosts=", "--worker_hosts=h:1"])


def test_job_name_without_hosts_flags_is_rejected() -> None:
    with pytest.raises(ConfigError, match="--job_name=ps --task_index=0 given without hosts flags"):
        parse_cluster_flags(["--job_name=ps", "--task_index=0"])


def test_task_index_without_job_name_is_rejected() -> None:
    with pytest.raises(ConfigError, match="--task_index=1 given without --job_name"):
        parse_cluster_flags([*SEED_ARGV[:2], "--task_index=1"])


def test_job_name_not_in_spec_is_rejected_naming_jobs_that_exist() -> None:
    with pytest.raises(ConfigError, match="job 'chief' is not in the cluster. Jobs that exist: ps, worker"):
        parse_cluster_flags([*SEED_ARGV[:2], "--job_name=chief"])
    with pytest.raises(ConfigError, match="job 'learner' is not in the cluster"):
        parse_cluster_flags([*SEED_ARGV[:2], "--job_name=learner"])


@pytest.mark.parametrize("value", ["one", "1.5", "**0**", ""])
def test_task_index_that_is_not_an_int_is_rejected_naming_it(value: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"--task_index must be an integer. Received: {value!r}")):
        parse_cluster_flags([*SEED_ARGV[:3], f"--task_index={value}"])


def test_negative_task_index_is_rejected() -> None:
    with pytest.raises(ConfigError, match="non-negative integer. Received: -1"):
        parse_cluster_flags([*SEED_ARGV[:3], "--task_index", "-1"])


def test_task_index_out_of_range_is_rejected() -> None:
    with pytest.raises(ConfigError, match="worker:3 is out of range: job 'worker' has 3 tasks"):
        parse_cluster_flags([*SEED_ARGV[:3], "--task_index=3"])


def test_flag_without_value_is_rejected() -> None:
    with pytest.raises(ConfigError, match="Flag --job_name needs a value"):
        parse_cluster_flags([*SEED_ARGV[:2], "--job_name"])
    with pytest.raises(ConfigError, match="Flag --job_name needs a value"):
        parse_cluster_flags([*SEED_ARGV[:2], "--job_name", "--task_index=0"])


def test_bad_address_in_hosts_flag_is_rejected_naming_it() -> None:
    with pytest.raises(ConfigError, match="Task worker:1: Malformed address 'localhost'"):
        parse_cluster_flags(["--ps_hosts=localhost:1", "--worker_hosts=localhost:2,localhost"])


# --- Slurm --------------------------------------------------------------------------------------


def slurm_env(**overrides: str) -> dict[str, str]:
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "5",
        "SLURM_JOB_NODELIST": "n[1-2],gpu5",
        "SLURM_TASKS_PER_NODE": "2(x2),1",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v != "-"}


def test_slurm_env_with_nodelist_expression_builds_block_layout() -> None:
    s, task = cluster_from_slurm_env(slurm_env(), num_ps=1, base_port=7000)
    assert s.to_dict() == {"ps": ["n1:7000"], "worker": ["n1:7001", "n2:7002", "n2:7003", "gpu5:7004"]}
    assert task == TaskId("worker", 2) and s.address(task) == "n2:7003"


def test_slurm_step_variables_win_and_one_host_may_hold_every_task() -> None:
    env = slurm_env(SLURM_PROCID="0", SLURM_STEP_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE="5")
    s, task = cluster_from_slurm_env(env, num_ps=2, base_port=9000)
    assert task == TaskId("ps", 0) and s.hosts() == {"localhost"}
    assert s.jobs["worker"] == ("localhost:9002", "localhost:9003", "localhost:9004")


def test_slurm_nodelist_fallback_and_all_reduce() -> None:
    env = slurm_env(SLURM_JOB_NODELIST="-", SLURM_NODELIST="a,b", SLURM_TASKS_PER_NODE="3,2")
    s, task = cluster_from_slurm_env(env, num_ps=0, base_port=9000, require_ps=False)
    assert task == TaskId("worker", 3) and s.num_tasks("ps") == 0
    with pytest.raises(ConfigError, match="has no 'ps' task"):
        cluster_from_slurm_env(env, num_ps=0, base_port=9000)


def test_slurm_missing_variables_are_all_named() -> None:
    with pytest.raises(ConfigError) as e:
        cluster_from_slurm_env({"SLURM_NTASKS": "2"}, num_ps=1, base_port=9000)
    msg = str(e.value)
    assert "SLURM_PROCID" in msg and "SLURM_JOB_NODELIST" in msg and "SLURM_TASKS_PER_NODE" in msg
    assert "missing SLURM_NTASKS" not in msg


def test_slurm_non_integer_procid_is_rejected_naming_it() -> None:
    with pytest.raises(ConfigError, match="SLURM_PROCID must be a non-negative integer. Received: 'x'"):
        cluster_from_slurm_env(slurm_env(SLURM_PROCID="x"), num_ps=1, base_port=9000)


def test_slurm_counts_that_disagree_are_rejected() -> None:
    with pytest.raises(ConfigError, match="Slurm variables disagree.*SLURM_NTASKS=6"):
        cluster_from_slurm_env(slurm_env(SLURM_NTASKS="6"), num_ps=1, base_port=9000)
    with pytest.raises(ConfigError, match="Slurm variables disagree.*'2\\(x4\\)' gives 4 nodes"):
        cluster_from_slurm_env(slurm_env(SLURM_TASKS_PER_NODE="2(x4)", SLURM_NTASKS="8"), num_ps=1, base_port=9000)


def test_slurm_procid_out_of_range_is_rejected() -> None:
    with pytest.raises(ConfigError, match="SLURM_PROCID=5 is out of range for SLURM_NTASKS=5"):
        cluster_from_slurm_env(slurm_env(SLURM_PROCID="5"), num_ps=1, base_port=9000)


@pytest.mark.parametrize("num_ps", [-1, 5])
def test_slurm_num_ps_must_leave_a_worker(num_ps: int) -> None:
    with pytest.raises(ConfigError, match=f"num_ps={num_ps} must be in 0..4"):
        cluster_from_slurm_env(slurm_env(), num_ps=num_ps, base_port=9000)


@pytest.mark.parametrize("base_port", [0, 65532])
def test_slurm_ports_must_fit(base_port: int) -> None:
    with pytest.raises(ConfigError, match=f"base_port={base_port} gives ports"):
        cluster_from_slurm_env(slurm_env(), num_ps=1, base_port=base_port)


# srun -N3 -n5 on n[1-2],gpu5 (tasks per node 2,2,1), as `srun -l hostname` prints each layout.
STEP = {"SLURM_NTASKS": "5", "SLURM_STEP_NODELIST": "n[1-2],gpu5", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
        "SLURM_JOB_NODELIST": "n[1-3],gpu5", "SLURM_TASKS_PER_NODE": "2(x3),1"}
LAYOUTS = {
    "block": ["n1", "n1", "n2", "n2", "gpu5"],
    "cyclic": ["n1", "n2", "gpu5", "n1", "n2"],
    "cyclic:block": ["n1", "n2", "gpu5", "n1", "n2"],  # the node level is the first field
    "block:cyclic,Pack": ["n1", "n1", "n2", "n2", "gpu5"],
    "": ["n1", "n1", "n2", "n2", "gpu5"],  # unset: srun's default, block
}


@pytest.mark.parametrize("distribution", LAYOUTS)
def test_slurm_every_task_lands_on_the_node_it_runs_on(distribution: str) -> None:
    nodes = LAYOUTS[distribution]
    for procid, node in enumerate(nodes):
        env = {**STEP, "SLURM_PROCID": str(procid), "SLURMD_NODENAME": node, "SLURM_DISTRIBUTION": distribution}
        s, task = cluster_from_slurm_env(env, num_ps=1, base_port=7000)
        assert [a.rsplit(":", 1)[0] for a in (*s.jobs["ps"], *s.jobs["worker"])] == nodes
        assert s.address(task) == f"{node}:{7000 + procid}"


def test_slurm_cyclic_procid_1_runs_on_node_2_and_block_would_list_it_on_node_1() -> None:
    env = {**STEP, "SLURM_PROCID": "1", "SLURMD_NODENAME": "n2", "SLURM_DISTRIBUTION": "cyclic"}
    s, task = cluster_from_slurm_env(env, num_ps=1, base_port=7000)
    assert task == TaskId("worker", 0) and s.address(task) == "n2:7001"
    with pytest.raises(ConfigError, match=r"Slurm task 1 runs on 'n2' \(SLURMD_NODENAME\) but the step's layout puts "
                                          r"it on 'n1' \(SLURM_DISTRIBUTION='block'.*--ps_hosts/--worker_hosts"):
        cluster_from_slurm_env({**env, "SLURM_DISTRIBUTION": "block"}, num_ps=1, base_port=7000)


def test_slurm_a_layout_the_environment_does_not_tell_is_refused_saying_what_to_pass() -> None:
    env = {**STEP, "SLURM_PROCID": "0", "SLURMD_NODENAME": "n1"}
    with pytest.raises(ConfigError, match=r"SLURM_DISTRIBUTION=arbitrary: .*SLURM_HOSTFILE.*--ps_hosts/--worker_hosts "
                                          r"with --job_name/--task_index \(or PSFLOW_CLUSTER with PSFLOW_TASK\)"):
        cluster_from_slurm_env({**env, "SLURM_DISTRIBUTION": "arbitrary"}, num_ps=1, base_port=7000)
    with pytest.raises(ConfigError, match=r"SLURM_DISTRIBUTION='plane': psflow derives .* block, cyclic and plane "
                                          r"\(with SLURM_DIST_PLANESIZE\) only"):
        cluster_from_slurm_env({**env, "SLURM_DISTRIBUTION": "plane"}, num_ps=1, base_port=7000)  # no plane size
    with pytest.raises(ConfigError, match=r"SLURM_DISTRIBUTION='spiral'"):
        cluster_from_slurm_env({**env, "SLURM_DISTRIBUTION": "spiral"}, num_ps=1, base_port=7000)


# What srun 22.05 (Debian 12) did with --nodes=3 --ntasks=5 on 127.0.0.[1-3], tasks per node 3,1(x2):
# `srun -m M bash -c 'echo $SLURM_PROCID $SLURMD_NODENAME'`, sorted by rank.
SRUN_2205 = {
    "block": ["127.0.0.1", "127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.3"],
    "cyclic:block": ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.1", "127.0.0.1"],
    "plane": ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.1"],  # -m plane=2
}


@pytest.mark.parametrize("distribution", SRUN_2205)
def test_slurm_layouts_match_what_srun_did(distribution: str) -> None:
    nodes = expand_slurm_nodelist("127.0.0.[1-3]")
    assert slurm_task_nodes(nodes, expand_slurm_tasks_per_node("3,1(x2)"), distribution, 2) == SRUN_2205[distribution]


def test_slurm_cyclic_skips_a_node_once_it_has_its_count() -> None:
    assert slurm_task_nodes(["a", "b", "c"], [3, 1, 2], "cyclic") == ["a", "b", "c", "a", "c", "a"]
    assert slurm_task_nodes(["a", "b", "c"], [3, 1, 2], "block") == ["a", "a", "a", "b", "c", "c"]
    assert slurm_task_nodes(["a"], [3], "CYCLIC") == ["a", "a", "a"]


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("n[1-3],gpu5", ["n1", "n2", "n3", "gpu5"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[1-2,7]", ["n1", "n2", "n7"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("solo", ["solo"]),
    ],
)
def test_slurm_nodelist_expansion(expr: str, names: list[str]) -> None:
    assert expand_slurm_nodelist(expr) == names


@pytest.mark.parametrize("expr", ["n[1-3", "n1-3]", "n[3-1]", "n[a-b]", "n[[1]]", "a,,b", "n[1-]"])
def test_slurm_malformed_nodelist_is_rejected_naming_it(expr: str) -> None:
    with pytest.raises(ConfigError, match="Slurm node list") as e:
        expand_slurm_nodelist(expr)
    assert repr(expr) in str(e.value)


def test_slurm_tasks_per_node_expansion_and_errors() -> None:
    assert expand_slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ConfigError, match="'2x3' is malformed at '2x3'"):
        expand_slurm_tasks_per_node("2x3")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("localhost:2222", "127.0.0.1:2222"),
        ("LOCALHOST.:2222", "127.0.0.1:2222"),
        ("[::ffff:127.0.0.1]:2222", "127.0.0.1:2222"),
        ("[0:0:0:0:0:0:0:1]:2222", "[::1]:2222"),
        ("Node1.example.org.:2222", "node1.example.org:2222"),
    ],
)
def test_one_address_written_two_ways_is_a_duplicate(first: str, second: str) -> None:
    with pytest.raises(ConfigError, match=rf"Address '{re.escape(second)}' is used by both ps:0 and worker:0 "
                                          rf"\('{re.escape(first)}' and '{re.escape(second)}' are one address"):
        spec(ps=[first], worker=[second])


@pytest.mark.parametrize(
    ("first", "second"),
    [("127.0.0.1:2222", "127.0.0.2:2222"), ("localhost:2222", "[::1]:2222"), ("h1:2222", "h2:2222")],
)
def test_different_addresses_on_one_port_are_not_duplicates(first: str, second: str) -> None:
    assert spec(ps=[first], worker=[second]).address(TaskId("worker", 0)) == second
