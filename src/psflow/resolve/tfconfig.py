"""``TF_CONFIG``, Kubeflow's TFJob: ``{"cluster": {...}, "task": {"type": "worker", "index": 0}}``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from psflow.cluster import ClusterSpec, TaskId, load_json
from psflow.resolve import Resolved
from psflow.validation import validate

_TF_EXAMPLE = '{"cluster": {"ps": ["h0:2222"], "worker": ["h1:2222"]}, "task": {"type": "worker", "index": 0}}'


class _TfTask(BaseModel):
    """TF_CONFIG's ``task``: this process's job and index."""

    model_config = ConfigDict(strict=True)
    type: str = Field(description="the job: chief (or master), ps, worker or evaluator")
    index: int = Field(0, ge=0, description="the task's index in its job")


class _TfConfig(BaseModel):
    """The parts of TF_CONFIG psflow reads (others, such as ``environment`` and ``rpc_layer``, are ignored)."""

    model_config = ConfigDict(strict=True)
    cluster: dict[str, Any] = Field(description="job -> addresses")
    task: _TfTask | None = Field(None, description="this process's type and index; absent or empty: none")

    @field_validator("task", mode="before")
    @classmethod
    def _empty_is_none(cls, task: object) -> object:
        return task or None


def parse_tf_config(text: str, *, require_ps: bool = True) -> tuple[ClusterSpec, TaskId | None]:
    """Reads ``TF_CONFIG``'s text. Other keys (``environment``, ``rpc_layer``) are ignored; ``master`` reads as ``chief``.

    Returns:
        The spec, and this process's task (None when ``task`` is absent or empty).

    Raises:
        ConfigError: malformed JSON (position and snippet quoted), no ``cluster``, an invalid
            spec, a task type not in the cluster or an index out of range.
    """
    cfg: _TfConfig = validate(_TfConfig, load_json(text, "TF_CONFIG"), what="TF_CONFIG",
                              fix=f"Example: {_TF_EXAMPLE}")
    spec = ClusterSpec.from_dict(cfg.cluster, require_ps=require_ps)
    if cfg.task is None:
        return spec, None
    return spec, spec.named_task(cfg.task.type, cfg.task.index, "TF_CONFIG task")


def resolve(env: Mapping[str, str], *, require_ps: bool) -> Resolved | None:
    """The spec and task of ``env``'s ``TF_CONFIG``; None when it is unset or empty.

    Raises:
        ConfigError: as :func:`parse_tf_config`.
    """
    text = env.get("TF_CONFIG")
    if not text:
        return None
    spec, task = parse_tf_config(text, require_ps=require_ps)
    return Resolved(spec, task, "TF_CONFIG")
