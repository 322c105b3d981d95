"""List rules for the ``_foreach_*`` ops (what ``torch.optim`` runs with ``foreach=True``, and ``clip_grad_norm_``).

A list op applies one pointwise op to every element of its tensor lists: ``_foreach_add_(params, grads, alpha=-lr)``
is ``params[i].add_(grads[i], alpha=-lr)`` for every ``i``. Its rule is a **list rule**: every element keeps its own
placements (a ``Shard(0)`` weight next to a replicated bias), so one operator runs the whole list on each worker
and nothing is gathered. On one mesh axis, element ``i`` takes the placement ``p_i`` of its *lead* tensor:

- in place (``_foreach_mul_``): ``p_i`` is ``self[i]``'s placement, which is pinned (written where it is);
- out of place: the first ``Shard`` among the element's tensors of the output's shape, else ``Partial`` when every
  one is the same ``Partial`` and the op is linear (below), else ``Replicate``;

and every other tensor of element ``i`` is moved to ``p_i`` (a broadcast operand to ``Replicate`` along a dim it
broadcasts, or to the matching ``Shard`` of its own dims). A ``Partial`` lead stays ``Partial`` only for the ops
that are linear in their tensors (``mul``/``div`` by scalars, ``neg``, ``zero``, ``add``/``sub``/``lerp`` with
every list ``Partial`` alike, ``copy``, ``clone``): the other tensors become that ``Partial`` too (a ``Replicate``
one by a zero-fill); a single shared tensor argument (the 0-dim ``other`` of ``_foreach_mul_.Tensor``) is always
``Replicate``. An in-place op on a ``Partial`` element that is not linear, or lists spanning several meshes, run op
by op instead: torch's own per-tensor kernel (``OpRule.op_by_op_fallback``), correct and slower.

Plans do not depend on the scalars (an optimizer's per-parameter step sizes change every step), so a list op with
the same tensors' layouts plans once (``constants_key``): an AdamW step over 200 parameters is ~10 operators.

Not ruled (per-tensor fallback): the reductions ``_foreach_norm``, ``_foreach_max``, ``_foreach_powsum``, the
``_foreach_mm`` matmul, and ``_foreach_addcmul``/``_foreach_addcdiv`` with a 1-D CPU ``Tensor`` of scalars.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.errors import PlacementMismatchError
from torch_dtorch.graph import TensorMeta
from torch_dtorch.placement import Placement, Replicate, Shard, is_partial, placements_str
from torch_dtorch.placement_rules.call import LocalContext, OpCall, tensor_slot_specs
from torch_dtorch.placement_rules.rule import OpRule, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature

__all__ = ["ForeachRule", "FOREACH_OPS"]

aten = torch.ops.aten
_R = Replicate()

UNARY = (
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1", "floor", "frac", "lgamma",
    "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt",
    "tan", "tanh", "trunc", "zero",
)  # fmt: skip
BINARY = ("add", "sub", "mul", "div", "maximum", "minimum", "clamp_min", "clamp_max", "pow", "copy")
TERNARY = ("addcmul", "addcdiv", "lerp")
OUT_OF_PLACE_ONLY = ("clone",)

#: (name, overload) pairs left to the per-tensor fallback: a 1-D CPU tensor of scalars is not a dtorch operand
_SKIPPED = {("addcmul", "Tensor"), ("addcdiv", "Tensor")}

#: overloads linear in their tensor lists: a ``Partial`` lead stays ``Partial`` (the others join it)
_LINEAR = {
    **{(n, o): "all" for n in ("add", "sub") for o in ("List",)},
    **{(n, o): "all" for n in ("lerp",) for o in ("Scalar", "ScalarList")},
    **{(n, o): "lead" for n in ("mul", "div") for o in ("Scalar", "ScalarList", "Tensor")},
    ("neg", "default"): "lead",
    ("zero", "default"): "lead",
    ("copy", "default"): "src",
    ("clone", "default"): "lead",
}


def _overloads(name: str, *, in_place: bool) -> list[Any]:
    packet = getattr(aten, f"_foreach_{name}{'_' if in_place else ''}", None)
    if packet is None:  # an older torch without this op
        return []
    out = []
    for overload in packet.overloads():
        op = getattr(packet, overload)
        if any(a.is_out for a in op._schema.arguments) or (name, overload) in _SKIPPED:
            continue
        out.append(op)
    return out


class ForeachRule(OpRule):
    """The list rule of one ``_foreach_*`` overload (see the module docstring)."""

    family = "foreach"
    op_by_op_fallback = True
    plan_ignores_scalars = True  # (constants_key below)
    auto_replicate = False  # every element has its own target: never gather the whole list

    def __init__(self, name: str, overload: str, *, in_place: bool) -> None:
        self.name = name
        self.linear = _LINEAR.get((name, overload))
        self.writes_inputs = in_place
        self.pinned_inputs = (0,) if in_place else ()

    # --- the structure of one call ------------------------------------------------------------------------------
    @staticmethod
    def _elements(call: OpCall) -> tuple[int, list[int | None]]:
        """The list length and, per tensor slot, the element index it belongs to (``None``: a shared tensor)."""
        n = 0
        elements: list[int | None] = []
        nargs = len(call.args)
        for pos, name, is_list in tensor_slot_specs(call.op):
            v = call.args[pos] if pos is not None and pos < nargs else call.kwargs.get(name)
            if not is_list:
                elements.append(None)
            elif v is not None:
                n = max(n, len(v))
                elements.extend(range(len(v)))
        return n, elements

    def pinned_for(self, call: OpCall) -> Sequence[int]:
        return range(self._elements(call)[0]) if self.writes_inputs else ()

    def constants_key(self, call: OpCall) -> Any:
        return None  # the plan depends on the tensors' layouts (the cache's slots) only, never on the scalars

    # --- hooks ------------------------------------------------------------------------------------------------
    def infer_meta(self, call: OpCall) -> list[TensorMeta]:
        metas = super().infer_meta(call)  # torch's own checks (list lengths, shapes, dtypes)
        if not self.writes_inputs:
            return metas
        n = self._elements(call)[0]
        written = call.inputs[:n]
        return [TensorMeta(x.shape, x.dtype, x.stride) for x in written if x is not None]

    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        """One signature per mesh axis: every element in its lead's placement (the module docstring)."""
        n, elements = self._elements(call)
        by_element: list[list[int]] = [[] for _ in range(n)]
        for slot, e in enumerate(elements):
            if e is not None:
                by_element[e].append(slot)
        sigs = []
        for axis in range(call.mesh_ndim):
            ins: list[Placement] = [_R] * len(call.inputs)
            outs: list[Placement] = []
            for e, slots in enumerate(by_element):
                shape = call.out_meta[e].shape
                lead = self._lead(call, axis, slots, shape)
                for slot in slots:
                    x = call.inputs[slot]
                    if x is not None:
                        ins[slot] = _adapt(lead, shape, x.shape)
                outs.append(lead)
            sigs.append(PlacementSignature(tuple(ins), tuple(outs)))
        return _dedupe(sigs)

    def _lead(self, call: OpCall, axis: int, slots: list[int], shape: tuple[int, ...]) -> Placement:
        current = [(call.placements[s] or ())[axis] for s in slots if call.inputs[s] is not None]
        if self.writes_inputs:
            lead = current[0]
            if is_partial(lead) and not self._keeps_partial(lead, current):
                x = call.inputs[slots[0]]
                assert x is not None
                raise PlacementMismatchError(
                    call.op,
                    arguments=[
                        f"self element {x.type_str()} {placements_str(call.placements[slots[0]] or ())}"
                    ],
                    axis=axis,
                    signatures=[],
                    reason=f"{self.name} in place on a Partial element is not linear in it",
                    fix="reduce the tensor first (t.redistribute(..., [Replicate()])); runs op by op meanwhile",
                )
            return lead
        same_shape = [
            p
            for s, p in zip(slots, current)
            if (x := call.inputs[s]) is not None and tuple(x.shape) == tuple(shape)
        ]
        for p in same_shape:
            if type(p) is Shard:
                return p
        if current and is_partial(current[0]) and self._keeps_partial(current[0], current):
            return current[0]
        return _R

    def _keeps_partial(self, lead: Placement, current: list[Placement]) -> bool:
        if self.linear == "lead" or self.linear == "src":
            return len(current) == 1 or self.linear == "src" or all(p == lead for p in current)
        if self.linear == "all":
            return all(p == lead or type(p) is Replicate for p in current)
        return False

    def may_run_op_as_is(self, op: Any) -> bool:
        return not self.writes_inputs and "kernel" not in vars(self)

    def runs_op_as_is(self, call: OpCall, ctx: LocalContext) -> bool:
        """Out of place, the kernel is the op itself (workers replay it); in place it returns the written list."""
        return self.may_run_op_as_is(call.op)

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = call.op(*args, **kwargs)
        if self.writes_inputs:  # the op returns nothing: its outputs are the written shards
            return list(args[0] if args else kwargs["self"])
        return out


def _adapt(lead: Placement, out_shape: Sequence[int], shape: Sequence[int]) -> Placement:
    """The placement of a tensor of ``shape`` that broadcasts against an element of ``out_shape`` placed ``lead``."""
    if type(lead) is not Shard or tuple(shape) == tuple(out_shape):
        return lead
    d = lead.dim - (len(out_shape) - len(shape))
    if d < 0 or shape[d] == 1:
        return _R  # the tensor broadcasts along the sharded dim
    return Shard(d)


def _dedupe(sigs: list[PlacementSignature]) -> list[PlacementSignature]:
    """The per-axis signatures as a list the matcher tries on every axis (the exact one for each axis matches)."""
    seen: dict[PlacementSignature, None] = {}
    for s in sigs:
        seen.setdefault(s, None)
    return list(seen)


def _register() -> list[Any]:
    ops: list[Any] = []
    for names, in_place_too in ((UNARY, True), (BINARY, True), (TERNARY, True), (OUT_OF_PLACE_ONLY, False)):
        for name in names:
            for in_place in (False, True) if in_place_too else (False,):
                for op in _overloads(name, in_place=in_place):
                    register_rule(op, family="foreach")(
                        ForeachRule(name, op._overloadname, in_place=in_place)
                    )
                    ops.append(op)
    return ops


FOREACH_OPS: tuple[Any, ...] = tuple(_register())
