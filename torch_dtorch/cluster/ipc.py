"""CUDA IPC between the controller and the worker processes it started (process mode, one host).

A CUDA tensor of at least ``DTORCH_SHM_THRESHOLD_BYTES`` going to a local worker (an upload) or coming back from one
(a fetched value) does not go through host memory (:func:`~.cluster_store.choose_route` picks the route):

1. the producer copies it into a fresh tensor it owns (on the worker's GPU for uploads: workers only ever touch their
   own GPU), shares that tensor's CUDA allocation (``UntypedStorage._share_cuda_``: an IPC memory handle, an IPC
   event recorded after the copy, torch's reference counter in a shared-memory file) and sends the handle as
   explicit, typed fields of the signed ``VALUE`` message (:func:`ipc_fields`; never pickle);
2. the consumer checks the fields (:func:`parse_fields`), opens the handle (its stream waits on the event), copies
   into a tensor of its own, waits for the copy and closes the mapping (:func:`open_copy`: no foreign mapping is
   kept), and only then acknowledges (``ACK {"ipc_done": key, "ok": true}``; controller -> worker on the control
   socket);
3. the producer holds the shared tensor in its :class:`IpcOutbox` until that acknowledgement, then drops it.

Lifetime rule: a shared tensor lives exactly from the ``VALUE`` message to the consumer's acknowledgement. When a
consumer dies first, the controller's failure handling drops every held tensor once the local workers are reaped
(:meth:`IpcOutbox.drop` with ``consumers_gone``: the reference counters a dead consumer can no longer release are
released too, so the memory returns to the caching allocator instead of torch's IPC limbo); when the controller
dies, the worker processes exit and the driver frees their memory.

Fallback: CPU tensors, small tensors, remote workers (even on this host), ``DTORCH_CUDA_IPC=0``, or CUDA IPC
unavailable. A producer that cannot share (``_share_cuda_`` fails) and a consumer that cannot open (it answers
``{"ok": false}``; the producer then resends the held tensor) turn CUDA IPC off for that peer: the value, and every
later one, goes through shared memory (or ZMQ frames) instead.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from torch_dtorch.cluster.store import Route, key_from_wire, tensor_route, wire_key
from torch_dtorch.cluster.transport import MessageKind, TransportError
from torch_dtorch.collectives.errors import TensorStoreError
from torch_dtorch.collectives.store import StoreKey
from torch_dtorch.executor.instructions import Fetch
from torch_dtorch.executor.worker import Worker
from torch_dtorch.runtime.blob import KernelError
from torch_dtorch.runtime.stream import COMPUTE

__all__ = [
    "CudaFetchWorker",
    "CudaIpcError",
    "IpcAck",
    "IpcHandle",
    "IpcOutbox",
    "WorkerIpc",
    "ack_body",
    "ipc_fields",
    "ipc_supported",
    "is_ipc_body",
    "open_copy",
    "parse_ack",
    "parse_fields",
]

log = logging.getLogger(__name__)

_VERSION = 1
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_MAX_HANDLE_BYTES = 4096
_MAX_REF_NAME = 255
_MAX_REF_OFFSET = 1 << 20  # torch's reference-counter files hold 10000 counters


class CudaIpcError(TensorStoreError):
    """A CUDA tensor could not be shared through CUDA IPC, or a received handle could not be opened (``opened``:
    the handle was opened before the failure, so closing it released torch's reference counter)."""

    def __init__(self, message: str, *, opened: bool = False) -> None:
        super().__init__(message)
        self.opened = opened


def _storage_method(obj: Any, name: str) -> Any:
    """``UntypedStorage``'s CUDA sharing method ``_<name>_cuda`` (``_<name>_device`` in newer torch releases)."""
    for suffix in ("cuda", "device"):
        method = getattr(obj, name.format(suffix), None)
        if method is not None:
            return method
    raise CudaIpcError(f"this torch build has no UntypedStorage.{name.format('cuda')}")


def ipc_supported() -> bool:
    """Whether this process can share and open CUDA IPC handles (a CUDA build of torch on Linux, a visible GPU)."""
    try:
        for name in ("_share_{}_", "_new_shared_{}", "_release_ipc_counter_{}"):
            _storage_method(torch.UntypedStorage, name)
    except CudaIpcError:
        return False
    return sys.platform == "linux" and torch.cuda.is_available()


class IpcHandle(NamedTuple):
    """The checked fields of a shared CUDA tensor (see :func:`ipc_fields`)."""

    device: int
    handle: bytes
    size: int  # bytes of the shared storage
    offset: int  # byte offset of the storage in the shared allocation
    ref: bytes  # torch's reference-counter file (shared memory)
    ref_offset: int
    event: bytes
    event_sync: bool
    dtype: torch.dtype
    shape: tuple[int, ...]


def ipc_fields(t: torch.Tensor) -> dict[str, Any]:
    """The wire fields of the IPC handle of ``t`` (a contiguous CUDA tensor at storage offset 0, which the caller
    keeps alive until the consumer acknowledged). Plain JSON values and bytes: the message format never pickles."""
    if not t.is_cuda or not t.is_contiguous() or t.storage_offset() != 0:
        raise CudaIpcError(
            f"ipc_fields: needs a contiguous CUDA tensor at offset 0, got {t.device} {t.stride()}"
        )
    share = _storage_method(t.untyped_storage(), "_share_{}_")
    device, handle, size, offset, ref, ref_offset, event, event_sync = share()
    if handle is None or ref is None:
        raise CudaIpcError("ipc_fields: the tensor has no CUDA allocation to share")
    return {
        "v": _VERSION,
        "device": int(device),
        "handle": bytes(handle),
        "size": int(size),
        "offset": int(offset),
        "ref": bytes(ref),
        "ref_offset": int(ref_offset),
        "event": bytes(event) if event is not None else b"",
        "event_sync": bool(event_sync),
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
    }


def _int(fields: dict[str, Any], name: str, limit: int | None = None) -> int:
    v = fields.get(name)
    if type(v) is not int or v < 0 or (limit is not None and v >= limit):
        raise CudaIpcError(
            f"CUDA IPC handle: field {name!r} must be an int in [0, {limit or 'inf'}), got {v!r}"
        )
    return v


def _bytes(fields: dict[str, Any], name: str, limit: int) -> bytes:
    v = fields.get(name)
    if not isinstance(v, bytes) or not 0 < len(v) <= limit:
        raise CudaIpcError(f"CUDA IPC handle: field {name!r} must be 1 to {limit} bytes")
    return v


def parse_fields(raw: Any) -> IpcHandle:
    """Check the fields of a received handle (types, ranges, names) before anything is opened."""
    if not isinstance(raw, dict) or raw.get("v") != _VERSION:
        raise CudaIpcError(f"CUDA IPC handle: expected format {_VERSION}, got {type(raw).__name__}")
    name = raw.get("dtype")
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    shape = raw.get("shape")
    if dtype is None or not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise CudaIpcError(f"CUDA IPC handle: bad dtype/shape {raw.get('dtype')!r} {shape!r}")
    handle = _bytes(raw, "handle", _MAX_HANDLE_BYTES)
    ref = _bytes(raw, "ref", _MAX_REF_NAME)
    if not ref.startswith(b"/torch_") or b"/" in ref[1:] or b"\0" in ref:  # torch's own counter files only
        raise CudaIpcError(f"CUDA IPC handle: {ref!r} is not a torch reference-counter file")
    event_sync = raw.get("event_sync")
    if not isinstance(event_sync, bool):
        raise CudaIpcError("CUDA IPC handle: field 'event_sync' must be a bool")
    h = IpcHandle(
        device=_int(raw, "device", 1 << 16),
        handle=handle,
        size=_int(raw, "size"),
        offset=_int(raw, "offset"),
        ref=ref,
        ref_offset=_int(raw, "ref_offset", _MAX_REF_OFFSET),
        event=_bytes(raw, "event", _MAX_HANDLE_BYTES) if event_sync else b"",
        event_sync=event_sync,
        dtype=dtype,
        shape=tuple(shape),
    )
    if math.prod(h.shape) * dtype.itemsize > h.size:
        raise CudaIpcError(f"CUDA IPC handle: {list(h.shape)} {dtype} does not fit {h.size} bytes")
    return h


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, n = [], 1
    for size in reversed(shape):
        out.append(n)
        n *= max(size, 1)
    return tuple(reversed(out))


def open_copy(raw: Any, *, device: torch.device | None = None) -> torch.Tensor:
    """Open the handle in ``raw``, copy the tensor into a new one of this process (on ``device``, default the
    handle's GPU), wait for the copy and close the mapping. Raises :class:`CudaIpcError`."""
    h = parse_fields(raw)
    src = torch.device("cuda", h.device)
    dst = src if device is None else device
    opened = False
    try:
        with torch.cuda.device(src):
            # its stream waits on the producer's event; the storage releases torch's reference counter when freed
            new_shared = _storage_method(torch.UntypedStorage, "_new_shared_{}")
            storage = new_shared(
                h.device, h.handle, h.size, h.offset, h.ref, h.ref_offset, h.event, h.event_sync
            )
            opened = True
            foreign = torch.empty((0,), dtype=h.dtype, device=src).set_(
                storage, 0, h.shape, _strides(h.shape)
            )
            out = torch.empty(h.shape, dtype=h.dtype, device=dst)
            out.copy_(foreign)
            torch.cuda.current_stream(src).synchronize()
            if dst != src:
                torch.cuda.current_stream(dst).synchronize()
            del foreign, storage  # closes the mapping before the producer hears that it may free the memory
    except Exception as e:  # noqa: BLE001 - the caller falls back to the host path
        raise CudaIpcError(
            f"could not open a CUDA IPC handle of cuda:{h.device}: {type(e).__name__}: {e}", opened=opened
        ) from e
    return out


def _release_counter(fields: dict[str, Any]) -> None:
    """Release the reference counter a consumer took with the handle (for consumers that died holding it)."""
    try:
        _storage_method(torch.UntypedStorage, "_release_ipc_counter_{}")(fields["ref"], fields["ref_offset"])
    except Exception:  # noqa: BLE001 - best effort, as in torch: the block then stays in torch's IPC limbo
        log.debug("could not release a CUDA IPC reference counter", exc_info=True)


def is_ipc_body(body: Any) -> bool:
    return isinstance(body, dict) and "cuda_ipc" in body


def ack_body(key: StoreKey, *, error: CudaIpcError | None = None) -> dict[str, Any]:
    """The body of the ``ACK`` a consumer sends once it copied the value of ``key`` (or could not: ``error``)."""
    if error is None:
        return {"ipc_done": wire_key(key), "ok": True}
    return {"ipc_done": wire_key(key), "ok": False, "opened": error.opened, "error": str(error)}


class IpcAck(NamedTuple):
    key: StoreKey
    ok: bool
    opened: bool  # the consumer opened the handle (so it released torch's reference counter itself)
    error: str


def parse_ack(body: dict[str, Any]) -> IpcAck:
    ok, opened = body.get("ok"), body.get("opened", True)
    if not isinstance(ok, bool) or not isinstance(opened, bool):
        raise TensorStoreError(f"malformed CUDA IPC acknowledgement: {body!r}")
    return IpcAck(key_from_wire(body.get("ipc_done")), ok, opened, str(body.get("error", "")))


class _Held(NamedTuple):
    tensor: torch.Tensor
    fields: dict[str, Any]


class IpcOutbox:
    """The producer's side: tensors shared through CUDA IPC, each held until its consumer acknowledged it."""

    def __init__(self) -> None:
        self._held: dict[StoreKey, _Held] = {}
        self._lock = threading.Lock()
        self.shared = 0  # tensors shared so far

    def share(
        self, key: StoreKey, tensor: torch.Tensor, *, device: torch.device | None = None
    ) -> dict[str, Any]:
        """Copy ``tensor`` into a new tensor on ``device`` (default: its own GPU), share it, hold it until
        :meth:`release`; the ``VALUE`` body naming it. Raises :class:`CudaIpcError`."""
        try:
            own = torch.empty(tensor.shape, dtype=tensor.dtype, device=device or tensor.device)
            own.copy_(tensor.detach())  # on the current stream, where _share_cuda_ records its IPC event
            fields = ipc_fields(own)
        except CudaIpcError:
            raise
        except Exception as e:  # noqa: BLE001 - the caller falls back to the host path
            raise CudaIpcError(f"could not share a CUDA tensor: {type(e).__name__}: {e}") from e
        with self._lock:
            if key in self._held:
                raise TensorStoreError(f"IpcOutbox: {key!r} is already shared and not acknowledged")
            self._held[key] = _Held(own, fields)
            self.shared += 1
        return {"key": wire_key(key), "cuda_ipc": fields}

    def release(self, ack: IpcAck) -> torch.Tensor | None:
        """The consumer acknowledged ``ack.key``: stop holding it (returned, for a resend after a failed open).
        A consumer that never opened the handle did not take torch's reference counter: release it here, or the
        memory would wait in torch's IPC limbo until this process exits."""
        with self._lock:
            held = self._held.pop(ack.key, None)
        if held is None:
            return None
        if not ack.opened:
            _release_counter(held.fields)
        return held.tensor

    def drop(self, *, consumers_gone: bool) -> int:
        """Stop holding every tensor (shutdown, failure); with ``consumers_gone`` (their processes are reaped) also
        release the reference counters they took. Returns how many were held."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        if consumers_gone:
            for h in held:
                _release_counter(h.fields)
        return len(held)

    def __len__(self) -> int:
        return len(self._held)

    def __repr__(self) -> str:
        return f"IpcOutbox({len(self._held)} held, {self.shared} shared)"


class CudaFetchWorker(Worker):
    """The worker of a process with CUDA IPC on: a fetched CUDA value is handed to the store as the device tensor,
    on the compute stream, instead of as a host copy. The process's store then shares a copy of it through CUDA IPC
    (the IPC event is recorded on that stream) or, for the other routes, copies it to the host itself."""

    def _fetch(self, instr: Fetch) -> None:
        stream = self.stream
        b = self.blobs.get(instr.operand.id)
        if stream is None or not stream.is_cuda or b is None or b.error is not None or b.tensor is None:
            super()._fetch(instr)
            return
        key = (instr.key, self.device)
        try:
            stream.wait_for([b], COMPUTE)
            with stream.use(COMPUTE):
                self.store.put(key, b.tensor)
            return
        except TransportError:
            raise
        except Exception as e:  # noqa: BLE001 - delivered to the controller instead of a tensor
            err = KernelError("fetch", self.device, e, detail=f"of {instr.operand.name}")
        self.store.put(key, err)


#: ``send(body, kind)``: a message to the controller on the worker's reply socket
SendFn = Callable[[dict[str, Any], MessageKind], Any]


class WorkerIpc:
    """The worker process's side of CUDA IPC (on when its ``WELCOME`` says ``cuda_ipc``).

    Args:
        device: this worker's CUDA device (uploads are copied there).
        send: sends a message to the controller (the reply socket).
        host_body: the ``VALUE`` body of a value on the host route (shared memory or frames).
    """

    def __init__(
        self,
        *,
        device: torch.device,
        threshold: int,
        send: SendFn,
        host_body: Callable[[StoreKey, Any], dict[str, Any]],
    ) -> None:
        self.device = device
        self.threshold = threshold
        self.on = True
        self.outbox = IpcOutbox()
        self._send = send
        self._host_body = host_body

    @classmethod
    def from_welcome(
        cls,
        welcome: dict[str, Any],
        *,
        device: torch.device,
        send: SendFn,
        host_body: Callable[[StoreKey, Any], dict[str, Any]],
    ) -> WorkerIpc | None:
        """The worker's CUDA IPC when its ``WELCOME`` offers it and this process can use it, else ``None``."""
        if not welcome.get("cuda_ipc"):
            return None
        if not ipc_supported():
            log.warning("worker on %s: CUDA IPC is not available here; using host memory", device)
            return None
        threshold = int(welcome.get("cuda_ipc_threshold", 1 << 20))
        return cls(device=device, threshold=threshold, send=send, host_body=host_body)

    def value_body(self, key: StoreKey, value: Any, *, shm: bool) -> dict[str, Any] | None:
        """The body of a fetched value shared through CUDA IPC, or ``None``: its route is another one (see
        :func:`~.cluster_store.choose_route`), or sharing failed (CUDA IPC is then off)."""
        route = tensor_route(value, same_host=True, threshold=self.threshold, shm=shm, cuda_ipc=self.on)
        if route is not Route.CUDA_IPC:
            return None
        try:
            return self.outbox.share(key, value)
        except CudaIpcError as e:
            log.warning("worker on %s: %s; CUDA IPC off, values go through host memory", self.device, e)
            self.on = False
            return None

    def receive(self, body: dict[str, Any]) -> tuple[StoreKey, torch.Tensor] | None:
        """An upload shared by the controller: its copy, acknowledged (``None``: could not open; the controller
        resends it through host memory)."""
        key = key_from_wire(body.get("key"))
        try:
            value = open_copy(body["cuda_ipc"], device=self.device)
        except CudaIpcError as e:
            log.warning("worker on %s: %s; asking for a resend through host memory", self.device, e)
            self.on = False
            self._send(ack_body(key, error=e), MessageKind.ACK)
            return None
        self._send(ack_body(key), MessageKind.ACK)
        return key, value

    def acknowledged(self, body: dict[str, Any]) -> None:
        """The controller copied (or could not open) a fetched value: drop it (or resend it through host memory)."""
        ack = parse_ack(body)
        held = self.outbox.release(ack)
        if ack.ok or held is None:
            return
        log.warning(
            "worker on %s: the controller could not open %r (%s); resending through host memory",
            self.device,
            ack.key,
            ack.error,
        )
        self.on = False
        torch.cuda.synchronize(held.device)  # the copy was made on the compute stream
        self._send(self._host_body(ack.key, held), MessageKind.VALUE)

    def close(self) -> None:
        self.outbox.drop(consumers_gone=False)  # the process exits: the driver frees the memory
