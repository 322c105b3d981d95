"""``RejectLog``: what a receiver keeps of the messages it dropped (bad signature, replay, malformed, refused join).

A flood of bad messages must cost neither memory nor log volume: the log counts every rejection (in total and by
error type), keeps only the last ``keep`` texts, and writes one log line for the first rejection and then at most
one per ``interval_s``, saying how many were dropped since the last line. Worker processes use the same
rate limit to decide when to forward their rejections to the controller (:meth:`RejectLog.take_pending`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator

__all__ = ["RejectLog"]


class RejectLog:
    """Counter + bounded memory + rate-limited log line of rejected messages (thread-safe).

    Args:
        logger: where the rate-limited lines go (level WARNING).
        what: who is rejecting, for the log line (e.g. ``"ClusterRunner"``).
        keep: how many of the latest rejection texts are kept (:attr:`recent`).
        interval_s: at most one log line (and one forwarded report) per this many seconds after the first.
    """

    def __init__(self, logger: logging.Logger, what: str, *, keep: int = 32, interval_s: float = 5.0) -> None:
        self._log = logger
        self._what = what
        self.interval_s = interval_s
        self.count = 0
        self.by_type: Counter[str] = Counter()
        self._recent: deque[tuple[int, str]] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._next_line = 0.0  # monotonic time from which the next line may be written
        self._pending = 0  # rejections not yet logged / forwarded
        self._pending_text = ""

    def add(self, text: str, *, kind: str = "TransportError", count: int = 1) -> int:
        """Record ``count`` rejections described by ``text``. Returns how many rejections the log line written now
        covers (these and the pending ones; the caller may forward them), or 0 when no line was written (they are
        pending: :meth:`take_pending`)."""
        now = time.monotonic()
        with self._lock:
            first = self.count + 1
            self.count += count
            self.by_type[kind] += count
            self._recent.append((first, text))
            self._pending += count
            self._pending_text = text
            if now < self._next_line:
                return 0
            self._next_line = now + self.interval_s
            n, self._pending = self._pending, 0
        more = f" ({n} rejected since the last report, {self.count} in total)" if n > 1 else ""
        self._log.warning("%s: dropped a message: %s%s", self._what, text, more)
        return n

    def take_pending(self, *, force: bool = False) -> tuple[int, str] | None:
        """``(count, last text)`` of the rejections not reported yet, once ``interval_s`` passed since the last
        report (or at once with ``force``); ``None`` when there is nothing to report yet."""
        now = time.monotonic()
        with self._lock:
            if not self._pending or (now < self._next_line and not force):
                return None
            self._next_line = now + self.interval_s
            n, self._pending = self._pending, 0
            text = self._pending_text
        self._log.warning(
            "%s: dropped %d more message(s), the last: %s (%d in total)", self._what, n, text, self.count
        )
        return n, text

    @property
    def recent(self) -> list[str]:
        """The latest rejection texts (at most ``keep``), oldest first."""
        with self._lock:
            return [t for _, t in self._recent]

    def since(self, count: int) -> list[str]:
        """The kept texts of the rejections after the first ``count`` (``count`` from an earlier :attr:`count`)."""
        with self._lock:
            return [t for i, t in self._recent if i > count]

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[str]:
        return iter(self.recent)

    def __repr__(self) -> str:
        return f"RejectLog({self._what}: {self.count} rejected, {dict(self.by_type)})"
