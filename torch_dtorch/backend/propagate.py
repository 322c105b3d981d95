"""Placement propagation over a captured aten graph: the eager :class:`GraphConstructor` on a recording
:class:`LogicalGraph`, node by node — the same rules, the same matching, the same redistributes as eager mode."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from torch_dtorch._tree import any_leaf, map_only
from torch_dtorch.backend.graph_program import PY_TARGETS
from torch_dtorch.backend.local import ProgramSource
from torch_dtorch.backend.place import PLACE_AS_OP, PLACE_OP, place_as_target, place_target
from torch_dtorch.backend.place_grad import OutTarget, place_output
from torch_dtorch.config import RedistributePolicy
from torch_dtorch.errors import DTorchError
from torch_dtorch.executor.constructor import GraphConstructor
from torch_dtorch.graph import LogicalGraph, Operand, Operator
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placements, Replicate
from torch_dtorch.placement_rules.families.backward import MASKED_OUTPUT_OPS, present_outputs

__all__ = ["InputSpec", "Propagated", "UnsupportedGraphError", "propagate"]


class UnsupportedGraphError(DTorchError, NotImplementedError):
    """The captured graph holds something placement propagation cannot handle (symbolic shapes, higher-order
    ops, ...). The backend then runs that graph eagerly on dtorch tensors instead."""


@dataclass(frozen=True)
class InputSpec:
    """What propagation knows of one graph input: its metadata and layout."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: DeviceMesh | None
    placements: Placements


@dataclass
class Propagated:
    """The LogicalGraph of one captured graph under given input placements.

    ``inputs`` are the graph's input operands in placeholder order, then one per tensor constant and mesh it is
    used on (``constants`` holds their values, uploaded once per compiled variant to that operand's mesh);
    ``outputs`` holds, per graph output, an operand or a plain Python value (``None``, ints)."""

    graph: LogicalGraph
    mesh: DeviceMesh
    inputs: list[Operand]
    constants: list[torch.Tensor]
    outputs: list[Operand | Any]

    @property
    def operators(self) -> list[Operator]:
        return self.graph.operators

    def source(self) -> ProgramSource:
        """The part every worker needs to build its local program (what process mode ships)."""
        return ProgramSource(self.mesh, tuple(self.inputs), tuple(self.graph.operators), tuple(self.outputs))


_CONVERT_ELEMENT_TYPE = torch.ops.prims.convert_element_type.default
_PY_FUNCS = frozenset(PY_TARGETS.values())
#: size queries of a tensor: with symbolic sizes they compute ints from the (global) shape at propagation time
_SYM_QUERIES: dict[Any, Callable[..., int]] = {
    torch.ops.aten.sym_size.int: lambda x, d: x.shape[d],
    torch.ops.aten.sym_numel.default: lambda x: x.numel(),
}


def _check_static(node: fx.Node) -> None:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    for v in vals:
        if isinstance(v, torch.Tensor) and any(not isinstance(s, int) for s in v.shape):
            raise UnsupportedGraphError(
                f"{node.format_node()}: symbolic (dynamic) shape {tuple(v.shape)}; the dtorch backend compiles "
                "static shapes only — pass dynamic=False to torch.compile"
            )
        if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
            raise UnsupportedGraphError(
                f"{node.format_node()}: symbolic value {v}; pass dynamic=False to torch.compile"
            )


def _plain(v: Any) -> Any:
    """FX's immutable containers as plain lists/tuples/dicts (aten schemas reject ``immutable_list``)."""
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_plain(x) for x in v)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


class _Constant:
    """A tensor constant of the graph (``get_attr``), not yet bound to a mesh."""

    __slots__ = ("value", "tag")

    def __init__(self, value: torch.Tensor, tag: str) -> None:
        self.value = value
        self.tag = tag


def _foldable(target: Any, tree: Any) -> bool:
    """Whether a call computes on graph constants alone and may run once at compile time (a deterministic,
    non-mutating aten op): its result is a constant too, bound to a mesh where it is used."""
    if (
        not isinstance(target, torch._ops.OpOverload)
        or not any_leaf(_Constant, tree)
        or any_leaf(Operand, tree)
    ):
        return False
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags


def _fold(target: Any, args: Any, kwargs: Any) -> Any:
    args, kwargs = map_only(_Constant, lambda c: c.value, (args, kwargs))
    with torch.no_grad():
        out = target(*args, **kwargs)
    return map_only(torch.Tensor, lambda t: _Constant(t, f"constant {target}"), out)


def _int_arithmetic(target: Any, tree: Any) -> bool:
    """A Python function of plain numbers (``operator.add`` on sizes, ``torch.sym_max``...): computed directly."""
    return target in _PY_FUNCS and not any_leaf(Operand, tree)


def _first_mesh(tree: Any) -> DeviceMesh | None:
    """The mesh of the first operand in ``tree`` that has one."""
    found: list[DeviceMesh] = []

    def visit(x: Operand) -> Operand:
        if not found and x.mesh is not None:
            found.append(x.mesh)
        return x

    map_only(Operand, visit, tree)
    return found[0] if found else None


def _get_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _place(con: GraphConstructor, moved: dict[tuple[Any, ...], Operand], x: Any, *request: Any) -> Any:
    """``dtorch::place``: the redistribute the hook would have made for ``x``'s layout (each request once per
    operand: a tensor moved to a pipeline stage by several hooks is moved once)."""
    if not isinstance(x, Operand):
        raise UnsupportedGraphError(f"dtorch::place on {type(x).__name__}, expected a tensor operand")
    key = (x.id, *request)
    hit = moved.get(key)
    if hit is not None:
        return hit
    tgt = place_target(x.mesh, x.root_placements, x.ndim, *request)
    y = x if tgt is None else con.redistribute(x, tgt[1], device_mesh=tgt[0])
    moved[key] = y
    return y


def _place_as(con: GraphConstructor, g: Any, like: Any) -> Any:
    """``dtorch::place_as``: the gradient ``g`` moved to ``like``'s layout (``Partial`` there: ``Replicate``)."""
    if not isinstance(g, Operand) or not isinstance(like, Operand):
        raise UnsupportedGraphError("dtorch::place_as on a non-tensor, expected two tensor operands")
    tgt = place_as_target(g.mesh, g.root_placements, like.mesh, like.root_placements)
    return g if tgt is None else con.redistribute(g, tgt[1], device_mesh=tgt[0])


def propagate(
    gm: fx.GraphModule,
    inputs: Sequence[InputSpec | int],
    *,
    mesh: DeviceMesh,
    policy: RedistributePolicy | None = None,
    out_targets: Sequence[OutTarget | None] | None = None,
    symbolic: bool = False,
) -> Propagated:
    """Record ``gm`` on operands with the given input layouts; returns the LogicalGraph and its boundary.
    ``out_targets`` (a training backward graph, :mod:`~torch_dtorch.backend.place_grad`): the layout each output
    must end in, redistributed inside the program.

    ``symbolic``: ``gm`` has symbolic sizes (``dynamic=True``); it is recorded for one concrete call — tensor specs
    with that call's shapes, a plain ``int`` spec for each SymInt input — and size arithmetic (``sym_size``, Python
    operators on ints) is evaluated on the way (:mod:`~torch_dtorch.backend.symbolic` decides whether the
    placements found hold for every size). SymInt inputs get no input operand."""
    graph = LogicalGraph()
    con = GraphConstructor(graph, default_mesh=mesh, policy=policy)
    env: dict[fx.Node, Any] = {}
    in_operands: list[Operand] = []
    constants: list[torch.Tensor] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise ValueError(f"propagate: the graph has {len(placeholders)} inputs, {len(inputs)} specs given")
    outputs: list[Any] = []
    moved: dict[tuple[Any, ...], Operand] = {}
    bound: dict[tuple[int, int], Operand] = {}  # (constant, root mesh) -> its Replicate input operand there

    def bind(c: _Constant, where: DeviceMesh) -> Operand:
        """The constant's input operand on ``where`` (one per mesh it is used on, made at its first use there:
        a constant a later pipeline stage uses lives on that stage, like an eager 0-d tensor)."""
        key = (id(c), id(where.root))
        x = bound.get(key)
        if x is None:
            x = con.input(
                tuple(c.value.shape), where, [Replicate()] * where.ndim, dtype=c.value.dtype, tag=c.tag
            )
            bound[key] = x
            constants.append(c.value)
            in_operands.append(x)
        return x

    def bind_all(tree: Any, where: DeviceMesh | None) -> Any:
        target = where if where is not None else mesh
        return map_only(_Constant, lambda c: bind(c, target), tree)

    it = iter(inputs)
    for node in gm.graph.nodes:
        if not symbolic:
            _check_static(node)
        if node.op == "placeholder":
            spec = next(it)
            if not isinstance(spec, InputSpec):  # a SymInt input: its value at this call
                env[node] = spec
                continue
            x = con.input(spec.shape, spec.mesh, spec.placements, dtype=spec.dtype, tag=node.name)
            in_operands.append(x)
            env[node] = x
        elif node.op == "get_attr":
            value = _get_attr(gm, str(node.target))
            if isinstance(value, torch.Tensor):
                env[node] = _Constant(value.detach(), f"constant {node.target}")
            else:
                env[node] = value
        elif node.op == "call_function":
            args, kwargs = _plain(fx.node.map_arg((node.args, node.kwargs), env.__getitem__))
            if _foldable(node.target, (args, kwargs)):
                env[node] = _fold(node.target, args, kwargs)  # e.g. lift_fresh_copy: stays a constant
                continue
            args, kwargs = bind_all((args, kwargs), _first_mesh((args, kwargs)))
            if node.target is operator.getitem:
                env[node] = args[0][args[1]]
            elif symbolic and node.target in _SYM_QUERIES:
                env[node] = _SYM_QUERIES[node.target](*args, **kwargs)
            elif symbolic and _int_arithmetic(node.target, (args, kwargs)):
                env[node] = node.target(*args, **kwargs)
            elif node.target is PLACE_OP:
                env[node] = _place(con, moved, *args)
            elif node.target is PLACE_AS_OP:  # the backward of ``place`` (training)
                env[node] = _place_as(con, *args)
            elif node.target is _CONVERT_ELEMENT_TYPE:
                # inserted after tracing by torch's scalar tensorify pass: a float hyperparameter dynamo made
                # dynamic (a changed ``lr``) arrives as a 0-d float64 input and is cast before it meets a tensor
                env[node] = con.call(torch.ops.aten._to_copy.default, args[0], dtype=args[1])
            elif isinstance(node.target, torch._ops.OpOverload):
                out = con.call(node.target, *args, **kwargs)
                if (
                    node.target in MASKED_OUTPUT_OPS
                ):  # the operator holds the present outputs; getitem counts all
                    present = iter(out if isinstance(out, (list, tuple)) else [out])
                    out = tuple(
                        next(present) if p else None for p in present_outputs(node.target, args, kwargs)
                    )
                env[node] = out
            else:
                raise UnsupportedGraphError(
                    f"{node.format_node()}: {node.target} is not an aten overload (higher-order ops and Python "
                    "calls are not propagated); this graph runs eagerly on dtorch tensors"
                )
        elif node.op == "output":
            outs = bind_all(fx.node.map_arg(node.args[0], env.__getitem__), None)
            outputs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            if out_targets is not None and len(out_targets) == len(outputs):
                outputs = [place_output(con, y, t) for y, t in zip(outputs, out_targets, strict=True)]
        else:
            raise UnsupportedGraphError(f"{node.format_node()}: FX node kind {node.op!r} is not supported")
    return Propagated(graph, mesh, in_operands, constants, outputs)
