"""One rank's execution of a :class:`~torch_dtorch.placement_rules.redistribute.planner.RedistributePlan` with real collectives.

Every device of the plan's meshes calls :func:`execute_plan` with its own local tensor; the steps run in order and
produce exactly the shards :func:`torch_dtorch.placement_rules.redistribute.simulate.apply_plan` computes (the property test in
``tests/collectives`` checks this with ``torch.equal``, uneven and empty shards, partials and cross-mesh plans
included).

- Axis steps run on the group of ``device`` along ``step.axis`` of the current root mesh (the source root mesh up
  to a :class:`PointToPoint`, the destination root mesh after it).
- :class:`LocalSlice` / :class:`ZeroFill` are local; for ``ZeroFill(sum)`` the rank at index 0 of the axis keeps
  the value and the others hold zeros.
- :class:`PointToPoint`: sources send (asynchronously), destinations receive; a device may be both. A device that
  is not in the destination mesh ends up with ``None``.

The result never aliases ``local``.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from torch_dtorch.collectives.errors import CollectiveError
from torch_dtorch.collectives.group import Comm, Work
from torch_dtorch.collectives.local import chunk
from torch_dtorch.errors import ShapeError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placements, local_shape, placements_str
from torch_dtorch.placement_rules.redistribute.planner import RedistributePlan
from torch_dtorch.placement_rules.redistribute.steps import (
    AllGather,
    AllReduce,
    AllToAll,
    AxisStep,
    LocalSlice,
    PointToPoint,
    ReduceScatter,
    ZeroFill,
)

__all__ = ["execute_plan"]

Coord = tuple[int, ...]


@lru_cache(maxsize=4096)
def _coordinate(mesh: DeviceMesh, device: int) -> Coord | None:
    """``device``'s coordinate in a root mesh, or ``None`` when it is not a member."""
    for d, c in mesh.coordinates():
        if d == device:
            return c
    return None


@lru_cache(maxsize=4096)
def _axis_group(mesh: DeviceMesh, axis: int, device: int) -> tuple[int, ...]:
    """Devices of ``device``'s group along ``axis`` of a root mesh, in rank order."""
    coord = _coordinate(mesh, device)
    assert coord is not None
    ids = mesh.mesh
    return tuple(int(ids[(*coord[:axis], k, *coord[axis + 1 :])]) for k in range(mesh.shape[axis]))


@lru_cache(maxsize=4096)
def _sizes_along(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: Placements,
    coord: Coord,
    axis: int,
    dim: int,
) -> tuple[int, ...]:
    """Size of tensor dim ``dim`` on every rank of ``coord``'s group along ``axis`` (rank order)."""
    out = []
    for k in range(mesh_shape[axis]):
        c = (*coord[:axis], k, *coord[axis + 1 :])
        out.append(local_shape(shape, mesh_shape, placements, c)[dim])
    return tuple(out)


def _axis_step(
    step: AxisStep, t: torch.Tensor, shape: tuple[int, ...], mesh: DeviceMesh, device: int, comm: Comm
) -> torch.Tensor:
    coord = _coordinate(mesh, device)
    assert coord is not None
    axis = step.axis
    n = mesh.shape[axis]
    index = coord[axis]
    if isinstance(step, LocalSlice):
        return chunk(t, step.dim, n, index).clone()
    if isinstance(step, ZeroFill):
        return torch.zeros_like(t) if step.reduce_op == "sum" and index != 0 else t.clone()
    group = comm.group(_axis_group(mesh, axis, device))
    if isinstance(step, AllGather):
        sizes = _sizes_along(shape, mesh.shape, step.placements_before, coord, axis, step.dim)
        return group.all_gather(t, step.dim, sizes=sizes)
    if isinstance(step, AllReduce):
        return group.all_reduce(t, step.reduce_op)
    if isinstance(step, ReduceScatter):
        return group.reduce_scatter(t, step.reduce_op, step.dim)
    if isinstance(step, AllToAll):
        src_sizes = _sizes_along(shape, mesh.shape, step.placements_before, coord, axis, step.src_dim)
        return group.all_to_all(t, step.src_dim, step.dst_dim, src_sizes=src_sizes)
    raise TypeError(f"execute_plan: unknown plan step {step!r}")


def _point_to_point(
    step: PointToPoint, t: torch.Tensor | None, device: int, comm: Comm, tag: int
) -> torch.Tensor | None:
    works: list[Work] = []
    if t is not None:
        for src, dst in step.pairs:
            if src == device and dst != device:
                works.append(comm.send(t, dst, tag))
    out: torch.Tensor | None = None
    for src, dst in step.pairs:
        if dst == device:
            if src == device:
                assert t is not None
                out = t.clone()
            else:
                out = comm.recv(src, tag)
    for w in works:
        w.wait()
    return out


def _check_local(
    what: str, t: torch.Tensor, plan: RedistributePlan, mesh: DeviceMesh, placements: Placements, coord: Coord
) -> None:
    want = local_shape(plan.shape, mesh.shape, placements, coord)
    if tuple(t.shape) != want:
        raise ShapeError(
            f"execute_plan: {what} on mesh coordinate {coord} has shape {tuple(t.shape)}, but a tensor of global "
            f"shape {list(plan.shape)} with placements {placements_str(placements)} on a mesh of {mesh.shape} "
            f"needs {want} there"
        )


def execute_plan(
    plan: RedistributePlan, local: torch.Tensor | None, *, device: int, comm: Comm, tag: int = 0
) -> torch.Tensor | None:
    """Run every step of ``plan`` for ``device``; every device of the plan's meshes must call it (in the same order
    relative to its other collectives).

    Args:
        plan: the plan (root placements on ``plan.src_mesh.root`` / ``plan.dst_mesh.root``).
        local: ``device``'s shard under the source placements, or ``None`` when ``device`` is not in the source
            mesh (a pipeline stage that only receives).
        device: the calling device id.
        comm: ``device``'s communicator (e.g. :class:`~torch_dtorch.collectives.memory.InMemoryComm`).
        tag: point-to-point tag (distinguishes concurrent plans between the same devices; messages with one tag
            arrive in order).

    Returns:
        ``device``'s shard under the destination placements (a new tensor), or ``None`` when ``device`` is not in
        the destination mesh.

    Raises:
        ShapeError: ``local`` does not have the shape the source placements give this device, or is ``None`` /
            not ``None`` against the device's membership of the source mesh.
        CollectiveError: a collective failed (``CollectiveTimeout``, ``CollectiveAborted``, ...).
    """
    if comm.device != device:
        raise CollectiveError(
            f"execute_plan: device {device} called with the communicator of device {comm.device}"
        )
    mesh = plan.src_mesh.root
    coord = _coordinate(mesh, device)
    if (coord is None) != (local is None):
        where = "is not" if coord is None else "is"
        raise ShapeError(
            f"execute_plan: device {device} {where} in the source mesh {mesh!r}, so it must pass "
            f"{'None' if coord is None else 'its local shard'} as local, got "
            f"{'None' if local is None else f'a tensor of shape {tuple(local.shape)}'}"
        )
    if local is not None and coord is not None:
        _check_local("the local input", local, plan, mesh, plan.src_placements, coord)
    if not plan.steps:
        return None if local is None else local.clone()
    cur = local
    for step in plan.steps:
        if isinstance(step, PointToPoint):
            cur = _point_to_point(step, cur, device, comm, tag)
            mesh = plan.dst_mesh.root
        elif not isinstance(step, AxisStep):
            raise TypeError(f"execute_plan: unknown plan step {step!r}")
        elif cur is not None:
            cur = _axis_step(step, cur, plan.shape, mesh, device, comm)
    coord = _coordinate(mesh, device)
    if cur is not None and coord is not None:
        _check_local("the result", cur, plan, mesh, plan.dst_placements, coord)
    return cur
