"""Alerts: a webhook told when a run fails, stalls or has a task restarted.

A pure core under a thin I/O shell:

- :class:`AlertBook` (pure) takes what a run shows, step by step: its events
  (``restart``: a task restarted; ``run_finished`` with status ``failed``) and a look at each live
  run's global step at a time. It returns :class:`Alert` values. A run stalls when its global step has
  not moved for ``stall_s`` (while it runs, once past step 0); it is told once per stall, and again only after its step
  moved and stood still again. Book states per live run: ``moving --no new step for stall_s--> stalled
  (alert) --the step moves--> moving``; a run that is no longer live is forgotten.
- :class:`AlertSender` (the shell): claims an alert in the job store (:meth:`JobStore.claim_alert`,
  keyed by :func:`alert_key`: run, kind, and the restarted task's attempt or the stalled step), then
  POSTs it as JSON to the webhook (``text`` for chat tools that read that field, Slack's and
  Mattermost's incoming webhooks among them, and the alert's fields): each alert of a run is told at
  most once, however many senders see it.

Each run's launcher decides and sends its run's alerts, as one of its run's subscribers
(:mod:`psflow.platform.runalerts`), to its own webhook (``psflow run --alert-webhook``,
``PSFLOW_ALERT_WEBHOOK``) or to the dashboard's (``psflow ui --alert-webhook``).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from psflow.errors import ConfigError


@dataclass(frozen=True)
class Alert:
    """What to tell: ``kind`` is ``failed``, ``restarted`` or ``stalled``; ``text`` says it in one line."""

    kind: str
    run_id: str
    text: str
    task: str | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class AlertBook:
    """Decides the alerts (see the module docstring). ``stall_s``: how long a live run's global step may
    stand still before it counts as stalled."""

    stall_s: float = 300.0
    _steps: dict[str, tuple[int, float, bool]] = field(default_factory=dict)  # run -> (step, since, told)

    def on_events(self, events: Iterable[Mapping[str, Any]],
                  root_causes: Mapping[str, str | Mapping[str, Any] | None]) -> list[Alert]:
        """Alerts for run events (``restart``, ``run_finished``), oldest first; ``root_causes``: run ->
        its root cause, in words where known (:func:`psflow.errorreport.describe_root_cause`:
        the alert then says the exception and message, and carries the traceback's tail) or its task."""
        out = []
        for e in events:
            data = e.get("data") or {}
            run_id = str(e.get("run_id"))
            if e.get("kind") == "restart":
                task = str(data.get("task"))
                out.append(Alert("restarted", run_id, f"psflow: run {run_id}: {task} restarted as attempt "
                                 f"{data.get('attempt')} ({data.get('reason')})", task, dict(data)))
            elif e.get("kind") == "run_finished" and data.get("status") == "failed":
                out.append(_failed(run_id, root_causes.get(run_id)))
        return out

    def on_look(self, steps: Mapping[str, int], now: float) -> list[Alert]:
        """Alerts for the live runs' global steps seen at ``now`` (run -> step); other runs are forgotten."""
        out = []
        for run_id in set(self._steps) - set(steps):
            del self._steps[run_id]
        for run_id, step in steps.items():
            if step == 0:  # not training yet (starting, restoring): the launcher's start deadlines judge that
                continue
            last = self._steps.get(run_id)
            if last is None or step != last[0]:
                self._steps[run_id] = (step, now, False)
                continue
            _, since, told = last
            if not told and now - since >= self.stall_s:
                self._steps[run_id] = (step, since, True)
                out.append(Alert("stalled", run_id, f"psflow: run {run_id} stalled: global step {step} has not moved "
                                 f"for {now - since:.0f} s", None, {"global_step": step, "stalled_s": round(now - since, 1)}))
        return out


def _failed(run_id: str, cause: str | Mapping[str, Any] | None) -> Alert:
    """``psflow: run r2 failed; root cause: worker:1: ValueError: loss is nan`` (its traceback's tail in the detail)."""
    if not isinstance(cause, Mapping):
        return Alert("failed", run_id, f"psflow: run {run_id} failed" + (f"; root cause: {cause}" if cause else ""),
                     cause, {"root_cause": cause})
    task = cause.get("task")
    detail = {"root_cause": task or cause.get("message"), **{k: cause.get(k) for k in ("exception", "message", "traceback_tail")}}
    return Alert("failed", run_id, f"psflow: run {run_id} failed; root cause: {cause.get('text')}", task, detail)


def alert_key(alert: Alert) -> str:
    """What tells one alert of a run and kind from another: the restarted task and attempt, the
    stalled global step (a failure happens once per run)."""
    if alert.kind == "restarted":
        return f"{alert.task}@{alert.detail.get('attempt')}"
    if alert.kind == "stalled":
        return f"step={alert.detail.get('global_step')}"
    return "run"


def check_webhook(url: str) -> str:
    """``url`` if it is an http(s) URL with a host.

    Raises:
        ConfigError: another scheme or no host.
    """
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"--alert-webhook {url!r} is not an http:// or https:// URL. Give the webhook's full URL.")
    return url


class AlertSender:
    """The one way an alert leaves psflow: claimed in the job store, then POSTed to the webhook.

    A run's alerts (:mod:`psflow.platform.runalerts`) send through one, as its ``source``
    (``launcher``): whichever sender claims an alert first (:meth:`JobStore.claim_alert`, keyed by
    :func:`alert_key`) tells it, any other skips it. A store that cannot be read does not stop the alert (told twice rather than lost); a webhook that
    refuses it is warned about (``warn``), never raised.

    Args:
        url: the webhook.
        db_path: the job store (None: ``$PSFLOW_HOME/jobs.db``).
        source: who sends: recorded with the claim and in the body.
        warn: where a lost alert or an unreadable store is said.
        send: posts one JSON body (default: urllib, 5 s timeout); tests and other transports swap it.
        link: makes a link to a run's page (the dashboard's URL), added to each alert.
    """

    def __init__(self, url: str, *, db_path: Path | None, source: str, warn: Callable[[str], None],
                 send: Callable[[str, bytes], None] | None = None, link: Callable[[str], str] | None = None) -> None:
        self.url, self.db_path, self.source, self.warn = check_webhook(url), db_path, source, warn
        self.send = send or post_json
        self.link = link
        self.sent = 0
        self.failed = 0

    def tell(self, alert: Alert) -> bool:
        """Claim ``alert`` and POST it; False where another sender claimed it first or the webhook refused it."""
        if not self._claimed(alert):
            return False
        body = {**asdict(alert), "detail": dict(alert.detail), "source": self.source}
        if self.link is not None:
            body["url"] = self.link(alert.run_id)
            body["text"] = f"{alert.text} ({body['url']})"
        try:
            self.send(self.url, json.dumps(body, default=str).encode())
        except Exception as e:  # noqa: BLE001 (a webhook's failure never touches the run or the dashboard)
            self.failed += 1
            self.warn(f"the webhook {self.url} refused or could not be reached ({e}); lost: {alert.text}")
            return False
        self.sent += 1
        return True

    def _claimed(self, alert: Alert) -> bool:
        import sqlite3

        from psflow.platform.jobstore import JobStore, JobStoreError

        try:
            with JobStore(self.db_path) as db:
                return db.claim_alert(alert.run_id, alert.kind, alert_key(alert), time.time(), self.source)
        except (JobStoreError, sqlite3.Error) as e:
            self.warn(f"cannot claim {alert.kind} in the job store ({e}); telling it anyway")
            return True


def post_json(url: str, body: bytes) -> None:
    """POST ``body`` (JSON) to ``url``; raises on an error status or no answer within 5 s."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 (http(s) checked by check_webhook)
        response.read()

