"""``psflow ui``: serve the dashboard and its API (:mod:`psflow.platform.api`) with uvicorn.

Binds 127.0.0.1 by default. Any other address is refused unless the user says so twice: an explicit
``allow_remote`` (``--allow-remote``) and a token of their own (``PSFLOW_UI_TOKEN``) of at least
``MIN_REMOTE_TOKEN_CHARS`` characters; then every request, reads included, needs the token. On
loopback a fresh token is made when none is set, and printed with the URL (in its ``#token=`` fragment, which browsers never send to the server).

Every request, reads included, must give a ``Host`` the dashboard answers to (loopback names, the
bound address, ``--allowed-host`` names; :mod:`psflow.platform.hosts`): DNS rebinding cannot reach it.

Runs started from it keep their logdirs in ``./runs/<run id>`` (``--runs-dir``), as ``psflow
run``'s do; it says so at start. While it serves, ``$PSFLOW_HOME/ui.json`` says where (url, pid), so ``psflow run`` can print where
the dashboard is (:mod:`psflow.platform.uifile`); it is removed at exit, and one whose pid is gone is ignored.

Called by :mod:`psflow.cli`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import secrets
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psflow.errors import ConfigError
from psflow.home import UI_TOKEN_ENV, psflow_home, ui_token
from psflow.platform import hosts
from psflow.platform.alerts import check_webhook
from psflow.platform.api import UiSettings, create_app
from psflow.platform.uifile import remove_ui, write_ui

MIN_REMOTE_TOKEN_CHARS = 16  # a dashboard reachable off this machine: a token short enough to guess is none
_MAKE_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def settings_for(host: str, *, allow_remote: bool, scripts: tuple[Path, ...] = (), runs_dir: Path | None = None,
                 env: dict[str, str] | None = None, alert_webhook: str | None = None,
                 alert_stall_s: float = 300.0, allowed_hosts: tuple[str, ...] = ()) -> UiSettings:
    """The dashboard's settings for a bind to ``host``; ``allowed_hosts``: more names its requests'
    ``Host`` may give (``--allowed-host``).

    Raises:
        ConfigError: a non-loopback ``host`` without ``allow_remote``, or without a token of the user's own
            of at least ``MIN_REMOTE_TOKEN_CHARS`` characters;
            an ``allowed_hosts`` entry that is not a host name.
    """
    token = ui_token(env)
    remote = not is_loopback(host)
    if remote and not allow_remote:
        raise ConfigError(f"--host {host} is reachable from other machines. The dashboard binds 127.0.0.1 unless told "
                          f"otherwise: add --allow-remote (and set {UI_TOKEN_ENV}), or use an SSH tunnel to 127.0.0.1.")
    if remote and token is None:
        raise ConfigError(f"--host {host} --allow-remote needs a token of your own: set {UI_TOKEN_ENV} to a long "
                          f"random string (e.g. {_MAKE_TOKEN}).")
    if remote and token is not None and len(token) < MIN_REMOTE_TOKEN_CHARS:
        raise ConfigError(f"--host {host} --allow-remote: {UI_TOKEN_ENV} is {len(token)} characters long; a dashboard "
                          f"reachable from other machines needs a token of at least {MIN_REMOTE_TOKEN_CHARS} characters. "
                          f"Generate one: export {UI_TOKEN_ENV}=$({_MAKE_TOKEN})")
    for d in scripts:
        if not d.is_dir():
            raise ConfigError(f"--scripts {d}: not a directory. Give the directory whose .py files the form may start.")
    if alert_webhook is not None:
        check_webhook(alert_webhook)
    if not alert_stall_s > 0:
        raise ConfigError(f"--alert-stall must be a positive number of seconds; received {alert_stall_s}.")
    return UiSettings(home=psflow_home(env), token=token or secrets.token_urlsafe(24),
                      script_roots=tuple(d.resolve() for d in scripts) or (Path.cwd(),),
                      runs_root=(runs_dir or Path("runs")).resolve(), auth_reads=remote,
                      alert_webhook=alert_webhook, alert_stall_s=alert_stall_s,
                      allowed_hosts=hosts.allowed_hosts(host, allowed_hosts, loopback=not remote))


def serve(settings: UiSettings, host: str = "127.0.0.1", port: int = 8265, *,
          echo: Callable[[str], None] = print) -> None:
    """Serve until interrupted (Ctrl-C, SIGTERM); ``port`` 0 takes a free one (the URL printed says which)."""
    import uvicorn

    app = create_app(settings)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off")
    server = _Server(config, settings, echo)
    try:
        server.run()
    finally:
        remove_ui(settings.home)


class _Server:
    """uvicorn's server, which prints where it listens once bound (the port may have been 0)."""

    def __init__(self, config: Any, settings: UiSettings, echo: Callable[[str], None]) -> None:
        import uvicorn

        settings_, echo_ = settings, echo

        class Server(uvicorn.Server):
            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                await super().startup(sockets)
                bound = [s.getsockname() for srv in getattr(self, "servers", []) for s in srv.sockets]
                if bound:
                    _announce(settings_, bound[0], echo_)
                    closing = self.config.app.state.closing
                    threading.Thread(target=summarise_backlog, args=(settings_.db_path, closing), daemon=True,
                                     name="psflow-summarise").start()
                    if settings_.alert_webhook:  # each run's launcher tells them (psflow.platform.runalerts)
                        echo_(f"psflow ui: alerts (failed, stalled for {settings_.alert_stall_s:g} s, restarted) go to "
                              f"{settings_.alert_webhook}, told by each run's launcher while this dashboard runs")

            async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
                # here, not after run(): uvicorn raises the captured SIGTERM again once it has shut down
                remove_ui(settings_.home)
                closing = getattr(getattr(self.config.app, "state", None), "closing", None)
                if closing is not None:
                    closing.set()  # open live streams end (uvicorn waits for their responses)
                await super().shutdown(sockets)

        self.server = Server(config)

    def run(self) -> None:
        with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
            self.server.run()


def summarise_backlog(db_path: Path, stop: threading.Event, *, pause_s: float = 1.0, budget_s: float = 0.5) -> None:
    """Sum up the points of a migrated store's older runs (:meth:`JobStore.summarise_backlog`) in small
    batches, ``pause_s`` apart, until none is left or ``stop`` is set: each series its own short write,
    so runs, launchers and readers go on meanwhile (a run's first chart sums it up at once)."""
    from psflow.platform.jobstore import JobStore, JobStoreError

    while not stop.is_set():
        try:
            with JobStore(db_path) as db:
                if db.summarise_backlog(budget_s=budget_s) == 0:
                    return
        except JobStoreError as e:
            print(f"psflow ui: summing up older runs' metrics: {e}; trying again", file=sys.stderr, flush=True)
        stop.wait(pause_s)


def _announce(settings: UiSettings, sockname: Any, echo: Callable[[str], None]) -> str:
    host, port = sockname[0], sockname[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/"
    echo(f"psflow ui: the dashboard is at {url}#token={settings.token}")
    echo(f"psflow ui: runs started here keep their logdirs in {settings.logdirs}/<run id> (as psflow run's runs/<run id> "
         "under the directory it starts in; --runs-dir to change); psflow runs and the dashboard list them all")
    echo(f"psflow ui: API at {url}api/runs, OpenAPI schema at {url}openapi.json, Prometheus at {url}metrics")
    echo(f"psflow ui: job store {settings.db_path}; requests that change anything need the token "
         f"(Authorization: Bearer TOKEN{'' if ui_token() else ', or set ' + UI_TOKEN_ENV + ' to choose it'})")
    alerts = {"webhook": settings.alert_webhook, "stall_s": settings.alert_stall_s} if settings.alert_webhook else None
    write_ui(settings.home, url, alerts=alerts)  # where the runs' launchers find the webhook
    return url
