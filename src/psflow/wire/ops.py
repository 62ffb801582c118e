"""Operation codes of the wire protocol: one number per request kind, shared by every service."""

from __future__ import annotations

import enum


class Op(enum.IntEnum):
    # connection level
    HELLO = 1        # server -> client: nonce
    AUTH = 2         # client -> server: task id, client nonce, HMAC
    AUTH_OK = 3      # server -> client: HMAC of the client nonce (mutual proof)
    ERROR = 4        # reply: {"error": message, "kind": class name}
    OK = 5           # reply carrying meta and tensors
    PING = 6
    CLOCK = 7        # -> {"now_us": the server's timeline clock}: the timeline's clock-offset estimate
    # parameter server
    PS_INIT = 20     # chief -> ps: placement, optimizer, initial values
    PS_READY = 21    # wait until initialized (with a deadline)
    PS_PULL = 22     # parameters (optionally waiting for a version)
    PS_PUSH = 23     # gradients
    PS_STATUS = 24   # counters, global step
    PS_DONE = 25     # a worker finished
    PS_CLOCK = 26    # bounded staleness: report / wait on clocks
    PS_SAVE = 27     # write this shard's checkpoint
    PS_SHUTDOWN = 28
    PS_REPLICATE = 29  # primary ps -> its backup ps: the shard's init, then its recorded events in order
    # launcher coordination
    CO_REGISTER = 40  # task -> launcher: my address; reply: the cluster (first round: once all registered)
    CO_REPORT = 41    # task -> launcher: metrics / final results
    # 42 was CO_STATUS (nothing asked for it; CO_RESOLVE without a task returns the whole book)
    CO_RESOLVE = 43   # task -> launcher: where a task listens now (or the whole address book, with its version)
    CO_VIEW = 44      # ps -> launcher: the shard views (who serves each shard, in which term), and reports that change them
