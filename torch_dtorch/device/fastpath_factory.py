"""The eager fast path of factories: ops with no tensor argument (``arange``, ``full``, ``scalar_tensor``, ``zeros``).

Model code makes the same small tensors every step — HF's generation makes ``torch.arange(n, device=x.device)``,
``torch.full((1,), False, device=...)`` and ``torch.tensor(-inf, device=...)`` for its cache positions, attention
masks and stopping checks, several times per decoded token. On the full path each is a miss: a factory made with
no mesh in sight is *deferred* (an unbound operand, :mod:`.binding`), and every consumer of it then misses the
native kernel, which keys bound layouts only, to bind it on the Python fast path.

:class:`FactoryOp` keys a call by its constants (with the values below taken out) and where its mesh comes from:
the innermost ``with mesh:``, else the root of the mesh the last op ran on. A template is learned from the full
path: under ``with mesh:`` the factory is recorded on that mesh at once (:func:`.binding.record_factory`); without
one the deferred factory is watched and the template learned when its first consumer binds it (the mesh it bound
to, Replicate). A later call with that key records the factory's plan at once on that mesh (one ``FastRun``) and
returns a bound tensor, so its consumers hit the native kernel too. A deferred factory bound to two meshes (a
pipeline's stages) makes its key ambiguous: such calls stay deferred.

**Values that change per call.** ``arange(past, past + 1)``, ``full(shape, value)`` and ``scalar_tensor(value)``
are keyed by what their output metadata depends on only — ``arange``: the length, ``full``/``scalar_tensor``: the
value's type — and the run carries the call's own values (:attr:`~torch_dtorch.executor.fast.FastPlan.varies`: the
workers resolve such a plan per values, process mode's hit templates are keyed by them), so a fill value torch
refuses (``full((2,), 300, dtype=torch.uint8)``) fails in the workers' kernel as on the full path; an ``arange``
torch refuses (inconsistent step sign) keeps its values in the key and raises at once on the full path.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from torch_dtorch.device import binding, dispatch, state
from torch_dtorch.device.fastpath_keys import MISS, constant_key, keep, layout_of, stats
from torch_dtorch.device.tensors import TABLE
from torch_dtorch.executor.fast import FastPlan
from torch_dtorch.graph import Operand
from torch_dtorch.mesh import DeviceMesh, current_mesh

__all__ = ["FactoryOp", "factory_fits"]

_TEMPLATES_PER_OP = 1024
#: |value| below this: int arithmetic in doubles is exact (``arange``'s length for a floating dtype)
_EXACT = 1 << 50
_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

aten = torch.ops.aten
_ARANGE = {aten.arange.default: 1, aten.arange.start: 2, aten.arange.start_step: 3}
#: ops whose value argument (at this position) is a per-call value: ``full(size, fill_value)``, ``scalar_tensor(s)``
_VALUE_AT = {aten.full.default: 1, aten.scalar_tensor.default: 0}


class FactoryTemplate(NamedTuple):
    """What a hit of :class:`FactoryOp` records."""

    plan: FastPlan
    mesh: DeviceMesh
    layout: int


def factory_fits(op: Any) -> bool:
    """``op`` is a factory :class:`FactoryOp` serves: no tensor argument, no generator, one tensor returned, not
    mutable, not random (``randperm``; the caller checks ``dispatch.RANDOM_OPS`` too)."""
    schema = getattr(op, "_schema", None)
    if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
        return False
    if (
        schema is None
        or schema.is_mutable
        or len(schema.returns) != 1
        or str(schema.returns[0].type) != "Tensor"
    ):
        return False
    for a in schema.arguments:
        t = str(a.type)
        if "Tensor" in t or "Generator" in t:
            return False
    return True


class FactoryOp:
    """The fast path of one factory overload (see the module docstring)."""

    __slots__ = (
        "op",
        "cache",
        "grown",
        "ambiguous",
        "kind",
        "list_pos",
        "written",
        "view_of",
        "slot_pos",
        "native_ok",
    )

    def __init__(self, op: Any) -> None:
        self.op = op
        self.cache: dict[tuple[Any, ...], FactoryTemplate] = {}
        self.grown: dict[Any, Any] = {}  # (no growth keys: the fast path's cache protocol)
        #: keys whose deferred factories were bound to more than one mesh (a pipeline's stages): they stay deferred
        self.ambiguous: set[tuple[Any, ...]] = set()
        self.kind = "single"
        self.list_pos: int | None = None
        self.written: int | None = None
        self.view_of: int | None = None
        self.slot_pos: tuple[int, ...] = ()
        self.native_ok = False  # (the C++ kernel keys tensor slots: it would miss every call)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rt = state._SESSION
        if rt is None:
            return MISS
        key = self._key(args, kwargs)
        if key is None:
            return MISS
        varies, ckey = key
        mesh = current_mesh()
        if mesh is not None:
            where: Any = mesh
        else:
            last = rt.last_mesh
            where = None if last is None else ("last", last.root)
        full_key = (ckey, where)
        try:
            tpl = self.cache.get(full_key)
        except TypeError:  # an unhashable constant
            return MISS
        if tpl is None:
            learn = where is not None and full_key not in self.ambiguous
            return self._record(rt, args, kwargs, full_key, mesh, varies, learn)
        outs = rt.executor.record_fast(tpl.plan, args, [])
        stats["hit"] += 1
        if mesh is not None:
            rt.last_mesh = mesh  # (as the full path: a deferred factory leaves it alone)
        else:  # bound where the call's earlier results went: a consumer elsewhere moves it (and unlearns this)
            binding.note_eager(outs[0], lambda: self._unlearn(full_key))
        return TABLE.wrap(outs[0], rt.generation, dispatch._free_callback(rt), tpl.layout)

    def _unlearn(self, key: tuple[Any, ...]) -> None:
        """A result bound at once under ``key`` met a consumer on another mesh: such calls stay deferred."""
        self.ambiguous.add(key)
        self.cache.pop(key, None)

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, tuple[Any, ...]] | None:
        """``(varies, key)``: the call's key, with the values a plan does not depend on taken out (``varies``);
        ``None``: the call cannot take the fast path (a tensor constant)."""
        op = self.op
        dtype = kwargs.get("dtype")
        extra: Any = None
        varies = False
        n = _ARANGE.get(op)
        vpos = _VALUE_AT.get(op, -1)
        if n is not None and len(args) == n:
            length = _arange_length(args, dtype)
            if length is not None:
                varies, extra, args = True, ("arange", length), ()
        elif vpos >= 0 and len(args) > vpos:
            tag = _value_tag(args[vpos])
            if tag is not None:
                varies, extra = True, tag
                args = args[:vpos] + args[vpos + 1 :]
        key: list[Any] = [extra, None if dtype is not None else torch.get_default_dtype()]
        for a in args:
            if type(a) is list or type(a) is tuple:
                for v in a:
                    if isinstance(v, torch.Tensor):
                        return None
                key.append((type(a), tuple(map(constant_key, a))))
            elif isinstance(a, torch.Tensor):
                return None
            else:
                key.append(constant_key(a))
        for k, v in kwargs.items():
            if isinstance(v, (torch.Tensor, list)):
                return None
            key.append((k, constant_key(v)))
        return varies, tuple(key)

    def _record(
        self,
        rt: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: tuple[Any, ...],
        mesh: DeviceMesh | None,
        varies: bool,
        learn: bool,
    ) -> Any:
        """A miss: the full path, then a template (under ``with mesh:``: now; else when the deferred factory's
        first consumer binds it)."""
        stats["miss"] += 1
        out = dispatch.dispatch_op(self.op, args, kwargs)
        if not learn or not isinstance(out, torch.Tensor):
            return out
        e = TABLE.entry(out)
        if e is None:
            return out
        x = e.operand
        if mesh is not None:
            if x.mesh is mesh:
                self._learn(args, kwargs, key, mesh, False, varies)
            return out
        if x.mesh is None:

            def on_bind(bound_mesh: DeviceMesh, first: bool) -> None:
                if first:
                    self._learn(args, kwargs, key, bound_mesh, True, varies)
                else:
                    self._unlearn(key)

            binding.watch(x, on_bind)
        return out

    def _learn(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: tuple[Any, ...],
        mesh: DeviceMesh,
        replicate: bool,
        varies: bool,
    ) -> None:
        """Keep the template of ``key``: the plan the full path recorded ``args``/``kwargs`` with on ``mesh``
        (``replicate``: in Replicate, as a deferred factory binds; else in the rule's placements)."""
        if key in self.ambiguous:
            return
        plan = binding.factory_plan(self.op, args, kwargs, mesh, replicate=replicate)
        if plan is None:
            return
        if varies:
            plan.varies = True
        shape, dtype, out_mesh, pl, stride, _ = plan.outs[0]
        probe = Operand(-1, shape, dtype, out_mesh, pl, stride)
        keep(self.cache, key, FactoryTemplate(plan, mesh, layout_of(probe)), limit=_TEMPLATES_PER_OP)
        stats["recorded"] += 1


def _arange_length(args: tuple[Any, ...], dtype: Any) -> int | None:
    """The length of ``arange(*args)`` for plain ints (bools excluded) whose length torch computes exactly as here,
    ``None`` otherwise (the values stay in the key: the full path computes, or raises)."""
    for a in args:
        if type(a) is not int or not -_EXACT < a < _EXACT:
            return None
    if dtype is not None and dtype is not torch.int64 and dtype not in _FLOATS:
        return None  # (narrow ints: torch checks the range of the values)
    if len(args) == 1:
        start, end, step = 0, args[0], 1
    elif len(args) == 2:
        (start, end), step = args, 1
    else:
        start, end, step = args
    if step == 0 or (step > 0 and end < start) or (step < 0 and end > start):
        return None  # torch raises
    return -((start - end) // step)  # ceil((end - start) / step), exact


def _value_tag(v: Any) -> Any:
    """The key's stand-in of a fill value: its type (a plain bool, int or float; the inferred dtype follows it);
    ``None``: the value stays in the key. The workers fill with the call's own value, so a value torch refuses
    (``full((2,), 300, dtype=torch.uint8)``) fails there as on the full path."""
    t = type(v)
    return ("value", t) if t is bool or t is int or t is float else None
