"""Point-to-point mailboxes of the in-memory world: FIFO queues keyed by ``(src, dst, tag)``."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from torch_dtorch.collectives import streams
from torch_dtorch.collectives.errors import CollectiveTimeout

__all__ = ["Mailbox"]

_Key = tuple[int, int, int]


class Mailbox:
    """Buffered messages between devices of one process. :meth:`put` never waits; :meth:`take` waits (bounded)
    for the oldest message under a key. Messages are copies made at :meth:`put`, so the sender may reuse its
    tensor at once."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._boxes: dict[_Key, deque[tuple[torch.Tensor, streams.Events | None]]] = {}
        self._abort: Callable[[], BaseException] | None = None

    def put(self, src: int, dst: int, tag: int, t: torch.Tensor) -> None:
        copy = t.clone()
        done = streams.record_done((copy,))
        with self._cond:
            if self._abort is not None:
                raise self._abort()
            self._boxes.setdefault((src, dst, tag), deque()).append((copy, done))
            self._cond.notify_all()

    def take(self, src: int, dst: int, tag: int, timeout: float) -> torch.Tensor:
        key = (src, dst, tag)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._abort is not None:
                    raise self._abort()
                queue = self._boxes.get(key)
                if queue:
                    t, done = queue.popleft()
                    if not queue:
                        del self._boxes[key]
                    return streams.adopt(t, done)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveTimeout(
                        f"recv(src={src}, dst={dst}, tag={tag}) timed out after {timeout:g} s: device {src} sent "
                        "nothing with this tag",
                        devices=(src, dst),
                        op="recv",
                        arrived=(dst,),
                        timeout_s=timeout,
                    )
                self._cond.wait(remaining)

    def abort(self, error: Callable[[], BaseException]) -> None:
        """Drop every message; every current and later call raises ``error()``."""
        with self._cond:
            if self._abort is None:
                self._abort = error
            self._boxes.clear()
            self._cond.notify_all()
