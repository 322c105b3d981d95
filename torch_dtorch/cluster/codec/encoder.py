"""Controller side of the batch codec: :class:`BatchEncoder` (see :mod:`torch_dtorch.cluster.codec`)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_dtorch.cluster.codec.common import (
    CONST_TAG,
    CUSTOM,
    CUSTOM_BY_TYPE,
    MAGIC,
    MAX_FAST,
    MAX_OPERANDS,
    MAX_TABLE,
    TABLES,
    VERSION,
    CodecError,
    nonfinite_body,
    op_name,
    pl_str,
    template_key,
)
from torch_dtorch.cluster.codec.hits import FREE, HitEncoding, hits_enabled, pack
from torch_dtorch.errors import NoRuleError
from torch_dtorch.executor.constructor import REDISTRIBUTE, BoundOp
from torch_dtorch.executor.instructions import (
    Barrier,
    FastRun,
    Fetch,
    Free,
    Instruction,
    Redistribute,
    RunOp,
    Upload,
)
from torch_dtorch.graph import AssignInfo, Operand, Operator, OperatorCost, TensorMeta, ViewInfo
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placement
from torch_dtorch.placement_rules import get_rule
from torch_dtorch.placement_rules.redistribute.planner import RedistributePlan
from torch_dtorch.runtime.native_replay import hit_encoder

__all__ = ["BatchEncoder", "EncodeContext"]


class EncodeContext:
    """Controller-side tables of one session; what :func:`register_codec` encoders use.

    Every table has a value-keyed index shared with the decoder (ids in definition order) and, for the hot path, an
    identity-keyed index (``id()`` of objects the controller reuses: plan outputs, assign infos, placements tuples)
    whose entries keep those objects alive, so an id cannot be reused while it is indexed."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._operands: dict[int, Operand] = {}
        self._tables: dict[str, dict[Any, int]] = {n: {} for n in TABLES}
        self._fast: dict[str, dict[Any, tuple[Any, ...]]] = {n: {} for n in TABLES}
        self._slots: list[Operand | None] | None = None
        self._view_call: tuple[Any, tuple[Any, ...]] | None = None
        self._tensors: list[torch.Tensor] = []

    def _intern(self, table: str, key: Any, make: Callable[[], Any]) -> tuple[Any, int]:
        """``(tree, ref)``: the ref when known, else the definition (and the ref it gets)."""
        t = self._tables[table]
        ref = t.get(key)
        if ref is not None:
            return ref, ref
        d = make()  # may define entries of other tables first: the decoder sees them in the same order
        ref = t[key] = len(t)
        return d, ref

    # --- public helpers ----------------------------------------------------------------------------------------
    def op(self, op: Any) -> Any:
        """Ref of an op overload (its qualified name the first time)."""
        return self._intern("op", op, lambda: op_name(op))[0]

    def mesh(self, mesh: DeviceMesh | None) -> Any:
        if mesh is None:
            return None
        return self._intern("mesh", mesh, lambda: _mesh_def(mesh))[0]

    def operand(self, x: Operand | None) -> Any:
        """Ref of an operand: its id once the decoder knows it, else its definition."""
        if x is None:
            return None
        if self._operands.get(x.id) is x:
            return x.id
        fast = self._fast["otype"]
        k1 = (x.shape, x.dtype, x.stride, id(x.mesh), id(x.placements), x.requires_grad, x.tag)
        hit = fast.get(k1)
        if hit is not None:
            ot: Any = hit[0]
        else:
            key = (x.shape, x.dtype, x.stride, x.mesh, x.placements, x.requires_grad, x.tag)
            ot, ref = self._intern("otype", key, lambda: self._otype(x))
            fast[k1] = (ref, x.mesh, x.placements)
        if x.base is None and x.view is None and x.copy_of is None:
            d: list[Any] = [x.id, ot]
        else:
            d = [x.id, ot, self.operand(x.base), None if x.view is None else self._view(x.view)]
            d.append(self.operand(x.copy_of))
            while d[-1] is None:
                d.pop()
        self._operands[x.id] = x
        return d

    def value(self, v: Any) -> Any:
        """A constant (see the module docstring) as a JSON-able tree; operands become refs."""
        t = type(v)
        if v is None or t is bool or t is int or t is str:
            return v
        if t is float:
            return v if math.isfinite(v) else ["f", nonfinite_body(v)]
        if t is list or t is tuple or t is torch.Size:
            return ["l" if t is list else "t" if t is tuple else "S", *[self.value(x) for x in v]]
        if t is dict:
            out = ["d"]
            for k, x in v.items():
                out.append(self.value(k))
                out.append(self.value(x))
            return out
        if t is Operand:
            return self._slot(v) if self._slots is not None else ["o", self.operand(v)]
        tag = CONST_TAG.get(t)
        if tag is not None:
            return [tag, str(v).removeprefix("torch.")]
        if t is torch.device:
            return ["dv", str(v)]
        if t is complex:
            return ["c", self.value(v.real), self.value(v.imag)]
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided or v.is_meta or v.device.type == "privateuseone":
                raise CodecError(
                    f"cannot send tensor constant {v.dtype}{list(v.shape)} on {v.device} ({v.layout})"
                )
            self._tensors.append(v.detach())
            return ["T", len(self._tensors) - 1]
        if isinstance(v, Placement):
            return ["p", pl_str((v,))]
        raise CodecError(
            f"cannot encode a constant of type {t.__qualname__} ({v!r:.80}); op arguments may be None, bool, int, "
            "float, complex, str, dtype, device, layout, memory_format, torch.Size, placements, tensors and "
            "lists/tuples/dicts of those"
        )

    # --- internals ---------------------------------------------------------------------------------------------
    def _slot(self, x: Operand) -> Any:
        assert self._slots is not None
        try:
            return ["@", self._slots.index(x)]
        except ValueError:
            raise CodecError(
                f"operand {x.describe()} appears in the arguments but not among the operator's inputs"
            ) from None

    def _otype(self, x: Operand) -> list[Any]:
        return [
            list(x.shape),
            str(x.dtype).removeprefix("torch."),
            None if x.stride is None else list(x.stride),
            self.mesh(x.mesh),
            pl_str(x.placements),
            x.requires_grad,
            x.tag,
        ]

    def _view(self, view: ViewInfo) -> Any:
        call = self._view_call
        if call is not None and view.op is call[0] and view.args == call[1]:
            return 1  # the carrying call's op and non-tensor args
        saved, self._slots = self._slots, None
        try:
            return [self.op(view.op), self.value(view.args)]
        finally:
            self._slots = saved


def _mesh_def(mesh: DeviceMesh) -> list[Any]:
    root = mesh.root
    return [
        root.device_type,
        list(root.shape),
        root.mesh.flatten().tolist(),
        None if root.mesh_dim_names is None else list(root.mesh_dim_names),
        list(mesh.root_axes) if mesh.is_submesh else None,
    ]


def _assign_enc(a: AssignInfo | None) -> Any:
    return None if a is None else [list(a.devices), a.stream]


def _cost_enc(c: OperatorCost) -> list[int]:
    return [c.flops, c.bytes_read, c.bytes_written, c.comm_bytes]


def _meta_enc(m: TensorMeta) -> list[Any]:
    return [list(m.shape), str(m.dtype).removeprefix("torch."), None if m.stride is None else list(m.stride)]


class BatchEncoder(EncodeContext, HitEncoding):
    """Controller side: one per cluster session. ``encode(batch)`` -> tree for ``wire.encode``: the instructions
    as compact JSON bytes (one signed frame), the fast-path hits and frees as binary records (one signed frame,
    :mod:`~torch_dtorch.cluster.codec.hits`) plus the tensor constants (zero-copy frames).

    ``hits``: send hits as records (default ``DTORCH_WIRE_HITS``, on); ``False`` sends every instruction as JSON.
    ``native``: encode runs of records in C++ (``_replay.cpp``'s ``encode_hits``; default: where the extension
    is built), the Python encoder taking each instruction the lane stops at."""

    def __init__(self, *, hits: bool | None = None, native: bool | None = None) -> None:
        self.hits = hits_enabled() if hits is None else hits
        self.lane: Callable[..., int] | None = hit_encoder() if native is not False else None
        if native and self.lane is None:
            raise RuntimeError(
                "BatchEncoder(native=True): the native extension is not built (docs/building.md)"
            )
        super().__init__()
        self._batch_no = 0
        self._send_reset = True

    def reset(self) -> None:
        """Forget every table; the next batch tells the decoders to forget theirs too."""
        super().reset()
        self._hits_reset()
        self._batch_no = 0
        self._send_reset = True

    def encode(self, batch: Sequence[Instruction]) -> Any:
        cleared = [n for n, t in self._tables.items() if len(t) > MAX_TABLE]
        if "mesh" in cleared and "otype" not in cleared:  # operand types name meshes
            cleared.append("otype")
        for n in cleared:
            self._tables[n].clear()
            self._fast[n].clear()
        for fast in self._fast.values():
            if len(fast) > MAX_FAST:  # identity index only: the decoder is not involved
                fast.clear()
        if len(self._hit_ok) > MAX_FAST:
            self._hit_ok.clear()
        dropped: list[int] = []
        if len(self._operands) > MAX_OPERANDS:
            dropped = list(self._operands)[: len(self._operands) - MAX_OPERANDS * 3 // 4]
            for i in dropped:
                del self._operands[i]
        self._tensors = []
        words: list[int] = []
        self._words = words
        try:
            instrs: list[Any] = []
            if self.hits:
                mark = 0  # words[mark:] are records the JSON list does not place yet
                hit, free_words = self._hit, self._free_words
                lane, known, table = self.lane, self._operands, self._tables["hit"]
                size, at = len(batch), 0
                while at < size:
                    if lane is not None:
                        at = lane(batch, at, FastRun, Free, known, table, words, FREE)
                        if at >= size:
                            break
                    instr = batch[at]
                    at += 1
                    t = type(instr)
                    if t is FastRun:
                        trees = hit(instr)  # type: ignore[arg-type]
                        if trees is None:
                            continue
                    elif t is Free:
                        free_words(instr.operand_ids)  # type: ignore[union-attr]
                        continue
                    else:
                        trees = [self._instr(instr)]
                    if len(words) > mark:
                        instrs.append(["H", len(words) - mark])
                        mark = len(words)
                    instrs.extend(trees)
                if len(words) > mark:
                    instrs.append(["H", len(words) - mark])
            else:
                for instr in batch:
                    if type(instr) is FastRun:
                        instrs.extend(self._instr(part) for part in instr.expand())  # type: ignore[union-attr]
                    else:
                        instrs.append(self._instr(instr))
            payload = json.dumps(instrs, separators=(",", ":"), allow_nan=False).encode()
        except BaseException:
            self.reset()  # the tables may hold entries the decoders never saw: start over next batch
            raise
        self._batch_no += 1
        reset, self._send_reset = self._send_reset, False
        tensors, self._tensors = self._tensors, []
        hits = pack(words) if words else None
        self._words = []
        return [MAGIC, VERSION, self._batch_no, reset, sorted(cleared), dropped, payload, hits, tensors]

    def _instr(self, instr: Any) -> Any:
        t = type(instr)
        if t is RunOp:
            return self._run_op(instr)
        if t is Redistribute:
            return self._redistribute(instr)
        if t is Free:
            pop = self._operands.pop
            for i in instr.operand_ids:
                pop(i, None)
            return ["D", list(instr.operand_ids)]
        if t is Upload:
            return ["U", self.operand(instr.operand), self.value(instr.key)]
        if t is Fetch:
            return ["F", self.operand(instr.operand), self.value(instr.key), list(instr.devices)]
        if t is Barrier:
            return ["B", self.value(instr.key)]
        tag = CUSTOM_BY_TYPE.get(t)
        if tag is None:
            raise CodecError(
                f"BatchEncoder.encode: no codec for instruction type {t.__qualname__}; register one with "
                "torch_dtorch.cluster.codec.register_codec(cls, tag=..., encode=..., decode=...)"
            )
        return [tag, CUSTOM[tag][1](instr, self)]

    def operator(self, node: Operator) -> Any:
        """Tree of one operator (a ``BoundOp`` payload or a redistribute plan) for custom codecs, e.g. a compiled
        program's operator list; :meth:`BatchDecoder.operator` rebuilds it."""
        if node.op == REDISTRIBUTE:
            return self._redistribute(Redistribute(node))
        return self._run_op(RunOp(node))

    def _run_op(self, instr: RunOp) -> list[Any]:
        node = instr.node
        bound = node.payload
        if type(bound) is not BoundOp:
            raise CodecError(f"RunOp {node.name}: payload is {type(bound).__name__}, expected a BoundOp")
        call = bound.call
        inputs = node.inputs
        if call.inputs is not inputs and call.inputs != inputs:
            raise CodecError(f"RunOp {node.name}: the call's inputs differ from the operator's inputs")
        operand = self.operand
        known = self._operands
        ins = [x.id if x is not None and known.get(x.id) is x else operand(x) for x in inputs]
        args, kwargs = node.args, node.kwargs
        same = call.args is args and call.kwargs is kwargs
        op, out_meta, assign, cost, mesh = node.op, call.out_meta, node.assign, node.cost, call.mesh
        key: list[Any] = [id(op), id(out_meta), id(assign), id(cost), id(mesh), node.family, node.note, same]
        key.extend(map(id, call.placements))
        n_fast = len(key)
        ok = template_key(args, key, inputs) and (not kwargs or template_key(kwargs, key, inputs))
        if ok and not same:
            ok = template_key(call.args, key, inputs) and template_key(call.kwargs, key, inputs)
        tmpl: Any
        if ok:
            fast = self._fast["tmpl"]
            k1 = tuple(key)
            hit = fast.get(k1)
            if hit is not None:
                tmpl = hit[0]
            else:
                k2 = (
                    op,
                    tuple(out_meta),
                    assign,
                    cost,
                    mesh,
                    node.family,
                    node.note,
                    same,
                    tuple(call.placements),
                    *key[n_fast:],
                )
                tmpl, ref = self._intern("tmpl", k2, lambda: self._template(node, bound))
                fast[k1] = (ref, op, out_meta, assign, cost, mesh, call.placements)
        else:
            tmpl = ["!", self._template(node, bound)]  # one-shot (tensor constants): never stored
        outputs = node.outputs
        if any([o.view is not None for o in outputs]):
            self._view_call = (op, tuple(a for a in call.args if not isinstance(a, Operand)))
            try:
                outs = [operand(o) for o in outputs]
            finally:
                self._view_call = None
        else:
            outs = [o.id if known.get(o.id) is o else operand(o) for o in outputs]
        return ["R", node.id, ins, tmpl, outs, instr.call_site]

    def _template(self, node: Operator, bound: BoundOp) -> list[Any]:
        call = bound.call
        try:
            registered = get_rule(node.op)
        except NoRuleError:
            registered = None
        if registered is not bound.rule:
            raise CodecError(
                f"RunOp {node.name}: its rule {bound.rule!r} is not the registered rule of {node.op}; workers find "
                "rules again in the registry, so register the rule (register_rule) instead of passing it directly"
            )
        same = call.args is node.args and call.kwargs is node.kwargs
        op_ref = self.op(node.op)
        self._slots = node.inputs
        try:
            args = [
                self.value(node.args),
                self.value(node.kwargs),
                None if same else [self.value(call.args), self.value(call.kwargs)],
            ]
        finally:
            self._slots = None
        return [
            op_ref,
            *args,
            node.family,
            node.note,
            _assign_enc(node.assign),
            _cost_enc(node.cost),
            self.mesh(call.mesh),
            [None if p is None else pl_str(p) for p in call.placements],
            [_meta_enc(m) for m in call.out_meta],
        ]

    def _redistribute(self, instr: Redistribute) -> list[Any]:
        node = instr.node
        plan = node.payload
        if type(plan) is not RedistributePlan or len(node.inputs) != 1 or len(node.outputs) != 1:
            raise CodecError(
                f"Redistribute {node.name}: expected one input, one output and a RedistributePlan"
            )
        x = self.operand(node.inputs[0])
        fast = self._fast["tmpl"]
        rest = (plan.src_placements, plan.dst_placements, node.assign, node.cost, node.note, node.family)
        k1 = (plan.shape, id(plan.steps), id(plan.src_mesh), id(plan.dst_mesh), *rest)
        hit = fast.get(k1)
        if hit is not None:
            tmpl: Any = hit[0]
        else:
            k2 = (plan, *rest)
            tmpl, ref = self._intern("tmpl", k2, lambda: self._plan(node, plan))
            fast[k1] = (ref, plan.steps, plan.src_mesh, plan.dst_mesh)
        return ["X", node.id, x, tmpl, self.operand(node.outputs[0]), instr.call_site]

    def _plan(self, node: Operator, plan: RedistributePlan) -> list[Any]:
        return [
            list(plan.shape),
            self.mesh(plan.src_mesh),
            pl_str(plan.src_placements),
            self.mesh(plan.dst_mesh),
            pl_str(plan.dst_placements),
            [
                [type(s).__name__, *(self.value(getattr(s, f.name)) for f in dataclasses.fields(s))]
                for s in plan.steps
            ],
            _assign_enc(node.assign),
            _cost_enc(node.cost),
            node.note,
            node.family,
        ]
