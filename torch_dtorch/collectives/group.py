"""The interfaces every collectives backend implements: :class:`Group` (one rank's handle on a group of ranks),
:class:`Comm` (one device's communicator: groups plus point-to-point) and :class:`Work`.

Semantics shared by every backend (the in-memory group and ``torch.distributed`` process groups):

- Ranks are positions in the group's device tuple; results are concatenated / chunked in rank order.
- Inputs are never modified; every result is a new tensor owned by the caller (no aliasing between ranks or with
  the input), on the input's device.
- Chunks follow ``torch.chunk`` (:func:`torch_dtorch.placement.chunk_size_and_offset`): uneven and empty chunks
  are allowed, and size-0 tensors go through every collective.
- ``avg`` is ``sum / size`` (floor division for integer dtypes), exactly like
  :func:`torch_dtorch.placement_rules.ranks.reduce_tensors`.
- Every member issues the same collectives in the same order (the workers run one ordered instruction stream);
  a call that waits longer than :func:`collective_timeout_s` raises
  :class:`~torch_dtorch.collectives.errors.CollectiveTimeout` instead of hanging.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "ENV_TIMEOUT",
    "REDUCE_OPS",
    "Comm",
    "DoneWork",
    "Group",
    "Work",
    "check_reduce_op",
    "collective_timeout_s",
]

#: reduce ops of ``all_reduce`` / ``reduce_scatter`` (the ``Partial`` ops of :mod:`torch_dtorch.placement`).
REDUCE_OPS = ("sum", "avg", "max", "min")

#: environment variable: seconds a collective or a receive may wait before raising ``CollectiveTimeout``.
ENV_TIMEOUT = "DTORCH_COLLECTIVE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0


def collective_timeout_s() -> float:
    """``DTORCH_COLLECTIVE_TIMEOUT_S`` (default 300 s), validated."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} must be > 0 seconds")
    return value


def check_reduce_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ValueError(f"unsupported reduce op {op!r}; use one of {REDUCE_OPS}")
    return op


@runtime_checkable
class Group(Protocol):
    """One rank's handle on a group of ranks. Every member must call the same collectives in the same order."""

    @property
    def rank(self) -> int:
        """This handle's position in :attr:`devices`."""
        ...

    @property
    def size(self) -> int: ...

    @property
    def devices(self) -> tuple[int, ...]:
        """Device ids of the members, in rank order."""
        ...

    def all_gather(self, t: torch.Tensor, dim: int, *, sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` in rank order. Sizes along ``dim`` may differ per rank
        (other dims must agree); ``sizes`` (every rank's size along ``dim``), when the caller knows them, saves
        backends a size exchange."""
        ...

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Elementwise reduction of every rank's ``t`` (equal shapes and dtypes), ``op`` in :data:`REDUCE_OPS`."""
        ...

    def reduce_scatter(self, t: torch.Tensor, op: str, dim: int) -> torch.Tensor:
        """This rank's ``torch.chunk`` chunk along ``dim`` of the reduction of every rank's ``t``."""
        ...

    def all_to_all(
        self, t: torch.Tensor, src_dim: int, dst_dim: int, *, src_sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Split ``t`` along ``dst_dim`` by the chunk rule (every rank must have the same size there), send chunk
        ``j`` to rank ``j``, and concatenate what arrives along ``src_dim`` in rank order. ``src_sizes`` (every
        rank's size along ``src_dim``), when known, saves backends a size exchange."""
        ...

    def broadcast(self, t: torch.Tensor | None, src: int) -> torch.Tensor:
        """Every rank gets a copy of rank ``src``'s ``t`` (other ranks may pass ``None``)."""
        ...

    def barrier(self) -> None: ...


class Work(Protocol):
    """Handle of an asynchronous operation."""

    def wait(self) -> None: ...


class DoneWork:
    """A :class:`Work` that has already completed."""

    __slots__ = ()

    def wait(self) -> None:
        return None


class Comm(Protocol):
    """One device's communicator: the groups it belongs to, and point-to-point transfers to other devices.

    ``send`` never waits for the receiver (it copies or starts an asynchronous send): call ``wait()`` on the
    returned :class:`Work` before mutating ``t``. Messages between one (source, destination, tag) are delivered in
    the order they were sent.
    """

    @property
    def device(self) -> int: ...

    def group(self, devices: Sequence[int]) -> Group:
        """This device's handle on the group of ``devices`` (in rank order; must contain :attr:`device`)."""
        ...

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> Work: ...

    def recv(self, src: int, tag: int = 0) -> torch.Tensor: ...
