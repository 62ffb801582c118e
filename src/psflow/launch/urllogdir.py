"""A run's log directory on a URL (``psflow run --logdir s3://bucket/prefix``, any fsspec URL).

Owns the three things a URL logdir needs beyond a local one:

- :func:`check_url`: before any task starts, a probe object is written to the URL and deleted again,
  so an unreachable endpoint, a missing bucket or refused credentials fail the run up front with one
  clear error (s3:// is tried once, with short timeouts: no minutes of botocore retries);
- :func:`staging_dir`: the tasks and the launcher write where they always do, into a local directory
  (``$PSFLOW_HOME/staging/<name>-<random>``, kept after the run as its local copy); the job store
  records that directory as the run's ``logdir`` (so the dashboard, ``psflow logs`` and
  ``psflow status`` read the files as they are written) and the URL as ``launch.logdir_url``;
- :class:`LogdirSyncer`: a thread in the launcher that uploads what changed in the staging directory
  every ``interval_s`` and, at the end, everything once more. Each file is uploaded whole (an object
  store has no append, and a PUT is whole or absent, so a reader sees a complete earlier version of a
  log, never a torn one; ``status.json`` is replaced atomically). ``DONE`` (the chief's "training
  ended" marker) is held back until the final pass, where it goes last: a reader that sees ``DONE``
  on the URL sees every other file of the run, ``summary.json`` included.

Checkpoints do not go through the staging directory: ``psflow run`` points the tasks'
``PSFLOW_CHECKPOINT_DIR`` at ``<url>/checkpoints`` (unless ``--checkpoint-dir`` is given), where
:mod:`psflow.checkpoint.remote` writes them with its manifest-last protocol. The run's secret
(``.secret``) is never uploaded.

Credentials and endpoints come from the environment, as fsspec's filesystems read them (for S3:
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``).

Called by ``psflow run`` (:mod:`psflow.cli`) and :mod:`psflow.platform.views` (``psflow status URL``).
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psflow.errors import ConfigError
from psflow.rundir import CHECKPOINTS_DIR, DONE_FILE, LOGS_DIR, SECRET_FILE, STATUS_FILE, SUMMARY_FILE

_NEVER = (SECRET_FILE,)  # the job secret stays on this machine
_PROBE_TIMEOUT_S = 5


def is_url(logdir: str | os.PathLike[str] | None) -> bool:
    """Whether ``logdir`` is a URL (``s3://...``, ``gs://...``, ``file://...``), not a local path."""
    return logdir is not None and "://" in str(logdir)


def _fs(url: str, *, probe: bool = False) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` (a fresh client: the environment may have changed) and its path."""
    import fsspec

    options: dict[str, Any] = {}
    if probe and url.startswith(("s3://", "s3a://")):
        # One try with short timeouts: an unreachable endpoint is reported in seconds, not after retries.
        options["config_kwargs"] = {"connect_timeout": _PROBE_TIMEOUT_S, "read_timeout": _PROBE_TIMEOUT_S,
                                    "retries": {"max_attempts": 1, "mode": "standard"}}
    try:
        fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"--logdir {url!r} cannot be used: {e}. For s3:// install s3fs (pip install 's3fs'); "
                          "other schemes need their fsspec package.") from e
    return fs, path.rstrip("/")


def check_url(url: str) -> None:
    """Write and delete a probe object under ``url``: the run can write its files there.

    Raises:
        ConfigError: it cannot (unreachable endpoint, no such bucket, no credentials or refused):
            the URL, the error and what to check.
    """
    fs, path = _fs(url, probe=True)
    probe = f"{path}/.psflow-probe-{uuid.uuid4().hex[:8]}"
    try:
        fs.pipe_file(probe, b"psflow checks that it can write here\n")
        fs.rm_file(probe)
    except Exception as e:  # noqa: BLE001 (each filesystem raises its own: botocore's, OSError, PermissionError)
        raise ConfigError(
            f"--logdir {url!r} cannot be written: {type(e).__name__}: {e}. Check that the endpoint is reachable "
            "(AWS_ENDPOINT_URL for an S3-compatible server), that the bucket exists and that the credentials in the "
            "environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) may write to it. No task was started."
        ) from None


def staging_dir(url: str, home: Path) -> Path:
    """A fresh local directory for the run's files, ``HOME/staging/<the URL's last name>-<random>`` (0700)."""
    base = home / "staging"
    base.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", url.rstrip("/").rsplit("/", 1)[-1])[:40] or "run"
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))


def checkpoint_url(url: str) -> str:
    """Where a URL logdir's checkpoints go: ``<url>/checkpoints``."""
    return f"{url.rstrip('/')}/{CHECKPOINTS_DIR}"


class LogdirSyncer:
    """Upload a staging directory's files to a URL: every ``interval_s`` what changed, then all at the end.

    Args:
        local: the staging directory.
        url: the run's logdir URL.
        interval_s: seconds between passes while the run goes on.
        warn: how the launcher tells its user that an upload failed (once per file and error).

    Example:
        >>> with LogdirSyncer(Path("/tmp/stage"), "s3://bucket/run") as syncer:
        ...     ...  # the run; on exit the final pass uploads everything, DONE last
    """

    def __init__(self, local: Path, url: str, *, interval_s: float = 5.0,
                 warn: Callable[[str], None] | None = None) -> None:
        self.local = local
        self.url = url.rstrip("/")
        self.interval_s = interval_s
        self.warn = warn or (lambda message: None)
        self._uploaded: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) last uploaded
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one pass at a time (the thread's and the final one)
        self._thread: threading.Thread | None = None
        self._fs, self._root = _fs(self.url)

    def __enter__(self) -> LogdirSyncer:
        self._thread = threading.Thread(target=self._loop, name="psflow-logdir-sync", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sync_once(final=False)

    def changed(self, *, final: bool) -> list[str]:
        """The files (relative paths) to upload now, in order: ``DONE`` only when ``final``, and last."""
        out = []
        for path in sorted(self.local.rglob("*")):
            rel = path.relative_to(self.local).as_posix()
            if not path.is_file() or rel in _NEVER or path.name.endswith(".tmp") or rel.startswith(f"{CHECKPOINTS_DIR}/"):
                continue
            if rel == DONE_FILE and not final:
                continue  # published last, by the final pass
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # replaced or removed between the listing and now
            if self._uploaded.get(rel) != (st.st_size, st.st_mtime_ns):
                out.append(rel)
        return sorted(out, key=lambda rel: rel == DONE_FILE)

    def sync_once(self, *, final: bool) -> list[str]:
        """One pass; returns the files it uploaded. Failures are warned about, not raised, unless ``final``.

        Raises:
            ConfigError: ``final`` and some file could not be uploaded (``DONE`` is then not published).
        """
        with self._lock:
            done, failed = [], []
            for rel in self.changed(final=final):
                if rel == DONE_FILE and failed:
                    break  # a reader seeing DONE must see everything: not while something is missing
                path = self.local / rel
                try:
                    st = path.stat()
                    data = path.read_bytes()
                    self._fs.pipe_file(f"{self._root}/{rel}", data)
                except FileNotFoundError:
                    continue
                except Exception as e:  # noqa: BLE001 (each filesystem raises its own errors)
                    failed.append(f"{rel} ({type(e).__name__}: {e})")
                    key = f"{rel}:{type(e).__name__}"
                    if key not in self._warned:
                        self._warned.add(key)
                        self.warn(f"could not upload {rel} to {self.url}: {type(e).__name__}: {e}; retrying later.")
                    continue
                self._uploaded[rel] = (st.st_size, st.st_mtime_ns)
                done.append(rel)
            if final and failed:
                raise ConfigError(f"The run's files could not all be uploaded to {self.url}: {'; '.join(failed)}. "
                                  f"They are all in {self.local}; copy them up by hand.")
            return done

    def close(self) -> None:
        """Stop the thread, then the final pass (everything not yet uploaded, ``DONE`` last).

        Raises:
            ConfigError: the final pass could not upload every file.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.sync_once(final=True)


def download(url: str, into: Path, *, names: tuple[str, ...] = (STATUS_FILE, SUMMARY_FILE, DONE_FILE, LOGS_DIR)) -> Path:
    """Copy a URL logdir's ``names`` (files or folders) into the local directory ``into``; returns it.

    Raises:
        ConfigError: the URL cannot be read, or holds no ``status.json`` (it is not a run's logdir).
    """
    fs, root = _fs(url)
    into.mkdir(parents=True, exist_ok=True)
    try:
        if not fs.exists(f"{root}/status.json"):
            raise ConfigError(f"{url} holds no status.json: it is not the --logdir of a `psflow run`.")
        for name in names:
            src = f"{root}/{name}"
            if fs.isdir(src):
                fs.get(src + "/", str(into / name) + "/", recursive=True)
            elif fs.exists(src):
                fs.get_file(src, str(into / name))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"Cannot read the run at {url}: {type(e).__name__}: {e}. Check the URL and the credentials "
                          "in the environment.") from None
    return into
