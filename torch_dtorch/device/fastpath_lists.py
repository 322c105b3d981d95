"""The eager fast path of in-place list ops (``_foreach_mul_``, ``_foreach_addcdiv_``, ...: what ``torch.optim``
runs with ``foreach=True``), and the list helpers of :mod:`torch_dtorch.device.fastpath`.

An optimizer step calls the same few list ops every step on the same parameters, gradients and states, with
scalars that change (AdamW's bias-corrected step sizes, a scheduler's learning rate). A list rule's plan does not
depend on its scalars (``OpRule.plan_ignores_scalars``), so :class:`FastListOp` keys a call by the layout of every
element of every tensor list (and of any single tensor), the *types* of its scalars (which a list op's output
dtype could follow) and its other constants and keyword arguments exactly. A hit replays the plan the full path
made for those layouts — redistributes of elements included — with the call's own scalars: the run carries its
arguments, never a template's (:meth:`~torch_dtorch.executor.eager_planned.PlannedRecorder.call_planned`). The
op writes its first list in place, so the hit returns nothing and makes no operand.

Anything unusual misses into the full path: an unbound or CPU tensor, a write through a view of a redistributed
copy (the full path raises), a list the rule runs op by op.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

from torch import Tensor

from torch_dtorch.device import binding, state
from torch_dtorch.device.fastpath_keys import MISS, constant_key, full_path, keep, layout_of, stats
from torch_dtorch.device.tensors import TABLE
from torch_dtorch.executor.constructor import redistribute_spec
from torch_dtorch.executor.fast import FastPlan
from torch_dtorch.graph import Operand
from torch_dtorch.mesh import current_mesh
from torch_dtorch.placement_rules import get_rule
from torch_dtorch.placement_rules.call import tensor_slot_specs
from torch_dtorch.placement_rules.rule import number_key

__all__ = ["FastListOp", "bind_elements", "list_op_fits", "writes_reach_base"]

_TEMPLATES_PER_OP = 1024
_NUMBERS = (bool, int, float, complex)


class ListTemplate(NamedTuple):
    """What a hit of :class:`FastListOp` replays."""

    plan: FastPlan
    #: the tensor slot of every written element (the first list's)
    written: tuple[int, ...]


def list_op_fits(op: Any) -> bool:
    """``op`` is an in-place list op :class:`FastListOp` serves: its rule writes its first list
    (``writes_inputs``), its plans ignore its scalars, and every tensor argument is positional."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    rule = get_rule(op)
    specs = tensor_slot_specs(op)
    return (
        rule.writes_inputs
        and rule.plan_ignores_scalars
        and bool(specs)
        and specs[0][2]
        and all(pos is not None for pos, _, _ in specs)
        and not schema.returns
    )


class FastListOp:
    """The fast path of one in-place list overload (see the module docstring)."""

    __slots__ = ("op", "cache", "grown", "kind", "list_pos", "written", "view_of", "slot_pos")

    def __init__(self, op: Any) -> None:
        self.op = op
        self.cache: dict[tuple[Any, ...], ListTemplate] = {}
        self.grown: dict[Any, Any] = {}  # (no growth keys: the fast path's cache protocol)
        self.kind = "none"
        self.list_pos: int | None = 0
        self.written: int | None = None
        self.view_of: int | None = None
        self.slot_pos: tuple[int, ...] = ()

    native_ok = False

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rt = state._SESSION
        if rt is None:
            return MISS
        gen = rt.generation
        entry = TABLE.entry
        key: list[Any] = []
        targs = list(args)
        inputs: list[Operand | None] = []
        positions: list[Any] = []  # per tensor slot: its argument index, or (index, element)
        for i, a in enumerate(args):
            t = type(a)
            if t is list or t is tuple:
                if a and isinstance(a[0], Tensor):
                    ops: list[Operand] = []
                    for j, v in enumerate(a):
                        found = _operand(entry, v, gen)
                        if found is None:
                            return MISS
                        x, lid = found
                        key.append(lid)
                        ops.append(x)
                        positions.append((i, j))
                    key.append(("n", len(a)))
                    targs[i] = ops
                    inputs.extend(ops)
                elif all(type(v) in _NUMBERS for v in a):  # scalars: their types, never their values
                    key.append((t, tuple(map(type, a))))
                else:
                    return MISS
            elif isinstance(a, Tensor):
                found = _operand(entry, a, gen)
                if found is None:
                    return MISS
                x, lid = found
                key.append(lid)
                targs[i] = x
                inputs.append(x)
                positions.append(i)
            elif t in _NUMBERS:
                key.append(("num", t))
            else:
                key.append(constant_key(a))
        if kwargs:
            for v in kwargs.values():
                if isinstance(v, (Tensor, list, tuple)):
                    return MISS
            key.append(
                tuple((k, type(v), None if type(v) in _NUMBERS else number_key(v)) for k, v in kwargs.items())
            )
        try:
            k_ = tuple(key)
            tpl = self.cache.get(k_)
        except TypeError:  # an unhashable constant
            return MISS
        if tpl is None:
            return self._record(rt, args, kwargs, targs, inputs, positions, k_)
        for s in tpl.written:
            w = inputs[s]
            if w is None or not writes_reach_base(w):
                return MISS  # the full path raises its error
        plan = tpl.plan
        if (
            kwargs != plan.kwargs
        ):  # (``alpha=-lr`` of a scheduled learning rate: the plan's, with this call's)
            plan = copy.copy(plan)
            plan.kwargs = dict(kwargs)
            plan.mem = None
        rt.executor.record_fast(plan, tuple(targs), inputs)
        stats["hit"] += 1
        rt.last_mesh = tpl.plan.root_mesh
        return None

    def _record(
        self,
        rt: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        targs: list[Any],
        inputs: list[Operand | None],
        positions: list[Any],
        key: tuple[Any, ...],
    ) -> Any:
        """Take the full path, then keep a template if the call qualifies."""
        out, last = full_path(rt, self.op, args, kwargs)
        if last is None or not last.rule.writes_inputs:
            return out
        call = last.call
        if len(call.inputs) != len(inputs) or any(
            a is not b for a, b in zip(inputs, call.inputs, strict=True)
        ):
            return out
        n = len(last.outputs)
        if any(o is not x for o, x in zip(last.outputs, last.inputs[:n], strict=True)) or any(
            last.inputs[s] is not inputs[s] for s in range(n)
        ):
            return out  # (a written element moved: never, they are pinned; kept out all the same)
        targets = last.plan.match.in_targets
        moves = tuple(
            (s, positions[s], redistribute_spec(call.inputs[s], call.mesh, targets[s]))  # type: ignore[arg-type]
            for s in last.moved
        )
        out_specs = [(m, o.mesh, o.placements) for m, o in zip(last.plan.out_meta, last.outputs, strict=True)]
        plan = FastPlan(last.rule, call, targets, out_specs, last.plan.assign, last.plan.cost, moves)
        keep(self.cache, key, ListTemplate(plan, tuple(range(n))), limit=_TEMPLATES_PER_OP)
        stats["recorded"] += 1
        return out


def _operand(entry: Any, t: Any, gen: int) -> tuple[Operand, int] | None:
    """The bound operand of the dtorch tensor ``t`` and its interned layout (``None``: not one the fast path
    takes)."""
    e = entry(t) if isinstance(t, Tensor) else None
    if e is None or e.generation != gen or t.shape != e.shape:
        return None
    x: Operand = e.operand
    if x.mesh is None:
        return None
    lid = e.layout
    if lid is None:
        lid = layout_of(x)
        TABLE.set_layout(t, e, lid)
    return x, lid


def writes_reach_base(x: Operand) -> bool:
    """A write into ``x`` lands in its base: no view on the way up is of a redistributed copy (the full path's
    ``_check_write_reaches_base`` raises otherwise)."""
    b = x.base
    while b is not None:
        if b.copy_of is not None:
            return False
        b = b.base
    return True


def bind_elements(
    rt: Any,
    unbound: list[tuple[int, int, Operand]],
    inputs: list[Operand | None],
    key: list[Any],
    targs: list[Any],
    lp: int,
) -> bool:
    """Materialize the unbound elements ``(j, k, x)`` of a list call (element ``j``, key entry ``k``) on the mesh
    the full path binds them to — the first bound element's, else the innermost ``with mesh:``, else the last
    op's (:func:`.fastpath_keys.bind_unbound`) — and put them and their layouts in ``inputs``, ``targs[lp]`` and
    ``key``. ``False``: no mesh in sight (the full path decides)."""
    first = next((x for x in inputs if x is not None and x.mesh is not None), None)
    mesh = first.mesh if first is not None else current_mesh() or rt.last_mesh
    if mesh is None:
        return False
    for j, k, x in unbound:
        y = binding.bind(rt, x, mesh)
        inputs[j] = y
        key[k] = layout_of(y)
    targs[lp] = list(inputs)
    return True
