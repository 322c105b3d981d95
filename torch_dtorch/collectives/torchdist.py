"""Collectives over ``torch.distributed`` process groups made from an explicit store, without
``init_process_group``: every rank (thread or process) builds its own backend object, so one process can hold
several ranks (that is thread mode with NCCL on distinct GPUs, or Gloo on CPU).

:func:`new_backend` builds ``ProcessGroupGloo(store, rank, size, timeout)`` or
``ProcessGroupNCCL(store, rank, size, options)`` the way ``torch.distributed`` does internally;
:class:`TorchDistGroup` implements :class:`~torch_dtorch.collectives.group.Group` on it with the same semantics as
the in-memory group (uneven all-gather by pad-to-max + trim, reduce-scatter by padding to equal chunks, all-to-all
through ``alltoall_base`` with per-rank split sizes, ``avg`` as sum then divide). The code path is the same for both
backends: only tensor devices differ. Only Gloo is exercised by the CPU test-suite.

Gloo with CUDA ranks (several simulated ranks on one GPU in process mode, where NCCL refuses two ranks on one
device) is *host-staged*: each collective copies its input to the CPU and its result back to the rank's GPU.

Reductions follow the backend's order (ring, tree...), so ``sum``/``avg`` of floats may differ from the in-memory
group in the last bits; ``max``/``min`` and integer-valued data are exact.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torch_dtorch.collectives.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeout
from torch_dtorch.collectives.group import Group, Work, check_reduce_op, collective_timeout_s
from torch_dtorch.collectives.local import chunk, normalize_dim
from torch_dtorch.placement import chunk_size_and_offset

__all__ = ["TorchDistComm", "TorchDistGroup", "new_backend"]

logger = logging.getLogger(__name__)

_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip
_MAX_DIMS = 14  # header: [dtype, ndim, *shape] padded to 16 int64


def new_backend(
    store: dist.Store, rank: int, size: int, *, backend: str = "gloo", timeout_s: float | None = None
) -> Any:
    """A ``torch.distributed`` backend object for ``rank`` of ``size`` that rendezvous through ``store`` (use a
    ``PrefixStore`` per group). Blocks until every rank has constructed its own."""
    timeout = timedelta(seconds=collective_timeout_s() if timeout_s is None else timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None or not dist.is_nccl_available():
            raise CollectiveError("new_backend: this torch build has no NCCL")
        options = nccl.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        return nccl(store, rank, size, options)
    raise ValueError(f"new_backend: backend must be 'gloo' or 'nccl', got {backend!r}")


def _wait(work: Any, what: str, devices: Sequence[int]) -> None:
    try:
        work.wait()
    except Exception as e:
        text = str(e)
        if "imed out" in text or "timeout" in text.lower():
            raise CollectiveTimeout(
                f"{what} on group {tuple(devices)} timed out: {text}", devices=devices, op=what
            ) from e
        raise CollectiveError(f"{what} on group {tuple(devices)} failed: {type(e).__name__}: {text}") from e


def _reduce_op(op: str) -> Any:
    return getattr(dist.ReduceOp, _OPS[check_reduce_op(op)])


def _finish_avg(t: torch.Tensor, op: str, n: int) -> torch.Tensor:
    if op != "avg":
        return t
    return t.div_(n) if t.is_floating_point() else t.floor_divide_(n)


def _header(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.ndim > _MAX_DIMS or t.dtype not in _DTYPES:
        raise CollectiveError(f"cannot transfer a tensor of {t.dtype} with {t.ndim} dims (max {_MAX_DIMS})")
    values = [_DTYPES.index(t.dtype), t.ndim, *t.shape] + [0] * (_MAX_DIMS - t.ndim)
    return torch.tensor(values, dtype=torch.int64, device=device)


def _from_header(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    values = header.tolist()
    return torch.empty(values[2 : 2 + values[1]], dtype=_DTYPES[values[0]], device=device)


def _real(t: torch.Tensor) -> torch.Tensor:
    """Gloo has no complex types: a complex tensor travels as its (real, imag) pairs, a trailing dim of 2 (dims
    are normalized against the complex tensor first, so they mean the same in the real view)."""
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def _complex(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(out.contiguous()) if like.is_complex() else out


def _host_staged(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A collective of a host-staged group: CUDA input copied to the CPU, the result copied back to the GPU."""

    @functools.wraps(fn)
    def staged(self: TorchDistGroup, t: torch.Tensor | None, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.home is None:
            return fn(self, t, *args, **kwargs)
        out = fn(self, None if t is None else t.cpu(), *args, **kwargs)
        return out.to(self.home, non_blocking=False)

    return staged


class TorchDistGroup:
    """One rank's :class:`~torch_dtorch.collectives.group.Group` over a ``torch.distributed`` backend object.

    Args:
        backend: the rank's backend (see :func:`new_backend`).
        devices: device ids of the members in rank order.
        device: this rank's device id (must be in ``devices``).
        torch_device: where size headers live (``cpu`` for Gloo, this rank's ``cuda:i`` for NCCL).
        home: for a host-staged group (Gloo on CUDA ranks), the rank's GPU: results are copied there.
    """

    def __init__(
        self,
        backend: Any,
        devices: Sequence[int],
        device: int,
        *,
        torch_device: torch.device,
        home: torch.device | None = None,
    ) -> None:
        self.backend = backend
        self.home = home
        self._devices = tuple(devices)
        self._rank = self._devices.index(device)
        self.torch_device = torch.device(torch_device)

    @classmethod
    def create(
        cls,
        store: dist.Store,
        devices: Sequence[int],
        device: int,
        *,
        backend: str = "gloo",
        torch_device: torch.device | None = None,
        timeout_s: float | None = None,
    ) -> TorchDistGroup:
        """Build the backend for ``device``'s rank in ``devices`` on ``PrefixStore("group/<devices>/", store)``."""
        devices = tuple(int(d) for d in devices)
        if device not in devices:
            raise CollectiveError(f"TorchDistGroup: device {device} is not in the group {devices}")
        prefix = dist.PrefixStore("group/" + "-".join(map(str, devices)) + "/", store)
        be = new_backend(prefix, devices.index(device), len(devices), backend=backend, timeout_s=timeout_s)
        if backend == "gloo":
            # Gloo moves host memory: CUDA ranks (simulated on one GPU) are staged through the CPU
            home = torch_device if torch_device is not None and torch_device.type == "cuda" else None
            return cls(be, devices, device, torch_device=torch.device("cpu"), home=home)
        default = torch.device("cuda", torch.cuda.current_device())
        return cls(be, devices, device, torch_device=torch_device or default)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._devices)

    @property
    def devices(self) -> tuple[int, ...]:
        return self._devices

    def __repr__(self) -> str:
        return f"TorchDistGroup(devices={self._devices}, rank={self._rank}, {self.backend.name()})"

    def _exchange_sizes(self, value: int) -> list[int]:
        mine = torch.tensor([value], dtype=torch.int64, device=self.torch_device)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        _wait(self.backend.allgather([out], [mine]), "all_gather(sizes)", self._devices)
        return [int(t.item()) for t in out]

    @_host_staged
    def all_gather(self, t: torch.Tensor, dim: int, *, sizes: Sequence[int] | None = None) -> torch.Tensor:
        dim = normalize_dim(dim, t.ndim, "all_gather")
        sizes = self._exchange_sizes(t.shape[dim]) if sizes is None else list(sizes)
        if len(sizes) != self.size or sizes[self._rank] != t.shape[dim]:
            raise CollectiveMismatchError(
                f"all_gather(dim={dim}): sizes {sizes} do not fit this rank's {tuple(t.shape)}"
            )
        like, t = t, _real(t)
        top = max(sizes)
        padded = list(t.shape)
        padded[dim] = top
        if t.shape[dim] == top:
            buf = t.contiguous()
        else:
            buf = t.new_zeros(padded)
            buf.narrow(dim, 0, t.shape[dim]).copy_(t)
        out = [torch.empty(padded, dtype=t.dtype, device=t.device) for _ in range(self.size)]
        _wait(self.backend.allgather([out], [buf]), f"all_gather(dim={dim})", self._devices)
        return _complex(torch.cat([o.narrow(dim, 0, s) for o, s in zip(out, sizes)], dim=dim), like)

    @_host_staged
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = _reduce_op(op)
        buf = _real(t).clone(memory_format=torch.contiguous_format)
        _wait(self.backend.allreduce([buf], opts), f"all_reduce(op={op})", self._devices)
        return _complex(_finish_avg(buf, op, self.size), t)

    @_host_staged
    def reduce_scatter(self, t: torch.Tensor, op: str, dim: int) -> torch.Tensor:
        dim = normalize_dim(dim, t.ndim, "reduce_scatter")
        like, t = t, _real(t)
        n, size = self.size, t.shape[dim]
        full = -(-size // n)
        padded = list(t.shape)
        padded[dim] = full * n
        buf = t.new_zeros(padded)
        buf.narrow(dim, 0, size).copy_(t)
        pieces = [buf.narrow(dim, full * j, full).contiguous() for j in range(n)]
        out = torch.empty_like(pieces[0])
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _reduce_op(op)
        _wait(
            self.backend.reduce_scatter([out], [pieces], opts),
            f"reduce_scatter(op={op}, dim={dim})",
            self._devices,
        )
        mine = chunk_size_and_offset(size, n, self._rank)[0]
        out = out if mine == full else out.narrow(dim, 0, mine).contiguous()
        return _complex(_finish_avg(out, op, n), like)

    @_host_staged
    def all_to_all(
        self, t: torch.Tensor, src_dim: int, dst_dim: int, *, src_sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        src_dim = normalize_dim(src_dim, t.ndim, "all_to_all")
        dst_dim = normalize_dim(dst_dim, t.ndim, "all_to_all")
        like, t = t, _real(t)
        n = self.size
        src_sizes = self._exchange_sizes(t.shape[src_dim]) if src_sizes is None else list(src_sizes)
        pieces = [chunk(t, dst_dim, n, j) for j in range(n)]
        send = torch.cat([p.reshape(-1) for p in pieces])
        shapes = []
        for k in range(n):
            shape = list(t.shape)
            shape[dst_dim] = pieces[self._rank].shape[dst_dim]
            shape[src_dim] = src_sizes[k]
            shapes.append(shape)
        recv_splits = [math.prod(s) for s in shapes]
        recv = torch.empty(sum(recv_splits), dtype=t.dtype, device=t.device)
        work = self.backend.alltoall_base(
            recv, send, recv_splits, [p.numel() for p in pieces], dist.AllToAllOptions()
        )
        _wait(work, f"all_to_all({src_dim}->{dst_dim})", self._devices)
        parts = [flat.view(shape) for flat, shape in zip(recv.split(recv_splits), shapes)]
        return _complex(torch.cat(parts, dim=src_dim), like)

    @_host_staged
    def broadcast(self, t: torch.Tensor | None, src: int) -> torch.Tensor:
        if not 0 <= src < self.size:
            raise ValueError(f"broadcast: src rank {src} out of range for a group of {self.size}")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        if self._rank == src:
            if t is None:
                raise CollectiveMismatchError(f"broadcast(src={src}): the source rank passed no tensor")
            header = _header(t, self.torch_device)
        else:
            header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self.torch_device)
        _wait(self.backend.broadcast([header], opts), f"broadcast(src={src})", self._devices)
        if self._rank == src:
            assert t is not None
            buf = t.clone(memory_format=torch.contiguous_format)
        else:
            buf = _from_header(header, t.device if t is not None else self.torch_device)
        _wait(self.backend.broadcast([_real(buf)], opts), f"broadcast(src={src})", self._devices)
        return buf

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.torch_device))


class _Works:
    """Pending sends; keeps their tensors alive until :meth:`wait`."""

    __slots__ = ("_devices", "_tensors", "_what", "_works")

    def __init__(
        self, works: list[Any], tensors: list[torch.Tensor], what: str, devices: tuple[int, int]
    ) -> None:
        self._works, self._tensors, self._what, self._devices = works, tensors, what, devices

    def wait(self) -> None:
        for w in self._works:
            _wait(w, self._what, self._devices)
        self._works, self._tensors = [], []


class TorchDistComm:
    """Device ``device``'s :class:`~torch_dtorch.collectives.group.Comm` over ``torch.distributed`` backends.

    The world group (every device of ``world_devices``, used for point-to-point) is built here, so every device
    of the world must construct its comm (concurrently: construction is a rendezvous). Axis groups are built on
    first use, which is safe because every member reaches its first collective on a group at the same point of
    the instruction stream. ``store`` is shared by every rank (``HashStore`` in one process, ``TCPStore`` across
    processes); ``prefix`` separates several worlds on one store.

    Its collectives are **stream-ordered** on CUDA: they read their input and write their result in the order of the
    calling (current) stream — host-staged Gloo copies on it synchronously, NCCL orders its own stream against it and
    records the tensors for the allocator — so a worker needs no host synchronization around them.
    """

    #: read by :class:`~torch_dtorch.runtime.op_runner.OpRunner`: no host synchronization around redistributes
    stream_ordered = True

    def __init__(
        self,
        store: dist.Store,
        device: int,
        world_devices: Sequence[int],
        *,
        backend: str = "gloo",
        torch_device: torch.device | None = None,
        timeout_s: float | None = None,
        prefix: str = "dtorch",
    ) -> None:
        self._device = int(device)
        self.backend = backend
        self.timeout_s = timeout_s
        self.store = dist.PrefixStore(prefix + "/", store)
        self._groups: dict[tuple[int, ...], TorchDistGroup] = {}
        self.world = self._make(tuple(int(d) for d in world_devices), torch_device)
        self.torch_device = self.world.torch_device
        self.home = self.world.home  # host-staged (Gloo on CUDA ranks): where received tensors go

    @property
    def device(self) -> int:
        return self._device

    def __repr__(self) -> str:
        return f"TorchDistComm(device={self._device}, world={self.world.devices}, {self.backend})"

    def _make(self, devices: tuple[int, ...], torch_device: torch.device | None) -> TorchDistGroup:
        group = TorchDistGroup.create(
            self.store,
            devices,
            self._device,
            backend=self.backend,
            torch_device=torch_device,
            timeout_s=self.timeout_s,
        )
        self._groups[devices] = group
        return group

    def group(self, devices: Sequence[int]) -> Group:
        key = tuple(int(d) for d in devices)
        group = self._groups.get(key)
        return group if group is not None else self._make(key, self.home or self.torch_device)

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> Work:
        rank = self.world.devices.index(dst)
        header, data = _header(t, self.torch_device), (t.cpu() if self.home is not None else t.contiguous())
        works = [
            self.world.backend.send([header], rank, 2 * tag),
            self.world.backend.send([data], rank, 2 * tag + 1),
        ]
        return _Works(works, [header, data], f"send({self._device}->{dst}, tag={tag})", (self._device, dst))

    def recv(self, src: int, tag: int = 0) -> torch.Tensor:
        rank = self.world.devices.index(src)
        what = f"recv({src}->{self._device}, tag={tag})"
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self.torch_device)
        _wait(self.world.backend.recv([header], rank, 2 * tag), what, (src, self._device))
        out = _from_header(header, self.torch_device)
        _wait(self.world.backend.recv([out], rank, 2 * tag + 1), what, (src, self._device))
        return out if self.home is None else out.to(self.home)
