"""Which ``Host`` headers the dashboard answers: its defence against DNS rebinding.

A web page on ``evil.example`` whose name its owner resolves to 127.0.0.1 makes the visitor's
browser send requests to the dashboard with ``Host: evil.example``; the browser's same-origin rule
then lets that page read the answers (logs, arguments, model weights through ``.../export``). So
every request, reads included, must name the dashboard by a name it expects, or it gets a 400 with
what was received and what is allowed.

Allowed (:func:`allowed_hosts`): ``localhost``, ``127.0.0.1``, ``[::1]``; the address ``psflow ui``
is bound to; off loopback also this machine's names and addresses (a wildcard bind, ``0.0.0.0``, is
reached by them); and the names given with ``psflow ui --allowed-host NAME`` (``*.example.org``
allows its subdomains, ``*`` any name). Patterns and their meaning are Starlette's
``TrustedHostMiddleware``'s; this middleware stands in for it to say *why* a request was refused and
to read ``[::1]:8265`` the same on every Starlette version fastapi>=0.110 allows.

Pure: :func:`host_of`, :func:`is_allowed`, :func:`check_patterns`. Used by
:func:`psflow.platform.api.create_app`, configured by :func:`psflow.platform.uiserver.settings_for`.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
from collections.abc import Iterable, Sequence
from typing import Any

from psflow.errors import ConfigError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
_NAME = re.compile(r"(\*|(\*\.)?[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?|\[[0-9a-f:.]+\])")
_HOST = re.compile(r"(?P<host>\[[0-9a-fA-F:.]+\]|[^:\[\]/?#@\s]+)(:(?P<port>[0-9]{1,5}))?")


def host_of(header: str | None) -> str | None:
    """The name in a ``Host`` header, lowercased, without its port (an IPv6 address keeps its
    brackets); None for a missing or malformed one.

    Example:
        >>> host_of("Evil.Example:8265"), host_of("[::1]:8265"), host_of("a b")
        ('evil.example', '[::1]', None)
    """
    if not header:
        return None
    m = _HOST.fullmatch(header.strip())
    if m is None:
        return None
    host = m["host"].lower()
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return None
    return host


def is_allowed(host: str | None, allowed: Iterable[str]) -> bool:
    """Whether ``host`` (:func:`host_of`) matches one of ``allowed``: a name, ``*.domain`` (its
    subdomains) or ``*`` (anything).

    Example:
        >>> is_allowed("127.0.0.1", ("localhost", "127.0.0.1")), is_allowed("evil.example", ("localhost",))
        (True, False)
    """
    if host is None:
        return False
    for pattern in allowed:
        if pattern == "*" or host == pattern or (pattern.startswith("*.") and host.endswith(pattern[1:])):
            return True
    return False


def check_patterns(names: Sequence[str]) -> tuple[str, ...]:
    """``--allowed-host`` values, lowercased, an IPv6 address put in brackets.

    Raises:
        ConfigError: one is not a host name, an address, ``*.domain`` or ``*`` (a port, scheme or path).
    """
    out = []
    for raw in names:
        name = _bracketed(raw.strip().lower())
        if not _NAME.fullmatch(name):
            raise ConfigError(f"--allowed-host {raw!r} is not a host name. Give a name or address as a browser sends it in "
                              "the Host header, without scheme, port or path: dash.example.org, 10.0.0.5, ::1, "
                              "*.example.org (its subdomains) or * (any name: no DNS-rebinding defence).")
        out.append(name)
    return tuple(out)


def allowed_hosts(bind_host: str, extra: Sequence[str] = (), *, loopback: bool = True) -> tuple[str, ...]:
    """The names the dashboard bound to ``bind_host`` answers to: loopback's, the bound address, and
    off loopback (``loopback`` False) this machine's host names and addresses; then ``extra``
    (:func:`check_patterns`)."""
    names = [*LOOPBACK_NAMES, _bracketed(bind_host.lower())]
    if not loopback:
        names += _machine_names()
    names += check_patterns(extra)
    return tuple(n for n in dict.fromkeys(names) if n not in ("0.0.0.0", "[::]", ""))


def _bracketed(name: str) -> str:
    try:
        return f"[{name}]" if ipaddress.ip_address(name).version == 6 else name
    except ValueError:
        return name


def _machine_names() -> list[str]:
    """This machine's names and the addresses they resolve to (how a wildcard bind is reached)."""
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    for name in list(names):
        try:
            names |= {_bracketed(str(info[4][0]).split("%")[0]) for info in socket.getaddrinfo(name, None)}
        except OSError:
            pass  # a name that does not resolve: itself only
    return sorted(names)


class HostAllowlist:
    """ASGI middleware: a request whose ``Host`` is not allowed gets a 400 (JSON ``detail``) and
    reaches no route.

    Args:
        app: the application.
        allowed: :func:`allowed_hosts`.
    """

    def __init__(self, app: Any, allowed: Sequence[str]) -> None:
        self.app = app
        self.allowed = tuple(allowed)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"), None)
        if is_allowed(host_of(header), self.allowed):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"detail": self.refusal(header)}).encode()
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def refusal(self, header: str | None) -> str:
        shown = "no Host header" if header is None else f"Host {header!r}"
        return (f"This dashboard does not answer to {shown}; it answers to {', '.join(self.allowed)}. A page of another "
                "site whose name resolves to this machine may not read it (DNS rebinding). To reach it by another name, "
                "start it with psflow ui --allowed-host NAME.")
