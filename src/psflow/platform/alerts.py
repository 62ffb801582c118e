"""Alerts: a webhook told when a run fails, stalls or has a task restarted (``psflow ui --alert-webhook URL``).

A pure core under a thin I/O shell:

- :class:`AlertBook` (pure) takes what the store shows, step by step: the run events that arrived
  (``restart``: a task restarted; ``run_finished`` with status ``failed``) and a look at each live
  run's global step at a time. It returns :class:`Alert` values. A run stalls when its global step has
  not moved for ``stall_s`` (while it runs, once past step 0); it is told once per stall, and again only after its step
  moved and stood still again. Book states per live run: ``moving --no new step for stall_s--> stalled
  (alert) --the step moves--> moving``; a run that is no longer live is forgotten.
- :class:`AlertWatcher` (the shell): a thread of the dashboard that reads the job store every
  ``poll_s``, feeds the book and POSTs each alert as JSON to the webhook (``text`` for chat tools
  that read that field, Slack's and Mattermost's incoming webhooks among them, and the alert's fields).
  It starts from the newest event in the store: history is not alerted again when the dashboard starts.

A launcher given a webhook (``psflow run --alert-webhook``, ``PSFLOW_ALERT_WEBHOOK``) tells its own
run's alerts with the same book, dashboard or not (:mod:`psflow.platform.runalerts`). Both send
through one :class:`AlertSender`: whichever comes first claims the alert in the job store
(:meth:`JobStore.claim_alert`, keyed by :func:`alert_key`: run, kind, and the restarted task's
attempt or the stalled step) and sends it; the other skips it.

Called by :mod:`psflow.platform.uiserver` and :mod:`psflow.platform.runalerts`.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from psflow.errors import ConfigError

EVENT_KINDS = ("restart", "run_finished")


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
        its root cause, in words where known (:func:`psflow.launch.errorreport.describe_root_cause`:
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

    The dashboard's watcher and a launcher's own alerts (:mod:`psflow.platform.runalerts`) both send
    through one, each as its ``source`` (``dashboard``, ``launcher``): whichever claims an alert
    first (:meth:`JobStore.claim_alert`, keyed by :func:`alert_key`) tells it, the other skips it. A
    store that cannot be read does not stop the alert (told twice rather than lost); a webhook that
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


class AlertWatcher:
    """The dashboard's thread that turns the store's news into webhook POSTs (through an :class:`AlertSender`).

    Args:
        db_path: the job store.
        url: the webhook.
        book: the rules (its ``stall_s``).
        poll_s: how often the store is read.
        link: makes a link to a run's page (the dashboard's URL), added to each alert.
        send: posts one JSON body (default: urllib, 5 s timeout); tests and other transports swap it.
    """

    def __init__(self, db_path: Path, url: str, book: AlertBook, *, poll_s: float = 2.0,
                 link: Callable[[str], str] | None = None, send: Callable[[str, bytes], None] | None = None) -> None:
        self.db_path, self.url, self.book, self.poll_s = db_path, check_webhook(url), book, poll_s
        self.sender = AlertSender(url, db_path=db_path, source="dashboard", send=send, link=link,
                                  warn=lambda m: print(f"psflow ui: alerts: {m}", file=sys.stderr, flush=True))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="psflow-alerts", daemon=True)
        self._cursor: int | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        from psflow.platform.jobstore import JobStore, JobStoreError

        while not self._stop.is_set():
            try:
                with JobStore(self.db_path) as db:
                    alerts = self._look(db)
            except JobStoreError as e:
                print(f"psflow ui: alerts: cannot read the job store ({e}); trying again", file=sys.stderr, flush=True)
                alerts = []
            for alert in alerts:
                self.sender.tell(alert)
            self._stop.wait(self.poll_s)

    def _look(self, db: Any) -> list[Alert]:
        if self._cursor is None:  # history is not news
            self._cursor = db.last_event_id()
        events = db.events_since(self._cursor, EVENT_KINDS)
        if events:
            self._cursor = events[-1]["id"]
        from psflow.platform.runfiles import root_cause_of

        failed = {e["run_id"] for e in events if e["kind"] == "run_finished"}
        causes = {r: root_cause_of(run) if (run := db.run(r, metrics=False)) else None for r in failed}
        live, _ = db.run_page(state="running", limit=1000)
        steps = {r["id"]: int(r.get("global_step") or 0) for r in live if r["state"] == "running"}
        return self.book.on_events(events, causes) + self.book.on_look(steps, time.time())


def post_json(url: str, body: bytes) -> None:
    """POST ``body`` (JSON) to ``url``; raises on an error status or no answer within 5 s."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 (http(s) checked by check_webhook)
        response.read()

