"""Loss family: elementwise losses with a ``reduction`` (``huber_loss``).

Signatures (one mesh axis), for the loss of ``self`` and ``target`` broadcast together:

- ``reduction='none'``: an elementwise binary op: for every output dim ``d``, each input that has the aligned dim at
  full size is ``S(aligned)``, a broadcast one ``R`` -> ``S(d)``.
- ``reduction='sum'`` / ``'mean'`` (a 0-d output): the same input placements -> ``P(sum)``. Each rank sums the loss
  of its block; for ``mean`` it divides that sum by the GLOBAL element count, so uneven and empty shards are exact.
  A rank holding every element (all inputs ``R``) runs the op unchanged (bit-identical to torch).
- No Partial inputs: the losses are not linear.

The reduction argument is the enum of ``torch.nn._reduction`` (0: none, 1: mean, 2: sum).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.placement import Partial
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.families.pointwise import broadcast_shard_signatures
from torch_dtorch.placement_rules.rule import OpRule, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["ElementwiseLossRule"]

aten = torch.ops.aten

REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2


def _broadcast_shape(shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*(torch.Size(s) for s in shapes)))


def _with_reduction(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], reduction: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with its ``reduction`` argument replaced (positional or keyword)."""
    names = [a.name for a in op._schema.arguments if not a.kwarg_only]
    at = names.index("reduction")
    if at < len(args):
        return (*args[:at], reduction, *args[at + 1 :]), kwargs
    return args, {**kwargs, "reduction": reduction}


class ElementwiseLossRule(OpRule):
    """A loss that is elementwise in its tensor inputs, then reduced by ``reduction`` (see the module doc)."""

    family = "loss"

    def _reduction(self, call: OpCall) -> int:
        return int(call.arg("reduction", REDUCTION_MEAN))

    def _shapes(self, call: OpCall) -> list[tuple[int, ...] | None]:
        return [tuple(x.shape) if x is not None else None for x in call.inputs]

    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        shapes = self._shapes(call)
        if self._reduction(call) == REDUCTION_NONE:
            return broadcast_shard_signatures(shapes, call.out_meta[0].shape)
        full = _broadcast_shape([s for s in shapes if s is not None])
        return [sig(s.inputs, Partial("sum")) for s in broadcast_shard_signatures(shapes, full)]

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A reduced loss over a block of the elements: the block's sum (divided by the global count for mean)."""
        reduction = self._reduction(call)
        if reduction == REDUCTION_NONE:
            return call.op(*args, **kwargs)
        shapes = self._shapes(call)
        full = _broadcast_shape([s for s in shapes if s is not None])
        local = _broadcast_shape([s for s in ctx.in_shapes if s is not None])
        if local == full:
            return call.op(*args, **kwargs)
        args, kwargs = _with_reduction(call.op, args, kwargs, REDUCTION_SUM)
        out = call.op(*args, **kwargs)
        if reduction == REDUCTION_MEAN:
            out = out / math.prod(full)
        return out


register_rule(aten.huber_loss.default, family="loss")(ElementwiseLossRule)
