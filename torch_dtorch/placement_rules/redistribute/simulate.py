"""Plain-torch execution of redistribute plans on simulated shards: the reference the runtime is checked against.

Shards are ``{mesh coordinate: local tensor}`` over a root mesh (row-major coordinates, as in
:mod:`torch_dtorch.placement_rules.ranks`). Each step is executed per device group of its mesh axis, and every
rank's result is computed only from what the real collective delivers to it (its own tensor for local steps, the
group's tensors for collectives, the source rank's tensor for point-to-point), each rank getting its own copy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from itertools import product

import torch

from torch_dtorch.placement import chunk_size_and_offset, local_shape, placements_str
from torch_dtorch.placement_rules.ranks import reduce_tensors
from torch_dtorch.placement_rules.redistribute.planner import RedistributePlan
from torch_dtorch.placement_rules.redistribute.steps import (
    AllGather,
    AllReduce,
    AllToAll,
    AxisStep,
    LocalSlice,
    PointToPoint,
    ReduceScatter,
    Step,
    ZeroFill,
)

__all__ = ["apply_plan", "apply_step", "axis_groups", "chunk", "reduce_tensors"]

Coord = tuple[int, ...]
Shards = dict[Coord, torch.Tensor]


def _coords(mesh_shape: Sequence[int]) -> list[Coord]:
    return list(product(*(range(n) for n in mesh_shape)))


def axis_groups(mesh_shape: Sequence[int], axis: int) -> Iterator[list[Coord]]:
    """Coordinates of every device group along ``axis``, each ordered by its index on that axis."""
    for c in _coords(mesh_shape):
        if c[axis] == 0:
            yield [(*c[:axis], k, *c[axis + 1 :]) for k in range(mesh_shape[axis])]


def chunk(t: torch.Tensor, dim: int, num_chunks: int, index: int) -> torch.Tensor:
    """Chunk ``index`` of ``t`` split ``num_chunks`` ways along ``dim`` (``torch.chunk`` rule, empty chunks kept)."""
    size, start = chunk_size_and_offset(t.shape[dim], num_chunks, index)
    return t.narrow(dim, start, size)


def _collective(step: AxisStep, group: list[torch.Tensor]) -> list[torch.Tensor]:
    """Results of one device group (rank order) for a collective step."""
    n = len(group)
    if isinstance(step, AllGather):
        rest = {tuple(s for d, s in enumerate(t.shape) if d != step.dim) for t in group}
        if len(rest) != 1:
            raise ValueError(
                f"{step}: chunks differ outside dim {step.dim}: {[tuple(t.shape) for t in group]}"
            )
        full = torch.cat(group, dim=step.dim)
        return [full.clone() for _ in range(n)]
    if isinstance(step, AllReduce):
        total = reduce_tensors(group, step.reduce_op)
        return [total.clone() for _ in range(n)]
    if isinstance(step, ReduceScatter):
        return [reduce_tensors([chunk(t, step.dim, n, m) for t in group], step.reduce_op) for m in range(n)]
    if isinstance(step, AllToAll):
        sizes = {t.shape[step.dst_dim] for t in group}
        if len(sizes) != 1:
            raise ValueError(f"{step}: ranks disagree on the size of dim {step.dst_dim}: {sorted(sizes)}")
        sent = [
            [chunk(t, step.dst_dim, n, m) for m in range(n)] for t in group
        ]  # sent[k][m]: rank k -> rank m
        return [torch.cat([sent[k][m] for k in range(n)], dim=step.src_dim) for m in range(n)]
    raise TypeError(f"not a collective step: {step!r}")


def _local(step: AxisStep, t: torch.Tensor, index: int, n: int) -> torch.Tensor:
    if isinstance(step, LocalSlice):
        return chunk(t, step.dim, n, index).clone()
    if isinstance(step, ZeroFill):
        if step.reduce_op == "sum" and index != 0:
            return torch.zeros_like(t)
        return t.clone()
    raise TypeError(f"not a local step: {step!r}")


def apply_step(step: Step, shards: Mapping[Coord, torch.Tensor], mesh_shape: Sequence[int]) -> Shards:
    """Run one step on every rank's local tensor. ``mesh_shape``: the root mesh the shards live on (for a
    :class:`PointToPoint`, the step's own source/destination shapes are used and the result is keyed by
    destination coordinates)."""
    if isinstance(step, PointToPoint):
        src_coords, dst_coords = _coords(step.src_mesh_shape), _coords(step.dst_mesh_shape)
        return {dst_coords[i]: shards[src_coords[s]].clone() for i, s in enumerate(step.sources)}
    if not isinstance(step, AxisStep):
        raise TypeError(f"unknown plan step {step!r}")
    out: Shards = {}
    n = mesh_shape[step.axis]
    for group in axis_groups(mesh_shape, step.axis):
        if step.communicates:
            for c, t in zip(group, _collective(step, [shards[c] for c in group])):
                out[c] = t
        else:
            for c in group:
                out[c] = _local(step, shards[c], c[step.axis], n)
    return out


def _check(
    shards: Mapping[Coord, torch.Tensor], shape: Sequence[int], mesh_shape: Sequence[int], step: Step
) -> None:
    placements = step.placements_after
    expected = set(_coords(mesh_shape))
    if set(shards) != expected:
        raise AssertionError(
            f"after {step}: shards cover {sorted(shards)}, expected every coordinate of {mesh_shape}"
        )
    for c, t in shards.items():
        want = local_shape(shape, mesh_shape, placements, c)
        if tuple(t.shape) != want:
            raise AssertionError(
                f"after {step}: rank {c} holds shape {tuple(t.shape)}, {placements_str(placements)} "
                f"on mesh {tuple(mesh_shape)} needs {want}"
            )


def apply_plan(
    plan: RedistributePlan,
    shards: Mapping[Coord, torch.Tensor],
    shape: Sequence[int] | None = None,
    *,
    check: bool = True,
) -> Shards:
    """Run every step of ``plan`` on ``shards`` (keyed by coordinates of the source root mesh); returns the shards
    on the destination root mesh. With ``check``, every rank's local shape is compared with the placements after
    each step (and the input with the source placements)."""
    shape = plan.shape if shape is None else tuple(shape)
    mesh_shape = plan.src_mesh.root.shape
    cur: Shards = dict(shards)
    if check:
        expected = set(_coords(mesh_shape))
        if set(cur) != expected:
            raise AssertionError(
                f"input shards cover {sorted(cur)}, expected every coordinate of {mesh_shape}"
            )
        for c, t in cur.items():
            want = local_shape(shape, mesh_shape, plan.src_placements, c)
            if tuple(t.shape) != want:
                raise AssertionError(f"input rank {c} holds shape {tuple(t.shape)}, expected {want}")
    for step in plan.steps:
        cur = apply_step(step, cur, mesh_shape)
        if isinstance(step, PointToPoint):
            mesh_shape = step.dst_mesh_shape
        if check:
            _check(cur, shape, mesh_shape, step)
    return cur
