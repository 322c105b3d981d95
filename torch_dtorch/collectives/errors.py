"""Typed errors of the collectives layer (all are :class:`~torch_dtorch.errors.DTorchError`)."""

from __future__ import annotations

from collections.abc import Sequence

from torch_dtorch.errors import DTorchError

__all__ = [
    "CollectiveAborted",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "TensorStoreError",
    "TensorStoreTimeout",
]


class CollectiveError(DTorchError, RuntimeError):
    """A collective or point-to-point transfer failed (bad inputs, a broken group, a backend error)."""


class CollectiveMismatchError(CollectiveError, ValueError):
    """The ranks of a group issued different collectives at the same position, or gave inputs that do not fit
    together (different dtypes, shapes that differ outside the gathered dim, ...)."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective (or a receive) waited longer than its timeout: some rank never arrived.

    Attributes name the group's devices, the operation, and which devices had arrived.
    """

    def __init__(
        self,
        message: str,
        *,
        devices: Sequence[int] = (),
        op: str = "",
        arrived: Sequence[int] = (),
        timeout_s: float = 0.0,
    ) -> None:
        super().__init__(message)
        self.devices = tuple(devices)
        self.op = op
        self.arrived = tuple(arrived)
        self.missing = tuple(d for d in self.devices if d not in self.arrived)
        self.timeout_s = timeout_s

    def __reduce__(self) -> tuple[object, ...]:  # keep the keyword attributes through pickling
        return (_rebuild_timeout, (str(self), self.devices, self.op, self.arrived, self.timeout_s))


def _rebuild_timeout(
    message: str, devices: tuple[int, ...], op: str, arrived: tuple[int, ...], timeout_s: float
) -> CollectiveTimeout:
    return CollectiveTimeout(message, devices=devices, op=op, arrived=arrived, timeout_s=timeout_s)


class CollectiveAborted(CollectiveError):
    """The world (or group) was aborted while this call waited, or before it started (shutdown, a failed worker)."""


class TensorStoreError(DTorchError, RuntimeError):
    """A :class:`~torch_dtorch.collectives.store.TensorStore` operation failed (closed store, duplicate key)."""


class TensorStoreTimeout(TensorStoreError, TimeoutError):
    """A key did not appear in a :class:`~torch_dtorch.collectives.store.TensorStore` within the timeout."""
