"""Step types of a redistribute plan (see :mod:`torch_dtorch.placement_rules.redistribute.planner`).

Every step is a frozen dataclass carrying the **root** placements before and after it; an :class:`AxisStep` changes
exactly one mesh axis (checked at construction), a :class:`PointToPoint` moves local tensors between two meshes.
``str(step)`` is the short form used in printed plans and golden tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import product
from math import prod

from torch_dtorch.placement import (
    Partial,
    Placement,
    Placements,
    Replicate,
    Shard,
    chunk_size_and_offset,
    local_shape,
    placement_str,
    placements_str,
)

__all__ = [
    "AllGather",
    "AllReduce",
    "AllToAll",
    "AxisStep",
    "LocalSlice",
    "PointToPoint",
    "ReduceScatter",
    "Step",
    "ZeroFill",
    "commutes",
    "step_elements",
]

_LINEAR_OPS = frozenset({"sum", "avg"})


def commutes(op_a: str, op_b: str) -> bool:
    """Whether reducing over two mesh axes with these ops gives the same result in either order."""
    return op_a == op_b or (op_a in _LINEAR_OPS and op_b in _LINEAR_OPS)


def _same(p: Placement, q: Placement) -> bool:
    if isinstance(p, Partial) and isinstance(q, Partial):
        return p.reduce_op == q.reduce_op
    return p == q


@dataclass(frozen=True)
class Step:
    """Base of every plan step: root placements before and after the step."""

    placements_before: Placements = field(kw_only=True)
    placements_after: Placements = field(kw_only=True)

    @property
    def communicates(self) -> bool:
        """False for steps every rank runs alone (:class:`LocalSlice`, :class:`ZeroFill`)."""
        return True


@dataclass(frozen=True)
class AxisStep(Step):
    """A step over the device groups of one mesh axis (``axis`` of the root mesh)."""

    axis: int

    def transition(self) -> tuple[Placement, Placement]:
        """The placement of :attr:`axis` before and after this step."""
        raise NotImplementedError

    def __post_init__(self) -> None:
        before, after = self.placements_before, self.placements_after
        if len(before) != len(after) or not 0 <= self.axis < len(before):
            raise ValueError(
                f"{self}: placements {placements_str(before)} -> {placements_str(after)} do not fit axis {self.axis}"
            )
        others = [i for i, (b, a) in enumerate(zip(before, after)) if i != self.axis and not _same(b, a)]
        exp_before, exp_after = self.transition()
        if others or not _same(before[self.axis], exp_before) or not _same(after[self.axis], exp_after):
            raise ValueError(
                f"{self}: changes axis {self.axis} from {placement_str(exp_before)} to {placement_str(exp_after)} "
                f"and no other axis, but got {placements_str(before)} -> {placements_str(after)}"
            )


@dataclass(frozen=True)
class AllGather(AxisStep):
    """S(dim) -> R: concatenate the group's chunks along ``dim``."""

    dim: int

    def transition(self) -> tuple[Placement, Placement]:
        return Shard(self.dim), Replicate()

    def __str__(self) -> str:
        return f"all_gather(axis={self.axis}, dim={self.dim})"


@dataclass(frozen=True)
class AllReduce(AxisStep):
    """P(reduce_op) -> R: reduce the group's pieces."""

    reduce_op: str

    def transition(self) -> tuple[Placement, Placement]:
        return Partial(self.reduce_op), Replicate()

    def __str__(self) -> str:
        return f"all_reduce(axis={self.axis}, op={self.reduce_op})"


@dataclass(frozen=True)
class ReduceScatter(AxisStep):
    """P(reduce_op) -> S(dim): reduce the group's pieces, keep this rank's chunk of ``dim``."""

    reduce_op: str
    dim: int

    def transition(self) -> tuple[Placement, Placement]:
        return Partial(self.reduce_op), Shard(self.dim)

    def __str__(self) -> str:
        return f"reduce_scatter(axis={self.axis}, op={self.reduce_op}, dim={self.dim})"


@dataclass(frozen=True)
class AllToAll(AxisStep):
    """S(src_dim) -> S(dst_dim): rank ``k`` sends chunk ``m`` of ``dst_dim`` to rank ``m``; every rank concatenates
    what it receives along ``src_dim`` in rank order."""

    src_dim: int
    dst_dim: int

    def transition(self) -> tuple[Placement, Placement]:
        return Shard(self.src_dim), Shard(self.dst_dim)

    def __post_init__(self) -> None:
        if self.src_dim == self.dst_dim:
            raise ValueError(f"{self}: src_dim and dst_dim must differ")
        super().__post_init__()

    def __str__(self) -> str:
        return f"all_to_all(axis={self.axis}, {self.src_dim}->{self.dst_dim})"


@dataclass(frozen=True)
class LocalSlice(AxisStep):
    """R -> S(dim): keep this rank's chunk of ``dim`` (no communication)."""

    dim: int

    def transition(self) -> tuple[Placement, Placement]:
        return Replicate(), Shard(self.dim)

    @property
    def communicates(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"local_slice(axis={self.axis}, dim={self.dim})"


@dataclass(frozen=True)
class ZeroFill(AxisStep):
    """R -> P(reduce_op) (no communication): for ``sum`` the rank at index 0 of the axis keeps the value and the
    others hold zeros; for ``avg``/``max``/``min`` every rank keeps the value."""

    reduce_op: str

    def transition(self) -> tuple[Placement, Placement]:
        return Replicate(), Partial(self.reduce_op)

    @property
    def communicates(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"zero_fill(axis={self.axis}, op={self.reduce_op})"


@dataclass(frozen=True)
class PointToPoint(Step):
    """Copy local tensors from one mesh to another (pipeline stages).

    Devices are listed row-major over each root mesh; destination device ``dst_devices[i]`` receives the local
    tensor of ``src_devices[sources[i]]``. ``placements_before`` are on the source mesh, ``placements_after`` on
    the destination mesh.
    """

    src_devices: tuple[int, ...]
    dst_devices: tuple[int, ...]
    src_mesh_shape: tuple[int, ...]
    dst_mesh_shape: tuple[int, ...]
    sources: tuple[int, ...]

    def __post_init__(self) -> None:
        ok = (
            prod(self.src_mesh_shape) == len(self.src_devices)
            and prod(self.dst_mesh_shape) == len(self.dst_devices)
            and len(self.sources) == len(self.dst_devices)
            and all(0 <= s < len(self.src_devices) for s in self.sources)
            and len(self.placements_before) == len(self.src_mesh_shape)
            and len(self.placements_after) == len(self.dst_mesh_shape)
        )
        if not ok:
            raise ValueError(
                f"PointToPoint: inconsistent devices, mesh shapes, sources or placements in {self!r}"
            )

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """``(source device, destination device)`` of every copy."""
        return tuple((self.src_devices[s], d) for s, d in zip(self.sources, self.dst_devices))

    def __str__(self) -> str:
        return "p2p(" + ", ".join(f"{s}->{d}" for s, d in self.pairs) + ")"


# --- communication volume -----------------------------------------------------------------------------------------


def step_elements(step: Step, shape: Sequence[int], mesh_shape: Sequence[int]) -> Fraction:
    """Elements received by all devices together in ``step`` for a tensor of global ``shape`` (exact local shapes;
    ring algorithms for all-reduce / reduce-scatter / all-to-all). ``mesh_shape``: the root mesh the step runs on
    (ignored for :class:`PointToPoint`, which carries both)."""
    if isinstance(step, PointToPoint):
        src_coords = list(product(*(range(n) for n in step.src_mesh_shape)))
        total = 0
        for i, s in enumerate(step.sources):
            if step.src_devices[s] != step.dst_devices[i]:
                total += prod(local_shape(shape, step.src_mesh_shape, step.placements_before, src_coords[s]))
        return Fraction(total)
    if not isinstance(step, AxisStep) or not step.communicates:
        return Fraction(0)
    n = mesh_shape[step.axis]
    total_f = Fraction(0)
    for c in product(*(range(k) for k in mesh_shape)):
        before = local_shape(shape, mesh_shape, step.placements_before, c)
        num_before = prod(before)
        if isinstance(step, AllGather):
            total_f += prod(local_shape(shape, mesh_shape, step.placements_after, c)) - num_before
        elif isinstance(step, AllReduce):
            total_f += Fraction(2 * (n - 1) * num_before, n)
        elif isinstance(step, ReduceScatter):
            total_f += Fraction((n - 1) * num_before, n)
        elif isinstance(step, AllToAll):
            own = list(before)
            own[step.dst_dim] = chunk_size_and_offset(own[step.dst_dim], n, c[step.axis])[0]
            total_f += prod(local_shape(shape, mesh_shape, step.placements_after, c)) - prod(own)
    return total_f
