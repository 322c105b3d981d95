"""The eager fast path: a per-op cache keyed by (input layouts, constant arguments) that replays a plan.

The first call of an op on given input layouts goes the full way (:func:`torch_dtorch.device.dispatch.dispatch`:
operands, binding, rule matching, planning). If that call was not in place and took only bound dtorch tensors in
top-level positional slots, the op's :class:`FastOp` keeps a :class:`Template` of what was decided — the rule,
the redistributes of its inputs, the output metadata/placements, the device assignment and cost. Later calls with the same
layouts (mesh, placements, shape, stride, dtype of every tensor argument) and equal constants look the template up
and only create the output operands, the operator and the output tensors.

A layout is interned once per tensor (a small int kept on the tensor table entry), so a hit hashes a short tuple of
ints and constants (the keys: :mod:`.fastpath_keys`; the template and what it records: :mod:`.fastpath_template`;
this module: the per-op cache, hits and the native kernel's hooks). Anything unusual (unbound or CPU tensors, tensor lists, unhashable arguments, random ops) misses
and takes the full path, which is always correct.
"""

from __future__ import annotations

import threading
from typing import Any

from torch import Tensor

from torch_dtorch.device import binding, dispatch, fastpath_grow, state
from torch_dtorch.device.fastpath_factory import FactoryOp, factory_fits
from torch_dtorch.device.fastpath_keys import (
    MISS,
    SCALAR,
    bind_unbound,
    constant_key,
    fresh_dense,
    full_path,
    is_scalar_upload,
    keep,
    layout_of,
    pattern_key,
    stats,
)
from torch_dtorch.device.fastpath_lists import FastListOp, bind_elements, list_op_fits, writes_reach_base
from torch_dtorch.device.fastpath_template import Template
from torch_dtorch.device.tensors import TABLE
from torch_dtorch.graph import Operand
from torch_dtorch.placement_rules import get_rule
from torch_dtorch.placement_rules.call import tensor_slot_specs
from torch_dtorch.placement_rules.rule import add_rule_listener, number_key

__all__ = ["KWARG_SLOT", "MISS", "NATIVE", "FastOp", "fast_op", "layout_of", "stats"]

#: the position of a keyword-only ``Tensor?`` slot (SDPA's ``attn_mask``) in :attr:`FastOp.slot_pos`: past every
#: positional argument, so the slot's input is ``None`` — a call with a tensor there misses (``_lookup``)
KWARG_SLOT = 1 << 30
_TEMPLATES_PER_OP = 4096

#: per thread, the template the last Python fast-path call used or recorded (the native kernel learns it)
_LEARNED = threading.local()
_LEARNED.tpl = None


class FastOp:
    """The fast path of one overload (see the module docstring)."""

    __slots__ = ("op", "slot_pos", "dense", "cache", "grown", "kind", "view_of", "list_pos", "written")

    def __init__(
        self,
        op: Any,
        slot_pos: tuple[int, ...],
        kind: str,
        view_of: int | None,
        *,
        list_pos: int | None = None,
        written: int | None = None,
    ) -> None:
        self.op = op
        #: the positional slot an in-place op writes (``x.add_(y)``: 0), whose tensor a hit returns; ``None``: the
        #: op makes new outputs
        self.written = written
        #: the position of the op's one tensor argument when it is a ``Tensor[]`` (``cat``, ``stack``): a call is
        #: keyed by the layout of every element (see :meth:`_call_list`)
        self.list_pos = list_pos
        self.slot_pos = slot_pos  # positional index of every tensor slot, in schema order
        #: n when the tensor slots are exactly positions 0..n-1 (the slots are then a prefix of the arguments)
        self.dense = len(slot_pos) if slot_pos == tuple(range(len(slot_pos))) else 0
        self.cache: dict[tuple[Any, ...], Template] = {}
        #: decisions kept per growth key (:mod:`.fastpath_grow`): exact misses derive their templates from them
        self.grown: dict[tuple[Any, ...], fastpath_grow.Kept] = {}
        self.kind = kind  # "single" | "tuple" | "list"
        self.view_of = view_of

    @property
    def native_ok(self) -> bool:
        """The C++ kernel may serve this op (it keys positional tensor slots or the op's one ``Tensor[]``: no
        in-place write, no keyword-only tensor slot)."""
        return self.written is None and KWARG_SLOT not in self.slot_pos

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rt = state._SESSION
        if rt is None:
            return MISS
        if self.list_pos is not None:
            return self._call_list(rt, args, kwargs)
        gen = rt.generation
        entry = TABLE.entry
        key: list[Any] = []
        targs = list(args)
        first: Operand | None = None
        unbound: list[tuple[int, int, Operand]] | None = None
        scalars: list[tuple[int, Tensor]] | None = None
        i = 0
        for a in args:
            if isinstance(a, Tensor):
                e = entry(a)
                if e is None:
                    # a plain 0-d CPU tensor (a timestep, a scale): keyed by its dtype, its value uploaded per call
                    if a.device.type != "cpu" or a.dim() != 0 or a.requires_grad or i == self.written:
                        return MISS
                    if scalars is None:
                        scalars = []
                    scalars.append((i, a))
                    key.append((SCALAR, a.dtype))
                    i += 1
                    continue
                if e.generation != gen or a.shape != e.shape:
                    return MISS
                x = e.operand
                if (
                    x.mesh is None
                ):  # bound below, as the full path binds it (``torch.arange(n, device=x.device)``)
                    if unbound is None:
                        unbound = []
                    unbound.append((i, len(key), x))
                    key.append(None)
                    i += 1
                    continue
                lid = e.layout
                if lid is None:
                    lid = layout_of(x)
                    TABLE.set_layout(a, e, lid)
                key.append(lid)
                targs[i] = x
                if first is None:
                    first = x
            elif type(a) is list or type(a) is tuple:
                for v in a:
                    if isinstance(v, Tensor):
                        return MISS
                types = tuple(map(type, a))
                if float in types or complex in types:
                    key.append((type(a), types, *map(number_key, a)))
                else:
                    key.append((type(a), types, *a))
            else:
                key.append(constant_key(a))
            i += 1
        if unbound is not None:
            first = bind_unbound(rt, first, unbound, key, targs)
        if first is None:
            return MISS
        if unbound is not None and self.written is not None:
            w = self.written
            for p, _, x in unbound:
                # an unbound self: materialized above; a hit writes there and rebinds the caller's tensor
                if p == w:
                    out = self._hit_or_record(rt, key, kwargs, args, targs, i, scalars)
                    if out is not MISS:
                        dispatch.rebind(rt, args[w], targs[w])
                        binding.forget(x)  # its controller-side value is not needed any more
                    return out
        return self._hit_or_record(rt, key, kwargs, args, targs, i, scalars)

    def _hit_or_record(
        self,
        rt: Any,
        key: list[Any],
        kwargs: dict[str, Any],
        args: tuple[Any, ...],
        targs: list[Any],
        i: int,
        scalars: list[tuple[int, Tensor]] | None,
    ) -> Any:
        """:meth:`__call__` once the call is keyed (``i``: its positional argument count)."""
        tpl = self._lookup(key, kwargs)
        if tpl is MISS:
            return MISS
        if tpl is None:
            alt = self._pattern_key(key)
            tpl = None if alt is None else self.cache.get(alt)
            if tpl is None and scalars is None and self.grown:
                tpl = self._derive(rt, targs, kwargs, key)
            if tpl is None:
                return self._record(rt, args, kwargs, targs, tuple(key), alt)
        if scalars is not None:
            return self._hit_scalars(rt, tpl, args, targs, scalars)
        _LEARNED.tpl = tpl
        n = self.dense
        if n and i >= n:
            inputs = targs[:n] if i > n else targs
        else:
            inputs = [targs[p] if p < i else None for p in self.slot_pos]
        if tpl.const_slots:  # Python numbers in tensor slots are constants (their key holds the value)
            inputs = list(inputs)
            for k in tpl.const_slots:
                inputs[k] = None
        return self._hit(rt, tpl, args, targs, inputs)

    def _pattern_key(self, key: list[Any]) -> tuple[Any, ...] | None:
        """``key`` under the stride patterns of its gapped inputs (:func:`.fastpath_keys.pattern_key`), for a
        non-view op only (``None``: a view, or no gapped input)."""
        return None if self.view_of is not None else pattern_key(key)

    def _lookup(self, key: list[Any], kwargs: dict[str, Any]) -> Any:
        """The cached template of ``key`` (plus ``kwargs``' constants, appended to ``key``); ``None`` when there is
        none yet; ``MISS`` when the call cannot take the fast path (a tensor or list keyword, an unhashable one)."""
        if kwargs:
            for v in kwargs.values():
                if isinstance(v, (Tensor, list)):
                    return MISS
            key.append(tuple((k, type(v), number_key(v)) for k, v in kwargs.items()))
        try:
            return self.cache.get(tuple(key))
        except TypeError:  # an unhashable constant
            return MISS

    def _hit(
        self, rt: Any, tpl: Template, args: tuple[Any, ...], targs: list[Any], inputs: list[Operand | None]
    ) -> Any:
        """Record one hit of ``tpl`` and make its output tensors (an in-place op's: the tensor it writes)."""
        w = self.written
        if w is not None:
            if not writes_reach_base(targs[w]):
                return MISS  # the full path raises its error
            rt.executor.record_fast(tpl.plan, tuple(targs), inputs)
            stats["hit"] += 1
            rt.last_mesh = tpl.mesh
            return args[w]
        outs = rt.executor.record_fast(tpl.plan, tuple(targs), inputs)
        stats["hit"] += 1
        rt.last_mesh = tpl.mesh
        on_free = dispatch._free_callback(rt)
        gen = rt.generation
        wrap = TABLE.wrap_view if self.view_of is not None and not args[0].is_inference() else TABLE.wrap
        if self.kind == "single":
            return wrap(outs[0], gen, on_free, tpl.out_layouts[0])
        res = [wrap(o, gen, on_free, lay) for o, lay in zip(outs, tpl.out_layouts, strict=True)]
        return res if self.kind == "list" else tuple(res)

    def _hit_scalars(
        self,
        rt: Any,
        tpl: Template,
        args: tuple[Any, ...],
        targs: list[Any],
        scalars: list[tuple[int, Tensor]],
    ) -> Any:
        """A hit whose call has plain 0-d CPU tensors at ``scalars`` (``(position, tensor)``): each is uploaded as
        a Replicate operand on the template's mesh (its value is no part of the key; the workers compute with a
        0-d tensor of its dtype, so type promotion is torch's), the hit recorded on them, and the operands freed
        after it."""
        ex = rt.executor
        uploaded: list[Operand] = []
        for p, t in scalars:
            x = targs[p] = ex.upload_scalar(t, tpl.mesh, tpl.devices)
            uploaded.append(x)
        try:
            n = len(targs)
            inputs = [targs[p] if p < n else None for p in self.slot_pos]
            for k in tpl.const_slots:
                inputs[k] = None
            return self._hit(rt, tpl, args, targs, inputs)
        finally:
            for x in uploaded:
                ex.free(x)

    def _call_list(self, rt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """:meth:`__call__` of an op whose one tensor argument is a list: the key holds every element's layout;
        the tensor inputs are the elements."""
        gen = rt.generation
        entry = TABLE.entry
        lp = self.list_pos
        key: list[Any] = []
        targs = list(args)
        inputs: list[Operand | None] = []
        unbound: list[tuple[int, int, Operand]] | None = None
        for i, a in enumerate(args):
            if i == lp:
                if (type(a) is not list and type(a) is not tuple) or not a:
                    return MISS
                for t in a:
                    e = entry(t) if isinstance(t, Tensor) else None
                    if e is None or e.generation != gen or t.shape != e.shape:
                        return MISS
                    x = e.operand
                    if x.mesh is None:  # a KV cache's ``torch.tensor([], device=...)``: bound below
                        if unbound is None:
                            unbound = []
                        unbound.append((len(inputs), len(key), x))
                        key.append(None)
                        inputs.append(x)
                        continue
                    lid = e.layout
                    if lid is None:
                        lid = layout_of(x)
                        TABLE.set_layout(t, e, lid)
                    key.append(lid)
                    inputs.append(x)
                key.append(len(a))  # (ints: the key's other entries are tuples)
                targs[i] = list(inputs)
            elif isinstance(a, Tensor) or type(a) is list or type(a) is tuple:
                return MISS
            else:
                key.append(constant_key(a))
        if not inputs:
            return MISS
        if unbound is not None and not bind_elements(rt, unbound, inputs, key, targs, lp):  # type: ignore[arg-type]
            return MISS
        tpl = self._lookup(key, kwargs)
        if tpl is MISS:
            return MISS
        if tpl is None and self.grown:
            tpl = self._derive(rt, targs, kwargs, key)
        if tpl is None:
            return self._record(rt, args, kwargs, targs, tuple(key))
        _LEARNED.tpl = tpl
        return self._hit(rt, tpl, args, targs, inputs)

    def _derive(self, rt: Any, targs: list[Any], kwargs: dict[str, Any], key: list[Any]) -> Template | None:
        """A template derived from a kept decision of the call's growth key (:mod:`.fastpath_grow`), stored under
        the call's exact ``key``; ``None``: none applies (the full path plans the call)."""
        k = tuple(key)
        tpl = fastpath_grow.derive(self.grown, rt, get_rule(self.op), self.op, targs, kwargs, k, self)
        if tpl is not None:
            keep(self.cache, k, tpl, limit=_TEMPLATES_PER_OP)
        return tpl

    def _record(
        self,
        rt: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        targs: list[Any],
        key: tuple[Any, ...],
        alt: tuple[Any, ...] | None = None,
    ) -> Any:
        """Take the full path, then keep a template if the call qualifies."""
        out, last = full_path(rt, self.op, args, kwargs)
        if last is None:
            return out
        call, rule, outputs = last.call, last.rule, last.outputs
        if rule.output_is_input != self.written:
            return out
        if self.written is not None and (
            self.written in last.moved
            or outputs[0] is not last.inputs[self.written]
            or out is not args[self.written]
        ):
            return out  # (an in-place op whose write moved: never, its ``self`` is pinned; kept out all the same)
        n = len(targs)
        if self.list_pos is not None:
            expected = list(targs[self.list_pos])
        else:
            expected = [targs[p] if p < n and isinstance(targs[p], Operand) else None for p in self.slot_pos]
            if len(expected) == len(call.inputs):
                for k, p in enumerate(self.slot_pos):
                    if p < n and isinstance(targs[p], Tensor):  # a plain 0-d CPU tensor: its upload
                        x = call.inputs[k]
                        if not is_scalar_upload(x, targs[p]):
                            return out
                        targs[p] = expected[k] = x
        if len(expected) != len(call.inputs) or any(
            a is not b for a, b in zip(expected, call.inputs, strict=True)
        ):
            return out
        if any(o.mesh is None for o in outputs):
            return out
        first = next(x for x in expected if x is not None)
        tpl = Template(
            rule,
            call,
            op_plan=last.plan,
            moved=list(last.moved),
            out_specs=[(m, o.mesh, o.placements) for m, o in zip(last.plan.out_meta, outputs, strict=True)],
            mesh=first.mesh,
            slot_pos=self.slot_pos,
            owner=self,
            targs=targs,
        )
        keep(self.cache, key, tpl, limit=_TEMPLATES_PER_OP)
        if alt is not None and rule.view_of is None and self.written is None and fresh_dense(outputs):
            self.cache[alt] = tpl  # (the stride pattern's key: see _pattern_key)
        fastpath_grow.keep(self.grown, rt, rule, call, last.plan, outputs, key)
        _LEARNED.tpl = tpl
        stats["recorded"] += 1
        return out


_FAST: dict[Any, FastOp | FastListOp | FactoryOp | None] = {}


def _in_place_ok(schema: Any, written: int | None, rule: Any, nrets: int) -> bool:
    """An in-place op the fast path serves: it writes exactly its positional argument ``written`` (``Tensor(a!)``),
    returns that one tensor, and its rule pins it (a plan never moves the written input, so its placements stay)."""
    if written is None or nrets != 1 or rule.view_of is not None or written not in rule.pinned_inputs:
        return False
    args = schema.arguments
    if written >= len(args) or args[written].kwarg_only:
        return False
    writes = [k for k, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
    return writes == [written]


def _rule_changed(op: Any) -> None:
    """A rule registered, replaced or removed: the templates recorded with the old one must not shadow it (the
    op's kernel holds its FastOp, so the templates are emptied rather than the entry dropped)."""
    fast = _FAST.get(op)
    if fast is not None:
        fast.cache.clear()
        fast.grown.clear()
    if NATIVE is not None:
        NATIVE.invalidate()


add_rule_listener(_rule_changed)


def fast_op(op: Any) -> FastOp | FastListOp | FactoryOp | None:
    """The :class:`FastOp` of ``op`` (a :class:`~.fastpath_lists.FastListOp` for in-place list ops, a
    :class:`~.fastpath_factory.FactoryOp` for factories), or ``None``
    when ``op`` always takes the full path (random ops, other in-place ops than those that write their one pinned
    positional ``self`` or their first list, ops with several tensor-list arguments that write none, outputs of
    unknown structure)."""
    if op in _FAST:
        return _FAST[op]
    fast: FastOp | FastListOp | FactoryOp | None = None
    schema = getattr(op, "_schema", None)
    if schema is not None and op not in dispatch.RANDOM_OPS and list_op_fits(op):
        fast = FastListOp(op)  # in-place list ops (``_foreach_*_``): fastpath_lists.py
    elif schema is not None and op not in dispatch.RANDOM_OPS and factory_fits(op):
        fast = FactoryOp(op)  # no tensor argument (``arange``, ``full``): fastpath_factory.py
    elif schema is not None and op not in dispatch.RANDOM_OPS:
        rule = get_rule(op)
        specs = tensor_slot_specs(op)
        rets = schema.returns
        list_pos = None
        if len(specs) == 1 and specs[0][2] and specs[0][0] is not None:
            arg = next(a for a in schema.arguments if a.name == specs[0][1])
            list_pos = specs[0][0] if str(arg.type) == "List[Tensor]" else None
        if len(rets) == 1:
            kind = "list" if str(rets[0].type) == "List[Tensor]" else "single"
        else:
            kind = "tuple"
        written = rule.output_is_input
        optional = {a.name for a in schema.arguments if a.kwarg_only and str(a.type) == "Optional[Tensor]"}
        ok = (
            (written is None and not schema.is_mutable or _in_place_ok(schema, written, rule, len(rets)))
            and (
                list_pos is not None
                or all((pos is not None or name in optional) and not is_list for pos, name, is_list in specs)
            )
            and all(str(r.type) in ("Tensor", "List[Tensor]") for r in rets)
        )
        if ok:
            fast = FastOp(
                op,
                tuple(KWARG_SLOT if pos is None else pos for pos, _, _ in specs),
                kind,
                rule.view_of,
                list_pos=list_pos,
                written=written,
            )
    _FAST[op] = fast
    return fast


# --- the native kernel's side (torch_dtorch/device/_native.cpp) ------------------------------------------------------

#: the C++ extension when the tensor table is native, else ``None`` (the Python fast path above serves every call);
#: its hooks and kernel registration are in :mod:`torch_dtorch.device.fastpath_native`
NATIVE: Any = TABLE._m if TABLE.native else None  # type: ignore[union-attr]
