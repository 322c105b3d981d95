"""``TensorStore``: the controller <-> worker channel for tensor bytes (uploads in, fetched values out).

Keys are ``(request_id, device)`` tuples of ints, or strings. A value is written once (``put``) and read by one
consumer (``get`` waits for it, ``pop`` waits and removes it). Every wait is bounded: a missing key raises
:class:`~torch_dtorch.collectives.errors.TensorStoreTimeout` (a ``TimeoutError``), and :meth:`TensorStore.close`
wakes every waiter with :class:`~torch_dtorch.collectives.errors.TensorStoreError`.

Backends: :class:`MemoryTensorStore` (thread mode: one dict shared by the controller and the worker threads, no
copy). File / shared-memory (processes on one host) and network (ZMQ frames) backends implement the same five
methods; :meth:`TensorStore.key_str` gives them a canonical, file-name-safe form of every key.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod

import torch

from torch_dtorch.collectives.errors import TensorStoreError, TensorStoreTimeout
from torch_dtorch.collectives.group import collective_timeout_s

__all__ = ["MemoryTensorStore", "StoreKey", "TensorStore"]

#: ``(request_id, device)`` or a string.
StoreKey = tuple[int, int] | str


def _check_key(key: object) -> StoreKey:
    if isinstance(key, str):
        if not key:
            raise TensorStoreError("TensorStore: an empty string is not a key")
        return key
    if (
        isinstance(key, tuple)
        and len(key) == 2
        and all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in key)
    ):
        return key
    raise TensorStoreError(
        f"TensorStore: keys are (request_id, device) tuples of ints >= 0 or strings, got {key!r}"
    )


class TensorStore(ABC):
    """Abstract store of tensors keyed by :data:`StoreKey`.

    Args:
        timeout_s: default wait of :meth:`get` / :meth:`pop` (``DTORCH_COLLECTIVE_TIMEOUT_S``, else 300 s).
    """

    def __init__(self, *, timeout_s: float | None = None) -> None:
        self.timeout_s = collective_timeout_s() if timeout_s is None else float(timeout_s)

    @staticmethod
    def key_str(key: StoreKey) -> str:
        """Canonical string of a key: ``"r12-d3"`` for ``(12, 3)``, ``"s-<name>"`` for strings."""
        key = _check_key(key)
        if isinstance(key, str):
            return "s-" + "".join(c if c.isalnum() or c in "-_." else f"%{ord(c):02x}" for c in key)
        return f"r{key[0]}-d{key[1]}"

    @abstractmethod
    def put(self, key: StoreKey, tensor: torch.Tensor) -> None:
        """Store ``tensor`` under ``key`` (a key holds one value: putting it twice raises ``TensorStoreError``).
        The store owns the tensor afterwards: the caller must not modify it."""

    @abstractmethod
    def get(self, key: StoreKey, timeout: float | None = None) -> torch.Tensor:
        """The value under ``key``, waiting up to ``timeout`` seconds (default: the store's) for it to appear."""

    @abstractmethod
    def pop(self, key: StoreKey, timeout: float | None = None) -> torch.Tensor:
        """Like :meth:`get`, and remove the key."""

    @abstractmethod
    def delete(self, key: StoreKey) -> bool:
        """Remove ``key`` if present; whether it was."""

    @abstractmethod
    def close(self) -> None:
        """Drop every value and wake every waiter with ``TensorStoreError``; later calls raise it too."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` holds a value now (never waits)."""

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemoryTensorStore(TensorStore):
    """Thread-safe in-process store (thread mode): a dict and a condition variable; values are not copied."""

    def __init__(self, *, timeout_s: float | None = None) -> None:
        super().__init__(timeout_s=timeout_s)
        self._cond = threading.Condition(threading.Lock())
        self._values: dict[StoreKey, torch.Tensor] = {}
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._values)} values"
        return f"MemoryTensorStore({state})"

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def put(self, key: StoreKey, tensor: torch.Tensor) -> None:
        key = _check_key(key)
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            # the taker uses it on its own stream (a worker's compute stream): the value must be complete first
            torch.cuda.current_stream(tensor.device).synchronize()
        with self._cond:
            self._check_open()
            if key in self._values:
                raise TensorStoreError(f"{self!r}: key {key!r} already holds a value; pop or delete it first")
            self._values[key] = tensor
            self._cond.notify_all()

    def get(self, key: StoreKey, timeout: float | None = None) -> torch.Tensor:
        return self._take(key, timeout, remove=False)

    def pop(self, key: StoreKey, timeout: float | None = None) -> torch.Tensor:
        return self._take(key, timeout, remove=True)

    def delete(self, key: StoreKey) -> bool:
        key = _check_key(key)
        with self._cond:
            return self._values.pop(key, None) is not None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._values.clear()
            self._cond.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise TensorStoreError(f"{self!r}: the store is closed (shut down)")

    def _take(self, key: StoreKey, timeout: float | None, *, remove: bool) -> torch.Tensor:
        key = _check_key(key)
        wait = self.timeout_s if timeout is None else max(0.0, float(timeout))
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                self._check_open()
                if key in self._values:
                    return self._values.pop(key) if remove else self._values[key]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TensorStoreTimeout(f"{self!r}: no value under {key!r} after {wait:g} s")
                self._cond.wait(remaining)
