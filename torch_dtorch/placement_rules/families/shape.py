"""Shape family: ops that rearrange or combine whole tensors into a fresh output (no aliasing).

Signatures (one mesh axis; ``P`` is any Partial the inputs carry):
- ``cat``: its own module, ``cat.py`` (local signatures and a communicating one along the sharded cat dim).
- ``stack``: every input ``S(d)`` -> ``S(d)`` below the new dim, ``S(d + 1)`` at or after it; all ``P`` -> ``P``.
- ``flip`` / ``roll``: ``S(d) -> S(d)`` for dims not flipped / rolled (``roll`` without ``dims`` rolls the flattened
  tensor: no Shard signature); ``P -> P``.
- ``repeat``: ``S(d) -> S(d + new leading dims)`` where that dim's repeat count is 1; ``P -> P``.
- ``tril`` / ``triu``: ``S(d) -> S(d)`` on batch dims (all but the last two); ``P -> P`` (masking is linear).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_dtorch.graph import OperatorCost
from torch_dtorch.ops.cost import traffic_cost
from torch_dtorch.placement import Placement, Shard
from torch_dtorch.placement_rules.call import OpCall
from torch_dtorch.placement_rules.families.view import distinct_partials, norm_dim
from torch_dtorch.placement_rules.rule import register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["SHAPE_OPS"]

aten = torch.ops.aten


def _copy_cost(call: OpCall) -> OperatorCost:
    return traffic_cost(call.inputs, call.out_meta)


def _shape_rule(*ops: Any) -> Callable[[Any], Any]:
    return register_rule(*ops, family="shape", cost=_copy_cost)


def _unary(call: OpCall, pairs: Sequence[tuple[int, int]]) -> list[PlacementSignature]:
    """``S(d) -> S(e)`` per pair and ``P -> P`` for each Partial of the input."""
    heads: list[tuple[Placement, Placement]] = [(Shard(d), Shard(e)) for d, e in pairs]
    heads += [(p, p) for p in distinct_partials(call.placements[0])]
    return [sig([i], o) for i, o in heads]


def _joined(call: OpCall, pairs: Sequence[tuple[int, int]]) -> list[PlacementSignature]:
    """Every input ``S(d)`` -> ``S(e)`` per pair; every input the same ``P`` -> ``P``."""
    n = len(call.inputs)
    sigs = [sig([Shard(d)] * n, Shard(e)) for d, e in pairs]
    partials: list[Placement] = []
    for pl in call.placements:
        partials += [p for p in distinct_partials(pl) if p not in partials]
    return sigs + [sig([p] * n, p) for p in partials]


def _ndim(call: OpCall) -> int:
    x = call.inputs[0]
    return x.ndim if x is not None else 0


@_shape_rule(aten.stack.default)
def stack(call: OpCall) -> list[PlacementSignature]:
    """Shard dims at or after the new dim move up by one; all-Partial stays Partial."""
    nd = call.out_ndim - 1
    dim = norm_dim(call.arg("dim"), nd + 1)
    return _joined(call, [(d, d if d < dim else d + 1) for d in range(nd)])


@_shape_rule(aten.flip.default)
def flip(call: OpCall) -> list[PlacementSignature]:
    """Dims not flipped stay sharded (a flipped uneven shard would land on another rank)."""
    nd = _ndim(call)
    flipped = {norm_dim(d, nd) for d in call.arg("dims")}
    return _unary(call, [(d, d) for d in range(nd) if d not in flipped])


@_shape_rule(aten.roll.default)
def roll(call: OpCall) -> list[PlacementSignature]:
    """Dims not rolled stay sharded; rolling the flattened tensor (no ``dims``) keeps nothing sharded."""
    nd = _ndim(call)
    dims = list(call.arg("dims") or [])
    if not dims:
        return _unary(call, [])
    rolled = {norm_dim(d, nd) for d in dims}
    return _unary(call, [(d, d) for d in range(nd) if d not in rolled])


@_shape_rule(aten.repeat.default)
def repeat(call: OpCall) -> list[PlacementSignature]:
    """Dims repeated once stay sharded, shifted by the new leading dims."""
    nd = _ndim(call)
    repeats = list(call.arg("repeats"))
    lead = len(repeats) - nd
    return _unary(call, [(d, d + lead) for d in range(nd) if repeats[d + lead] == 1])


@_shape_rule(aten.tril.default, aten.triu.default)
def tril(call: OpCall) -> list[PlacementSignature]:
    """Batch dims (all but the last two) stay sharded."""
    return _unary(call, [(d, d) for d in range(_ndim(call) - 2)])


SHAPE_OPS = [
    aten.stack.default, aten.flip.default, aten.roll.default, aten.repeat.default,
    aten.tril.default, aten.triu.default,
]  # fmt: skip
