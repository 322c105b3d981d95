"""In-place variants (``add_``, ``mul_``, ``copy_``, ``masked_fill_``, ...), derived from the functional rules.

An in-place op writes ``self``'s shards where they are: ``self`` is *pinned* (never redistributed) and only the
functional op's signatures whose output placement equals ``self``'s placement apply. Workers run the in-place
kernel on ``self``'s local tensor, so local views of it (``x[0]``, ``x.view(...)``) see the write exactly as in
torch. The output operand *is* ``self``'s operand. ``out=`` overloads are the functional op followed by an in-place
``copy_`` into each ``out`` tensor (done by the device layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from torch_dtorch.graph import OperatorCost, TensorMeta
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.rule import FunctionRule, OpRule, get_rule, iter_rules, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature

__all__ = [
    "InplaceRule",
    "functional_of_out",
    "functional_overload",
    "inplace_variant",
    "out_variants",
    "register_inplace_variants",
]


class InplaceRule(OpRule):
    """The rule of ``op_`` built from the rule of ``op``."""

    pinned_inputs = (0,)
    output_is_input = 0

    def __init__(self, functional: OpRule, functional_op: Any) -> None:
        self.functional = functional
        self.functional_op = functional_op
        self.family = functional.family
        self.stream = functional.stream

    def _as_functional(self, call: OpCall) -> OpCall:
        return replace(call, op=self.functional_op, _bound=None)

    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        sigs = self.functional.signatures(self._as_functional(call))
        return [s for s in sigs if len(s.outputs) == 1 and s.outputs[0] == s.inputs[0]]

    def check_inputs(self, call: OpCall) -> None:
        self.functional.check_inputs(self._as_functional(call))

    def infer_meta(self, call: OpCall) -> list[TensorMeta]:
        x = call.inputs[0]
        assert x is not None
        super().infer_meta(call)  # torch's own checks (broadcast into self, dtype casting rules)
        return [TensorMeta(x.shape, x.dtype, x.stride)]

    def localize(self, call: OpCall, ctx: LocalContext) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return self.functional.localize(self._as_functional(call), ctx)

    def cost(self, call: OpCall) -> OperatorCost:
        return self.functional.cost(self._as_functional(call))


def _non_out_args(op: Any) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in op._schema.arguments if not a.is_out]


#: in-place overloads named differently from their functional op's overload
_INPLACE_RENAMED = {"floor_divide.default": "Tensor"}


def inplace_variant(op: Any) -> Any | None:
    """``aten.add.Tensor`` -> ``aten.add_.Tensor`` (when it exists and mutates ``self``)."""
    if isinstance(op, str) or op.namespace != "aten":
        return None
    name = op._schema.name.split("::")[1]
    overload = _INPLACE_RENAMED.get(f"{name}.{op._overloadname}", op._overloadname)
    packet = getattr(torch.ops.aten, name + "_", None)
    if packet is None or overload not in packet.overloads():
        return None
    variant = getattr(packet, overload)
    args = variant._schema.arguments
    if not args or args[0].alias_info is None or not args[0].alias_info.is_write:
        return None
    if _non_out_args(variant) != _non_out_args(op):
        return None
    return variant


def out_variants(op: Any) -> list[Any]:
    """``out=`` overloads of the same packet whose non-out arguments equal ``op``'s."""
    if isinstance(op, str) or op.namespace != "aten":
        return []
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[1])
    want = _non_out_args(op)
    found = []
    for name in packet.overloads():
        cand = getattr(packet, name)
        if cand is op or not any(a.is_out for a in cand._schema.arguments):
            continue
        if _non_out_args(cand) == want:
            found.append(cand)
    return found


_OUT_TO_FUNCTIONAL: dict[Any, Any] = {}


def functional_overload(out_op: Any) -> Any | None:
    """The overload of ``out_op``'s packet without ``out=`` whose other arguments equal ``out_op``'s (``None``: not
    an ``out=`` overload, or no such functional overload)."""
    if isinstance(out_op, str) or not hasattr(out_op, "_schema"):
        return None
    if not any(a.is_out for a in out_op._schema.arguments):
        return None
    packet = getattr(getattr(torch.ops, out_op.namespace), out_op._schema.name.split("::")[1])
    want = _non_out_args(out_op)
    for name in packet.overloads():
        cand = getattr(packet, name)
        if not any(a.is_out for a in cand._schema.arguments) and _non_out_args(cand) == want:
            return cand
    return None


def _custom_kernel(rule: OpRule) -> bool:
    """Rules whose local kernel is not the op itself (global-count means, random draws) get no derived variant."""
    if isinstance(rule, FunctionRule):
        return rule._kernel is not None
    return type(rule).kernel is not OpRule.kernel


def functional_of_out(op: Any) -> Any | None:
    return _OUT_TO_FUNCTIONAL.get(op)


def register_inplace_variants() -> list[Any]:
    """Register ``op_`` for every functional rule that has one; index ``out=`` overloads. Returns new ops."""
    added = []
    for op, rule in list(iter_rules()):
        if isinstance(rule, InplaceRule):
            continue
        # out= is the functional op (any kernel) followed by copy_ into ``out``: every functional rule serves it
        for out in out_variants(op):
            _OUT_TO_FUNCTIONAL.setdefault(out, op)
        if rule.view_of is not None or _custom_kernel(rule):
            continue
        variant = inplace_variant(op)
        if variant is not None:
            try:
                get_rule(variant)
            except NotImplementedError:
                register_rule(variant, family=rule.family)(InplaceRule(rule, op))
                added.append(variant)
    return added
