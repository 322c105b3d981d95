"""``ThreadRunner``: one worker thread per device inside the controller process.

Each device gets a :class:`~torch_dtorch.executor.worker.Worker` on its own
:class:`~torch_dtorch.runtime.stream.KernelStream` thread; they share one in-memory collectives world and one
in-memory TensorStore with the controller. Threads share the GIL: this suits CPU simulation, virtual ranks on one
GPU and small meshes; several real GPUs want the process runner (:class:`torch_dtorch.cluster.runner.ClusterRunner`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.executor.instructions import Instruction
from torch_dtorch.executor.worker import Worker
from torch_dtorch.runtime.sticky import PoisonBoard
from torch_dtorch.runtime.stream import KernelStream

__all__ = ["ThreadRunner"]

log = logging.getLogger(__name__)


class ThreadRunner:
    """Workers as threads of this process.

    Args:
        devices: device ids (worker ranks) to start one worker for.
        device_type: ``"cpu"`` or ``"cuda"``. On CUDA device ``i`` runs on ``cuda:i``, or with ``simulate=True``
            every device runs on ``cuda:0`` (virtual ranks; each still gets its own compute and comm streams).
        simulate: map every device to one CUDA card.
        validate: check every kernel's outputs (default: ``DTORCH_VALIDATE_KERNEL_IO``).
    """

    def __init__(
        self,
        devices: Sequence[int],
        *,
        device_type: str = "cpu",
        simulate: bool = False,
        validate: bool | None = None,
    ) -> None:
        from torch_dtorch.collectives.memory import InMemoryComm, InMemoryWorld
        from torch_dtorch.collectives.store import MemoryTensorStore

        self.devices = tuple(int(d) for d in devices)
        if not self.devices or len(set(self.devices)) != len(self.devices):
            raise ValueError(f"ThreadRunner: need distinct device ids, got {list(devices)}")
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"ThreadRunner: device_type must be 'cpu' or 'cuda', got {device_type!r}")
        self.device_type = device_type
        self.simulate = simulate
        _apply_switch_interval()
        self.torch_devices = {d: self._torch_device(d) for d in self.devices}
        self.world = InMemoryWorld(self.devices)
        self.store = MemoryTensorStore()
        self.board = PoisonBoard()
        #: batches submitted so far (:meth:`finished_batches` counts the ones every worker has run)
        self.batches = 0
        self.streams: dict[int, KernelStream] = {}
        self.workers: dict[int, Worker] = {}
        one_gpu = device_type == "cuda" and len(set(self.torch_devices.values())) == 1
        for d in self.devices:
            stream = KernelStream(self.torch_devices[d], name=f"dtorch-worker-{d}")
            self.streams[d] = stream
            self.workers[d] = Worker(
                d,
                self.torch_devices[d],
                InMemoryComm(
                    self.world,
                    d,
                    torch_device=self.torch_devices[d] if device_type == "cuda" else None,
                    stream_ordered=one_gpu,
                ),
                self.store,
                stream=stream,
                board=self.board,
                validate=validate,
            )
        self._lock = threading.Lock()
        self._closed = False
        log.debug(
            "ThreadRunner: %d workers on %s",
            len(self.devices),
            sorted(set(map(str, self.torch_devices.values()))),
        )

    def _torch_device(self, d: int) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", 0 if self.simulate else d)

    # --- work ---------------------------------------------------------------------------------------------------
    def submit(self, batch: Sequence[Instruction]) -> None:
        """Append ``batch`` to every worker's queue (each worker runs the instructions that concern it)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("ThreadRunner: submit after shutdown()")
            batch = tuple(batch)
            self.batches += 1
            for d in self.devices:
                worker = self.workers[d]
                self.streams[d].submit(_BatchRun(worker, batch))

    def finished_batches(self) -> int:
        """How many of the batches submitted so far every worker has run (``batches`` counts the submitted ones;
        each worker's stream runs one closure per batch)."""
        return min(s.done for s in self.streams.values())

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every worker has run everything submitted so far (tests, benchmarks)."""
        return all(s.wait_idle(timeout) for s in self.streams.values())

    @property
    def closed(self) -> bool:
        return self._closed

    def shutdown(self, *, timeout: float = 10.0) -> None:
        """Abort collectives (waking any waiter), drop queued work and join the worker threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            from torch_dtorch.collectives.memory import SHUTDOWN

            self.world.abort(SHUTDOWN)
        except Exception:  # noqa: BLE001 - shutting down anyway
            log.exception("ThreadRunner: aborting the collectives world failed")
        for s in self.streams.values():
            s.close(discard=True, timeout=0)
        for d, s in self.streams.items():
            if not s.close(discard=True, timeout=timeout):
                log.warning("ThreadRunner: worker %d did not stop within %.1f s", d, timeout)
            else:
                self.workers[d].forget_resolved()  # the native loop reuses their entries
        close = getattr(self.store, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> ThreadRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        return f"ThreadRunner(devices={list(self.devices)}, {self.device_type}, {state})"


class _BatchRun:
    """A closure that runs one batch on one worker (a class, so queued work is cheap and inspectable)."""

    __slots__ = ("worker", "batch")

    def __init__(self, worker: Worker, batch: tuple[Instruction, ...]) -> None:
        self.worker = worker
        self.batch = batch

    def __call__(self) -> None:
        self.worker.run_batch(self.batch)


def _apply_switch_interval() -> None:
    """``DTORCH_SWITCH_INTERVAL_MS`` (``Config.switch_interval_ms``): the GIL switch interval for this process."""
    import sys

    from torch_dtorch.config import get_config

    ms = get_config().switch_interval_ms
    if ms > 0 and abs(sys.getswitchinterval() - ms / 1e3) > 1e-9:
        log.info("thread workers: GIL switch interval %.3f ms (DTORCH_SWITCH_INTERVAL_MS)", ms)
        sys.setswitchinterval(ms / 1e3)
