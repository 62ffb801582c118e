"""The one validation scheme for configs, plans and request bodies: pydantic, with psflow's errors.

A value that users fill in (``TrainConfig``, the chaos schedule, a launch's policies) is a pydantic
dataclass or model: its fields declare their types and bounds, and a field's ``description`` says
what the value means (the error quotes it after the bound it broke). Rules between fields stay in a
``model_validator(mode="after")`` that raises :class:`~psflow.errors.ConfigError` with its own message.

This module is the one place that turns pydantic's ``ValidationError`` into a ``ConfigError`` of
psflow's shape: the field, what is allowed, the value received, and what the field means:

    TrainConfig: sync_timeout_s must be > 0; received 0 (seconds: the longest wait for a sync or ssp step).

Entry points: :func:`checked` (a class decorator: the class raises ``ConfigError`` where pydantic
would raise ``ValidationError``), :func:`validate` (a mapping into a model) and :func:`config_error`.
"""

from __future__ import annotations

import functools
import re
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ArgsKwargs

from psflow.errors import ConfigError, PsflowError

T = TypeVar("T")

_UNKNOWN = ("extra_forbidden", "unexpected_keyword_argument")


def _place(loc: tuple[int | str, ...]) -> str:
    """``('cluster', 'ps', 0)`` as ``cluster.ps[0]``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _fields(model: type) -> Mapping[str, Any]:
    return getattr(model, "__pydantic_fields__", {}) or {}


def _field_at(model: type | None, loc: tuple[int | str, ...]) -> Any:
    """The FieldInfo that ``loc`` names (by name or alias, through nested models), or None; an
    item of a list or tuple is described by its container's field."""
    info = None
    for part in loc:
        if isinstance(part, int):  # an item: its model is the container's item type, if a model
            continue
        if model is None:
            return None
        fields = _fields(model)
        info = fields.get(part) or next((f for f in fields.values() if f.alias == part), None)
        if info is None:
            return None
        kinds = (info.annotation, *typing.get_args(info.annotation))
        model = next((k for k in kinds if isinstance(k, type) and _fields(k)), None)
    return info


_TEXT_PARSING = {"int_parsing": "must be an integer", "float_parsing": "must be a number",
                 "bool_parsing": "must be 1 or 0 (true/false, yes/no, on/off)"}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _reason(error: Mapping[str, Any]) -> str:
    ctx = error.get("ctx") or {}
    if error["type"] in ("model_type", "model_attributes_type", "dict_type", "dataclass_type"):
        return "must be a mapping (a JSON object)"
    if error["type"] in _TEXT_PARSING:  # text that is no value of the type (an environment variable's)
        return _TEXT_PARSING[error["type"]]
    if error["type"] == "too_short":
        return f"must hold at least {ctx['min_length']} item{'s' * (ctx['min_length'] != 1)}"
    if error["type"] == "too_long":
        return f"must hold at most {ctx['max_length']} item{'s' * (ctx['max_length'] != 1)}"
    if error["type"] in _BOUNDS and ctx:
        bound = next(iter(ctx.values()))
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        return f"must be {_BOUNDS[error['type']]} {bound}"
    msg = str(error["msg"])
    said = re.match(r"(Input|Value|String|List|Tuple|Dictionary) (should|is) ", msg)
    if said:  # "Input should be a valid integer" -> "must be a valid integer"
        return ("must " if said.group(2) == "should" else "is ") + msg[said.end():]
    return msg[:1].lower() + msg[1:]


def _sentence(error: Mapping[str, Any], what: str, model: type | None) -> str:
    loc = tuple(error.get("loc", ()))
    place = _place(loc)
    known = _fields(model) if model is not None else {}
    if error["type"] in _UNKNOWN:
        allowed = f" Known: {', '.join(known)}." if known else " Drop it."
        return f"{what} has no setting {place!r} (received {error['input']!r}).{allowed}"
    info = _field_at(model, loc)
    meaning = f" ({info.description})" if info is not None and info.description else ""
    if error["type"] == "missing":
        return f"{what}: {place} is required and missing{meaning}."
    value = error.get("input")
    received = "" if isinstance(value, ArgsKwargs) else f"; received {value!r}"
    return f"{what}: {place or 'the value'} {_reason(error)}{received}{meaning}."


def config_error(error: ValidationError, *, what: str, model: type | None = None,
                 error_class: type[PsflowError] = ConfigError, fix: str = "") -> PsflowError:
    """The psflow error that says what ``error`` found, in psflow's shape.

    Args:
        error: pydantic's report.
        what: the name of the value validated, as the user knows it (``"TrainConfig"``, ``"psflow chaos"``).
        model: the dataclass or model validated; its fields' descriptions say what they mean.
        error_class: the error to raise (``ConfigError``; ``CheckpointError`` for a checkpoint's records).
        fix: a sentence that ends the message: what to do.

    Returns:
        The psflow error a rule raised itself (a ``model_validator`` that raised one), as it was;
        otherwise an ``error_class`` naming the first field that is wrong, what is allowed, the
        value received and what the field means, and the other fields that are wrong too.
    """
    errors = error.errors(include_url=False)
    for e in errors:
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, PsflowError):
            return cause
    # a container whose item was refused is also reported as too short: the item says it
    errors = [e for e in errors if not any(o is not e and tuple(o["loc"])[:len(e["loc"])] == tuple(e["loc"])
                                           and len(o["loc"]) > len(e["loc"]) for o in errors)]
    text = _sentence(errors[0], what, model)
    others = [_place(tuple(e["loc"])) for e in errors[1:]]
    if others:
        text += f" Also wrong: {', '.join(o or 'the value' for o in others)}."
    return error_class(f"{text} {fix}" if fix else text)


def checked(cls: type[T] | None = None, *, what: str | None = None,
            error_class: type[PsflowError] = ConfigError, fix: str = "") -> Any:
    """Make a pydantic dataclass raise ``ConfigError`` (from :func:`config_error`) on invalid fields.

    Use as ``@checked`` (errors name the class) or ``@checked(what="psflow chaos")``; ``error_class``
    and ``fix`` as :func:`config_error`'s.

    Example:
        >>> from pydantic import Field
        >>> from pydantic.dataclasses import dataclass
        >>> @checked
        ... @dataclass(frozen=True)
        ... class Timeouts:
        ...     connect_s: float = Field(60.0, gt=0, description="seconds to retry a connection")
        >>> Timeouts(connect_s=-1)
        Traceback (most recent call last):
        psflow.errors.ConfigError: Timeouts: connect_s must be > 0; received -1 (seconds to retry a connection).
    """
    if cls is None:
        return functools.partial(checked, what=what, error_class=error_class, fix=fix)
    init = cls.__init__
    name = what or cls.__name__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except ValidationError as e:
            raise config_error(e, what=name, model=cls, error_class=error_class, fix=fix) from e

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


def validate(model: type[BaseModel], data: object, *, what: str, fix: str = "") -> Any:
    """``model`` from ``data`` (a mapping, e.g. parsed JSON or TOML).

    Raises:
        ConfigError: from :func:`config_error` (``fix`` ends its message).
    """
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise config_error(e, what=what, model=model, fix=fix) from e
