"""A fast-path op resolved once on a worker, replayed cheaply on every later hit (issue 20, item 1, Python path).

The eager fast path sends the same :class:`~torch_dtorch.executor.fast.FastPlan` for every call of one op on one
input layout. When the plan's rule runs the op itself on the localized arguments (``OpRule.runs_op_as_is``: the
default ``kernel`` of pointwise ops, matmuls, reductions, views, conversions, factories; ``dropout`` without
training), nothing of the general local path depends on the call beyond which blobs go into which argument
positions — ``localize`` depends only on what the plan fixes (layouts, shapes, constants) and the rank.
:func:`resolve` records it once as a :class:`LocalCall` — the op handle, the localized argument template, the
positions of the tensor slots — and :meth:`LocalCall.run` replays it on the worker's blobs: no ``Operator``, no
``LocalContext``, no localize, no argument walk.

An operand in several slots (``x * x``, ``mm(a, a)``) is resolved as the plan's calls on distinct operands of the
same layouts are (``x * y``: one plan serves both), with a stand-in operand per repeated slot (:func:`_distinct`);
the replay puts the same shard in each of its slots.

A call that cannot be resolved (custom kernels, kernels that communicate) is ``None``: the worker runs it on the
general path, as before.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from torch_dtorch.graph import Operand
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.ranks import takes_device
from torch_dtorch.runtime.native_replay import native_handle

__all__ = ["AMBIGUOUS", "LocalCall", "resolve"]

_NESTED = (Operand, list, tuple, dict)

#: :func:`resolve` could not tell this call's argument positions from its slots; another call of the plan may
AMBIGUOUS: Any = object()


class LocalCall(NamedTuple):
    """One resolved local op: ``op(*args, **kwargs)`` with ``args[pos] = shard of input slot k`` for every
    ``(pos, k)`` in ``tensor_slots``."""

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    tensor_slots: tuple[tuple[int, int], ...]
    #: the native loop's handle (``runtime/native_replay.py``), ``-1``: replayed in Python only
    native: int = -1
    #: ``(pos, (k, ...))``: ``args[pos]`` is the list of the shards of input slots ``k, ...`` (``cat``'s tensors)
    list_slots: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def run(self, local: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """The local outputs on ``local`` (this rank's shard of every input slot)."""
        args = list(self.args)
        for pos, k in self.tensor_slots:
            args[pos] = local[k]
        for pos, ks in self.list_slots:
            args[pos] = [local[k] for k in ks]
        out = self.op(*args, **self.kwargs)
        return list(out) if isinstance(out, (list, tuple)) else [out]


def _distinct(call: OpCall) -> OpCall | None:
    """``call`` with one operand per tensor slot: an operand named by several slots (``x * x``, ``mm(a, a)``,
    ``cat([x, x])``) keeps its first slot and gets a stand-in (a copy of its metadata) in every later one, so that
    :func:`resolve` can tell from the localized arguments which slot each argument is. The call is the one a plan's
    other calls make with distinct operands of the same layouts (``x * y``): its resolved call serves both.

    The ``j``-th occurrence of an operand in the positional arguments (``Tensor[]`` elements in order) is its
    ``j``-th slot: a call's inputs are its tensor arguments in schema order (``OpCall.inputs``). ``None`` when a
    repeated operand also sits in a keyword argument (no order to go by)."""
    slots: dict[int, list[int]] = {}
    for k, x in enumerate(call.inputs):
        if x is not None:
            slots.setdefault(id(x), []).append(k)
    repeated = {i for i, ks in slots.items() if len(ks) > 1}
    for v in call.kwargs.values():
        vs = v if type(v) in (list, tuple) else (v,)
        if any(type(e) is Operand and id(e) in repeated for e in vs):
            return None
    inputs = list(call.inputs)
    seen: dict[int, int] = {}

    def stand_in(x: Any) -> Any:
        if type(x) is not Operand or id(x) not in repeated:
            return x
        j = seen[id(x)] = seen.get(id(x), -1) + 1
        ks = slots[id(x)]
        if j >= len(ks):
            raise _Unmatched
        if j == 0:
            return x
        y = copy.copy(x)
        inputs[ks[j]] = y
        return y

    try:
        args = tuple(
            type(a)(stand_in(e) for e in a) if type(a) in (list, tuple) else stand_in(a) for a in call.args
        )
    except _Unmatched:
        return None
    if any(seen.get(i, -1) + 1 != len(slots[i]) for i in repeated):
        return None  # an input the positional arguments do not name once per slot
    return dataclasses.replace(call, args=args, inputs=inputs, _bound=None)


class _Unmatched(Exception):
    """An operand named by more positional arguments than it has slots."""


def resolve(rule: Any, call: OpCall, ctx: LocalContext, *, native: bool = False) -> LocalCall | None:
    """The :class:`LocalCall` of ``call`` on the rank ``ctx`` describes: the rule's localized arguments (operands in
    place) with the shards of the inputs put in their slots. ``None`` when the general local path is needed for every
    call of this op and layout, :data:`AMBIGUOUS` when this call alone cannot be resolved. ``native``: also resolve it
    for the native loop (``LocalCall.native``)."""
    inputs = call.inputs
    if not rule.runs_op_as_is(call, ctx):
        return None
    op = rule.local_op(
        call
    )  # (``view`` runs as ``reshape``: a view where the shard's strides allow, as its kernel)
    given = [x for x in inputs if x is not None]
    if len({id(x) for x in given}) != len(given):
        distinct = _distinct(call)
        if distinct is None:
            return AMBIGUOUS
        call = distinct
        inputs = call.inputs
    args, kwargs = rule.localize(call, ctx)
    if ctx.torch_device is not None and kwargs.get("device") is None and takes_device(op):
        kwargs = {**kwargs, "device": ctx.torch_device}  # as ``run_rank`` does: this worker's device, fixed
    for v in kwargs.values():
        t = type(v)
        if t is Operand or t is dict or (t in (list, tuple) and any(type(e) in _NESTED for e in v)):
            return None
    slot_of = {id(x): k for k, x in enumerate(inputs) if x is not None}
    slots: list[tuple[int, int]] = []
    list_slots: list[tuple[int, tuple[int, ...]]] = []
    template: list[Any] = []
    for pos, a in enumerate(args):
        t = type(a)
        if t is Operand:
            k = slot_of.get(id(a))
            if k is None:
                return None
            slots.append((pos, k))
            template.append(None)
        elif (t is list or t is tuple) and a and all(type(v) is Operand for v in a):
            ks = tuple(slot_of.get(id(v), -1) for v in a)
            if -1 in ks:
                return None
            list_slots.append((pos, ks))
            template.append(None)
        elif t in (list, tuple, dict):
            if any(
                type(v) is Operand or type(v) in (list, tuple, dict) for v in (a.values() if t is dict else a)
            ):
                return None
            template.append(a)
        else:
            template.append(a)
    if len(slots) + sum(len(ks) for _, ks in list_slots) != sum(x is not None for x in inputs):
        return None  # an input the arguments do not name directly
    present = {k: j for j, k in enumerate(k for k, x in enumerate(inputs) if x is not None)}
    positions = [0] * len(present)
    elements = [-1] * len(present)
    for pos, k in slots:
        positions[present[k]] = pos
    for pos, ks in list_slots:
        for j, k in enumerate(ks):
            positions[present[k]], elements[present[k]] = pos, j
    handle = native_handle(op, args, kwargs, positions, elements) if native else -1
    return LocalCall(op, tuple(template), dict(kwargs), tuple(slots), handle, tuple(list_slots))
