"""Configuration: dataclasses plus documented ``DTORCH_*`` environment variables.

| variable | meaning | default |
|---|---|---|
| ``DTORCH_REDISTRIBUTE`` | policy when inputs fit no placement signature: ``auto`` (cost-ordered redistribute, logged at DEBUG), ``local`` (only communication-free Replicate->Shard slices), ``never`` (raise) | ``auto`` |
| ``DTORCH_LOG_LEVEL`` | logging level of the ``torch_dtorch`` logger (CLI only) | ``WARNING`` |
| ``DTORCH_DEBUG`` | ``1``: record the user call site of every op (costly; for error messages) | ``0`` |
| ``DTORCH_VALIDATE_KERNEL_IO`` | ``1``: every worker kernel checks each local output's shape, dtype and device against the inferred metadata and raises ``KernelIOError`` naming the op and the worker | ``0`` |
| ``DTORCH_NATIVE`` | ``0``: no native (C++) eager fast path and tensor table; the Python ones, ~2x the controller time per op (see ``torch_dtorch/device/native.py``) | ``1`` |
| ``DTORCH_NATIVE_DIR`` | where the native extension is built (once per source, torch and Python version) | ``~/.cache/torch_dtorch/native`` |
| ``DTORCH_WORKER_REPLAY`` | ``0``: workers run every fast-path hit on the general local path instead of replaying the op resolved on its first hit (``torch_dtorch/runtime/replay.py``; in the native loop ``runtime/_replay.cpp`` when it is built; for A/B measurements) | ``1`` |
| ``DTORCH_BATCH_SIZE`` | eager executor: instructions per batch sent to the workers (a full batch is flushed at once) | ``64`` |
| ``DTORCH_FLUSH_MS`` | eager executor: pending instructions are flushed after this many milliseconds without a new op | ``2`` |
| ``DTORCH_SWITCH_INTERVAL_MS`` | thread mode: set the interpreter's GIL switch interval (``sys.setswitchinterval``) to this many milliseconds when worker threads start. A worker thread that needs the GIL while the controller's Python runs gets it only after the interval (Python's default 5 ms); a shorter one lets a worker's Python (its batch hand-off, an inductor program's kernel launches) run sooner, at a small cost to the controller. Process-wide; for measurements | unset (Python's 5 ms) |
| ``DTORCH_MODE`` | where workers run: ``thread`` (threads of this process) or ``process`` (one process per device, cluster mode); ``init_device_mesh(mode=...)`` overrides it | ``thread`` |
| ``DTORCH_WORKER_START_TIMEOUT_S`` | cluster mode: how long start-up waits for every worker to join and be ready | ``120`` |
| ``DTORCH_CLUSTER_LISTEN`` | cluster mode: control endpoint workers join (``tcp://HOST:PORT`` admits remote ``dtorch worker`` processes) | private ``ipc://`` |
| ``DTORCH_CLUSTER_SECRET_FILE`` | cluster mode: file (mode 0600) holding the cluster secret, shared with remote workers | a fresh random secret |
| ``DTORCH_CLUSTER_LOCAL_DEVICES`` | cluster mode: devices started as local processes (``0,1``, ``none``); the others must join remotely | all |
| ``DTORCH_CLUSTER_TRANSPORT`` | cluster mode, one host: ``ipc`` or ``tcp`` (loopback) sockets | ``ipc`` |
| ``DTORCH_WORKER_IMPORTS`` | cluster mode: comma-separated modules every worker imports at start (custom rules, instruction handlers) | none |
| ``DTORCH_CLUSTER_BATCH_SIZE`` | cluster mode: instructions the runner's outbox holds for busy workers before it sends them anyway (``torch_dtorch/cluster/outbox.py``: workers with fewer than 2 messages unacknowledged get each chunk of 64 at once, busy ones what gathered when they acknowledge; a sync, a fetch or any instruction that replies goes at once) | ``256`` |
| ``DTORCH_WORKER_PROFILE`` | cluster mode: a directory; each local worker process writes a cProfile of its kernel thread (receive, decode, run) there when it exits: ``worker-<device>-<pid>.prof`` (``torch_dtorch/cluster/worker/profile.py``). Worker processes the controller starts also get its intra-op thread count (``OMP_NUM_THREADS`` = ``torch.get_num_threads()``), so N workers do not oversubscribe a small host | unset |
| ``DTORCH_SHM_THRESHOLD_BYTES`` | cluster mode: uploads/fetches at least this large use shared memory between local processes (when available) | ``1048576`` |
| ``DTORCH_CUDA_IPC`` | cluster mode: ``0`` sends CUDA tensors between the controller and its local workers through shared memory instead of CUDA IPC handles | ``1`` |
| ``DTORCH_HEARTBEAT_TIMEOUT_S`` | cluster mode: a worker silent this long is reported lost (``WorkerLostError``; a worker process that dies is reported at once) | ``5.0`` |
| ``DTORCH_HANG_TIMEOUT_S`` | cluster mode: a worker busy on one op this long is reported hung (``WorkerHangError``) | ``600`` |
| ``DTORCH_CONTROLLER_TIMEOUT_S`` | cluster mode: a worker whose controller is silent this long exits by itself (at once when the controller dies) | ``10.0`` |
| ``DTORCH_MEMORY_CHECK`` | ``0``: no memory pre-check of planned allocations (``torch_dtorch/executor/memory_check.py``, docs/reliability.md) | ``1`` |
| ``DTORCH_GC_FREEZE`` | ``0``: do not freeze the start-up heap out of Python's garbage collector when a model is first placed on a mesh (``replicate_module``, ``parallelize_module``, ``fully_shard``, ``parallelize_pipeline``; ``torch_dtorch/device/heap.py``) | ``1`` |
| ``DTORCH_MEMORY_MARGIN`` | the memory pre-check keeps this fraction of a device's free memory back; a larger allocation raises ``DeviceMemoryError`` before anything is sent | ``0.1`` |
| ``DTORCH_WIRE_MAX_PAYLOAD_BYTES`` | cluster mode: the largest JSON payload frame a receiver parses (tensor bytes travel in other frames) | ``268435456`` |
| ``DTORCH_COLLECTIVE_TIMEOUT_S`` | a collective waiting longer for its peers raises ``CollectiveTimeout`` naming the missing ranks (read by ``torch_dtorch.collectives.group``) | ``300`` |
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum


class RedistributePolicy(StrEnum):
    AUTO = "auto"
    LOCAL = "local"
    NEVER = "never"


def _env_policy() -> RedistributePolicy:
    raw = os.environ.get("DTORCH_REDISTRIBUTE", "auto").strip().lower()
    try:
        return RedistributePolicy(raw)
    except ValueError:
        valid = ", ".join(p.value for p in RedistributePolicy)
        raise ValueError(f"DTORCH_REDISTRIBUTE={raw!r} is not one of: {valid}") from None


#: where workers run (``DTORCH_MODE``)
MODES = ("thread", "process")


def env_mode() -> str:
    raw = os.environ.get("DTORCH_MODE", "thread").strip().lower() or "thread"
    if raw not in MODES:
        raise ValueError(f"DTORCH_MODE={raw!r} is not one of: {', '.join(MODES)}")
    return raw


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _env_number(name: str, default: float, *, minimum: float, integer: bool = False) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name}={raw!r} is not {kind}") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be >= {minimum}")
    return value


@dataclass
class Config:
    """Process-wide settings; read once from the environment, changeable at run time via :func:`get_config`."""

    redistribute: RedistributePolicy = field(default_factory=_env_policy)
    debug: bool = field(default_factory=lambda: _env_flag("DTORCH_DEBUG"))
    validate_kernel_io: bool = field(default_factory=lambda: _env_flag("DTORCH_VALIDATE_KERNEL_IO"))
    #: workers replay resolved fast-path ops (``DTORCH_WORKER_REPLAY``, default on)
    worker_replay: bool = field(default_factory=lambda: os.environ.get("DTORCH_WORKER_REPLAY", "1") != "0")
    batch_size: int = field(
        default_factory=lambda: int(_env_number("DTORCH_BATCH_SIZE", 64, minimum=1, integer=True))
    )
    flush_ms: float = field(default_factory=lambda: _env_number("DTORCH_FLUSH_MS", 2.0, minimum=0.0))
    #: ``thread`` or ``process`` (``DTORCH_MODE``): the default of ``init_device_mesh(mode=None)``
    mode: str = field(default_factory=env_mode)
    #: thread mode: the interpreter's GIL switch interval in ms set when worker threads start
    #: (``DTORCH_SWITCH_INTERVAL_MS``; 0 or unset: Python's own, 5 ms)
    switch_interval_ms: float = field(
        default_factory=lambda: _env_number("DTORCH_SWITCH_INTERVAL_MS", 0.0, minimum=0.0)
    )


_CONFIG: Config | None = None


def get_config() -> Config:
    global _CONFIG
    if _CONFIG is None:
        _CONFIG = Config()
    return _CONFIG
