"""Helpers of the collectives tests: run one function per device, each on its own thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

JOIN_TIMEOUT_S = 60.0


class RankResults(dict):
    """``device -> return value``; ``errors``: ``device -> exception`` of the ranks that raised."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: dict[int, BaseException] = {}

    def check(self) -> RankResults:
        if self.errors:
            device, err = next(iter(sorted(self.errors.items())))
            raise AssertionError(
                f"rank threads failed: {sorted(self.errors)}; device {device}: {err!r}"
            ) from err
        return self


def run_ranks(
    devices: Sequence[int], fn: Callable[[int], Any], *, join_timeout_s: float = JOIN_TIMEOUT_S
) -> RankResults:
    """Call ``fn(device)`` for every device on its own (daemon) thread; collect results and exceptions. Fails if a
    thread is still running after ``join_timeout_s`` (a hang)."""
    results = RankResults()
    lock = threading.Lock()

    def body(device: int) -> None:
        try:
            value = fn(device)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            with lock:
                results.errors[device] = e
        else:
            with lock:
                results[device] = value

    threads = [threading.Thread(target=body, args=(d,), name=f"rank-{d}", daemon=True) for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout_s)
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"threads still running after {join_timeout_s} s: {hung}"
    return results
