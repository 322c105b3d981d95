"""The keys of a rule's plan cache: constant arguments as hashable keys that tell apart what ``==`` does not
(:func:`number_key`, :func:`const_key`; the eager fast path keys its constants the same way), and the plan cache
itself (:data:`PLAN_CACHE`, filled by :meth:`~torch_dtorch.placement_rules.rule.OpRule.plan`).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from torch_dtorch.config import RedistributePolicy
from torch_dtorch.graph import Operand
from torch_dtorch.placement import Placements
from torch_dtorch.placement_rules.call import OpCall

if TYPE_CHECKING:
    from torch_dtorch.placement_rules.rule import OpPlan, OpRule

__all__ = [
    "PLAN_CACHE",
    "PLAN_CACHE_SIZE",
    "clear_plan_cache",
    "const_key",
    "float_bits",
    "number_key",
    "plan_key",
]

#: ``plan_key(...) -> OpPlan`` of every call planned so far (emptied when any rule changes)
PLAN_CACHE: dict[tuple[Any, ...], OpPlan] = {}
PLAN_CACHE_SIZE = 8192


_DOUBLE = struct.Struct("<d")


def float_bits(v: float) -> int:
    """The IEEE bits of ``v``: unlike ``==``, they tell ``0.0`` from ``-0.0`` and make a NaN equal to itself."""
    return int.from_bytes(_DOUBLE.pack(v), "little", signed=True)


def number_key(v: Any) -> Any:
    """A hashable key of one Python number such that equal keys mean interchangeable values: tagged by type
    (``1 == 1.0 == True`` but they promote differently) and floats by their bits (``0.0 == -0.0`` but ``x * -0.0``
    flips the signs of zeros; ``nan != nan`` would make a key never hit). Other values are returned unchanged."""
    t = type(v)
    if t is float:
        return (float, float_bits(v))
    if t is complex:
        return (complex, float_bits(v.real), float_bits(v.imag))
    if t is int or t is bool:
        return (t, v)
    return v


def const_key(v: Any) -> Any:
    """A hashable stand-in for the non-tensor structure of the arguments (operands become None; numbers by
    :func:`number_key`)."""
    t = type(v)
    if t is tuple or t is list:
        return tuple([const_key(x) for x in v])
    if t is dict:
        return tuple(sorted((k, const_key(x)) for k, x in v.items()))
    if isinstance(v, Operand):
        return None
    hash(v)
    return number_key(v)


def plan_key(
    call: OpCall, policy: RedistributePolicy, prefer: tuple[Placements, ...] | None, rule: OpRule
) -> tuple[Any, ...] | None:
    """Plans depend only on the op, the inputs' metadata and placements, the mesh and the non-tensor args (the
    rule's :meth:`OpRule.constants_key`)."""
    try:
        slots = tuple(
            None if x is None else (x.shape, x.stride, x.dtype, pl)
            for x, pl in zip(call.inputs, call.placements, strict=True)
        )
        return (call.op, call.mesh, slots, rule.constants_key(call), policy, prefer)
    except TypeError:  # an unhashable argument: plan without caching
        return None


def clear_plan_cache() -> None:
    PLAN_CACHE.clear()
