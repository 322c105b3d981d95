"""``KernelStream``: one worker thread that runs closures in submission order, plus its CUDA streams.

On a CUDA device the stream owns a **compute** and a **communication** stream. Every tensor a kernel writes is
stamped (in its :class:`~torch_dtorch.runtime.blob.Blob`) with the stream that wrote it and an event recorded after
the write; a kernel on the other stream waits for that event before reading (and marks the tensor as used by its
stream for the caching allocator), so no stream ever reads what another is still writing. Redistributes run on the
communication stream, everything else on the compute stream. On the CPU the same API exists without streams.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
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
        if self.is_cuda:
            self._streams = {
                COMPUTE: torch.cuda.Stream(device=self.torch_device),
                COMM: torch.cuda.Stream(device=self.torch_device),
            }
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._discard = False
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
            # no ``torch.set_default_device``: its TorchFunctionMode would tax every torch call from Python; kernels
            # name their devices (``LocalContext.torch_device``)
            torch.cuda.set_device(self.torch_device)
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
        """Make ``kind``'s stream current (no-op on the CPU)."""
        s = self._streams.get(kind)
        if s is None:
            yield
            return
        with torch.cuda.stream(s):
            yield

    def wait_for(self, blobs: Iterable[Blob | None], kind: str) -> None:
        """Make stream ``kind`` wait until every blob written on another stream is complete."""
        if not self.is_cuda:
            return
        s = self._streams[kind]
        for b in blobs:
            if b is None or b.event is None or b.stream == kind or b.waited == kind or b.tensor is None:
                continue
            s.wait_event(b.event)
            if b.tensor.device.type == "cuda":
                b.tensor.record_stream(s)  # the allocator must not reuse it before ``s`` is done with it
            # ``s`` stays ordered after the write, and one record_stream covers every later use
            b.waited = kind

    def stamp(self, blobs: Iterable[Blob], kind: str) -> None:
        """Record that ``blobs`` were written on stream ``kind`` (one event after the write)."""
        if not self.is_cuda:
            for b in blobs:
                b.stream = kind
            return
        event = torch.cuda.Event()
        event.record(self._streams[kind])
        for b in blobs:
            b.stream = kind
            b.event = event
            b.waited = None

    def synchronize(self) -> None:
        """Wait for every kernel queued on both streams (no-op on the CPU)."""
        for s in self._streams.values():
            s.synchronize()

    def __repr__(self) -> str:
        return f"KernelStream({self._thread.name}, {self.torch_device})"
