"""Layout helpers shared by the parallel layers, the ParallelStyle adapter and the pipeline stages.

Every helper works on *one mesh axis* of a global-view dtorch tensor: the layers and styles of this package own one
axis (``tp``, ``cp``, ...) and leave the placements on every other axis (``dp`` batch sharding, ...) alone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torch_dtorch.api import distribute_tensor, from_local, redistribute
from torch_dtorch.backend.place import mesh_key, place
from torch_dtorch.device.dispatch import operand_of
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.errors import MeshError, PlacementError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import (
    Placement,
    Placements,
    Replicate,
    Shard,
    local_shape_and_offset,
    placement_str,
    placements_str,
)

__all__ = [
    "AxisRef",
    "describe",
    "distribute_param",
    "resolve_axis",
    "set_axis_placement",
    "shard_from_full",
]

log = logging.getLogger("torch_dtorch.nn")

_R = Replicate()


class AxisRef:
    """One axis of a root mesh, named by a (possibly sub-mesh view) mesh and an axis of it."""

    __slots__ = ("mesh", "root", "root_axis", "name", "mesh_key")

    def __init__(self, mesh: DeviceMesh, axis: int | str | None, *, what: str) -> None:
        if axis is None:
            if mesh.ndim != 1:
                names = mesh.mesh_dim_names
                if names is not None and "tp" in names:
                    axis = "tp"
                else:
                    raise MeshError(
                        f"{what}: the mesh {mesh!r} has {mesh.ndim} axes; pass a 1-d view (mesh['tp']) or name "
                        "the axis (tp_dim='tp')"
                    )
            else:
                axis = 0
        a = mesh.axis_index(axis)
        self.mesh = mesh
        self.root = mesh.root
        self.root_axis = mesh.root_axes[a]
        self.name = mesh.axis_name(a)
        #: names the root mesh inside compiled graphs (``dtorch::place``)
        self.mesh_key = mesh_key(self.root)

    @property
    def size(self) -> int:
        return self.root.shape[self.root_axis]

    def placements(self, p: Placement) -> Placements:
        """Root placements with ``p`` on this axis and Replicate elsewhere."""
        out: list[Placement] = [_R] * self.root.ndim
        out[self.root_axis] = p
        return tuple(out)

    def layout(self, p: Placement) -> tuple[DeviceMesh, list[Placement]]:
        """(mesh, placements) putting a tensor with ``p`` on this axis and Replicate elsewhere: on the 1-d view the
        layer was given (placements read like upstream's, ``(Shard(0),)``), else on the root mesh."""
        if self.mesh.ndim == 1:
            return self.mesh, [p]
        return self.root, list(self.placements(p))

    def __repr__(self) -> str:
        return f"axis {self.name!r} of {self.root!r}"


def resolve_axis(mesh: DeviceMesh, axis: int | str | None, *, what: str) -> AxisRef:
    return AxisRef(mesh, axis, what=what)


def describe(t: Any) -> str:
    """``f32[4, 7, 32] S(0)R on mesh(dp=2, tp=2)`` for error messages (any value)."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    shape = list(t.shape)
    dtype = str(t.dtype).removeprefix("torch.")
    if not is_dtorch(t):
        return f"{dtype}{shape} on {t.device}"
    op = operand_of(t)
    if op.mesh is None:
        return f"{dtype}{shape} (unbound Replicate)"
    return f"{dtype}{shape} {op.mesh.describe(op.placements)}"


def _normalize(p: Placement, ndim: int, what: str) -> Placement:
    if type(p) is Shard and p.dim < 0:
        if -p.dim > ndim:
            raise PlacementError(f"{what}: {p} is out of range for a {ndim}-d tensor")
        return Shard(p.dim + ndim)
    return p


def current_axis_placement(t: torch.Tensor, ax: AxisRef) -> Placement:
    op = operand_of(t)
    if op.mesh is None:
        return _R
    return op.root_placements[ax.root_axis]


def set_axis_placement(
    t: Any,
    ax: AxisRef,
    placement: Placement | None,
    *,
    what: str,
    declared: Placement | None = None,
    strict: bool = False,
) -> Any:
    """``t`` with ``placement`` on axis ``ax`` (other axes unchanged); non-tensors pass through.

    A torch tensor that is not on the dtorch device is distributed first: Replicate everywhere except ``declared``
    (the layout the caller says it has, default Replicate) on ``ax``. An unbound dtorch tensor binds to the mesh.
    ``strict=True`` raises :class:`PlacementError` instead of redistributing a tensor that has another placement.
    """
    if placement is None or not isinstance(t, torch.Tensor):
        return t
    if torch.compiler.is_compiling() and is_dtorch(t):
        # placements are unknown while dynamo traces: propagation resolves the request (backend/place.py)
        return place(t, ax.mesh_key, ax.root_axis, placement_str(placement), strict=strict, what=what)
    want = _normalize(placement, t.ndim, what)
    if not is_dtorch(t):
        decl = _normalize(declared if declared is not None else _R, t.ndim, what)
        return distribute_tensor(t, ax.root, ax.placements(decl))
    op = operand_of(t)
    if op.mesh is None:
        t = redistribute(t, ax.root, [_R] * ax.root.ndim)
        op = operand_of(t)
    assert op.mesh is not None
    if op.mesh.root != ax.root:
        raise PlacementError(
            f"{what}: input {describe(t)} lives on another mesh than the layer ({ax!r}).\n"
            "  fix: move it with x.redistribute(device_mesh=..., placements=...) (pipeline stages do this "
            "automatically when the layer belongs to a stage built by dt.nn.pipeline)"
        )
    cur = op.root_placements
    if cur[ax.root_axis] == want:
        return t
    if strict:
        raise PlacementError(
            f"{what}: input {describe(t)} has {placements_str((cur[ax.root_axis],))} on mesh axis "
            f"{ax.name!r}, the layer needs {placements_str((want,))}.\n"
            f"  fix: redistribute the input first, or build the layer with strict=False to convert it "
            "automatically"
        )
    new = list(cur)
    new[ax.root_axis] = want
    log.debug("%s: %s -> %s on axis %s", what, placements_str(cur), placements_str(new), ax.name)
    return redistribute(t, op.mesh.root, new)


def shard_from_full(value: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """Distribute ``value`` by slicing one shard per device (narrowed views: a memory-mapped state-dict tensor is
    read shard by shard; no device receives more than its shard)."""
    root = mesh.root
    rp = mesh.to_root_placements(list(placements))
    value = value.detach()
    shards: dict[int, torch.Tensor] = {}
    for d, c in root.coordinates():
        shape, offset = local_shape_and_offset(tuple(value.shape), root.shape, rp, c)
        s = value
        for dim, (n, o) in enumerate(zip(shape, offset, strict=True)):
            if n != value.shape[dim]:
                s = s.narrow(dim, min(o, value.shape[dim]), n)
        shards[d] = s
    return from_local(shards, mesh, list(placements), shape=tuple(value.shape))


def distribute_param(
    value: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    name: str,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> torch.nn.Parameter | torch.Tensor:
    """A parameter or buffer placed on ``mesh``: from ``state_dict[name]`` when given (required for meta tensors),
    else from its own value (a CPU tensor is sliced per shard; a dtorch tensor is redistributed)."""
    source: torch.Tensor = value
    if state_dict is not None and name in state_dict:
        source = state_dict[name]
        if tuple(source.shape) != tuple(value.shape):
            raise PlacementError(
                f"parallelize_module: state_dict[{name!r}] has shape {tuple(source.shape)}, the module's "
                f"{name} has {tuple(value.shape)}"
            )
        source = (
            source.to(value.dtype) if value.dtype != source.dtype and value.is_floating_point() else source
        )
    elif value.device.type == "meta":
        raise PlacementError(
            f"parallelize_module: {name} ({tuple(value.shape)}) is on the meta device and state_dict has no "
            f"entry {name!r}.\n  fix: pass state_dict= with every parameter and buffer (non-persistent buffers "
            "included), or build the model under dt.nn.init_empty_weights(), which keeps buffers real"
        )
    pl = tuple(placements)
    if is_dtorch(source):
        out = redistribute(source, mesh, list(pl))
    else:
        out = shard_from_full(source, mesh, pl)
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=value.requires_grad)
    return out
