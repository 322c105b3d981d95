"""TensorStores of cluster mode (the network backend: tensor bytes as zero-copy ZMQ frames) and the
cross-process :class:`StorePoisonBoard`.

- :class:`ControllerStore` (controller): ``put((key, d), t)`` sends ``t`` to worker ``d`` at once (its control
  socket, a per-worker sequence number); ``pop((key, d))`` waits for the value worker ``d`` sent back (fetches,
  barrier markers), delivered by the runner's receiver thread through :meth:`ControllerStore.deliver`. When the
  cluster fails, every waiter gets the failure (e.g. :class:`~torch_dtorch.cluster.heartbeat.WorkerLostError`).
- :class:`WorkerStore` (worker process): the mirror image.

Both keep received values in a :class:`~torch_dtorch.collectives.store.MemoryTensorStore` inbox, so the order in
which an upload's bytes and its ``Upload`` instruction arrive does not matter.

Between processes of one host, tensors of at least ``DTORCH_SHM_THRESHOLD_BYTES`` go through the controller's
:class:`~torch_dtorch.collectives.shm_store.ShmTensorStore` instead (:func:`value_body` with ``shm``): the sender
writes the value there, under a name derived from its key and direction (``u``: upload, ``f``: fetched value),
before sending the signed ``VALUE`` message that names it; the receiver claims (pops) it on that message. The name
never comes from the message (only the key, an int pair), and the directory is private to this user (0700).

CUDA tensors of that size between the controller and the workers it started travel as CUDA IPC handles instead
(:mod:`~torch_dtorch.cluster.ipc`). :func:`choose_route` is the one decision between the three routes.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable
from typing import Any

import torch

from torch_dtorch.cluster.protocol import decode_error, encode_error
from torch_dtorch.collectives.errors import TensorStoreError, TensorStoreTimeout
from torch_dtorch.collectives.shm_store import ShmTensorStore
from torch_dtorch.collectives.store import MemoryTensorStore, StoreKey, TensorStore
from torch_dtorch.runtime.blob import KernelError
from torch_dtorch.runtime.sticky import PoisonBoard

__all__ = ["ControllerStore", "Route", "StorePoisonBoard", "WorkerStore", "choose_route", "tensor_route"]

log = logging.getLogger(__name__)

#: ``send(device, key, value)``: ship one value to the other side (``value``: a tensor or an exception)
SendFn = Callable[[int, StoreKey, Any], None]


def wire_key(key: StoreKey) -> Any:
    return list(key) if isinstance(key, tuple) else key


def key_from_wire(raw: Any) -> StoreKey:
    if isinstance(raw, list) and len(raw) == 2 and all(type(k) is int for k in raw):
        return (raw[0], raw[1])
    if isinstance(raw, str) and raw:
        return raw
    raise TensorStoreError(f"malformed store key {raw!r} in a cluster message")


class _InboxStore(TensorStore):
    """Received values in a memory inbox; ``put`` ships a value to the other side through ``send``."""

    def __init__(self, send: SendFn, *, timeout_s: float | None = None) -> None:
        super().__init__(timeout_s=timeout_s)
        self._send = send
        self._inbox = MemoryTensorStore(timeout_s=timeout_s)
        self._failure: BaseException | None = None

    def deliver(self, key: StoreKey, value: Any) -> None:
        """A value arrived from the other side (receiver threads call this)."""
        try:
            self._inbox.put(key, value)
        except TensorStoreError as e:
            log.warning("%r: dropped a value for %r: %s", self, key, e)

    def fail(self, error: BaseException) -> None:
        """Wake every waiter with ``error`` (and raise it from every later call)."""
        if self._failure is None:
            self._failure = error
        self._inbox.close()

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _take(self, key: StoreKey, timeout: float | None, *, remove: bool) -> Any:
        self._check()
        try:
            return self._inbox.pop(key, timeout) if remove else self._inbox.get(key, timeout)
        except TensorStoreTimeout:
            raise
        except TensorStoreError:
            self._check()
            raise

    def get(self, key: StoreKey, timeout: float | None = None) -> torch.Tensor:
        return self._take(key, timeout, remove=False)  # type: ignore[no-any-return]

    def pop(self, key: StoreKey, timeout: float | None = None) -> torch.Tensor:
        return self._take(key, timeout, remove=True)  # type: ignore[no-any-return]

    def delete(self, key: StoreKey) -> bool:
        return self._inbox.delete(key)

    def __contains__(self, key: object) -> bool:
        return key in self._inbox

    def close(self) -> None:
        if self._failure is None:
            self._failure = TensorStoreError(f"{self!r}: the store is closed (shut down)")
        self._inbox.close()


class ControllerStore(_InboxStore):
    """The controller's end: ``put((key, d), t)`` uploads to worker ``d``; ``pop((key, d))`` waits for worker ``d``'s
    reply."""

    def put(self, key: StoreKey, tensor: torch.Tensor) -> None:
        self._check()
        if not (isinstance(key, tuple) and len(key) == 2):
            raise TensorStoreError(f"ControllerStore.put: key must be (request_id, device), got {key!r}")
        self._send(key[1], key, tensor)

    def __repr__(self) -> str:
        return "ControllerStore()"


class WorkerStore(_InboxStore):
    """A worker process's end: ``put`` sends a value (or a :class:`KernelError`) to the controller; ``pop`` waits
    for an upload."""

    def __init__(self, device: int, send: SendFn, *, timeout_s: float | None = None) -> None:
        super().__init__(send, timeout_s=timeout_s)
        self.device = device

    def put(self, key: StoreKey, tensor: Any) -> None:
        self._check()
        self._send(self.device, key, tensor)

    def __repr__(self) -> str:
        return f"WorkerStore(device={self.device})"


class Route(enum.StrEnum):
    """How one value travels between the controller and a worker."""

    FRAMES = "frames"  # its bytes as ZMQ frames of the signed message (every peer)
    SHM = "shm"  # a file in the controller's shared-memory directory (processes of one host)
    CUDA_IPC = "cuda_ipc"  # a CUDA IPC handle; the receiver copies, then acknowledges (processes of one host)


def choose_route(
    *, device_type: str, nbytes: int, same_host: bool, threshold: int, shm: bool, cuda_ipc: bool
) -> Route:
    """The route of a tensor of ``nbytes`` bytes on ``device_type``.

    Args:
        same_host: the peer is a process this controller started on this host (remote workers, even on this
            host, never share memory with it).
        threshold: tensors smaller than this travel as frames (``DTORCH_SHM_THRESHOLD_BYTES``; ``<= 0``: always).
        shm: a shared-memory store is attached on both sides.
        cuda_ipc: CUDA IPC is on for this peer (``DTORCH_CUDA_IPC``, CUDA on both sides, no failure so far).
    """
    if not same_host or threshold <= 0 or nbytes < threshold:
        return Route.FRAMES
    if device_type == "cuda" and cuda_ipc:
        return Route.CUDA_IPC
    return Route.SHM if shm else Route.FRAMES


def tensor_route(value: Any, *, same_host: bool, threshold: int, shm: bool, cuda_ipc: bool) -> Route:
    """:func:`choose_route` for ``value`` (anything but a strided tensor travels as frames)."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return Route.FRAMES
    return choose_route(
        device_type=value.device.type,
        nbytes=value.numel() * value.element_size(),
        same_host=same_host,
        threshold=threshold,
        shm=shm,
        cuda_ipc=cuda_ipc,
    )


def shm_key(key: StoreKey, direction: str) -> str:
    """The shared-memory store key of ``key`` sent in ``direction`` (``"u"`` upload, ``"f"`` fetched value)."""
    return f"{direction}-{TensorStore.key_str(key)}"


def value_body(
    key: StoreKey, value: Any, *, shm: ShmTensorStore | None = None, threshold: int = 0, direction: str = ""
) -> dict[str, Any]:
    """The body of a ``VALUE`` message carrying ``value`` (a tensor, or an exception as its fields). With ``shm``,
    a tensor of at least ``threshold`` bytes is written there first and the body only names it."""
    if isinstance(value, BaseException):
        return {"key": wire_key(key), "error": encode_error(value)}
    if not isinstance(value, torch.Tensor):
        raise TensorStoreError(
            f"only tensors and errors travel through the store, got {type(value).__name__}"
        )
    route = tensor_route(
        value, same_host=shm is not None, threshold=threshold, shm=shm is not None, cuda_ipc=False
    )
    if route is Route.SHM:
        assert shm is not None
        shm.put(shm_key(key, direction), value)
        return {"key": wire_key(key), "shm": direction}
    return {"key": wire_key(key), "tensor": value}


def value_from_body(
    body: Any, *, device: int, shm: ShmTensorStore | None = None, direction: str = ""
) -> tuple[StoreKey, Any]:
    """Inverse of :func:`value_body` (a value sent through ``shm`` is claimed from it)."""
    if not isinstance(body, dict) or "key" not in body:
        raise TensorStoreError(f"malformed VALUE message from device {device}: {type(body).__name__}")
    key = key_from_wire(body["key"])
    if "error" in body:
        return key, decode_error(body["error"], device=device)
    if "cuda_ipc" in body:  # the caller opens those (cluster_ipc) when CUDA IPC is on for this peer
        raise TensorStoreError(
            f"VALUE message for {key!r} from device {device} carries a CUDA IPC handle, but CUDA IPC is off "
            "on this side"
        )
    if "shm" in body:
        if shm is None or body["shm"] != direction:
            raise TensorStoreError(
                f"VALUE message for {key!r} from device {device} names a shared-memory value ({body['shm']!r}) "
                "but this side has no shared-memory store for that direction"
            )
        return key, shm.pop(shm_key(key, direction), 0.0)  # written before the message was sent
    tensor = body.get("tensor")
    if not isinstance(tensor, torch.Tensor):
        raise TensorStoreError(f"VALUE message for {key!r} from device {device} holds no tensor")
    return key, tensor


class StorePoisonBoard(PoisonBoard):
    """The :class:`PoisonBoard` of worker processes, kept in the cluster's ``torch.distributed`` store.

    A rank whose redistribute input is poisoned posts *before* entering the collectives (the ``set`` is confirmed
    by a read on the same connection, so it is visible to every other client), and every rank looks *after*
    leaving them: a rank that received zeros from a poisoned peer therefore poisons its output too, as in thread
    mode. Costs one store round trip per redistribute (``check``); errors are rare and cost two more.
    """

    def __init__(self, store: Any, *, prefix: str = "dtorch-poison/") -> None:
        super().__init__()
        self._store = store
        self._prefix = prefix

    def post(self, operand_id: int, error: KernelError) -> None:
        key = f"{self._prefix}{operand_id}"
        try:
            self._store.set(key, json.dumps(encode_error(error)))
            self._store.check([key])
        except Exception:  # noqa: BLE001 - peers then see zeros; the local output is still poisoned
            log.exception("StorePoisonBoard: could not post the error of operand %d", operand_id)

    def get(self, operand_id: int) -> KernelError | None:
        key = f"{self._prefix}{operand_id}"
        try:
            if not self._store.check([key]):
                return None
            fields = json.loads(self._store.get(key))
        except Exception:  # noqa: BLE001
            log.exception("StorePoisonBoard: could not read the error of operand %d", operand_id)
            return None
        err = decode_error(fields, device=int(fields.get("device", -1)))
        return err if isinstance(err, KernelError) else KernelError("redistribute", -1, str(err))
