"""The public eager API: names follow ``torch.distributed.tensor`` where the concept exists there."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from torch_dtorch.device import autograd, transfer
from torch_dtorch.device.dispatch import controller_device, operand_of, wrap
from torch_dtorch.device.registration import ensure_registered
from torch_dtorch.device.state import get_session, shutdown
from torch_dtorch.device.state import start_session as _start_runtime
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.errors import DTorchError, PlacementError
from torch_dtorch.executor.future import TensorFuture
from torch_dtorch.mesh import DeviceMesh, current_mesh
from torch_dtorch.placement import Placement, Replicate, local_shape_and_offset, normalize_placements

if TYPE_CHECKING:
    from torch_dtorch.cluster.protocol import ClusterConfig

__all__ = [
    "distribute_tensor",
    "empty",
    "from_local",
    "full",
    "init_device_mesh",
    "ones",
    "rand",
    "randn",
    "redistribute",
    "redistribute_by_dict",
    "shutdown",
    "sync",
    "to_torch",
    "to_torch_async",
    "zeros",
]

aten = torch.ops.aten


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int] | int,
    *,
    mesh_dim_names: Sequence[str] | None = None,
    simulate: bool = False,
    mode: str | None = None,
    cluster: ClusterConfig | None = None,
) -> DeviceMesh:
    """A mesh of ``prod(mesh_shape)`` devices, starting (or reusing) one worker per device.

    ``"cpu"`` simulates any number of devices on the CPU; ``"cuda"`` uses one GPU per device, or with
    ``simulate=True`` runs every rank on ``cuda:0``. Calling it again (a notebook re-run) reuses a compatible pool
    or restarts it cleanly.

    ``mode``: ``"thread"`` (default; workers are threads of this process) or ``"process"`` (one worker process per
    device, local or remote: see ``docs/cluster.md``); default ``DTORCH_MODE``. ``cluster``: a
    :class:`~torch_dtorch.cluster.protocol.ClusterConfig` for process mode (default: the
    ``DTORCH_CLUSTER_*`` environment variables); giving one always starts a fresh pool.
    """
    ensure_registered()
    mesh = DeviceMesh.from_shape(device_type, mesh_shape, mesh_dim_names=mesh_dim_names)
    _start_runtime(device_type, mesh.size(), simulate=simulate, mode=mode, cluster=cluster)
    return mesh


def _require(t: Any, what: str) -> None:
    if not is_dtorch(t):
        kind = type(t).__name__ if not isinstance(t, torch.Tensor) else f"a {t.device} tensor"
        raise DTorchError(f"{what}: expected a dtorch tensor, got {kind}")


def _mesh_or_default(mesh: DeviceMesh | None, what: str) -> DeviceMesh:
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise DTorchError(f"{what}: no device_mesh given and no `with mesh:` is active")
    return mesh


def distribute_tensor(
    tensor: torch.Tensor, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None
) -> torch.Tensor:
    """Split a torch tensor over the mesh (each worker receives only its shard). Partial placements put the value
    on the first rank of each group and zeros elsewhere."""
    mesh = _mesh_or_default(device_mesh, "distribute_tensor")
    placements = placements if placements is not None else [Replicate()] * mesh.ndim
    pl = normalize_placements(placements, ndim=tensor.ndim, mesh_ndim=mesh.ndim, what="distribute_tensor")
    if is_dtorch(tensor):
        return autograd.redistribute(tensor, mesh, pl)
    return transfer.upload(tensor, mesh, pl, what="distribute_tensor")


def _global_shape(
    locals_: Mapping[int, torch.Tensor], mesh: DeviceMesh, pl: Sequence[Placement]
) -> tuple[int, ...]:
    root = mesh.root
    rp = mesh.to_root_placements(pl)
    coord_device = {c: d for d, c in root.coordinates()}
    first = locals_[root.first_device]
    shape = list(first.shape)

    def size(dim: int, axis: int, prefix: tuple[int, ...]) -> int:
        if axis == root.ndim:
            return int(locals_[coord_device[prefix]].shape[dim])
        if type(rp[axis]).__name__ == "Shard" and rp[axis].dim == dim:  # type: ignore[attr-defined]
            return sum(size(dim, axis + 1, (*prefix, i)) for i in range(root.shape[axis]))
        return size(dim, axis + 1, (*prefix, 0))

    for d in range(len(shape)):
        shape[d] = size(d, 0, ())
    return tuple(shape)


def from_local(
    local_tensors: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """A dtorch tensor from one local tensor per device (a list in the mesh's device order, or {device: tensor}).

    The global shape is inferred from the shards (uneven shards included) unless ``shape`` is given; every shard
    must have the shape the placements imply."""
    mesh = _mesh_or_default(device_mesh, "from_local")
    rt = get_session()
    devices = mesh.devices
    if isinstance(local_tensors, Mapping):
        locals_ = dict(local_tensors)
    else:
        if len(local_tensors) != len(devices):
            raise PlacementError(
                f"from_local: got {len(local_tensors)} local tensors for a mesh of {len(devices)} devices"
            )
        locals_ = dict(zip(devices, local_tensors, strict=True))
    missing = [d for d in devices if d not in locals_]
    if missing:
        raise PlacementError(f"from_local: no local tensor for devices {missing}")
    first = locals_[devices[0]]
    placements = placements if placements is not None else [Replicate()] * mesh.ndim
    pl = normalize_placements(placements, ndim=first.ndim, mesh_ndim=mesh.ndim, what="from_local")
    gshape = tuple(shape) if shape is not None else _global_shape(locals_, mesh, pl)
    root, rp = mesh.root, mesh.to_root_placements(pl)
    bad = []
    for d, c in root.coordinates():
        want = local_shape_and_offset(gshape, root.shape, rp, c)[0]
        if tuple(locals_[d].shape) != want or locals_[d].dtype != first.dtype:
            bad.append(f"device {d}: {locals_[d].dtype} {tuple(locals_[d].shape)} (expected {want})")
    if bad:
        raise PlacementError(
            f"from_local: shards do not form a {first.dtype} tensor of shape {gshape} with placements "
            f"{mesh.describe(pl)}:\n  " + "\n  ".join(bad)
        )
    operand = rt.executor.input(gshape, mesh, pl, dtype=first.dtype)
    rt.executor.upload_shards(operand, {d: t.detach() for d, t in locals_.items()})
    rt.last_mesh = mesh  # as after an op (see transfer.upload)
    return wrap(rt, operand)


def to_torch_async(t: torch.Tensor) -> TensorFuture:
    """Start fetching the global value; returns at once. ``get()/wait()/wait_for(ms)/is_ready()/await``."""
    _require(t, "to_torch_async")
    return transfer.fetch_async(t)


def to_torch(t: torch.Tensor) -> torch.Tensor:
    """The global value as a torch tensor on the controller (blocks; a sync point)."""
    return to_torch_async(t).get()


def redistribute(
    t: torch.Tensor, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None
) -> torch.Tensor:
    """The same value with other placements (or on another mesh: a pipeline stage move)."""
    _require(t, "redistribute")
    return autograd.redistribute(t, device_mesh, placements)


def redistribute_by_dict(t: torch.Tensor, placements: Mapping[str | int, Placement]) -> torch.Tensor:
    """Change the placements of the named mesh axes only: ``redistribute_by_dict(x, {"tp": Replicate()})``."""
    _require(t, "redistribute_by_dict")
    operand = operand_of(t)
    if operand.mesh is None:
        raise DTorchError("redistribute_by_dict: the tensor is not on a mesh yet")
    new = list(operand.placements)
    for axis, p in placements.items():
        new[operand.mesh.axis_index(axis)] = p
    return redistribute(t, operand.mesh, new)


def sync() -> None:
    """Wait until the workers have run everything issued so far (errors stay with their tensors)."""
    get_session().executor.sync()


def _factory(
    op: Any,
    size: list[int],
    *extra: Any,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
    dtype: torch.dtype | None,
    requires_grad: bool,
    what: str,
) -> torch.Tensor:
    """Every worker creates only its shard (random ops: the rank's slice of the global draw)."""
    mesh = _mesh_or_default(device_mesh, what)
    rt = get_session()
    placements = placements if placements is not None else [Replicate()] * mesh.ndim
    pl = normalize_placements(placements, ndim=len(size), mesh_ndim=mesh.ndim, what=what)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    out = rt.executor.call(op, size, *extra, device_mesh=mesh, placements=[pl], **kwargs)
    rt.last_mesh = mesh
    t = wrap(rt, out)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _size_args(size: tuple[Any, ...]) -> list[int]:
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        return list(size[0])
    return [int(s) for s in size]


def zeros(*size: Any, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
          dtype: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:  # fmt: skip
    """``torch.distributed.tensor.zeros``: each worker creates only its shard."""
    return _factory(aten.zeros.default, _size_args(size), device_mesh=device_mesh, placements=placements,
                    dtype=dtype, requires_grad=requires_grad, what="zeros")  # fmt: skip


def ones(*size: Any, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:  # fmt: skip
    return _factory(aten.ones.default, _size_args(size), device_mesh=device_mesh, placements=placements,
                    dtype=dtype, requires_grad=requires_grad, what="ones")  # fmt: skip


def empty(*size: Any, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
          dtype: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:  # fmt: skip
    return _factory(aten.empty.memory_format, _size_args(size), device_mesh=device_mesh, placements=placements,
                    dtype=dtype, requires_grad=requires_grad, what="empty")  # fmt: skip


def full(size: Sequence[int], fill_value: float, *, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None, dtype: torch.dtype | None = None,
         requires_grad: bool = False) -> torch.Tensor:  # fmt: skip
    return _factory(aten.full.default, list(size), fill_value, device_mesh=device_mesh, placements=placements,
                    dtype=dtype, requires_grad=requires_grad, what="full")  # fmt: skip


def _random(
    fn: Any, size: list[int], *, device_mesh: DeviceMesh | None, placements: Sequence[Placement] | None,
    dtype: torch.dtype | None, requires_grad: bool, what: str,
) -> torch.Tensor:  # fmt: skip
    """Drawn on the controller from torch's generator, then distributed: equals single-device torch under the same
    seed whatever the placements (O(global) on the controller, each worker receives only its shard)."""
    mesh = _mesh_or_default(device_mesh, what)
    value = fn(size, dtype=dtype, device=controller_device(get_session()))
    out = distribute_tensor(value, mesh, placements)
    if requires_grad:
        out.requires_grad_(True)
    return out


def rand(*size: Any, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:  # fmt: skip
    """Equals ``torch.rand`` under the same seed, whatever the placements."""
    return _random(torch.rand, _size_args(size), device_mesh=device_mesh, placements=placements, dtype=dtype,
                   requires_grad=requires_grad, what="rand")  # fmt: skip


def randn(*size: Any, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
          dtype: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:  # fmt: skip
    """Equals ``torch.randn`` under the same seed, whatever the placements."""
    return _random(torch.randn, _size_args(size), device_mesh=device_mesh, placements=placements, dtype=dtype,
                   requires_grad=requires_grad, what="randn")  # fmt: skip
