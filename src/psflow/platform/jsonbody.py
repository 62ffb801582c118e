"""Request bodies as strict JSON: no NaN, no infinity, for every route of the HTTP API.

Python's :func:`json.loads` (which Starlette's ``Request.json`` uses) accepts ``NaN``, ``Infinity``
and ``-Infinity``, and reads ``1e999`` as ``inf``; none of them is JSON (RFC 8259), and a
non-finite number reaching a form field ends as a 500 (the validation error that quotes it cannot
be written back as JSON). :class:`FiniteJsonRoute` parses every JSON body with
:func:`loads_finite`, so such a body is a 422 in FastAPI's own shape, naming each field that holds
one, before any model sees it.

Pure: :func:`loads_finite`. Used by :func:`psflow.platform.api.create_app` (the routers' ``route_class``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute


class NonFiniteNumberError(ValueError):
    """A JSON text holds NaN or an infinite number; ``fields`` are where (``["body", "lr"]``, ...)."""

    def __init__(self, fields: list[list[str | int]], texts: list[str]) -> None:
        self.fields, self.texts = fields, texts
        super().__init__("; ".join(f"{'.'.join(map(str, f))}: {t}" for f, t in zip(fields, texts, strict=True)))


class _NonFinite:
    def __init__(self, text: str) -> None:
        self.text = text


def _number(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def loads_finite(text: str | bytes) -> Any:
    """``json.loads``, refusing NaN, ``Infinity`` and numbers too large for a float (``1e999``).

    Raises:
        NonFiniteNumberError: the text holds one; its ``fields`` name each place, as paths from ``body``.
        json.JSONDecodeError: the text is not JSON.

    Example:
        >>> loads_finite('{"lr": 0.1}')
        {'lr': 0.1}
        >>> loads_finite('{"lr": NaN, "x": [1, 1e999]}')
        Traceback (most recent call last):
        ...
        psflow.platform.jsonbody.NonFiniteNumberError: body.lr: NaN; body.x.1: 1e999
    """
    value = json.loads(text, parse_constant=_NonFinite, parse_float=_number)
    found: list[tuple[list[str | int], str]] = []
    _find(value, ["body"], found)
    if found:
        raise NonFiniteNumberError([f for f, _ in found], [t for _, t in found])
    return value


def _find(value: Any, path: list[str | int], found: list[tuple[list[str | int], str]]) -> None:
    if isinstance(value, _NonFinite):
        found.append((path, value.text))
    elif isinstance(value, dict):
        for k, v in value.items():
            _find(v, [*path, k], found)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _find(v, [*path, i], found)


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this content type as JSON (as it does one without any)."""
    if not content_type:
        return True
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


class FiniteJsonRoute(APIRoute):
    """A route whose JSON body is read by :func:`loads_finite` first: a non-finite number is a 422
    naming its field; a body that is not JSON at all is left to FastAPI's own 422."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def finite_json_handler(request: Request) -> Response:
            body = await request.body()
            if body and _is_json(request.headers.get("content-type")):
                try:
                    request._json = loads_finite(body)  # Starlette's own cache: FastAPI's request.json() reads it
                except NonFiniteNumberError as e:
                    raise RequestValidationError([
                        {"type": "finite_number", "loc": tuple(f), "input": t,
                         "msg": f"{'.'.join(map(str, f[1:])) or 'the body'} is {t}, which is not a JSON number: "
                                "give a finite number (NaN and infinity are refused)"}
                        for f, t in zip(e.fields, e.texts, strict=True)]) from None
                except (json.JSONDecodeError, UnicodeDecodeError):
                    pass
            return await handler(request)

        return finite_json_handler
