"""``.placements``, ``.device_mesh``, ``.redistribute()``, ``.full_tensor()``, ``.to_local(rank)`` on torch.Tensor,
and printing of dtorch tensors. On a tensor that is not on the ``dtorch`` device each raises a clear error."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch._compat import is_fake_tensor
from torch_dtorch.device import autograd
from torch_dtorch.device.autograd import full_tensor_with_grad
from torch_dtorch.device.dispatch import operand_of
from torch_dtorch.device.state import get_session
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.device.transfer import fetch
from torch_dtorch.errors import DTorchError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placement, Placements, Replicate, placements_str

__all__ = ["install_tensor_methods"]

_INSTALLED = False


def _need(t: torch.Tensor, what: str) -> None:
    if not is_dtorch(t):
        raise DTorchError(
            f"Tensor.{what} is only defined for dtorch tensors; this one is on {t.device}. Create distributed "
            "tensors with torch_dtorch.distribute_tensor(t, mesh, placements)."
        )


def _placements(self: torch.Tensor) -> Placements:
    _need(self, "placements")

    operand = operand_of(self)
    return operand.placements if operand.mesh is not None else (Replicate(),)


def _device_mesh(self: torch.Tensor) -> DeviceMesh | None:
    _need(self, "device_mesh")

    return operand_of(self).mesh


def _redistribute(
    self: torch.Tensor, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None
) -> torch.Tensor:
    _need(self, "redistribute")
    return autograd.redistribute(self, device_mesh, placements)


def _full_tensor(self: torch.Tensor) -> torch.Tensor:
    _need(self, "full_tensor")
    if self.requires_grad and torch.is_grad_enabled():  # differentiable, as upstream's DTensor.full_tensor
        return full_tensor_with_grad(self)
    return fetch(self)


def _to_local(self: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    """The shard device ``rank`` holds (a copy on the controller). ``rank`` may be omitted on a 1-device mesh."""
    _need(self, "to_local")

    rt = get_session()
    operand = operand_of(self, rt)
    if operand.mesh is None:
        return fetch(self)
    devices = operand.mesh.devices
    if rank is None:
        if len(devices) != 1:
            raise DTorchError(
                f"to_local: the tensor lives on {len(devices)} devices {devices}; say which shard: "
                "to_local(rank) (there is no 'current rank' in a single-controller program)"
            )
        rank = devices[0]
    if rank not in devices:
        raise DTorchError(f"to_local: device {rank} is not in the tensor's mesh {devices}")
    return rt.executor.fetch_local(operand, rank).get()


_ORIGINAL_REPR: Any = None


def _repr(self: torch.Tensor, *args: Any, **kwargs: Any) -> str:
    if not is_dtorch(self) or is_fake_tensor(self):  # a fake (tracing) tensor has no value to fetch
        return _ORIGINAL_REPR(self, *args, **kwargs)

    value = repr(fetch(self)).removeprefix("tensor(").removesuffix(")")
    try:
        pl = placements_str(_placements(self))
    except DTorchError as e:  # stale tensor
        return f"dtensor(<{e}>)"
    return f"dtensor({value}, device='dtorch', placements={pl})"


def install_tensor_methods() -> None:
    global _INSTALLED, _ORIGINAL_REPR
    if _INSTALLED:
        return
    torch.Tensor.placements = property(_placements)  # type: ignore[attr-defined]
    torch.Tensor.device_mesh = property(_device_mesh)  # type: ignore[attr-defined]
    torch.Tensor.redistribute = _redistribute  # type: ignore[attr-defined]
    torch.Tensor.full_tensor = _full_tensor  # type: ignore[attr-defined]
    torch.Tensor.to_local = _to_local  # type: ignore[attr-defined]
    _ORIGINAL_REPR = torch.Tensor.__repr__
    torch.Tensor.__repr__ = _repr  # type: ignore[method-assign,assignment]
    _INSTALLED = True
