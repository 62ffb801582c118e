"""The psflow wire: framing, connections and the job-secret handshake."""

from psflow.wire.conn import Connection, connect
from psflow.wire.frame import FrameError, Limits
from psflow.wire.ops import Op

__all__ = ["Connection", "connect", "FrameError", "Limits", "Op"]
