"""In-memory collectives for thread mode: every worker thread of one process shares one :class:`InMemoryWorld`.

Each group keeps sequence-numbered slots: the ``k``-th collective call of every member meets in slot ``k``. The
last rank to arrive computes every rank's result with the plain-torch functions of
:mod:`torch_dtorch.collectives.local` (once, so every rank gets bit-identical values, each its own copy; the same
kernels as ``plan_sim``, so the same bits as the simulation) and wakes the others. Inputs are only read while every
other member is blocked in the same call, so no copy of the inputs is needed. Works for CPU tensors and for CUDA
tensors of virtual ranks sharing one GPU, each rank on its own streams (CUDA events order inputs and results, see
:mod:`~torch_dtorch.collectives.streams`; results stay on each input's device).

Nothing waits forever: a call that waits longer than the world's timeout (``DTORCH_COLLECTIVE_TIMEOUT_S``, default
300 s) raises :class:`CollectiveTimeout` naming the group, the op and the devices that arrived, and breaks the group
(later calls fail at once). :meth:`InMemoryWorld.abort` wakes every waiter with :class:`CollectiveAborted`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from torch_dtorch.collectives import local, streams
from torch_dtorch.collectives.errors import (
    CollectiveAborted,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeout,
)
from torch_dtorch.collectives.group import DoneWork, Group, Work, check_reduce_op, collective_timeout_s
from torch_dtorch.collectives.mailbox import Mailbox

__all__ = ["SHUTDOWN", "InMemoryComm", "InMemoryGroup", "InMemoryGroupHandle", "InMemoryWorld"]

logger = logging.getLogger(__name__)

#: the reason a normal shutdown gives :meth:`InMemoryWorld.abort` (logged at debug level only)
SHUTDOWN = "shut down"

_Compute = Callable[[list[Any]], Sequence[torch.Tensor]]
_DONE = DoneWork()


class _Slot:
    __slots__ = (
        "args",
        "arrived",
        "done",
        "error",
        "events",
        "inputs",
        "num_arrived",
        "num_left",
        "op",
        "results",
    )

    def __init__(self, op: str, args: tuple[object, ...], size: int) -> None:
        self.op = op
        self.args = args
        self.inputs: list[object] = [None] * size
        self.arrived = [False] * size
        self.events: list[Any] | None = None  # CUDA arrival events, only when some input is a CUDA tensor
        self.done: streams.Events | None = None
        self.num_arrived = 0
        self.num_left = 0
        self.results: list[torch.Tensor | None] | None = None
        self.error: CollectiveError | None = None


class _Failure:
    """Why a group is unusable; raises a fresh exception per caller (exceptions are not shared across threads)."""

    __slots__ = ("cls", "kwargs", "message")

    def __init__(self, cls: type[CollectiveError], message: str, **kwargs: object) -> None:
        self.cls, self.message, self.kwargs = cls, message, kwargs

    def error(self) -> CollectiveError:
        return self.cls(self.message, **self.kwargs)


def _cuda_device(inputs: list[Any]) -> torch.device | None:
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return t.device
    return None


def _describe(op: str, args: tuple[object, ...]) -> str:
    return f"{op}({', '.join(str(a) for a in args)})"


class InMemoryGroup:
    """The state shared by the members of one device group; members use :meth:`handle`."""

    def __init__(self, world: InMemoryWorld, devices: tuple[int, ...]) -> None:
        self.world = world
        self.devices = devices
        self.size = len(devices)
        self._rank_of = {d: r for r, d in enumerate(devices)}
        self._cond = threading.Condition(threading.Lock())
        self._next_seq = [0] * self.size
        self._slots: dict[int, _Slot] = {}
        self._failure: _Failure | None = None

    def __repr__(self) -> str:
        return f"InMemoryGroup(devices={self.devices})"

    def handle(self, device: int) -> InMemoryGroupHandle:
        """``device``'s handle on this group."""
        if device not in self._rank_of:
            raise CollectiveError(f"device {device} is not a member of the group {self.devices}")
        return InMemoryGroupHandle(self, self._rank_of[device])

    def _fail(self, failure: _Failure) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = failure
            self._cond.notify_all()

    def run(
        self, rank: int, op: str, args: tuple[object, ...], payload: object, compute: _Compute
    ) -> torch.Tensor:
        """Meet the other members in this rank's next slot; return this rank's result."""
        cuda = isinstance(payload, torch.Tensor) and payload.is_cuda
        event = streams.record_arrival(payload) if cuda else None
        with self._cond:
            if self._failure is not None:
                raise self._failure.error()
            seq = self._next_seq[rank]
            self._next_seq[rank] = seq + 1
            slot = self._slots.get(seq)
            if slot is None:
                slot = self._slots[seq] = _Slot(op, args, self.size)
            elif (slot.op, slot.args) != (op, args) and slot.error is None:
                slot.error = CollectiveMismatchError(
                    f"collective #{seq} on group {self.devices}: device {self.devices[rank]} called "
                    f"{_describe(op, args)} but an earlier member called {_describe(slot.op, slot.args)}; every "
                    "member must issue the same collectives in the same order"
                )
            slot.inputs[rank] = payload
            if event is not None:
                if slot.events is None:
                    slot.events = [None] * self.size
                slot.events[rank] = event
            slot.arrived[rank] = True
            slot.num_arrived += 1
            if slot.num_arrived == self.size:
                if slot.error is None:
                    try:
                        if slot.events is not None:
                            streams.wait_arrivals(slot.events, _cuda_device(slot.inputs))
                        results: list[torch.Tensor | None] = list(compute(slot.inputs))
                        if slot.events is not None:
                            slot.done = streams.record_done(results)
                        slot.results = results
                    except CollectiveError as e:
                        slot.error = e
                    except Exception as e:  # bad arguments: every member gets the same typed error
                        slot.error = CollectiveMismatchError(
                            f"{_describe(op, args)} on group {self.devices} failed: {type(e).__name__}: {e}"
                        )
                        slot.error.__cause__ = e
                slot.inputs = []
                self._cond.notify_all()
            else:
                self._wait(slot, seq, rank)
            slot.num_left += 1
            if slot.num_left == self.size:
                del self._slots[seq]
            if slot.error is not None:
                raise type(slot.error)(str(slot.error)) from slot.error
            assert slot.results is not None
            result = slot.results[rank]
            slot.results[rank] = None
            assert result is not None
        return result if slot.done is None else streams.adopt(result, slot.done)

    def _wait(self, slot: _Slot, seq: int, rank: int) -> None:
        timeout = self.world.timeout_s
        deadline = time.monotonic() + timeout
        while slot.results is None and slot.error is None:
            if self._failure is not None:
                raise self._failure.error()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                arrived = tuple(d for d, here in zip(self.devices, slot.arrived) if here)
                missing = [d for d in self.devices if d not in arrived]
                message = (
                    f"{_describe(slot.op, slot.args)} (collective #{seq}) on group devices {self.devices} timed "
                    f"out after {timeout:g} s on device {self.devices[rank]}: arrived {list(arrived)}, never "
                    f"arrived {missing}. A worker died or the members issued different collectives; raise "
                    "DTORCH_COLLECTIVE_TIMEOUT_S for long-running steps."
                )
                failure = _Failure(
                    CollectiveTimeout,
                    message,
                    devices=self.devices,
                    op=slot.op,
                    arrived=arrived,
                    timeout_s=timeout,
                )
                logger.error("%s", message)
                self._failure = failure
                self._cond.notify_all()
                raise failure.error()
            self._cond.wait(remaining)


class InMemoryGroupHandle:
    """One rank's :class:`~torch_dtorch.collectives.group.Group` over an :class:`InMemoryGroup`."""

    __slots__ = ("_group", "_rank")

    def __init__(self, group: InMemoryGroup, rank: int) -> None:
        self._group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._group.size

    @property
    def devices(self) -> tuple[int, ...]:
        return self._group.devices

    def __repr__(self) -> str:
        return f"InMemoryGroupHandle(devices={self.devices}, rank={self._rank})"

    def all_gather(self, t: torch.Tensor, dim: int, *, sizes: Sequence[int] | None = None) -> torch.Tensor:
        dim = local.normalize_dim(dim, t.ndim, "all_gather")
        sizes = None if sizes is None else tuple(sizes)
        fn = partial(local.all_gather_results, dim=dim, sizes=sizes)
        return self._group.run(self._rank, "all_gather", (f"dim={dim}",), t, fn)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        check_reduce_op(op)
        return self._group.run(
            self._rank, "all_reduce", (f"op={op}",), t, partial(local.all_reduce_results, op=op)
        )

    def reduce_scatter(self, t: torch.Tensor, op: str, dim: int) -> torch.Tensor:
        check_reduce_op(op)
        dim = local.normalize_dim(dim, t.ndim, "reduce_scatter")
        fn = partial(local.reduce_scatter_results, op=op, dim=dim)
        return self._group.run(self._rank, "reduce_scatter", (f"op={op}", f"dim={dim}"), t, fn)

    def all_to_all(
        self, t: torch.Tensor, src_dim: int, dst_dim: int, *, src_sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        src_dim = local.normalize_dim(src_dim, t.ndim, "all_to_all")
        dst_dim = local.normalize_dim(dst_dim, t.ndim, "all_to_all")
        fn = partial(local.all_to_all_results, src_dim=src_dim, dst_dim=dst_dim)
        return self._group.run(self._rank, "all_to_all", (f"{src_dim}->{dst_dim}",), t, fn)

    def broadcast(self, t: torch.Tensor | None, src: int) -> torch.Tensor:
        if not 0 <= src < self.size:
            raise ValueError(f"broadcast: src rank {src} out of range for a group of {self.size}")
        fn = partial(local.broadcast_results, src=src)
        return self._group.run(self._rank, "broadcast", (f"src={src}",), t, fn)

    def barrier(self) -> None:
        self._group.run(self._rank, "barrier", (), True, _barrier_results)


def _barrier_results(inputs: list[Any]) -> list[torch.Tensor]:
    return [torch.empty(0) for _ in inputs]


class InMemoryWorld:
    """Collectives and point-to-point mailboxes shared by the worker threads of one process.

    Args:
        devices: every device id of the world.
        timeout_s: how long a call may wait (default: ``DTORCH_COLLECTIVE_TIMEOUT_S``, else 300 s).
    """

    def __init__(self, devices: Sequence[int], *, timeout_s: float | None = None) -> None:
        self.devices = tuple(int(d) for d in devices)
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"InMemoryWorld: devices must be distinct, got {self.devices}")
        self.timeout_s = collective_timeout_s() if timeout_s is None else float(timeout_s)
        self._lock = threading.Lock()
        self._groups: dict[tuple[int, ...], InMemoryGroup] = {}
        self._mailbox = Mailbox()
        self._abort: _Failure | None = None

    def __repr__(self) -> str:
        return f"InMemoryWorld(devices={self.devices})"

    @property
    def aborted(self) -> bool:
        return self._abort is not None

    def group(self, devices: Sequence[int]) -> InMemoryGroup:
        """The group over ``devices`` (rank order), created on first use and shared by every caller."""
        key = tuple(int(d) for d in devices)
        group = self._groups.get(key)
        if group is not None:
            return group
        bad = [d for d in key if d not in self.devices]
        if not key or bad or len(set(key)) != len(key):
            raise CollectiveError(
                f"InMemoryWorld.group: {key} must be distinct devices of the world {self.devices} (bad: {bad})"
            )
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = InMemoryGroup(self, key)
                if self._abort is not None:
                    group._fail(self._abort)
            return group

    def abort(self, reason: str = "aborted") -> None:
        """Fail every current and future call of this world with :class:`CollectiveAborted` (idempotent)."""
        failure = _Failure(CollectiveAborted, f"collectives of {self!r} aborted: {reason}")
        with self._lock:
            if self._abort is None:
                self._abort = failure
            groups = list(self._groups.values())
        # a normal shutdown aborts too (waking any waiter): worth a line only when something else failed it
        logger.log(logging.DEBUG if reason == SHUTDOWN else logging.INFO, "aborting %r: %s", self, reason)
        for g in groups:
            g._fail(failure)
        self._mailbox.abort(failure.error)

    # --- point to point -------------------------------------------------------------------------------------------
    def send(self, t: torch.Tensor, src: int, dst: int, tag: int = 0) -> None:
        """Buffer a copy of ``t`` for ``dst`` (never waits for the receiver)."""
        self._check_device(src, "send")
        self._check_device(dst, "send")
        self._mailbox.put(src, dst, tag, t)

    def recv(self, src: int, dst: int, tag: int = 0, *, timeout_s: float | None = None) -> torch.Tensor:
        """The oldest tensor ``src`` sent to ``dst`` with ``tag``; waits for it (at most the world's timeout)."""
        self._check_device(src, "recv")
        self._check_device(dst, "recv")
        return self._mailbox.take(src, dst, tag, self.timeout_s if timeout_s is None else timeout_s)

    def _check_device(self, device: int, what: str) -> None:
        if device not in self.devices:
            raise CollectiveError(f"{what}: device {device} is not in {self!r}")


class InMemoryComm:
    """Device ``device``'s :class:`~torch_dtorch.collectives.group.Comm` over an :class:`InMemoryWorld`.

    ``torch_device``, when given, is where received tensors are moved (distinct GPUs in one process); by default
    they stay where the sender had them. ``stream_ordered`` (read by
    :class:`~torch_dtorch.runtime.op_runner.OpRunner`): every member's tensors live on one CUDA device (virtual ranks),
    where the arrival/done events of :mod:`.streams` order the collectives against the callers' streams, so workers
    need no host synchronization around them; across distinct GPUs they still do.
    """

    def __init__(
        self,
        world: InMemoryWorld,
        device: int,
        *,
        torch_device: torch.device | None = None,
        stream_ordered: bool = False,
    ) -> None:
        world._check_device(device, "InMemoryComm")
        self.world = world
        self._device = device
        self.torch_device = torch_device
        self.stream_ordered = stream_ordered
        self._handles: dict[tuple[int, ...], Group] = {}

    @property
    def device(self) -> int:
        return self._device

    def __repr__(self) -> str:
        return f"InMemoryComm(device={self._device}, world={self.world!r})"

    def group(self, devices: Sequence[int]) -> Group:
        key = tuple(devices)
        handle = self._handles.get(key)
        if handle is None:
            handle = self._handles[key] = self.world.group(key).handle(self._device)
        return handle

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> Work:
        self.world.send(t, self._device, dst, tag)
        return _DONE

    def recv(self, src: int, tag: int = 0) -> torch.Tensor:
        t = self.world.recv(src, self._device, tag)
        if self.torch_device is not None and t.device != self.torch_device:
            t = t.to(self.torch_device)
        return t
