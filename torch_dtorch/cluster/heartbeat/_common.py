"""Shared constants and helpers of the heartbeat client and monitor."""

from __future__ import annotations

import logging
import os

from torch_dtorch.cluster.heartbeat.errors import HeartbeatError

log = logging.getLogger("torch_dtorch.cluster.heartbeat")

ENV_DEATH_TIMEOUT = "DTORCH_HEARTBEAT_TIMEOUT_S"
"""Silence (seconds) after which the controller declares a worker dead. Default 5 (a process that dies is
noticed at once, when its stream breaks; silence only means a stopped, frozen or partitioned worker)."""
ENV_HANG_TIMEOUT = "DTORCH_HANG_TIMEOUT_S"
"""Seconds a live worker may stay busy on one op before the controller reports a hang. Default 600."""
ENV_CONTROLLER_TIMEOUT = "DTORCH_CONTROLLER_TIMEOUT_S"
"""Silence (seconds) after which a worker declares its controller gone and exits. Default 10 (a controller that
dies breaks the stream: its workers leave at once)."""

DEFAULT_INTERVAL_S = 0.1
DEFAULT_DEATH_TIMEOUT_S = 5.0
DEFAULT_HANG_TIMEOUT_S = 600.0
DEFAULT_CONTROLLER_TIMEOUT_S = 10.0

# Keep connections responsive and never let gRPC silently hold a broken one open.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
]


STALL_GRACE_S = 0.2
"""A watchdog pass later than its period by more than this means the watching process itself was stalled."""


def stall_seconds(gap_s: float, *, period: float) -> float:
    """How much of ``gap_s`` (time between two watchdog passes meant to be ``period`` apart) the watching process
    was stalled: 0 for a pass on time (within :data:`STALL_GRACE_S`), else everything past the period. A stalled
    watcher has not read the beats that arrived meanwhile, so silence measured across the stall is not the peer's."""
    late = gap_s - period
    return late if late > STALL_GRACE_S else 0.0


def resolve_seconds(value: float | None, *, env: str, default: float) -> float:
    """``value`` if given, else the float in environment variable ``env``, else ``default``; must be > 0."""
    if value is None:
        raw = os.environ.get(env, "").strip()
        try:
            value = float(raw) if raw else default
        except ValueError as e:
            raise HeartbeatError(f"{env}={raw!r} is not a number of seconds.") from e
    if not value > 0:
        raise HeartbeatError(f"timeout/interval must be > 0 seconds, got {value!r} (from {env} or argument).")
    return float(value)
