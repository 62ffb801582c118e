"""Every trainer is a SupervisedTrainer: it defines each method and attribute the Supervisor uses,
itself or through TrainerBase's defaults, so the Supervisor never asks a trainer what it has."""

from __future__ import annotations

import inspect
import re

import pytest

from psflow.train.allreduce import AllReduceTrainer
from psflow.train.base import SupervisedTrainer, TrainerBase
from psflow.train.trainer import Trainer

METHODS = sorted(n for n, v in vars(SupervisedTrainer).items() if inspect.isfunction(v) and not n.startswith("_"))
ATTRIBUTES = sorted(SupervisedTrainer.__annotations__)


def assigned(cls: type, name: str) -> bool:
    """Whether ``cls`` or a base of it below the protocol sets ``self.<name>``."""
    sources = [inspect.getsource(c) for c in cls.__mro__ if issubclass(c, TrainerBase)]
    return any(re.search(rf"self\.{name}\b\s*(:[^=\n]+)?=[^=]", src) for src in sources)


@pytest.mark.parametrize("cls", [Trainer, AllReduceTrainer])
def test_each_trainer_defines_what_the_supervisor_uses(cls):
    assert SupervisedTrainer in cls.__mro__  # explicitly, not only by shape
    stubs = [m for m in METHODS if getattr(cls, m) is vars(SupervisedTrainer)[m]]
    assert not stubs, f"{cls.__name__} leaves {stubs} to the protocol's empty stubs"
    unset = [a for a in ATTRIBUTES if not assigned(cls, a)]
    assert not unset, f"{cls.__name__} never sets {unset}"


def test_the_supervisor_asks_no_trainer_what_it_has():
    import psflow.supervisor as supervisor

    source = inspect.getsource(supervisor)
    assert not re.findall(r"(hasattr|getattr)\((self\.)?trainer\b", source)


def test_the_protocol_holds_what_the_supervisor_calls():
    import psflow.supervisor as supervisor

    used = set(re.findall(r"self\.trainer\.(\w+)", inspect.getsource(supervisor)))
    assert used - set(METHODS) - set(ATTRIBUTES) == set()
