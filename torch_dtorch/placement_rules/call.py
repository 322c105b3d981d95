"""``OpCall``: one call of an op on operands, as the rules see it (metadata only)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torch_dtorch._tree import map_only
from torch_dtorch.errors import PlacementError
from torch_dtorch.graph import Operand, TensorMeta
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placements, Replicate, local_shape_and_offset

__all__ = [
    "LocalContext",
    "OpCall",
    "every_shard_nonempty",
    "map_operands",
    "tensor_slot_specs",
    "tensor_slot_types",
]

_TENSOR_TYPES = frozenset({"Tensor", "Optional[Tensor]"})
_TENSOR_LIST_TYPES = frozenset({"List[Tensor]", "List[Optional[Tensor]]"})


def tensor_slot_types() -> frozenset[str]:
    return _TENSOR_TYPES | _TENSOR_LIST_TYPES


def map_operands(tree: Any, fn: Callable[[Operand], Any]) -> Any:
    """Replace every :class:`Operand` leaf of ``tree`` (args, kwargs, nested lists) by ``fn(operand)``."""
    return map_only(Operand, fn, tree)


def _bind(op: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    schema = op._schema
    bound: dict[str, Any] = {}
    positional = [a for a in schema.arguments if not a.kwarg_only]
    for a, v in zip(positional, args, strict=False):
        bound[a.name] = v
    for a in schema.arguments:
        if a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.name not in bound and a.has_default_value():
            bound[a.name] = a.default_value
    return bound


_SLOT_SPECS: dict[Any, tuple[tuple[int | None, str, bool], ...]] = {}


def _tensor_slots(op: Any) -> tuple[tuple[int | None, str, bool], ...]:
    """Per op, once: (positional index or None, name, is a list) of every tensor argument, in schema order."""
    spec = _SLOT_SPECS.get(op)
    if spec is None:
        out = []
        pos = 0
        for a in op._schema.arguments:
            t = str(a.type)
            index = None if a.kwarg_only else pos
            if not a.kwarg_only:
                pos += 1
            if t in _TENSOR_TYPES:
                out.append((index, a.name, False))
            elif t in _TENSOR_LIST_TYPES:
                out.append((index, a.name, True))
        spec = _SLOT_SPECS[op] = tuple(out)
    return spec


tensor_slot_specs = _tensor_slots


@dataclass
class LocalContext:
    """What ``OpRule.localize`` knows about one rank: its coordinate and the local shapes in and out."""

    device: int
    coordinate: tuple[int, ...]
    in_shapes: list[tuple[int, ...] | None]
    out_shapes: list[tuple[int, ...]]
    out_offsets: list[tuple[int, ...]]
    #: the worker's communicator (``collectives.group.Comm``) for kernels that communicate (context-parallel
    #: attention); ``None`` in the plain-torch simulator
    comm: Any = None
    #: the call's number, equal on every rank of the call and different between calls (the eager operator's id; a
    #: compiled call's output id and step): kernels that communicate tag their messages with it (``device_comm``);
    #: ``None`` in the simulator
    seq: int | None = None
    #: where kernels create tensors that have no input to follow (a worker's ``cuda:i``; workers run without a
    #: default device); ``None``: torch's default device (the simulator, CPU workers)
    torch_device: torch.device | None = None


@dataclass(slots=True)
class OpCall:
    """An op applied to operands: the call structure, the flattened tensor slots and their placements.

    ``inputs`` are the tensor arguments in schema order (``Tensor[]`` arguments expanded, ``None`` for an absent
    optional tensor); ``placements`` are their placements on the call's root ``mesh`` (unbound operands count as
    Replicate). ``out_meta`` is filled by shape inference.
    """

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: list[Operand | None]
    mesh: DeviceMesh | None
    placements: list[Placements | None]
    out_meta: list[TensorMeta] = field(default_factory=list)
    _bound: dict[str, Any] | None = field(default=None, repr=False)
    #: per-device RNG draws of a random op (see ``placement_rules.creation``), shared by the ranks of one call
    random_draws: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def make(
        cls,
        op: Any,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any] | None = None,
        *,
        mesh: DeviceMesh | None = None,
    ) -> OpCall:
        kwargs = dict(kwargs or {})
        inputs = cls._flatten(op, args, kwargs)
        root = cls._resolve_mesh(op, inputs, mesh)
        placements: list[Placements | None] = []
        for x in inputs:
            if x is None:
                placements.append(None)
            elif x.mesh is None:
                placements.append((Replicate(),) * (root.ndim if root is not None else 0))
            else:
                placements.append(x.root_placements)
        return cls(op, tuple(args), kwargs, inputs, root, placements)

    @staticmethod
    def _flatten(op: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Operand | None]:
        schema = getattr(op, "_schema", None)
        if schema is None:
            leaves = pytree.tree_leaves((args, dict(kwargs)))
            return [x for x in leaves if isinstance(x, Operand)]
        slots: list[Operand | None] = []
        n = len(args)
        for pos, name, is_list in _tensor_slots(op):
            v = args[pos] if pos is not None and pos < n else kwargs.get(name)
            if not is_list:
                slots.append(v if isinstance(v, Operand) else None)
            elif v is not None:
                slots.extend(x if isinstance(x, Operand) else None for x in v)
        return slots

    @staticmethod
    def _resolve_mesh(op: Any, inputs: list[Operand | None], default: DeviceMesh | None) -> DeviceMesh | None:
        roots = {x.mesh.root for x in inputs if x is not None and x.mesh is not None}
        if len(roots) > 1:
            lines = "\n".join(f"    {x.describe()}" for x in inputs if x is not None)
            raise PlacementError(
                f"{op}: inputs live on different device meshes:\n{lines}\n"
                "  rule: every tensor input of one op must be on the same mesh (sub-mesh views of one mesh count "
                "as the same).\n  fix: move one input with x.redistribute(device_mesh=..., placements=...) first."
            )
        if roots:
            return roots.pop()
        return default.root if default is not None else None

    def with_inputs(self, new_inputs: list[Operand | None]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` with the tensor slots replaced, slot by slot (the same operand may fill two slots)."""
        it = iter(new_inputs)
        schema = getattr(self.op, "_schema", None)
        if schema is None:
            return pytree.tree_map_only(Operand, lambda _: next(it), (self.args, self.kwargs))
        positional = [a for a in schema.arguments if not a.kwarg_only]
        index = {a.name: i for i, a in enumerate(positional)}
        args = list(self.args)
        kwargs = dict(self.kwargs)
        for a in schema.arguments:
            t = str(a.type)
            if t not in _TENSOR_TYPES and t not in _TENSOR_LIST_TYPES:
                continue
            pos = index.get(a.name)
            in_args = pos is not None and pos < len(args)
            if not in_args and a.name not in kwargs:
                if t in _TENSOR_TYPES:
                    next(it)  # absent optional slot
                continue
            value = args[pos] if in_args and pos is not None else kwargs[a.name]
            if t in _TENSOR_TYPES:
                new = next(it)
                value = new if isinstance(value, Operand) else value
            elif value is not None:
                value = [next(it) if isinstance(v, Operand) else (next(it), v)[1] for v in value]
            if in_args and pos is not None:
                args[pos] = value
            else:
                kwargs[a.name] = value
        return tuple(args), kwargs

    def retarget(self, new_inputs: list[Operand | None], placements: list[Placements | None]) -> OpCall:
        """The same call on other operands (e.g. after redistributes), with their placements and this out_meta."""
        if new_inputs == self.inputs:
            args, kwargs = self.args, self.kwargs
        else:
            args, kwargs = self.with_inputs(new_inputs)
        return OpCall(self.op, args, kwargs, new_inputs, self.mesh, placements, self.out_meta)

    # --- argument access ----------------------------------------------------------------------------------------
    @property
    def bound(self) -> dict[str, Any]:
        """Arguments by schema name, defaults filled in."""
        if self._bound is None:
            self._bound = _bind(self.op, self.args, self.kwargs) if hasattr(self.op, "_schema") else {}
        return self._bound

    def arg(self, name: str, default: Any = None) -> Any:
        return self.bound.get(name, default)

    @property
    def mesh_ndim(self) -> int:
        return self.mesh.ndim if self.mesh is not None else 0

    @property
    def num_outputs(self) -> int:
        return len(self.out_meta)

    @property
    def out_ndim(self) -> int:
        return len(self.out_meta[0].shape)

    def present(self) -> list[Operand]:
        return [x for x in self.inputs if x is not None]

    def to_meta_args(self, *, contiguous: bool = False) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Args/kwargs with meta tensors in place of operands (and ``device='meta'``), for shape inference.

        ``contiguous=True`` ignores the operands' strides (dtorch tensors report contiguous strides to user code,
        so code may ``view`` what is strided underneath; view rules retry that way)."""

        def meta(o: Operand) -> torch.Tensor:
            if contiguous:
                return torch.empty(o.shape, dtype=o.dtype, device="meta")
            return torch.empty_strided(o.shape, o.stride or (), dtype=o.dtype, device="meta")

        args, kwargs = map_operands((self.args, self.kwargs), meta)
        schema_args = list(self.op._schema.arguments) if hasattr(self.op, "_schema") else []
        names = [a.name for a in schema_args]
        if "device" in names:  # never allocate (or draw random numbers) for real during shape inference
            pos = names.index("device")
            if pos < len(args) and not schema_args[pos].kwarg_only:
                args = (*args[:pos], torch.device("meta"), *args[pos + 1 :])
            else:
                kwargs = {**kwargs, "device": torch.device("meta")}
        kwargs.pop("pin_memory", None)
        return args, kwargs


def every_shard_nonempty(call: OpCall, slots: Sequence[int] | None = None) -> bool:
    """Every rank's shard of every input at ``slots`` (default: all; ``None`` inputs and 0-d ones skipped) holds at
    least one element, under the call's placements (a plan's calls: its input targets). Worth asking once per
    resolved call: it walks every coordinate of the mesh."""
    mesh = call.mesh
    if mesh is None:
        return False
    coords = list(product(*(range(n) for n in mesh.shape)))
    for k in range(len(call.inputs)) if slots is None else slots:
        x, pl = call.inputs[k], call.placements[k]
        if x is None or not x.ndim:
            continue
        if pl is None:
            return False
        for c in coords:
            shape, _ = local_shape_and_offset(x.shape, mesh.shape, pl, c)
            if 0 in shape:
                return False
    return True
