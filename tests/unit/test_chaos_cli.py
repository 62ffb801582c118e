"""`psflow chaos`'s own options are checked before any task starts, with one clear error each; it
takes `psflow run`'s options (less other backends')."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from psflow.cli import _seconds, main
from psflow.errors import ConfigError

SCRIPT = "examples/mnist_softmax.py"


@pytest.mark.parametrize("args,message", [
    (["--kinds", "explode"], "--kinds 'explode'"),
    (["--for", "soon"], "--for 'soon': give a positive duration"),
    (["--targets", "evaluator"], "targets"),
    (["--every", "0"], "--every"),
    (["--backend", "slurm"], "No such option '--backend'"),
])
def test_bad_chaos_options_are_refused_before_anything_starts(args: list[str], message: str) -> None:
    r = CliRunner().invoke(main, ["chaos", *args, SCRIPT])
    assert r.exit_code == 2, r.output
    assert message in r.output, r.output


def test_durations_read_seconds_minutes_and_hours() -> None:
    assert (_seconds("90", "--for"), _seconds("90s", "--for"), _seconds("5m", "--for"), _seconds("1h", "--for")) == (
        90.0, 90.0, 300.0, 3600.0)
    with pytest.raises(ConfigError, match="-5m"):
        _seconds("-5m", "--for")


def test_chaos_takes_runs_options() -> None:
    names = {p.name for p in main.get_command(None, "chaos").params}  # type: ignore[union-attr]
    assert {"num_ps", "ps_replicas", "restart", "fail_at", "mode", "every_s", "baseline"} <= names
    assert not {"backend", "nodes", "dry_run"} & names
