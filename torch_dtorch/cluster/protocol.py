"""Cluster mode, shared by the controller (:mod:`.cluster_runner`) and the worker process (:mod:`.worker_main`):
errors, settings (:class:`ClusterConfig`, ``DTORCH_CLUSTER_*``), the per-cluster secret, and the bodies of the
control messages.

Sockets of one cluster (every message signed with the secret, :mod:`.transport.wire`):

=============  =========================  ==================================================================
socket         direction                  carries
=============  =========================  ==================================================================
control        worker DEALER -> ROUTER    ``JOIN`` (worker asks for a device), then ``WELCOME`` back; later
                                          the controller's uploads to that worker (``VALUE``, per-worker seq)
batches        controller PUB -> SUB      ``HELLO`` probes, ``BATCH`` (ordered instruction batches),
                                          ``SHUTDOWN``
replies        worker PUSH -> PULL        ``HELLO_ACK``, ``ACK`` (ready / batch done), ``VALUE`` (fetched
                                          values, barrier markers), ``ERROR`` (rejected messages, fatal errors)
heartbeat      gRPC stream                liveness and the op in flight (:mod:`.heartbeat`)
rendezvous     ``torch.distributed``      ``TCPStore`` hosted by the controller: Gloo / NCCL groups per mesh axis
=============  =========================  ==================================================================
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torch_dtorch.cluster.transport.wire import MIN_SECRET_BYTES, check_secret
from torch_dtorch.errors import DTorchError

__all__ = [
    "ENV_CUDA_IPC",
    "ENV_LISTEN",
    "ENV_LOCAL_DEVICES",
    "ENV_SECRET_FILE",
    "ENV_SHM_THRESHOLD",
    "ENV_START_TIMEOUT",
    "ENV_TRANSPORT",
    "ENV_WORKER_IMPORTS",
    "ClusterConfig",
    "ClusterError",
    "WorkerFailedError",
    "WorkerStartError",
    "decode_error",
    "encode_error",
    "new_secret",
    "read_secret_fd",
    "read_secret_file",
    "write_secret_file",
]

ENV_LISTEN = "DTORCH_CLUSTER_LISTEN"
ENV_SECRET_FILE = "DTORCH_CLUSTER_SECRET_FILE"
ENV_LOCAL_DEVICES = "DTORCH_CLUSTER_LOCAL_DEVICES"
ENV_TRANSPORT = "DTORCH_CLUSTER_TRANSPORT"
ENV_START_TIMEOUT = "DTORCH_WORKER_START_TIMEOUT_S"
ENV_WORKER_IMPORTS = "DTORCH_WORKER_IMPORTS"
ENV_SHM_THRESHOLD = "DTORCH_SHM_THRESHOLD_BYTES"
ENV_CUDA_IPC = "DTORCH_CUDA_IPC"
ENV_BATCH_SIZE = "DTORCH_CLUSTER_BATCH_SIZE"

DEFAULT_START_TIMEOUT_S = 120.0
#: uploads/fetches at least this large go through shared memory between processes of one host (when available)
DEFAULT_SHM_THRESHOLD = 1 << 20
#: instructions the outbox holds for busy workers before it publishes them anyway, unless set: a message costs a
#: signed send, a worker wake-up and a native chain on each worker (cluster/outbox.py, docs/benchmarks.md)
DEFAULT_BATCH_SIZE = 256

#: exit codes of a worker process
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CONTROLLER_LOST = 3  # == heartbeat.CONTROLLER_LOST_EXIT_CODE


class ClusterError(DTorchError, RuntimeError):
    """Base class of cluster-mode failures (start-up, protocol, worker-reported fatal errors)."""


class WorkerStartError(ClusterError):
    """Workers did not start or join in time, exited during start-up, or were refused."""


class WorkerFailedError(ClusterError):
    """A worker reported a fatal error (lost message, undecodable batch) and left the cluster."""


# ---------------------------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------------------------


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r} must be > 0")
    return value


def env_switch(name: str, default: bool) -> bool:
    """A ``1``/``0`` (``true``/``false``, ``yes``/``no``, ``on``/``off``) environment variable; unset: ``default``."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected 1 or 0 (true/false, yes/no, on/off)")


def parse_devices(text: str, *, what: str) -> tuple[int, ...]:
    """``"0,1,4-7"`` -> ``(0, 1, 4, 5, 6, 7)``; ``""``/``"none"`` -> ``()``."""
    text = text.strip()
    if text.lower() in ("", "none"):
        return ()
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected device ids like '0,1,4-7' or 'none'") from None
    if len(set(out)) != len(out) or any(d < 0 for d in out):
        raise ValueError(f"{what}={text!r}: device ids must be distinct and >= 0")
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """How the controller runs its worker processes (defaults: every device a local process, private IPC).

    Args:
        listen: the control endpoint workers join (``tcp://HOST:PORT`` for remote workers, which then also get
            TCP endpoints for batches, replies, heartbeat and rendezvous on ``HOST``); ``None``: a private
            ``ipc://`` path (or ``tcp://127.0.0.1:<free>`` with ``transport="tcp"``). Env ``DTORCH_CLUSTER_LISTEN``.
        secret_file: read the cluster secret from this file (mode 0600; remote workers get the same file);
            ``None``: a fresh random secret, given to local workers through an inherited pipe. Env
            ``DTORCH_CLUSTER_SECRET_FILE``.
        local_devices: devices to start as local processes (``None``: all; ``()``: none, every worker joins
            with ``dtorch worker``). Env ``DTORCH_CLUSTER_LOCAL_DEVICES`` (``"0,1"``, ``"none"``).
        transport: ``"ipc"`` (default on one host) or ``"tcp"`` (loopback). Env ``DTORCH_CLUSTER_TRANSPORT``.
        start_timeout_s: how long start-up waits for every worker to join and be ready. Env
            ``DTORCH_WORKER_START_TIMEOUT_S`` (120).
        worker_imports: modules every worker imports at start (custom rules, instruction handlers). Env
            ``DTORCH_WORKER_IMPORTS`` (comma-separated).
        shm_threshold: tensors of at least this many bytes travel through shared memory between local processes
            when a shared-memory store is available. Env ``DTORCH_SHM_THRESHOLD_BYTES`` (1 MiB).
        cuda_ipc: CUDA tensors of at least ``shm_threshold`` bytes travel between this controller and the workers
            it started as CUDA IPC handles (no host copy; :mod:`.cluster_ipc`); ``False``: through shared memory.
            Env ``DTORCH_CUDA_IPC`` (``1``; ``0`` disables it).
        batch_size: instructions held for busy workers before they are published anyway (``None``:
            :data:`DEFAULT_BATCH_SIZE`; idle workers get each chunk at once: :mod:`.outbox`). Env
            ``DTORCH_CLUSTER_BATCH_SIZE``.
    """

    listen: str | None = None
    secret_file: str | None = None
    local_devices: tuple[int, ...] | None = None
    transport: Literal["ipc", "tcp"] = "ipc"
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    worker_imports: tuple[str, ...] = ()
    shm_threshold: int = DEFAULT_SHM_THRESHOLD
    cuda_ipc: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"ClusterConfig: transport must be 'ipc' or 'tcp', got {self.transport!r}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"ClusterConfig: start_timeout_s must be > 0, got {self.start_timeout_s!r}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"ClusterConfig: batch_size must be >= 1, got {self.batch_size!r}")
        if self.listen is not None and not self.listen.startswith(("tcp://", "ipc://")):
            raise ValueError(
                f"ClusterConfig: listen must be 'tcp://HOST:PORT' or 'ipc://PATH', got {self.listen!r}"
            )

    @classmethod
    def from_env(cls) -> ClusterConfig:
        listen = os.environ.get(ENV_LISTEN, "").strip() or None
        local = os.environ.get(ENV_LOCAL_DEVICES)
        transport = os.environ.get(ENV_TRANSPORT, "").strip().lower() or "ipc"
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"{ENV_TRANSPORT}={transport!r} must be 'ipc' or 'tcp'")
        imports = tuple(m.strip() for m in os.environ.get(ENV_WORKER_IMPORTS, "").split(",") if m.strip())
        return cls(
            listen=listen,
            secret_file=os.environ.get(ENV_SECRET_FILE, "").strip() or None,
            local_devices=None if local is None else parse_devices(local, what=ENV_LOCAL_DEVICES),
            transport=transport,  # type: ignore[arg-type]
            start_timeout_s=_env_float(ENV_START_TIMEOUT, DEFAULT_START_TIMEOUT_S),
            worker_imports=imports,
            shm_threshold=int(_env_float(ENV_SHM_THRESHOLD, DEFAULT_SHM_THRESHOLD)),
            cuda_ipc=env_switch(ENV_CUDA_IPC, True),
            batch_size=int(_env_float(ENV_BATCH_SIZE, 0)) or None,
        )

    def bind_host(self) -> str:
        """The address the controller binds its TCP endpoints on (and remote workers connect to)."""
        listen = self.listen
        if listen is None or not listen.startswith("tcp://"):
            return "127.0.0.1"
        host = listen[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        if host in ("*", "0.0.0.0", ""):
            raise ValueError(
                f"ClusterConfig.listen={listen!r}: give the concrete address remote workers reach this host on "
                "(e.g. tcp://10.0.0.5:29600), not a wildcard"
            )
        return host

    @property
    def remote(self) -> bool:
        """Whether remote workers may join (the control endpoint is TCP on a non-loopback address)."""
        if self.listen is None or not self.listen.startswith("tcp://"):
            return False
        host = self.listen[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        return not (host.startswith("127.") or host in ("localhost", "::1"))

    def local(self, devices: Sequence[int]) -> tuple[int, ...]:
        """The devices of ``devices`` to start as local processes."""
        if self.local_devices is None:
            return tuple(devices)
        bad = [d for d in self.local_devices if d not in devices]
        if bad:
            raise ValueError(
                f"ClusterConfig.local_devices {list(self.local_devices)} names devices {bad} outside the mesh "
                f"devices {list(devices)}"
            )
        return tuple(self.local_devices)


# ---------------------------------------------------------------------------------------------------------------
# the per-cluster secret
# ---------------------------------------------------------------------------------------------------------------


def new_secret() -> bytes:
    """A fresh random per-cluster secret."""
    return secrets.token_bytes(MIN_SECRET_BYTES)


def write_secret_file(path: str, secret: bytes | None = None) -> bytes:
    """Create ``path`` (mode 0600, must not exist) holding ``secret`` (default: a new one) as hex; return it."""
    secret = check_secret(secret if secret is not None else new_secret())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return secret


def _parse_secret(text: bytes, where: str) -> bytes:
    raw = text.strip()
    try:
        secret = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        secret = raw  # raw bytes are accepted too
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{where}: the cluster secret must be at least {MIN_SECRET_BYTES} bytes (hex-encoded in the file); "
            "create one with `python -c 'import secrets; print(secrets.token_hex(32))' > F; chmod 600 F`"
        )
    return secret


def read_secret_file(path: str) -> bytes:
    """The secret in ``path``; refuses a file that others can read or write (like ssh does with keys)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"cannot read the cluster secret file {path!r}: {e}") from e
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"the cluster secret file {path!r} has mode {stat.S_IMODE(st.st_mode):04o}: other users may read it. "
            f"Fix: chmod 600 {path}"
        )
    with open(path, "rb") as f:
        return _parse_secret(f.read(), f"secret file {path!r}")


def read_secret_fd(fd: int) -> bytes:
    """Read the secret from an inherited pipe (local workers) and close it."""
    chunks = []
    try:
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    return _parse_secret(b"".join(chunks), f"secret fd {fd}")


# ---------------------------------------------------------------------------------------------------------------
# errors carried in VALUE messages (never pickled: fields only)
# ---------------------------------------------------------------------------------------------------------------


def _kernel_error_classes() -> dict[str, type]:
    from torch_dtorch.runtime.blob import KernelError

    out: dict[str, type] = {}
    todo: list[type] = [KernelError]
    while todo:
        cls = todo.pop()
        out[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return out


def encode_error(err: BaseException) -> dict[str, Any]:
    """Fields of a worker-side error, to rebuild it on the controller with :func:`decode_error`."""
    from torch_dtorch.runtime.blob import KernelError

    if isinstance(err, KernelError):
        cause = err.cause
        cause_text = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(cause)
        return {
            "type": type(err).__name__,
            "op": err.op,
            "device": err.device,
            "cause": cause_text,
            "call_site": err.call_site,
            "detail": err.detail,
        }
    return {"type": type(err).__name__, "message": str(err)}


def decode_error(fields: Any, *, device: int) -> BaseException:
    """The controller-side exception for ``fields`` (a :class:`KernelError` subclass where possible)."""
    from torch_dtorch.runtime.blob import KernelError

    if not isinstance(fields, dict):
        return WorkerFailedError(f"worker {device} sent a malformed error report: {fields!r}")
    cls = _kernel_error_classes().get(str(fields.get("type")))
    if cls is not None and "op" in fields:
        err: BaseException = cls(
            str(fields["op"]),
            int(fields.get("device", device)),
            str(fields.get("cause", "")),
            call_site=fields.get("call_site"),
            detail=str(fields.get("detail") or ""),
        )
        return err
    return KernelError("worker", device, f"{fields.get('type')}: {fields.get('message')}")
