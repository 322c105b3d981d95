"""gRPC bidirectional heartbeat between the controller and its workers (docs/cluster.md, docs/reliability.md).

* :class:`HeartbeatMonitor` (controller): detects dead workers (:class:`WorkerLostError`, within
  ``DTORCH_HEARTBEAT_TIMEOUT_S``, default 5 s; at once when the process dies) and hung ones
  (:class:`WorkerHangError`, busy on one op longer than ``DTORCH_HANG_TIMEOUT_S``, default 600 s).
* :class:`HeartbeatClient` (worker): beats from its own threads; exits the worker (or calls a callback) when the
  controller goes away for ``DTORCH_CONTROLLER_TIMEOUT_S`` (default 10 s; at once when its stream breaks).
"""

from __future__ import annotations

from torch_dtorch.cluster.heartbeat._common import (
    ENV_CONTROLLER_TIMEOUT,
    ENV_DEATH_TIMEOUT,
    ENV_HANG_TIMEOUT,
)
from torch_dtorch.cluster.heartbeat.client import (
    CONTROLLER_LOST_EXIT_CODE,
    ControllerUnreachableError,
    HeartbeatClient,
)
from torch_dtorch.cluster.heartbeat.errors import HeartbeatError, WorkerHangError, WorkerLostError
from torch_dtorch.cluster.heartbeat.monitor import HeartbeatMonitor, WorkerStatus

__all__ = [
    "CONTROLLER_LOST_EXIT_CODE",
    "ENV_CONTROLLER_TIMEOUT",
    "ENV_DEATH_TIMEOUT",
    "ENV_HANG_TIMEOUT",
    "ControllerUnreachableError",
    "HeartbeatClient",
    "HeartbeatError",
    "HeartbeatMonitor",
    "WorkerHangError",
    "WorkerLostError",
    "WorkerStatus",
]
