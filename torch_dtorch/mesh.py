"""``DeviceMesh`` for the controller: an n-d array of device ids with named axes, and no process group.

The controller never joins a collective, so unlike ``torch.distributed.device_mesh.DeviceMesh`` this mesh is pure
metadata. Device ids are the workers' ranks (``0..N-1`` for a mesh built by :meth:`DeviceMesh.from_shape`); which
physical device a rank runs on is the runtime's business.

Sub-meshes (``mesh["tp"]``, ``mesh[("dp", "tp")]``) are *views*: a tensor placed on ``mesh["tp"]`` lives on every
device of the root mesh and is replicated over the axes that were not selected, exactly what SPMD code that calls
``distribute_tensor(x, mesh["tp"], ...)`` on every rank produces. :meth:`DeviceMesh.unbind` instead cuts the mesh
into disjoint meshes (pipeline stages).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from itertools import product

import torch

from torch_dtorch.errors import MeshError
from torch_dtorch.placement import Placement, Placements, Replicate, placements_str

__all__ = ["DeviceMesh", "current_mesh"]

_LOCAL = threading.local()


def current_mesh() -> DeviceMesh | None:
    """The innermost ``with mesh:`` of this thread, or ``None``."""
    stack: list[DeviceMesh] = getattr(_LOCAL, "stack", [])
    return stack[-1] if stack else None


def _no_rank(call: str) -> str:
    return (
        f"DeviceMesh.{call}: a single-controller program has no current rank — one process drives every device "
        "of the mesh. Code that asks for its rank is torchrun boilerplate: to draw a per-rank data batch, build "
        "the global batch and dt.distribute_tensor(x, mesh, [Shard(0), ...]) it; for rank-0-only logging, log "
        "once. Use mesh.coordinate_of(device) to find where a device sits"
    )


class DeviceMesh:
    """An n-d mesh of device ids with optional axis names.

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (the kind of device the workers run on).
        mesh: nested sequence or integer tensor of distinct device ids; its shape is the mesh shape.
        mesh_dim_names: one unique name per axis, or ``None``.
    """

    __slots__ = ("_device_type", "_mesh", "_names", "_root", "_root_axes", "_hash", "_shape", "_devices")

    def __init__(
        self,
        device_type: str,
        mesh: Sequence[object] | torch.Tensor,
        *,
        mesh_dim_names: Sequence[str] | None = None,
    ) -> None:
        ids = mesh.detach().to("cpu", torch.int64) if isinstance(mesh, torch.Tensor) else torch.tensor(mesh)
        if ids.dtype not in (torch.int64, torch.int32):
            raise MeshError(f"DeviceMesh: device ids must be integers, got a tensor of {ids.dtype}")
        ids = ids.to(torch.int64)
        if ids.ndim == 0 or ids.numel() == 0:
            raise MeshError(
                f"DeviceMesh: need at least one axis and one device, got mesh of shape {tuple(ids.shape)}"
            )
        flat = ids.flatten().tolist()
        if len(set(flat)) != len(flat):
            raise MeshError(f"DeviceMesh: device ids must be distinct, got {ids.tolist()}")
        if min(flat) < 0:
            raise MeshError(f"DeviceMesh: device ids must be >= 0, got {ids.tolist()}")
        names: tuple[str, ...] | None = None
        if mesh_dim_names is not None:
            names = tuple(mesh_dim_names)
            if len(names) != ids.ndim:
                raise MeshError(
                    f"DeviceMesh: mesh of shape {tuple(ids.shape)} has {ids.ndim} axes but got "
                    f"{len(names)} mesh_dim_names {names}"
                )
            if len(set(names)) != len(names):
                raise MeshError(f"DeviceMesh: mesh_dim_names must be unique, got {names}")
        self._device_type = str(device_type)
        self._mesh = ids
        self._names = names
        self._root: DeviceMesh = self
        self._root_axes: tuple[int, ...] = tuple(range(ids.ndim))
        self._hash: int | None = None
        # read on every op (rules, templates): kept as Python values rather than recomputed from the id tensor
        self._shape: tuple[int, ...] = tuple(ids.shape)
        self._devices: tuple[int, ...] = tuple(flat)

    # --- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_shape(
        cls, device_type: str, shape: Sequence[int] | int, *, mesh_dim_names: Sequence[str] | None = None
    ) -> DeviceMesh:
        """A mesh of devices ``0 .. prod(shape)-1`` laid out row-major."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not shape or any(s < 1 for s in shape):
            raise MeshError(f"DeviceMesh.from_shape: shape must be non-empty with sizes >= 1, got {shape}")
        n = 1
        for s in shape:
            n *= s
        return cls(device_type, torch.arange(n).reshape(shape), mesh_dim_names=mesh_dim_names)

    # --- basic properties ---------------------------------------------------------------------------------------
    @property
    def device_type(self) -> str:
        return self._device_type

    @property
    def mesh(self) -> torch.Tensor:
        """Device ids of this mesh; for a sub-mesh, the group that contains the root's first device."""
        return self._mesh

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self._names

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return self._mesh.ndim

    def size(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            return self._mesh.numel()
        return self.shape[self.axis_index(mesh_dim)]

    @property
    def root(self) -> DeviceMesh:
        """The mesh this one is a view of (itself unless built by ``mesh[...]``)."""
        return self._root

    @property
    def root_axes(self) -> tuple[int, ...]:
        """Which axes of :attr:`root` this mesh selects (all of them for a root mesh)."""
        return self._root_axes

    @property
    def is_submesh(self) -> bool:
        return self._root is not self

    @property
    def devices(self) -> list[int]:
        """Every device a tensor on this mesh lives on (for a sub-mesh: every device of the root), row-major."""
        return list(self._root._devices)

    @property
    def first_device(self) -> int:
        return self.devices[0]

    def axis_index(self, mesh_dim: int | str) -> int:
        """Position of an axis given by index or name (raises :class:`MeshError` naming the known axes)."""
        if isinstance(mesh_dim, str):
            if self._names is None or mesh_dim not in self._names:
                raise MeshError(
                    f"DeviceMesh: no axis named {mesh_dim!r}; this mesh has axes {self._names or '(unnamed)'}"
                )
            return self._names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise MeshError(f"DeviceMesh: axis {mesh_dim} out of range for a {self.ndim}-d mesh {self.shape}")
        return mesh_dim % self.ndim

    def axis_name(self, axis: int) -> str:
        return self._names[axis] if self._names is not None else str(axis)

    # --- coordinates and groups (root meshes) -------------------------------------------------------------------
    def coordinates(self) -> Iterator[tuple[int, tuple[int, ...]]]:
        """``(device, coordinate)`` for every device of the root mesh, row-major."""
        root = self._root._mesh
        for coord in product(*(range(s) for s in root.shape)):
            yield int(root[coord]), coord

    def coordinate_of(self, device: int) -> tuple[int, ...]:
        """Coordinate of ``device`` in the root mesh."""
        hits = (self._root._mesh == device).nonzero()
        if hits.numel() == 0:
            raise MeshError(f"DeviceMesh: device {device} is not in {self!r}")
        return tuple(int(i) for i in hits[0])

    def groups(self, axis: int | str) -> list[list[int]]:
        """Device groups along one axis of the root mesh: the ranks a collective over that axis spans."""
        root = self._root
        a = root.axis_index(axis) if self.is_submesh is False else self._root_axes[self.axis_index(axis)]
        moved = root._mesh.movedim(a, -1).reshape(-1, root.shape[a])
        return moved.tolist()

    # --- upstream's per-process queries: no current rank in a single-controller program -------------------------
    def get_rank(self) -> int:
        raise MeshError(_no_rank("get_rank()"))

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        raise MeshError(_no_rank("get_local_rank()"))

    def get_coordinate(self) -> list[int] | None:
        raise MeshError(_no_rank("get_coordinate()"))

    def get_group(self, mesh_dim: int | str | None = None) -> object:
        raise MeshError(
            "DeviceMesh.get_group(): the controller holds no process group (the workers do, one per mesh axis). "
            "Collectives happen through placements: redistribute a dtorch tensor (Partial -> Replicate is an "
            "all-reduce, Shard -> Replicate an all-gather) instead of calling torch.distributed on a group"
        )

    # --- sub-meshes and stages ----------------------------------------------------------------------------------
    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        if isinstance(names, str):
            names = (names,)
        names = tuple(names)
        if self._names is None:
            raise MeshError(
                "DeviceMesh: cannot index a mesh without mesh_dim_names; pass mesh_dim_names=(...)"
            )
        axes = tuple(self.axis_index(n) for n in names)
        if len(set(axes)) != len(axes):
            raise MeshError(f"DeviceMesh: repeated axis names in {names}")
        if axes == tuple(range(self.ndim)):
            return self
        root_axes = tuple(self._root_axes[a] for a in axes)
        root = self._root
        others = [a for a in range(root.ndim) if a not in root_axes]
        groups = root._mesh.permute(*others, *root_axes).reshape(-1, *(root.shape[a] for a in root_axes))
        sub = object.__new__(DeviceMesh)
        sub._device_type = root._device_type
        sub._mesh = groups[0].clone()
        sub._names = names
        sub._root = root
        sub._root_axes = root_axes
        sub._hash = None
        sub._shape = tuple(sub._mesh.shape)
        sub._devices = root._devices
        return sub

    def unbind(self, mesh_dim: int | str) -> list[DeviceMesh]:
        """Cut the mesh along one axis into disjoint meshes (pipeline stages).

        Each stage keeps the remaining axes and their names; unbinding the only axis gives 1-device meshes
        that keep the axis name.
        """
        if self.is_submesh:
            raise MeshError("DeviceMesh.unbind: unbind the root mesh, not a sub-mesh view")
        a = self.axis_index(mesh_dim)
        out = []
        for i in range(self.shape[a]):
            part = self._mesh.select(a, i)
            names = None if self._names is None else tuple(n for j, n in enumerate(self._names) if j != a)
            if part.ndim == 0:
                part = part.reshape(1)
                names = None if self._names is None else (self._names[a],)
            out.append(DeviceMesh(self._device_type, part, mesh_dim_names=names))
        return out

    # --- placements between a sub-mesh and its root -------------------------------------------------------------
    def to_root_placements(self, placements: Sequence[Placement]) -> Placements:
        """Placements of a tensor on this mesh, expressed on :attr:`root` (Replicate on unselected axes)."""
        if not self.is_submesh:
            return tuple(placements)
        out: list[Placement] = [Replicate()] * self._root.ndim
        for p, a in zip(placements, self._root_axes, strict=True):
            out[a] = p
        return tuple(out)

    def from_root_placements(self, placements: Sequence[Placement]) -> Placements | None:
        """Inverse of :meth:`to_root_placements`; ``None`` when an unselected axis is not Replicate."""
        if not self.is_submesh:
            return tuple(placements)
        for a, p in enumerate(placements):
            if a not in self._root_axes and type(p) is not Replicate:
                return None
        return tuple(placements[a] for a in self._root_axes)

    # --- default mesh ---------------------------------------------------------------------------------------------
    def __enter__(self) -> DeviceMesh:
        """``with mesh:`` makes this the thread's default mesh (factories with ``device="dtorch"`` bind to it)."""
        if not hasattr(_LOCAL, "stack"):
            _LOCAL.stack = []
        _LOCAL.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _LOCAL.stack.pop()

    # --- identity -----------------------------------------------------------------------------------------------
    def _key(self) -> tuple[object, ...]:
        root = self._root
        return (
            root._device_type,
            root._shape,
            root._devices,
            root._names,
            self._root_axes,
        )

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return isinstance(other, DeviceMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self._key())
        return self._hash

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self._names}" if self._names is not None else ""
        if self.is_submesh:
            return f"DeviceMesh({self._device_type!r}, {self._mesh.tolist()}{names}, view of {self._root!r})"
        return f"DeviceMesh({self._device_type!r}, {self._mesh.tolist()}{names})"

    def describe(self, placements: Sequence[Placement]) -> str:
        """``S(0)R on mesh(dp=2, tp=2)``: used in error messages."""
        axes = ", ".join(f"{self.axis_name(i)}={s}" for i, s in enumerate(self.shape))
        return f"{placements_str(placements)} on mesh({axes})"
