"""The process-wide worker pool behind every mesh (one pool, shared by all meshes of the process)."""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torch_dtorch.config import MODES, get_config
from torch_dtorch.device import binding
from torch_dtorch.device.tensors import TABLE
from torch_dtorch.device.worker_rng import sync_worker_rng
from torch_dtorch.errors import DTorchError, MeshError
from torch_dtorch.executor.eager import EagerGraphExecutor
from torch_dtorch.executor.runner import Runner
from torch_dtorch.executor.thread_runner import ThreadRunner
from torch_dtorch.graph import Operand

if TYPE_CHECKING:
    from torch_dtorch.cluster.protocol import ClusterConfig
    from torch_dtorch.mesh import DeviceMesh

__all__ = ["NoSessionError", "Session", "get_session", "session_or_none", "shutdown", "start_session"]

log = logging.getLogger(__name__)


class NoSessionError(DTorchError, RuntimeError):
    """A dtorch op ran before ``init_device_mesh`` started workers (or after ``shutdown``)."""


@dataclass
class Session:
    device_type: str
    num_devices: int
    simulate: bool
    executor: EagerGraphExecutor
    generation: int
    #: ``"thread"`` (ThreadRunner) or ``"process"`` (ClusterRunner)
    mode: str = "thread"
    #: the mesh of the most recent op with a bound input: where tensors created without a mesh bind by default
    last_mesh: DeviceMesh | None = None

    def torch_device(self, device: int) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, 0 if self.simulate else device)


_LOCK = threading.RLock()
_SESSION: Session | None = None
_GENERATION = 0


def _check_devices(device_type: str, num_devices: int, simulate: bool) -> None:
    if device_type == "cpu":
        return
    if device_type != "cuda":
        raise MeshError(f"init_device_mesh: device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if not torch.cuda.is_available():
        raise MeshError(
            "init_device_mesh('cuda', ...): CUDA is not available here; use 'cpu' to simulate the mesh"
        )
    have = torch.cuda.device_count()
    if not simulate and num_devices > have:
        raise MeshError(
            f"init_device_mesh('cuda', ...): the mesh needs {num_devices} devices but {have} GPU(s) are visible; "
            "pass simulate=True to run every rank on cuda:0, or use a smaller mesh"
        )


def resolve_mode(mode: str | None) -> str:
    """``mode`` if given, else ``DTORCH_MODE`` (default ``thread``); validated."""
    mode = get_config().mode if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"init_device_mesh: mode must be one of {MODES}, got {mode!r} (or set DTORCH_MODE)")
    return mode


def _make_runner(
    mode: str, device_type: str, num_devices: int, simulate: bool, cluster: ClusterConfig | None
) -> Runner:
    devices = list(range(num_devices))
    if mode == "process":
        from torch_dtorch.cluster.runner import (
            ClusterRunner,  # process mode's heavy imports (zmq, grpc) on demand
        )

        return ClusterRunner(devices, device_type=device_type, simulate=simulate, config=cluster)
    if cluster is not None:
        raise ValueError("init_device_mesh: cluster= only applies to mode='process'")
    return ThreadRunner(devices, device_type=device_type, simulate=simulate)


def start_session(
    device_type: str,
    num_devices: int,
    *,
    simulate: bool = False,
    mode: str | None = None,
    cluster: ClusterConfig | None = None,
) -> Session:
    """Start (or reuse) the worker pool. A compatible running pool with enough devices (same mode, not failed) is
    reused; otherwise the old pool is shut down cleanly first (a notebook cell re-run), which invalidates its
    tensors. ``mode``: ``"thread"`` or ``"process"`` (default ``DTORCH_MODE``)."""
    global _SESSION, _GENERATION
    mode = resolve_mode(mode)
    _check_devices(device_type, num_devices, simulate)
    with _LOCK:
        rt = _SESSION
        if (
            rt is not None
            and rt.device_type == device_type
            and rt.simulate == simulate
            and rt.num_devices >= num_devices
            and rt.mode == mode
            and cluster is None
            and not getattr(rt.executor.runner, "failed", False)
        ):
            return rt
        if rt is not None:
            log.info(
                "restarting the dtorch worker pool (%s, %d devices -> %s, %d devices)",
                rt.mode,
                rt.num_devices,
                mode,
                num_devices,
            )
            shutdown()
        runner = _make_runner(mode, device_type, num_devices, simulate, cluster)
        _GENERATION += 1
        executor = EagerGraphExecutor(runner, batch_size=getattr(runner, "batch_size", None))
        executor.collect = TABLE.drain
        if device_type != "cpu":
            executor.result_device = torch.device(
                device_type, 0
            )  # values come back where the controller computes
        _SESSION = Session(device_type, num_devices, simulate, executor, _GENERATION, mode=mode)
        if device_type == "cpu":  # worker processes start from the controller's generator, not their own
            sync_worker_rng(_SESSION, torch.default_generator)
        _free_callback(_SESSION)  # the native table learns the new generation now (its cached templates go)
        return _SESSION


def session_or_none() -> Session | None:
    return _SESSION


def get_session() -> Session:
    rt = _SESSION
    if rt is None:
        raise NoSessionError(
            "no dtorch workers are running: create a mesh first with torch_dtorch.init_device_mesh(...)"
        )
    return rt


def shutdown() -> None:
    """Stop the workers (idempotent). dtorch tensors created before become unusable."""
    global _SESSION
    with _LOCK:
        rt, _SESSION = _SESSION, None
    TABLE.set_runtime(-1, None)
    # the recipes of unbound tensors are keyed by operand id, and ids restart with the next session: an old
    # recipe must not answer for a new operand (its tensors are unusable anyway)
    binding._DEFERRED.clear()
    if rt is not None:
        try:
            rt.executor.shutdown()
        except Exception:  # noqa: BLE001 - shutdown must not raise at exit
            log.exception("error while shutting down the dtorch workers")


atexit.register(shutdown)

_FREE_CALLBACKS: dict[int, Any] = {}


def _free_callback(rt: Session):  # noqa: ANN202 - closure factory, one per runtime generation
    cb = _FREE_CALLBACKS.get(rt.generation)
    if cb is None:
        _FREE_CALLBACKS.clear()
        cb = _FREE_CALLBACKS[rt.generation] = _make_free_callback(rt)
        TABLE.set_runtime(rt.generation, cb)
    return cb


def _make_free_callback(rt: Session):  # noqa: ANN202 - closure factory
    generation = rt.generation
    executor = rt.executor
    eager = binding._EAGER  # an eager-bound factory result's mark dies with its tensor (binding.move_eager)

    def on_free(operand: Operand) -> None:
        current = _SESSION
        if current is None or current.generation != generation:
            return
        if operand.mesh is None:
            deferred = binding._DEFERRED.pop(operand.id, None)
            if deferred is not None:
                for bound in deferred.bound.values():
                    executor.release(bound.id)
            return
        if eager:
            eager.pop(operand.id, None)
        executor.release(operand.id)

    return on_free
