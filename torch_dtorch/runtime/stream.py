"""``KernelStream``: one worker thread that runs closures in submission order, plus its CUDA streams.

On a CUDA device the stream owns a **compute** and a **communication** stream. Redistributes run on the
communication stream, everything else on the compute stream. On the CPU the same API exists without streams.

The stream-ordering rules of a worker (docs/cluster.md, "Stream ordering on a worker"), all applied here:

1. **Stamp every write.** Every blob a kernel, redistribute, upload or program stores is stamped (:meth:`stamp`) with
   the stream that wrote it — also when the write was host-synchronous.
2. **Wait before a cross-stream read.** A reader on another stream first waits for an event recorded on the
   writer's stream (:meth:`wait_for`; recorded at the read, which follows the write: events exist only per hand-off).
   A blob already waited for is skipped only while nothing else was written on the writer's stream: a write to its
   storage through an alias (an in-place op on a view's base) stamps the alias's blob, not this one.
3. **Tell the allocator about every cross-stream use.** The caching allocator hands a freed block out again as soon
   as its *allocating* stream has reached the free, so a tensor used on any other stream is ``record_stream``-ed
   there (:meth:`wait_for` for blobs, :meth:`adopt` for tensors that arrive from another thread's stream: CUDA IPC
   uploads, in-memory collectives). A blob can then be dropped (``Free``) at any time.
4. **Allocate where you write.** Temporaries (zeros of a failed input) are made on the stream that uses them
   (:meth:`zeros`), never on the thread's default stream.

Tests check the rules on the CPU with a fake of the three primitives (:meth:`_event`, :meth:`_wait_event`,
:meth:`_record_stream`): tests/unit/test_stream_rules.py.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from torch_dtorch.runtime.blob import Blob

__all__ = ["COMM", "COMPUTE", "KernelStream"]

log = logging.getLogger(__name__)

COMPUTE = "compute"
COMM = "comm"
_STOP = object()


class KernelStream:
    """A thread + queue executing closures in order on ``torch_device``.

    Args:
        torch_device: where the kernels run (``cpu``, ``cuda:1``, ...). Several streams may share one CUDA device
            (virtual ranks): each still gets its own compute and communication streams.
        name: thread name (for logs and traces).
    """

    def __init__(self, torch_device: torch.device | str, *, name: str = "dtorch-worker") -> None:
        self.torch_device = torch.device(torch_device)
        self.is_cuda = self.torch_device.type == "cuda"
        self._streams: dict[str, Any] = {}
        #: per stream, how many times blobs were stamped as written there (a cross-stream reader that waited for a
        #: blob need not wait again while this count is unchanged)
        self._stamps: dict[str, int] = {}
        if self.is_cuda:
            self._streams = {
                COMPUTE: torch.cuda.Stream(device=self.torch_device),
                COMM: torch.cuda.Stream(device=self.torch_device),
            }
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._discard = False
        self._compute_current = False  # the compute stream is the thread's current stream (set by the thread)
        self._idle = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # --- the queue ----------------------------------------------------------------------------------------------
    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the stream's thread after everything submitted before it."""
        with self._idle:
            self._submitted += 1
        self._queue.put(fn)

    @property
    def done(self) -> int:
        """How many submitted closures have run (or were dropped at close)."""
        return self._done

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every closure submitted so far has run (does not wait for CUDA kernels to finish)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._done >= self._submitted, timeout)

    def close(self, *, discard: bool = True, timeout: float | None = 10.0) -> bool:
        """Stop the thread; with ``discard`` the closures still queued are dropped. Returns whether it stopped."""
        self._discard = discard
        self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        if self.is_cuda:
            try:
                # no ``torch.set_default_device``: its TorchFunctionMode would tax every torch call from Python;
                # kernels name their devices (``LocalContext.torch_device``)
                torch.cuda.set_device(self.torch_device)
                # the compute stream is this thread's current stream for good: ``use(COMPUTE)`` on it costs
                # nothing (it was two stream-context switches per op)
                torch.cuda.set_stream(self._streams[COMPUTE])
                self._compute_current = True
            except Exception:  # noqa: BLE001 - the closures then fail with the error; the thread must not die
                log.exception("%s: could not select %s", self._thread.name, self.torch_device)
        while True:
            fn = self._queue.get()
            if fn is _STOP:
                break
            try:
                if not self._discard:
                    fn()
            except BaseException:  # noqa: BLE001 - a worker thread must survive anything a closure raises
                log.exception("%s: unhandled error in a queued closure", self._thread.name)
            finally:
                with self._idle:
                    self._done += 1
                    self._idle.notify_all()
        with self._idle:
            self._done = self._submitted
            self._idle.notify_all()

    # --- CUDA streams and events --------------------------------------------------------------------------------
    def stream(self, kind: str) -> Any:
        """The CUDA stream of ``kind`` (``compute``/``comm``); ``None`` on the CPU."""
        return self._streams.get(kind)

    @contextlib.contextmanager
    def use(self, kind: str) -> Iterator[None]:
        """Make ``kind``'s stream current (no-op on the CPU, and for the compute stream on the stream's own thread,
        where it is always current)."""
        s = self._streams.get(kind)
        if s is None or (
            kind == COMPUTE and self._compute_current and threading.current_thread() is self._thread
        ):
            yield
            return
        with torch.cuda.stream(s):
            yield

    def wait_for(self, blobs: Iterable[Blob | None], kind: str) -> None:
        """Before stream ``kind`` reads ``blobs``: order it after each write made on another stream (an event
        recorded now on the writer's stream follows the write), and tell the allocator the tensor is used there
        (rules 2 and 3)."""
        if not self.is_cuda:
            return
        ordered: set[str] | None = None  # writer streams ``kind`` already waits for in this call
        stamps = self._stamps
        for b in blobs:
            if b is None or b.tensor is None or b.stream == kind:
                continue
            writer = b.stream
            if b.waited == kind and (writer is None or b.waited_at == stamps.get(writer, 0)):
                # ordered after every write on the writer's stream, and none since: not to this blob, nor to an
                # alias of its storage (an in-place write to a view's base stamps the base's blob, not the view's)
                continue
            if writer is not None:
                if ordered is None:
                    ordered = set()
                if writer not in ordered:
                    self._wait_event(kind, self._event(writer))
                    ordered.add(writer)
            if b.waited != kind:
                self._record_stream(b.tensor, kind)  # one record_stream covers every later use
            b.waited = kind
            b.waited_at = stamps.get(writer, 0) if writer is not None else 0

    def stamp(self, blobs: Iterable[Blob], kind: str) -> None:
        """Record that ``blobs`` were written on stream ``kind`` (rule 1; the event a cross-stream reader needs is
        made when it reads)."""
        for b in blobs:
            b.stream = kind
            b.waited = None
        self._stamps[kind] = self._stamps.get(kind, 0) + 1

    def host_wait(self, blob: Blob | None) -> None:
        """Block this thread until ``blob``'s write is done (another thread reads it on its own stream)."""
        if self.is_cuda and blob is not None and blob.stream is not None:
            self._event(blob.stream).synchronize()

    def adopt(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        """``tensor`` was allocated on another thread's stream (a CUDA IPC upload) and is complete; from now on it is
        used on ``kind``: tell the allocator (rule 3). No-op on the CPU."""
        if self.is_cuda:
            self._record_stream(tensor, kind)
        return tensor

    def upload(self, value: torch.Tensor, kind: str) -> torch.Tensor:
        """``value``, a host tensor, on this stream's device, written on ``kind``. A blocking copy from pageable
        memory synchronizes the stream first: the GPU drains and the worker waits for it, so the work queued behind
        no longer overlaps the issue. A one-element value (a scheduler's per-step sigma, a 0-d timestep) is written
        by a fill kernel instead, which queues like any kernel; larger ones are copied."""
        with self.use(kind):
            if value.numel() == 1 and value.device.type == "cpu" and self.is_cuda:
                return torch.full(value.shape, value.item(), dtype=value.dtype, device=self.torch_device)
            return value.to(self.torch_device)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype, kind: str) -> torch.Tensor:
        """Zeros allocated and written on stream ``kind`` (rule 4)."""
        with self.use(kind):
            return torch.zeros(tuple(shape), dtype=dtype, device=self.torch_device)

    def synchronize_device(self) -> None:
        """Wait for everything queued on this stream's device (every stream of the process there)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)

    # --- the three CUDA primitives (a test fake overrides these to check the rules on the CPU) -------------------
    def _event(self, kind: str) -> Any:
        event = torch.cuda.Event()
        event.record(self._streams[kind])
        return event

    def _wait_event(self, kind: str, event: Any) -> None:
        self._streams[kind].wait_event(event)

    def _record_stream(self, tensor: torch.Tensor, kind: str) -> None:
        if tensor.device.type == "cuda":
            tensor.record_stream(self._streams[kind])

    def synchronize(self) -> None:
        """Wait for every kernel queued on both streams (no-op on the CPU)."""
        for s in self._streams.values():
            s.synchronize()

    def __repr__(self) -> str:
        return f"KernelStream({self._thread.name}, {self.torch_device})"
