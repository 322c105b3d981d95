"""Values in and out of the dtorch device, and placement changes: the implementations behind
``dt.distribute_tensor`` / ``dt.to_torch`` / ``dt.redistribute`` (:mod:`torch_dtorch.api` validates and forwards)
and behind the tensor methods and dispatch paths that need them (``.to("cpu")``, ``full_tensor``, ``repr``, the
host fallbacks). Autograd-aware redistribution is :mod:`torch_dtorch.device.autograd`, built on :func:`move`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_dtorch.device import binding
from torch_dtorch.device.dispatch import operand_of, wrap
from torch_dtorch.device.state import get_session
from torch_dtorch.executor.future import TensorFuture
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placement, Replicate, normalize_placements

__all__ = ["fetch", "fetch_async", "move", "upload"]


def upload(
    tensor: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], *, what: str
) -> torch.Tensor:
    """A torch tensor (not a dtorch one) split over ``mesh``: each worker receives only its shard."""
    rt = get_session()
    pl = normalize_placements(placements, ndim=tensor.ndim, mesh_ndim=mesh.ndim, what=what)
    value = tensor.detach()
    operand = rt.executor.input(tuple(value.shape), mesh, pl, dtype=value.dtype)
    rt.executor.upload(operand, value)
    rt.last_mesh = mesh  # the mesh a factory made next (no mesh in sight) is bound to, as after an op
    out = wrap(rt, operand)
    if tensor.requires_grad:
        out.requires_grad_(True)
    return out


def fetch_async(t: torch.Tensor) -> TensorFuture:
    """Start fetching the global value of dtorch tensor ``t``; returns at once."""
    rt = get_session()
    operand = operand_of(t, rt)
    if operand.mesh is None:
        if binding.current_mesh() is None and rt.last_mesh is None:
            value = binding.host_value(operand)  # never bound to a mesh: its value is on the controller
            if value is not None:
                fut = TensorFuture(f"unbound {tuple(value.shape)}")
                fut.set_result(value.clone())
                return fut
        operand = binding.bind(rt, operand, binding.fallback_mesh(rt, "to_torch"))
    return rt.executor.fetch(operand)


def fetch(t: torch.Tensor) -> torch.Tensor:
    """The global value of dtorch tensor ``t`` on the controller (blocks; a sync point)."""
    return fetch_async(t).get()


def move(
    t: torch.Tensor, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None
) -> torch.Tensor:
    """``t`` with other placements (or on another mesh), not recorded by autograd."""
    rt = get_session()
    operand = operand_of(t, rt)
    if operand.mesh is None:
        operand = binding.bind(rt, operand, device_mesh or binding.fallback_mesh(rt, "redistribute"))
    mesh = device_mesh if device_mesh is not None else operand.mesh
    assert mesh is not None
    placements = placements if placements is not None else [Replicate()] * mesh.ndim
    # a new tensor (as upstream's DTensor.redistribute), not a copy standing in for ``t``: an in-place write through
    # a view of it lands in it (only writes meant for ``t`` that would land in such a copy are refused)
    return wrap(rt, rt.executor.redistribute(operand, placements, device_mesh=mesh, copy=False))
