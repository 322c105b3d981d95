"""``TensorFuture``: the value of a distributed tensor on its way back to the controller.

``get()`` blocks and returns a plain ``torch.Tensor`` (or re-raises the worker's typed error, e.g.
:class:`~torch_dtorch.runtime.blob.KernelError`); ``wait``/``wait_for``/``is_ready`` poll; ``await fut`` works in
asyncio; ``add_done_callback`` runs a function once the value (or error) is there. The futures of one executor
resolve in the order they were requested.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Generator
from typing import Any

import torch

from torch_dtorch.runtime.blob import KernelError

__all__ = ["TensorFuture"]

log = logging.getLogger(__name__)


class TensorFuture:
    """A tensor being fetched from the workers. Created by the executor; resolved by its resolver thread."""

    __slots__ = ("_cond", "_done", "_value", "_error", "_callbacks", "description")

    def __init__(self, description: str = "") -> None:
        self._cond = threading.Condition()
        self._done = False
        self._value: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[TensorFuture], None]] = []
        self.description = description

    # --- consumer side ------------------------------------------------------------------------------------------
    def is_ready(self) -> bool:
        """Whether the value (or error) has arrived."""
        return self._done

    def done(self) -> bool:  # concurrent.futures spelling
        return self._done

    def wait(self, timeout: float | None = None) -> None:
        """Block until the value (or error) has arrived; ``TimeoutError`` after ``timeout`` seconds. Does not raise
        the worker's error (``get`` does)."""
        if not self._wait(timeout):
            raise TimeoutError(f"{self._what()} not ready after {timeout} s")

    def wait_for(self, ms: float) -> bool:
        """Wait up to ``ms`` milliseconds; returns :meth:`is_ready`."""
        return self._wait(ms / 1000.0)

    def get(self, timeout: float | None = None) -> torch.Tensor:
        """The global tensor; re-raises a worker error typed (:class:`KernelError` and subclasses)."""
        self.wait(timeout)
        err = self._error
        if err is not None:
            if isinstance(err, KernelError):
                raise err.again(self._what()) from err.__cause__
            raise err
        assert self._value is not None
        return self._value

    def result(self, timeout: float | None = None) -> torch.Tensor:  # concurrent.futures spelling
        return self.get(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.wait(timeout)
        return self._error

    def add_done_callback(self, fn: Callable[[TensorFuture], None]) -> None:
        """Call ``fn(self)`` once resolved (at once if already resolved; else on the executor's resolver thread)."""
        with self._cond:
            if not self._done:
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)

    def __await__(self) -> Generator[Any, None, torch.Tensor]:
        if not self._done:
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()

            def wake(_: TensorFuture) -> None:
                try:
                    loop.call_soon_threadsafe(_finish, waiter)
                except RuntimeError:  # the loop was closed meanwhile
                    pass

            self.add_done_callback(wake)
            yield from waiter.__await__()
        return self.get()

    # --- producer side (the executor) ---------------------------------------------------------------------------
    def set_result(self, value: torch.Tensor) -> None:
        self._resolve(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._resolve(None, error)

    def _resolve(self, value: torch.Tensor | None, error: BaseException | None) -> None:
        with self._cond:
            if self._done:
                return
            self._value, self._error, self._done = value, error, True
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        for fn in callbacks:
            _run_callback(fn, self)

    # --- internals ----------------------------------------------------------------------------------------------
    def _wait(self, timeout: float | None) -> bool:
        if self._done:
            return True
        with self._cond:
            return self._cond.wait_for(lambda: self._done, timeout)

    def _what(self) -> str:
        return f"fetching {self.description}" if self.description else "fetching a tensor"

    def __repr__(self) -> str:
        state = "pending" if not self._done else ("error" if self._error is not None else "ready")
        return f"TensorFuture({self.description or '?'}, {state})"


def _finish(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _run_callback(fn: Callable[[TensorFuture], None], fut: TensorFuture) -> None:
    try:
        fn(fut)
    except Exception:  # noqa: BLE001 - a callback must not break the resolver
        log.exception("TensorFuture callback %r failed", fn)
