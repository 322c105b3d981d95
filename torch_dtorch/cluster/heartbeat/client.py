"""Worker side of the gRPC heartbeat: beats on its own daemon threads, whatever the main thread is doing.

The worker's main thread may sit in a long kernel or an inductor compile; the beat threads keep running
(kernels and ``time.sleep`` release the GIL, and pure-Python work yields it every few milliseconds), so a busy
worker is never mistaken for a dead one. The main thread only calls :meth:`HeartbeatClient.set_state` around
each op, which is what the controller's hang timeout measures.

If the controller's stream breaks or its beats stop for ``controller_timeout_s`` (default 10 s, env
``DTORCH_CONTROLLER_TIMEOUT_S``), ``on_controller_lost`` is called once; the default logs and calls
``os._exit(3)`` so orphaned workers go away by themselves.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from torch_dtorch.cluster.heartbeat import heartbeat_pb2 as pb
from torch_dtorch.cluster.heartbeat import heartbeat_pb2_grpc as pb_grpc
from torch_dtorch.cluster.heartbeat._common import (
    CHANNEL_OPTIONS,
    DEFAULT_CONTROLLER_TIMEOUT_S,
    DEFAULT_INTERVAL_S,
    ENV_CONTROLLER_TIMEOUT,
    log,
    resolve_seconds,
    stall_seconds,
)
from torch_dtorch.cluster.heartbeat.errors import HeartbeatError

CONTROLLER_LOST_EXIT_CODE = 3


class ControllerUnreachableError(HeartbeatError, ConnectionError):
    """The worker could not open its heartbeat stream to the controller."""


def exit_on_controller_lost(reason: str) -> None:
    """Default ``on_controller_lost``: log and leave at once (no atexit handlers: the controller is gone)."""
    log.critical("dtorch worker pid %d: controller lost (%s); exiting.", os.getpid(), reason)
    for h in log.handlers:
        try:
            h.flush()
        except Exception:
            pass
    os._exit(CONTROLLER_LOST_EXIT_CODE)


class HeartbeatClient:
    """Heartbeat of one worker. ``start()`` connects (blocking up to ``connect_timeout_s``) and starts beating."""

    def __init__(
        self,
        controller_addr: str,
        worker_id: str,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        controller_timeout_s: float | None = None,
        connect_timeout_s: float = 10.0,
        host: str | None = None,
        on_controller_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.controller_addr = controller_addr
        self.worker_id = worker_id
        self.interval_s = resolve_seconds(interval_s, env="", default=DEFAULT_INTERVAL_S)
        self.controller_timeout_s = resolve_seconds(
            controller_timeout_s, env=ENV_CONTROLLER_TIMEOUT, default=DEFAULT_CONTROLLER_TIMEOUT_S
        )
        self.connect_timeout_s = connect_timeout_s
        self.host = host or socket.gethostname()
        self._on_lost = on_controller_lost or exit_on_controller_lost
        self._lock = threading.Lock()
        self._busy_op: str | None = None
        self._last_op = ""
        self._busy_since = 0.0
        self._seq = 0
        self._last_controller_beat = time.monotonic()
        self._stopping = threading.Event()
        self._lost_fired = threading.Event()
        self._wake: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._channel: Any = None
        self._call: Any = None
        self._threads: list[threading.Thread] = []

    # -- main-thread API ---------------------------------------------------------------------------------------

    def set_state(self, busy_op: str | None) -> None:
        """Report the op now running (``None``: idle). Sent with the next beat, which is sent at once."""
        with self._lock:
            if busy_op is not None:
                self._busy_op, self._last_op, self._busy_since = busy_op, busy_op, time.time()
            else:
                self._busy_op = None
        self._wake.put(True)

    def start(self) -> HeartbeatClient:
        if self._channel is not None:
            raise HeartbeatError("HeartbeatClient.start() called twice.")
        self._channel = grpc.insecure_channel(self.controller_addr, options=CHANNEL_OPTIONS)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.connect_timeout_s)
        except grpc.FutureTimeoutError as e:
            self._channel.close()
            raise ControllerUnreachableError(
                f"worker {self.worker_id!r}: no heartbeat server at {self.controller_addr} "
                f"after {self.connect_timeout_s:g} s."
            ) from e
        self._last_controller_beat = time.monotonic()
        stub = pb_grpc.HeartbeatStub(self._channel)
        self._call = stub.Beat(self._beats())
        for target, name in (
            (self._read, "dtorch-hb-client-reader"),
            (self._watch, "dtorch-hb-client-watchdog"),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Say goodbye (the controller records a clean leave, not a death) and close the stream."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._wake.put(True)
        # Give the goodbye beat a moment to go out before the channel closes.
        for t in self._threads:
            if t.name.endswith("reader"):
                t.join(timeout=0.5)
        if self._call is not None:
            self._call.cancel()
        if self._channel is not None:
            self._channel.close()

    def __enter__(self) -> HeartbeatClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- beat threads ------------------------------------------------------------------------------------------

    def _beat(self, state: pb.Beat.State) -> pb.Beat:
        with self._lock:
            self._seq += 1
            busy = self._busy_op is not None and state != pb.Beat.STOPPING
            return pb.Beat(
                worker_id=self.worker_id,
                host=self.host,
                pid=os.getpid(),
                sequence=self._seq,
                state=pb.Beat.BUSY if busy else state,
                op=self._busy_op if busy else self._last_op,
                busy_since=self._busy_since if busy else 0.0,
                sent_at=time.time(),
            )

    def _beats(self) -> Iterator[pb.Beat]:
        # Consumed by a gRPC-owned thread: one beat per interval, or at once after set_state()/stop().
        while not self._stopping.is_set():
            yield self._beat(pb.Beat.IDLE)
            try:
                self._wake.get(timeout=self.interval_s)
            except queue.Empty:
                pass
        yield self._beat(pb.Beat.STOPPING)

    def _read(self) -> None:
        reason = "controller closed the heartbeat stream"
        try:
            for _beat in self._call:
                self._last_controller_beat = time.monotonic()
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            reason = f"controller heartbeat stream broke ({getattr(code, 'name', code)})"
        except Exception as e:  # pragma: no cover - defensive
            reason = f"controller heartbeat stream failed: {e!r}"
        self._fire(reason)

    def _watch(self) -> None:
        period = min(self.interval_s, 0.05)
        last = time.monotonic()
        while not self._stopping.wait(period) and not self._lost_fired.is_set():
            now = time.monotonic()
            stalled = stall_seconds(now - last, period=period)  # see HeartbeatMonitor._scan
            last = now
            self._last_controller_beat = min(now, self._last_controller_beat + stalled)
            silent = now - self._last_controller_beat
            if silent > self.controller_timeout_s:
                self._fire(f"no controller heartbeat for {silent:.2f} s")

    def _fire(self, reason: str) -> None:
        if self._stopping.is_set() or self._lost_fired.is_set():
            return
        self._lost_fired.set()
        try:
            self._on_lost(reason)
        except Exception:
            log.exception("on_controller_lost callback failed")
