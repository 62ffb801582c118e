"""The launcher->task contract: TaskEnv renders and parses every PSFLOW_* variable, and says what is wrong."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from psflow.cluster import TaskId
from psflow.config import TrainConfig
from psflow.errors import ConfigError
from psflow.taskenv import ENV, TaskEnv

SRC = Path(__file__).resolve().parents[2] / "src" / "psflow"

EVERY_FIELD = TaskEnv(
    task=TaskId("worker", 1), coordinator="127.0.0.1:4000", attempt=2, cluster_json='{"ps": ["h:1"], "worker": ["h:2", "h:3"]}',
    secret="s3cret", secret_file="/run/secret", train_config=TrainConfig(mode="sync", staleness=2), logdir="runs/a",
    checkpoint_dir="s3://bucket/run", error_file="runs/a/errors/worker-1.json", data_dir="/data", fail_at="worker:1@step=3",
    clock_skew="ps:0=5e6", resume=False, num_threads=3,
    bind_host="0.0.0.0", connect_timeout_s=1.5, handshake_timeout_s=0.25, max_handshaking=7, allow_unauthenticated_allreduce=True,
    num_ps=0, base_port=3000, data_shards=2, chaos=True,
)


def test_every_field_survives_render_and_parse():
    rendered = EVERY_FIELD.render()
    assert set(rendered) == set(TaskEnv.variables())  # every field differs from its default, so every variable is set
    assert all(isinstance(v, str) for v in rendered.values())
    assert TaskEnv.parse(rendered) == EVERY_FIELD


def test_defaults_render_to_an_empty_environment_and_an_empty_environment_parses_to_defaults():
    assert TaskEnv().render() == {}
    assert TaskEnv.parse({}) == TaskEnv()
    assert TaskEnv.parse({}).attempt == 0 and TaskEnv.parse({}).connect_timeout_s == 60.0


def test_render_sets_only_what_differs_from_the_default():
    env = TaskEnv(task=TaskId("ps", 0), attempt=1, fail_at=None, resume=True).render()
    assert env == {"PSFLOW_TASK": "ps:0", "PSFLOW_ATTEMPT": "1", "PSFLOW_RESUME": "1"}


def test_variables_outside_the_contract_are_ignored():
    assert TaskEnv.parse({"PATH": "/bin", "PSFLOW_TASK": "chief:0", "TF_CONFIG": "{}"}) == TaskEnv(task=TaskId("chief", 0))


def test_blank_values_are_unset_but_an_empty_bind_host_means_every_interface():
    blank = {name: "" for name in TaskEnv.variables()} | {"PSFLOW_CONNECT_TIMEOUT_S": "  ", "PSFLOW_RESUME": " "}
    assert TaskEnv.parse(blank) == TaskEnv(bind_host="")


def test_values_are_stripped_except_text():
    parsed = TaskEnv.parse({"PSFLOW_ATTEMPT": " 3 ", "PSFLOW_TASK": " worker:2 ", "PSFLOW_SECRET": " spaced "})
    assert parsed.attempt == 3 and parsed.task == TaskId("worker", 2) and parsed.secret == " spaced "


def test_the_secret_stays_out_of_the_repr():
    assert "s3cret" not in repr(EVERY_FIELD)


@pytest.mark.parametrize("name, raw, expected", [
    ("PSFLOW_TASK", "worker", r"PSFLOW_TASK must name one task as 'job:index'.*Received: 'worker'"),
    ("PSFLOW_TASK", "boss:1", r"PSFLOW_TASK must name one task.*Received: 'boss:1'"),
    ("PSFLOW_COORDINATOR", "localhost", r"PSFLOW_COORDINATOR must be the launcher's coordinator as 'host:port'. Received: 'localhost'"),
    ("PSFLOW_ATTEMPT", "-1", r"The task's environment: PSFLOW_ATTEMPT must be >= 0; received '-1' \(which start of this task"),
    ("PSFLOW_ATTEMPT", "first", r"PSFLOW_ATTEMPT must be an integer; received 'first'"),
    ("PSFLOW_TRAIN_CONFIG", "{not json", r"PSFLOW_TRAIN_CONFIG is not a valid training config: Training config is not valid JSON"),
    ("PSFLOW_TRAIN_CONFIG", '{"mode": "fast"}', r"PSFLOW_TRAIN_CONFIG is not a valid training config: TrainConfig: mode must be 'async'.*received 'fast'"),
    ("PSFLOW_RESUME", "maybe", r"PSFLOW_RESUME must be 1 or 0 \(true/false, yes/no, on/off\); received 'maybe' \(1: continue"),
    ("PSFLOW_ALLOW_UNAUTHENTICATED_ALLREDUCE", "sure", r"PSFLOW_ALLOW_UNAUTHENTICATED_ALLREDUCE must be 1 or 0.*'sure'"),
    ("PSFLOW_NUM_THREADS", "0", r"PSFLOW_NUM_THREADS must be >= 1; received '0'"),
    ("PSFLOW_CONNECT_TIMEOUT_S", "soon", r"PSFLOW_CONNECT_TIMEOUT_S must be a number; received 'soon'"),
    ("PSFLOW_HANDSHAKE_TIMEOUT_S", "inf", r"PSFLOW_HANDSHAKE_TIMEOUT_S must be a finite number; received 'inf'"),
    ("PSFLOW_HANDSHAKE_TIMEOUT_S", "-2", r"PSFLOW_HANDSHAKE_TIMEOUT_S must be > 0; received '-2'"),
    ("PSFLOW_MAX_HANDSHAKING", "1.5", r"PSFLOW_MAX_HANDSHAKING must be an integer; received '1.5'"),
    ("PSFLOW_NUM_PS", "-1", r"PSFLOW_NUM_PS must be >= 0; received '-1'"),
    ("PSFLOW_BASE_PORT", "70000", r"PSFLOW_BASE_PORT must be <= 65535; received '70000'"),
])
def test_a_bad_value_is_refused_naming_the_variable_and_the_value(name, raw, expected):
    with pytest.raises(ConfigError, match=expected):
        TaskEnv.parse({name: raw})


def test_env_lists_every_variable_of_the_contract():
    assert set(ENV) - {"TF_CONFIG"} == set(TaskEnv.variables())


def _string_constants(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def test_every_psflow_variable_that_the_code_mentions_is_one_a_task_reads():
    """A message that tells the user to set PSFLOW_X must name a variable something reads (a task,
    or the launcher and the CLI for themselves: psflow.home.ENV)."""
    from psflow.home import ENV as LAUNCHER_ENV

    not_variables = {"PSFLOW_REPORTS"}  # launch.metrics' constant, named in its docstring
    not_variables |= set(LAUNCHER_ENV)  # not a task's: read by the launcher and the CLI, in one place
    named = {(m, str(p.relative_to(SRC))) for p in SRC.rglob("*.py") for s in _string_constants(p)
             for m in re.findall(r"\bPSFLOW_[A-Z_]+\b", s)}
    unknown = sorted((name, where) for name, where in named if name not in ENV and name not in not_variables)
    assert not unknown, f"names of environment variables that nothing reads: {unknown}"
