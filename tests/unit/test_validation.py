"""The one validation scheme (psflow.validation): pydantic's errors as psflow's ConfigError."""

from __future__ import annotations

import dataclasses
import math

import pytest
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass

from psflow.config import TrainConfig
from psflow.errors import ConfigError
from psflow.modes import Mode
from psflow.resolve.tfconfig import parse_tf_config
from psflow.validation import checked, validate


@checked
@dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class Knobs:
    wait_s: float = Field(1.0, gt=0, allow_inf_nan=False, description="seconds to wait for the reply")
    tries: int = Field(3, ge=1, le=9)
    loud: bool = False

    @model_validator(mode="after")
    def _agree(self) -> Knobs:
        if self.loud and self.tries > 5:
            raise ConfigError(f"loud with tries={self.tries}: too much noise. Lower tries to 5 or drop loud.")
        return self


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    hosts: list[str] = Field(default_factory=list, max_length=2)


def test_a_refused_field_names_the_field_the_bound_the_value_and_its_meaning():
    with pytest.raises(ConfigError) as e:
        Knobs(wait_s=0)
    assert str(e.value) == "Knobs: wait_s must be > 0; received 0 (seconds to wait for the reply)."
    with pytest.raises(ConfigError, match=r"^Knobs: tries must be <= 9; received 12\.$"):
        Knobs(tries=12)
    with pytest.raises(ConfigError, match=r"^Knobs: wait_s must be a finite number; received nan"):
        Knobs(wait_s=math.nan)


def test_strict_types_refuse_what_would_be_converted_silently():
    with pytest.raises(ConfigError, match=r"Knobs: tries must be a valid integer; received True\."):
        Knobs(tries=True)
    with pytest.raises(ConfigError, match=r"Knobs: loud must be a valid boolean; received 1\."):
        Knobs(loud=1)
    with pytest.raises(ConfigError, match=r"Knobs: tries must be a valid integer; received '3'\."):
        Knobs(tries="3")


def test_an_unknown_setting_is_named_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"^Knobs has no setting 'speed' \(received 2\)\. Known: wait_s, tries, loud\.$"):
        Knobs(speed=2)


def test_every_wrong_field_is_named_the_first_in_full():
    with pytest.raises(ConfigError, match=r"^Knobs: wait_s must be > 0; received -1 .*\. Also wrong: tries, loud\.$"):
        Knobs(wait_s=-1, tries=0, loud="no")


def test_a_rule_between_fields_keeps_its_own_message():
    with pytest.raises(ConfigError) as e:
        Knobs(loud=True, tries=7)
    assert str(e.value) == "loud with tries=7: too much noise. Lower tries to 5 or drop loud."


def test_replace_validates_again():
    knobs = Knobs()
    assert dataclasses.replace(knobs, tries=4).tries == 4
    with pytest.raises(ConfigError, match="tries must be >= 1; received 0"):
        dataclasses.replace(knobs, tries=0)


def test_validate_a_mapping_into_a_model_names_nested_places_and_missing_fields():
    assert validate(Body, {"name": "a", "hosts": ["h1"]}, what="the body").hosts == ["h1"]
    with pytest.raises(ConfigError, match=r"^the body: name is required and missing\.$"):
        validate(Body, {}, what="the body")
    with pytest.raises(ConfigError, match=r"^the body: hosts\[1\] must be a valid string; received 7\.$"):
        validate(Body, {"name": "a", "hosts": ["h1", 7]}, what="the body")
    with pytest.raises(ConfigError, match=r"^the body has no setting 'port' \(received 1\)\. Known: name, hosts\.$"):
        validate(Body, {"name": "a", "port": 1}, what="the body")


def test_the_train_config_errors_name_the_setting_and_the_value():
    with pytest.raises(ConfigError, match=r"^TrainConfig: sync_timeout_s must be > 0; received 0 \(seconds: sync/ssp"):
        TrainConfig(sync_timeout_s=0)
    with pytest.raises(ConfigError, match=r"^TrainConfig: ps_replicas must be <= 2; received 3 \(copies of each shard"):
        TrainConfig(ps_replicas=3)
    with pytest.raises(ConfigError, match=r"^TrainConfig: staleness must be a valid integer; received 2\.5"):
        TrainConfig(staleness=2.5)
    with pytest.raises(ConfigError, match=r"^TrainConfig has no setting 'sped'"):
        TrainConfig.from_dict({"sped": 1})


def test_the_mode_is_a_mode_that_reads_as_its_text():
    config = TrainConfig(mode="ssp")
    assert config.mode is Mode.SSP and config.mode == "ssp" and repr(config.mode) == "'ssp'"
    assert TrainConfig.from_json(config.to_json()) == config
    assert config.to_dict()["mode"] == "ssp" and type(config.to_dict()["mode"]) is str


def test_a_refused_item_is_named_once_and_an_empty_list_says_how_many_it_needs():
    from psflow.chaos.schedule import ChaosSettings

    with pytest.raises(ConfigError) as e:
        ChaosSettings(every_s=1, duration_s=2, targets=("evaluator",))
    assert str(e.value) == ("psflow chaos: targets[0] must be 'chief', 'worker' or 'ps'; received 'evaluator' "
                            "(the jobs whose tasks may be hit).")
    with pytest.raises(ConfigError, match=r"^psflow chaos: targets must hold at least 1 item; received \(\)"):
        ChaosSettings(every_s=1, duration_s=2, targets=())
    with pytest.raises(ConfigError, match=r"^psflow chaos: kinds\[1\]\[1\] must be > 0; received 0\.0"):
        ChaosSettings(every_s=1, duration_s=2, kinds=(("kill", 1.0), ("stop", 0.0)))
    with pytest.raises(ConfigError, match=r"^psflow chaos: every_s is required and missing \(seconds: between faults"):
        ChaosSettings(duration_s=2)


def test_a_nested_field_is_named_by_its_path_with_its_own_meaning_and_the_fix():
    text = '{"cluster": {"ps": ["p:1"], "worker": ["w:1"]}, "task": {"type": "worker", "index": -1}}'
    with pytest.raises(ConfigError) as e:
        parse_tf_config(text)
    assert str(e.value).startswith("TF_CONFIG: task.index must be >= 0; received -1 (the task's index in its job). "
                                   'Example: {"cluster": ')
    with pytest.raises(ConfigError, match=r"^TF_CONFIG: task must be a mapping \(a JSON object\); received 'worker'"):
        parse_tf_config('{"cluster": {"ps": ["p:1"], "worker": ["w:1"]}, "task": "worker"}')
