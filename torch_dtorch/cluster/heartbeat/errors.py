"""Typed errors of the heartbeat layer (death and hang of a worker)."""

from __future__ import annotations

from torch_dtorch.errors import DTorchError


class HeartbeatError(DTorchError, RuntimeError):
    """Base class of heartbeat failures."""


class WorkerLostError(HeartbeatError):
    """A worker died, was stopped or became unreachable: its heartbeat stream broke or fell silent."""

    def __init__(self, worker: str, *, host: str, last_op: str | None, reason: str) -> None:
        self.worker = worker
        self.host = host
        self.last_op = last_op
        self.reason = reason
        op = f"last op {last_op!r}" if last_op else "no op in flight"
        super().__init__(
            f"worker {worker!r} on host {host!r} was lost ({reason}); {op}.\n"
            "Fix: check that worker's log and its host (OOM killer, crash, stopped process); "
            "the remaining workers are shut down."
        )


class WorkerHangError(HeartbeatError, TimeoutError):
    """A worker is alive (still heartbeating) but has been busy on one op longer than the hang timeout."""

    def __init__(self, worker: str, *, host: str, op: str, elapsed_s: float, timeout_s: float) -> None:
        self.worker = worker
        self.host = host
        self.op = op
        self.elapsed_s = elapsed_s
        self.timeout_s = timeout_s
        super().__init__(
            f"worker {worker!r} on host {host!r} has been busy on op {op!r} for {elapsed_s:.1f} s, "
            f"longer than the hang timeout of {timeout_s:g} s.\n"
            "Fix: if the op is legitimately long (large kernels, a first inductor compile), raise "
            "DTORCH_HANG_TIMEOUT_S; otherwise look for a deadlock (e.g. a collective some rank never entered)."
        )
