"""The exception hierarchy of psflow.

Every error a user can meet derives from :class:`PsflowError`. Messages follow one shape:
what went wrong, the value received, and what to do about it.
"""

from __future__ import annotations


class PsflowError(Exception):
    """Base class of every psflow error."""


class ConfigError(PsflowError, ValueError):
    """A cluster spec, flag, environment variable or argument is invalid."""


class ClusterError(PsflowError):
    """A task of the cluster cannot be reached or misbehaves."""


class TransportError(ClusterError):
    """A connection failed, timed out, or carried a malformed or refused frame."""


class PeerGoneError(TransportError):
    """Nothing listens at the peer's address any more (the connection was refused, and asked again,
    the launcher knows no newer address): on one host, its process is gone. Raised by
    ``connect(refused_is_gone=True)`` at once, where waiting out a deadline would only delay a failover."""


class AuthError(TransportError):
    """A peer did not prove that it holds the job's secret."""


class RemoteError(ClusterError):
    """A remote task refused or failed a request; the message is the remote's own, ``kind`` the
    class name of its error (``"StaleTermError"``, ...), when it said."""

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


class TaskFailedError(PsflowError):
    """A task of the job failed; the launcher reports the first one as the root cause."""


class CheckpointError(PsflowError):
    """A checkpoint is missing, partial or corrupt."""


class DataError(PsflowError):
    """A dataset is unavailable or does not match its checksum."""


class TrainingError(PsflowError):
    """Training cannot go on (a NaN, a sync step that can never complete, ...)."""


class StaleTermError(ClusterError):
    """A ps copy refused a message of an older term than its view of the shard (or from a copy the
    view does not name): the sender's view is out of date (``ps_replicas=2``, :mod:`psflow.ps.views`)."""


class NotServingError(ClusterError):
    """A ps does not serve a shard now (it restarted and is re-syncing, or holds the shard's backup
    copy): retryable, at the other ps of the shard's pair (``ps_replicas=2``)."""
