"""Controller side of the gRPC heartbeat: a server that watches every worker's beat stream.

Two independent failure detectors (docs/reliability.md):

* death: the worker's stream breaks (process killed, connection reset) or no beat arrives for
  ``death_timeout_s`` (process stopped, host frozen, partition) -> :class:`WorkerLostError`;
* hang: the worker keeps beating (its heartbeat thread is alive) but reports being busy on the same op
  invocation for longer than ``hang_timeout_s`` -> :class:`WorkerHangError`. Long kernels and compiles
  therefore never look like death; they only trip the (large, configurable) hang timeout.

Errors are delivered through the ``on_lost`` / ``on_hang`` callbacks (called from a monitor thread) and kept
for :meth:`HeartbeatMonitor.check`, which the controller calls from its own thread.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from torch_dtorch.cluster.heartbeat import heartbeat_pb2 as pb
from torch_dtorch.cluster.heartbeat import heartbeat_pb2_grpc as pb_grpc
from torch_dtorch.cluster.heartbeat._common import (
    DEFAULT_DEATH_TIMEOUT_S,
    DEFAULT_HANG_TIMEOUT_S,
    DEFAULT_INTERVAL_S,
    ENV_DEATH_TIMEOUT,
    ENV_HANG_TIMEOUT,
    SERVER_OPTIONS,
    log,
    resolve_seconds,
    stall_seconds,
)
from torch_dtorch.cluster.heartbeat.errors import HeartbeatError, WorkerHangError, WorkerLostError


@dataclass
class WorkerStatus:
    """What the controller knows about one worker (a snapshot is returned by :meth:`HeartbeatMonitor.workers`)."""

    worker: str
    host: str
    pid: int
    sequence: int
    last_beat: float  # time.monotonic() of the last beat received
    busy_op: str | None = None  # op in flight, None when idle
    last_op: str | None = None  # most recent op seen (in flight or finished)
    busy_key: tuple[str, float] | None = None  # (op, worker's busy_since): one op invocation
    busy_started: float = 0.0  # time.monotonic() when busy_key was first seen
    left: bool = False  # said goodbye (STOPPING) - no error when its stream ends
    released: bool = (
        False  # being shut down on purpose (:meth:`HeartbeatMonitor.forget`): not watched any more
    )
    ended: bool = False  # its beat stream is over (goodbye, death or cancellation)
    lost: bool = False
    hung: bool = False


class DaemonPool(futures.Executor):
    """The gRPC server's handler threads, as **daemon** threads that interpreter exit does not wait for.

    ``concurrent.futures.ThreadPoolExecutor`` joins its threads at interpreter exit, before ``atexit`` handlers run;
    a heartbeat stream handler only ends when its worker leaves, and workers only leave when dtorch's ``atexit``
    shutdown tells them to: a script that ended without ``dt.shutdown()`` never exited. These threads are not
    joined at exit, so the ``atexit`` shutdown runs and ends the streams."""

    def __init__(self, *, max_workers: int, thread_name_prefix: str) -> None:
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
        future: futures.Future[Any] = futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("DaemonPool: submit after shutdown")
            self._queue.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                t = threading.Thread(
                    target=self._run, name=f"{self._prefix}_{len(self._threads)}", daemon=True
                )
                t.start()
                self._threads.append(t)
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001 - delivered through the future
                    future.set_exception(e)
                else:
                    future.set_result(result)
            del future, fn, args, kwargs
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        if wait:
            for t in threads:
                t.join()


class HeartbeatMonitor:
    """gRPC heartbeat server of the controller. Use as a context manager or call :meth:`start`/:meth:`stop`."""

    def __init__(
        self,
        *,
        bind: str = "127.0.0.1:0",
        interval_s: float = DEFAULT_INTERVAL_S,
        death_timeout_s: float | None = None,
        hang_timeout_s: float | None = None,
        on_lost: Callable[[WorkerLostError], None] | None = None,
        on_hang: Callable[[WorkerHangError], None] | None = None,
        max_workers: int = 256,
    ) -> None:
        self.interval_s = resolve_seconds(interval_s, env="", default=DEFAULT_INTERVAL_S)
        self.death_timeout_s = resolve_seconds(
            death_timeout_s, env=ENV_DEATH_TIMEOUT, default=DEFAULT_DEATH_TIMEOUT_S
        )
        self.hang_timeout_s = resolve_seconds(
            hang_timeout_s, env=ENV_HANG_TIMEOUT, default=DEFAULT_HANG_TIMEOUT_S
        )
        self._bind = bind
        self._on_lost = on_lost
        self._on_hang = on_hang
        self._max_workers = max_workers
        self._host = socket.gethostname()
        self._lock = threading.Lock()
        self._workers: dict[str, WorkerStatus] = {}
        self._errors: list[HeartbeatError] = []
        self._changed = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._server: Any = None
        self._pool: DaemonPool | None = None
        self._watchdog: threading.Thread | None = None
        self.address: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> str:
        """Start serving; returns the ``host:port`` address workers connect to."""
        if self._server is not None:
            raise HeartbeatError("HeartbeatMonitor.start() called twice.")
        self._pool = DaemonPool(max_workers=self._max_workers, thread_name_prefix="dtorch-hb-srv")
        server = grpc.server(
            self._pool,
            options=SERVER_OPTIONS,
            maximum_concurrent_rpcs=self._max_workers,
        )
        pb_grpc.add_HeartbeatServicer_to_server(_Servicer(self), server)
        port = server.add_insecure_port(self._bind)
        if port == 0:
            raise HeartbeatError(f"heartbeat server could not bind {self._bind!r}.")
        server.start()
        self._server = server
        self.address = f"{self._bind.rsplit(':', 1)[0]}:{port}"
        self._watchdog = threading.Thread(target=self._watch, name="dtorch-hb-watchdog", daemon=True)
        self._watchdog.start()
        log.debug("heartbeat monitor serving on %s", self.address)
        return self.address

    def stop(self, grace_s: float | None = None) -> None:
        """Stop serving. ``grace_s=None`` cancels every stream at once (workers see the controller leave)."""
        self._stopping.set()
        if self._server is not None:
            self._server.stop(grace_s).wait(5.0)
        if self._watchdog is not None:
            self._watchdog.join(timeout=2.0)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        with self._changed:
            self._changed.notify_all()

    def __enter__(self) -> HeartbeatMonitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- queries -----------------------------------------------------------------------------------------------

    def workers(self) -> dict[str, WorkerStatus]:
        """A snapshot of every worker seen so far."""
        with self._lock:
            return {k: WorkerStatus(**vars(v)) for k, v in self._workers.items()}

    def errors(self) -> list[HeartbeatError]:
        with self._lock:
            return list(self._errors)

    def check(self) -> None:
        """Raise the first recorded failure (a :class:`WorkerLostError` before any :class:`WorkerHangError`)."""
        with self._lock:
            errs = list(self._errors)
        for kind in (WorkerLostError, WorkerHangError):
            for err in errs:
                if isinstance(err, kind):
                    raise err

    def wait_for_workers(self, worker_ids: Iterable[str], *, timeout_s: float) -> None:
        """Block until every worker in ``worker_ids`` has sent a beat; :class:`HeartbeatError` on timeout."""
        wanted = set(worker_ids)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not wanted <= self._workers.keys():
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping.is_set():
                    missing = sorted(wanted - self._workers.keys())
                    raise HeartbeatError(
                        f"workers {missing} did not connect to the heartbeat within {timeout_s:g} s."
                    )
                self._changed.wait(left)

    def forget(self, worker: str) -> None:
        """Stop watching ``worker`` (it is being shut down on purpose)."""
        with self._lock:
            st = self._workers.get(worker)
            if st is not None:
                st.released = True

    def wait_gone(self, worker_ids: Iterable[str], *, timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s`` until every worker of ``worker_ids`` said goodbye or its stream ended (call it
        before :meth:`stop` on a graceful shutdown: stopping cancels the streams, which a worker that has not seen
        its shutdown message yet would take for the controller's death). Returns the ones still connected."""
        wanted = set(worker_ids)
        deadline = time.monotonic() + timeout_s

        def still() -> list[str]:
            return sorted(
                w for w in wanted if (st := self._workers.get(w)) is not None and not (st.left or st.ended)
            )

        with self._changed:
            while (left := still()) and not self._stopping.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
            return left

    # -- internals ---------------------------------------------------------------------------------------------

    def _controller_beat(self, seq: int) -> pb.Beat:
        return pb.Beat(
            worker_id="",
            host=self._host,
            pid=os.getpid(),
            sequence=seq,
            state=pb.Beat.IDLE,
            sent_at=time.time(),
        )

    def _on_beat(self, beat: pb.Beat) -> None:
        now = time.monotonic()
        busy = beat.state == pb.Beat.BUSY
        with self._changed:
            st = self._workers.get(beat.worker_id)
            if st is None:
                st = WorkerStatus(beat.worker_id, beat.host, beat.pid, beat.sequence, now)
                self._workers[beat.worker_id] = st
                self._changed.notify_all()
                log.debug("worker %s (%s pid %d) joined the heartbeat", st.worker, st.host, st.pid)
            st.sequence, st.last_beat = beat.sequence, now
            if beat.state == pb.Beat.STOPPING and not st.left:
                st.left = True
                self._changed.notify_all()
            if busy:
                key = (beat.op, beat.busy_since)
                if key != st.busy_key:
                    st.busy_key, st.busy_started, st.hung = key, now, False
                st.busy_op = st.last_op = beat.op
            else:
                st.busy_op, st.busy_key = None, None
                if beat.op:
                    st.last_op = beat.op

    def _on_stream_end(self, worker: str, reason: str) -> None:
        with self._changed:
            st = self._workers.get(worker)
            if st is not None:
                st.ended = True
                self._changed.notify_all()
            if self._stopping.is_set():
                return
            err = None if st is None or st.left or st.released or st.lost else self._lost(st, reason)
        if err is not None:
            self._deliver(err, self._on_lost)

    def _lost(self, st: WorkerStatus, reason: str) -> WorkerLostError:
        # Caller holds the lock.
        st.lost = True
        err = WorkerLostError(st.worker, host=st.host, last_op=st.last_op, reason=reason)
        self._errors.append(err)
        return err

    def _watch(self) -> None:
        period = min(self.interval_s, 0.05)
        last = time.monotonic()
        while not self._stopping.wait(period):
            now = time.monotonic()
            self._scan(now, stalled_s=stall_seconds(now - last, period=period))
            last = now

    def _scan(self, now: float, *, stalled_s: float = 0.0) -> None:
        """One watchdog pass at ``now``. ``stalled_s``: how long this process could not run its watchdog (a
        loaded host descheduled it, or a C call held the GIL); beats that arrived meanwhile are still unread in
        the sockets, so that time is credited to every worker instead of counted as their silence."""
        fired: list[tuple[HeartbeatError, Any]] = []
        with self._lock:
            for st in self._workers.values():
                if st.lost or st.left or st.released:
                    continue
                st.last_beat = min(now, st.last_beat + stalled_s)
                silent = now - st.last_beat
                if silent > self.death_timeout_s:
                    reason = f"no heartbeat for {silent:.2f} s (process stopped, frozen or unreachable)"
                    fired.append((self._lost(st, reason), self._on_lost))
                elif st.busy_op is not None and not st.hung and now - st.busy_started > self.hang_timeout_s:
                    st.hung = True
                    hang = WorkerHangError(
                        st.worker,
                        host=st.host,
                        op=st.busy_op,
                        elapsed_s=now - st.busy_started,
                        timeout_s=self.hang_timeout_s,
                    )
                    self._errors.append(hang)
                    fired.append((hang, self._on_hang))
        for err, cb in fired:
            self._deliver(err, cb)

    def _deliver(self, err: HeartbeatError, callback: Callable[[Any], None] | None) -> None:
        log.error("%s", err)
        if callback is not None:
            try:
                callback(err)
            except Exception:
                log.exception("heartbeat callback failed")


class _Servicer(pb_grpc.HeartbeatServicer):  # type: ignore[misc]
    def __init__(self, monitor: HeartbeatMonitor) -> None:
        self._m = monitor

    def Beat(self, request_iterator: Iterator[pb.Beat], context: Any) -> Iterator[pb.Beat]:  # noqa: N802
        done = threading.Event()
        reader = threading.Thread(
            target=self._read, args=(request_iterator, done), name="dtorch-hb-reader", daemon=True
        )
        reader.start()
        seq = 0
        m = self._m
        while not done.is_set() and not m._stopping.is_set() and context.is_active():
            seq += 1
            yield m._controller_beat(seq)
            done.wait(m.interval_s)

    def _read(self, request_iterator: Iterator[pb.Beat], done: threading.Event) -> None:
        worker: str | None = None
        reason = "heartbeat stream closed without a goodbye"
        try:
            for beat in request_iterator:
                worker = beat.worker_id
                self._m._on_beat(beat)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            reason = (
                f"heartbeat stream broke ({getattr(code, 'name', code)}: process died or connection reset)"
            )
        except Exception as e:  # pragma: no cover - defensive
            reason = f"heartbeat stream failed: {e!r}"
        finally:
            done.set()
            if worker is not None:
                self._m._on_stream_end(worker, reason)
