"""``Operand``: the metadata of one distributed tensor value (no data lives on the controller)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placements, local_shape_and_offset, placements_str

if TYPE_CHECKING:
    from torch_dtorch.graph.operator import Operator

__all__ = ["Operand", "TensorMeta", "ViewInfo", "dtype_str", "contiguous_strides"]

_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def dtype_str(dtype: torch.dtype) -> str:
    return _DTYPE_SHORT.get(dtype, str(dtype).removeprefix("torch."))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (torch's: a dim of size 0 or 1 steps as if it were 1)."""
    strides: list[int] = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class TensorMeta:
    """Global shape, stride and dtype of a value, as shape inference produced it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...] | None = None

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        return cls(tuple(t.shape), t.dtype, tuple(t.stride()))


@dataclass(frozen=True)
class ViewInfo:
    """How a view operand was made from its base: the view op and its non-tensor arguments."""

    op: object
    args: tuple[object, ...]


@dataclass(eq=False, slots=True)
class Operand:
    """One distributed tensor value.

    ``mesh`` and ``placements`` are what the user sees (the mesh may be a sub-mesh view); ``mesh=None`` is an
    *unbound Replicate* operand that binds to the mesh of its first consumer. ``base``/``view`` record aliasing: a
    view operand knows the operand it views and how, so writes through it can land in the base.
    """

    id: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: DeviceMesh | None
    placements: Placements
    stride: tuple[int, ...] | None = None
    producer: Operator | None = field(default=None, repr=False)
    consumers: list[Operator] = field(default_factory=list, repr=False)
    base: Operand | None = field(default=None, repr=False)
    view: ViewInfo | None = None
    requires_grad: bool = False
    tag: str | None = None
    #: set on the output of a redistribute that stands in for its input (a moved op input, a view op's moved input):
    #: the operand it is a re-laid-out copy of (a write to it or its views does not reach the original); not on an
    #: explicit ``x.redistribute(...)``, a tensor of its own
    copy_of: Operand | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.stride is None:
            self.stride = contiguous_strides(self.shape)

    # --- identity & printing ------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return f"%{self.id}"

    def __str__(self) -> str:
        return self.name

    def type_str(self) -> str:
        """``f32[8, 16]``."""
        return f"{dtype_str(self.dtype)}[{', '.join(map(str, self.shape))}]"

    def describe(self) -> str:
        """``%3: f32[8, 16] S(0)R on mesh(dp=2, tp=2)`` — for error messages."""
        where = self.mesh.describe(self.placements) if self.mesh is not None else "unbound Replicate"
        return f"{self.name}: {self.type_str()} {where}"

    # --- sizes --------------------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize  # (== element_size() for every dtype; no meta tensor per call)

    def nbytes(self) -> int:
        return self.numel() * self.itemsize

    @property
    def root_placements(self) -> Placements:
        """Placements on the root mesh (sub-mesh views add Replicate on the axes they do not select)."""
        if self.mesh is None:
            return self.placements
        return self.mesh.to_root_placements(self.placements)

    @property
    def meta(self) -> TensorMeta:
        return TensorMeta(self.shape, self.dtype, self.stride)

    def local_shape_and_offset(self, device: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shape and global offset of the shard ``device`` holds (uneven shards follow torch.chunk)."""
        if self.mesh is None:
            return self.shape, (0,) * self.ndim
        root = self.mesh.root
        return local_shape_and_offset(
            self.shape, root.shape, self.root_placements, root.coordinate_of(device)
        )

    def local_shapes(self) -> dict[int, tuple[int, ...]]:
        if self.mesh is None:
            return {}
        root = self.mesh.root
        rp = self.root_placements
        return {d: local_shape_and_offset(self.shape, root.shape, rp, c)[0] for d, c in root.coordinates()}

    @property
    def placements_str(self) -> str:
        return placements_str(self.placements) if self.mesh is not None else "R?"

    @property
    def root_base(self) -> Operand:
        """The operand that owns the storage this one views (itself when not a view)."""
        op = self
        while op.base is not None:
            op = op.base
        return op
