"""The resolver thread of :class:`~torch_dtorch.executor.eager.EagerGraphExecutor`: takes fetched shards out of the
runner's store, in request order, assembles the global value and resolves the request's future."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch

from torch_dtorch.collectives.errors import TensorStoreTimeout
from torch_dtorch.executor.future import TensorFuture
from torch_dtorch.placement import Placement
from torch_dtorch.placement_rules.ranks import assemble

__all__ = ["ValueRequest", "ValueResolver"]

_POLL_S = 0.1


class ValueResolver:
    """Resolves :class:`ValueRequest` futures on a daemon thread. ``executor`` provides ``runner.store``,
    ``closed`` and ``result_device``."""

    def __init__(self, executor: Any) -> None:
        self._executor = executor
        self._queue: queue.SimpleQueue[ValueRequest | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="dtorch-resolver", daemon=True)
        self._thread.start()

    def put(self, req: ValueRequest) -> None:
        self._queue.put(req)

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the queued requests (those still waiting fail: the executor is closed)."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            req = self._queue.get()
            if req is None:
                break
            try:
                self._resolve(req)
            except Exception as e:  # noqa: BLE001 - delivered to the waiting caller
                req.future.set_exception(e)
        # fail whatever is still queued (shutdown)
        while True:
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                break
            if req is not None:
                req.future.set_exception(
                    RuntimeError("EagerGraphExecutor: shut down before the value arrived")
                )

    def _resolve(self, req: ValueRequest) -> None:
        by_device: dict[int, Any] = {}
        for d in req.devices:  # take every entry, even after an error, so the store does not keep them
            try:
                by_device[d] = self.store_take((req.key, d), None)
            except Exception as e:  # noqa: BLE001
                by_device[d] = e
        errors = [v for v in by_device.values() if isinstance(v, BaseException)]
        if errors:
            req.future.set_exception(errors[0])
            return
        device = self._executor.result_device
        if req.local is not None:
            result = by_device[req.local]
        else:
            shards = {c: by_device[d] for c, d in req.source.items()}
            if len({t.device for t in shards.values()}) > 1:  # e.g. CUDA IPC shards from several GPUs
                target = device if device is not None else torch.device("cpu")
                shards = {c: t.to(target) for c, t in shards.items()}
            result = assemble(shards, req.mesh_shape, req.placements, check_replicas=False)
        if device is not None:
            result = result.to(device)
        req.future.set_result(result)

    def store_take(self, key: tuple[int, int], deadline: float | None) -> Any:
        """Wait for ``key`` in the runner's store and remove it (polls so that shutdown is noticed)."""
        store = self._executor.runner.store
        while True:
            if self._executor.closed:
                raise RuntimeError("EagerGraphExecutor: shut down before the value arrived")
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"EagerGraphExecutor: no answer for {key} in time")
            try:
                return store.pop(key, wait)
            # only the store's own timeout: a WorkerHangError (cluster mode) is a TimeoutError that must reach the caller
            except TensorStoreTimeout:
                continue


class ValueRequest:
    """One pending fetch: which store keys to take and how to assemble them."""

    __slots__ = ("future", "key", "devices", "source", "mesh_shape", "placements", "local")

    def __init__(
        self,
        future: TensorFuture,
        key: int,
        devices: tuple[int, ...],
        source: dict[tuple[int, ...], int],
        mesh_shape: tuple[int, ...],
        placements: tuple[Placement, ...],
        *,
        local: int | None = None,
    ) -> None:
        self.future = future
        self.key = key
        self.devices = devices
        self.source = source  # mesh coordinate -> device whose shard stands for it
        self.mesh_shape = mesh_shape
        self.placements = placements
        self.local = local  # fetch_local: the one device whose shard is the result
