"""Worker side of the batch codec: :class:`BatchDecoder` (see :mod:`torch_dtorch.cluster.codec`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from torch_dtorch.cluster.codec.common import (
    BUILTIN_TAGS,
    CONST_TAG,
    CUSTOM,
    MAGIC,
    STEP_TYPES,
    TABLES,
    TORCH_CONSTS,
    VERSION,
    CodecError,
    Slot,
    nonfinite_from_body,
    resolve_op,
)
from torch_dtorch.cluster.codec.hits import HitDecoding, unpack
from torch_dtorch.executor.constructor import REDISTRIBUTE, BoundOp
from torch_dtorch.executor.instructions import Barrier, Fetch, Free, Instruction, Redistribute, RunOp, Upload
from torch_dtorch.graph import AssignInfo, Operand, Operator, OperatorCost, TensorMeta, ViewInfo
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placements, parse_placements
from torch_dtorch.placement_rules import OpCall
from torch_dtorch.placement_rules.redistribute.planner import RedistributePlan

__all__ = ["BatchDecoder", "DecodeContext"]

_CONST_TYPES = {tag: t for t, tag in CONST_TAG.items()}


class _Template:
    """A decoded operator template: everything of a RunOp but its node id, operands and call site."""

    __slots__ = (
        "op",
        "rule",
        "args",
        "kwargs",
        "cargs",
        "ckwargs",
        "flat",
        "stored",
        "family",
        "note",
        "assign",
        "cost",
        "mesh",
        "placements",
        "out_meta",
        "view_args",
    )
    op: Any
    rule: Any
    args: Any
    kwargs: Any
    cargs: Any
    ckwargs: Any
    flat: bool
    stored: bool
    family: str
    note: str
    assign: AssignInfo | None
    cost: OperatorCost
    mesh: DeviceMesh | None
    placements: list[Placements | None]
    out_meta: list[TensorMeta]
    view_args: tuple[Any, ...] | None


def _has_slot(v: Any) -> bool:
    t = type(v)
    if t is Slot:
        return True
    if t is list or t is tuple:
        return any(_has_slot(x) for x in v)
    if t is dict:
        return any(_has_slot(x) for x in v.values())
    return False


def _fill(v: Any, inputs: list[Operand | None]) -> Any:
    t = type(v)
    if t is Slot:
        return inputs[v.k]
    if t is list:
        return [_fill(x, inputs) for x in v]
    if t is tuple:
        return tuple([_fill(x, inputs) for x in v])
    if t is dict:
        return {k: _fill(x, inputs) for k, x in v.items()}
    return v


def _fill_flat(args: tuple[Any, ...], inputs: list[Operand | None]) -> tuple[Any, ...]:
    return tuple([inputs[a.k] if type(a) is Slot else a for a in args])


class DecodeContext:
    """Worker-side tables of one session; what :func:`register_codec` decoders use."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._operands: dict[int, Operand] = {}
        self._tables: dict[str, list[Any]] = {n: [] for n in TABLES}
        self._roots: dict[tuple[Any, ...], DeviceMesh] = {}
        self._placements: dict[str, Placements] = {}
        self._view_call: tuple[Any, tuple[Any, ...]] | None = None
        self._tensors: list[Any] = []

    def _lookup(self, table: str, ref: int) -> Any:
        try:
            return self._tables[table][ref]
        except (IndexError, TypeError):
            raise CodecError(
                f"unknown {table} ref {ref!r} (the decoder knows {len(self._tables[table])}): batches were decoded "
                "out of order, or the encoder and this decoder were not reset together"
            ) from None

    # --- public helpers ----------------------------------------------------------------------------------------
    def op(self, tree: Any) -> Any:
        """The op overload of an encoder's ``ctx.op(op)``."""
        return self._op(tree)[0]

    def mesh(self, tree: Any) -> DeviceMesh | None:
        if tree is None:
            return None
        if type(tree) is int:
            return self._lookup("mesh", tree)  # type: ignore[no-any-return]
        device_type, shape, ids, names, axes = tree
        rkey = (device_type, tuple(shape), tuple(ids), None if names is None else tuple(names))
        root = self._roots.get(rkey)
        if root is None:
            root = self._roots[rkey] = DeviceMesh(
                device_type, torch.tensor(ids, dtype=torch.int64).reshape(shape), mesh_dim_names=names
            )
        mesh = root if axes is None else root[tuple(names[a] for a in axes)]
        self._tables["mesh"].append(mesh)
        return mesh

    def operand(self, tree: Any) -> Operand | None:
        """The operand of an encoder's ``ctx.operand(x)`` (defined the first time, by id afterwards)."""
        if type(tree) is int:
            x = self._operands.get(tree)
            if x is None:
                x = self._lazy_operand(tree)  # type: ignore[attr-defined]
            if x is None:
                raise CodecError(
                    f"unknown operand %{tree}: the decoder never saw its definition (batches decoded out of order, "
                    "or the encoder and this decoder were not reset together)"
                )
            return x
        if tree is None:
            return None
        n = len(tree)
        shape, dtype, stride, mesh, placements, requires_grad, tag = self._otype(tree[1])
        base = self.operand(tree[2]) if n > 2 else None
        view = self._view(tree[3]) if n > 3 and tree[3] is not None else None
        copy_of = self.operand(tree[4]) if n > 4 else None
        x = Operand(
            tree[0],
            shape,
            dtype,
            mesh,
            placements,
            stride,
            base=base,
            view=view,
            requires_grad=requires_grad,
            tag=tag,
            copy_of=copy_of,
        )
        self._operands[x.id] = x
        return x

    def value(self, tree: Any) -> Any:
        """A constant of an encoder's ``ctx.value(v)``."""
        if type(tree) is not list:
            return tree
        tag = tree[0]
        if tag == "l":
            return [self.value(x) for x in tree[1:]]
        if tag == "t":
            return tuple([self.value(x) for x in tree[1:]])
        if tag == "@":
            return Slot(tree[1])
        if tag == "S":
            return torch.Size(tree[1:])
        if tag == "d":
            it = iter(tree[1:])
            return {self.value(k): self.value(v) for k, v in zip(it, it, strict=True)}
        if tag == "o":
            return self.operand(tree[1])
        kind = _CONST_TYPES.get(tag)
        if kind is not None:
            v = TORCH_CONSTS.get(tree[1])
            if type(v) is not kind:
                raise CodecError(f"unknown {kind.__name__} {tree[1]!r} in a batch (another torch version?)")
            return v
        if tag == "dv":
            return torch.device(tree[1])
        if tag == "T":
            t = self._tensors[tree[1]]
            if not isinstance(t, torch.Tensor):
                raise CodecError(f"tensor constant expected, got {type(t).__name__}")
            return t
        if tag == "f":
            return nonfinite_from_body(tree[1])
        if tag == "c":
            return complex(self.value(tree[1]), self.value(tree[2]))
        if tag == "p":
            return self._pl(tree[1])[0]
        raise CodecError(f"unknown value tag {tag!r} in {tree!r:.120}")

    # --- internals ---------------------------------------------------------------------------------------------
    def _op(self, tree: Any) -> tuple[Any, Any]:
        if type(tree) is int:
            return self._lookup("op", tree)  # type: ignore[no-any-return]
        entry = resolve_op(tree)
        self._tables["op"].append(entry)
        return entry

    def _pl(self, text: str) -> Placements:
        pl = self._placements.get(text)
        if pl is None:
            pl = self._placements[text] = parse_placements(text)
        return pl

    def _dtype(self, name: str) -> torch.dtype:
        d = TORCH_CONSTS.get(name)
        if type(d) is not torch.dtype:
            raise CodecError(f"unknown dtype {name!r} in a batch (another torch version?)")
        return d

    def _otype(self, tree: Any) -> tuple[Any, ...]:
        if type(tree) is int:
            return self._lookup("otype", tree)  # type: ignore[no-any-return]
        shape, dtype, stride, mesh, placements, requires_grad, tag = tree
        entry = (
            tuple(shape),
            self._dtype(dtype),
            None if stride is None else tuple(stride),
            self.mesh(mesh),
            self._pl(placements),
            requires_grad,
            tag,
        )
        self._tables["otype"].append(entry)
        return entry

    def _view(self, tree: Any) -> ViewInfo:
        if tree == 1:
            if self._view_call is None:
                raise CodecError("a view operand refers to its carrying call outside of a RunOp")
            return ViewInfo(*self._view_call)
        return ViewInfo(self.op(tree[0]), self.value(tree[1]))


class BatchDecoder(DecodeContext, HitDecoding):
    """Worker side: one per worker and session. ``decode(tree)`` -> instructions, in the encoder's order.

    ``progress``: called with an op's name when a hit record is materialized for the general path (the worker
    process's heartbeat notes the op in flight)."""

    def __init__(self) -> None:
        super().__init__()
        self._batch_no = 0
        self.progress: Any = None

    def reset(self) -> None:
        super().reset()
        self._hits_reset()
        self._batch_no = 0

    def decode(self, tree: Any) -> list[Instruction]:
        """Instructions of one batch tree (as ``wire.decode`` returns it, or straight from ``encode``)."""
        if type(tree) not in (list, tuple) or len(tree) < 2 or tree[0] != MAGIC:
            raise CodecError(f"not an instruction batch of this codec: {tree!r:.120}")
        version = tree[1]
        if version != VERSION or len(tree) != 9:
            raise CodecError(
                f"instruction batch format version {version!r}, this worker decodes version {VERSION}: run the "
                "same torch_dtorch version on the controller and the workers"
            )
        _magic, version, batch_no, reset, cleared, dropped, payload, hit_frame, tensors = tree
        if reset:
            self.reset()
        elif batch_no != self._batch_no + 1:
            raise CodecError(
                f"instruction batch {batch_no} arrived after batch {self._batch_no}: batches must be decoded once "
                "each, in order (reset the encoder to start a new session)"
            )
        try:
            instrs = json.loads(payload)
        except (TypeError, ValueError) as e:
            raise CodecError(f"instruction batch {batch_no}: the payload is not JSON bytes ({e})") from None
        words = unpack(hit_frame, batch_no=batch_no)
        self._batch_no = batch_no
        self._grave = {}  # the previous batch has run: what it freed is gone now
        for name in cleared:
            if name not in self._tables:
                raise CodecError(
                    f"unknown table {name!r} cleared by the encoder; known: {list(self._tables)}"
                )
            self._tables[name].clear()
        pop, lazy_pop = self._operands.pop, self._lazy.pop
        for i in dropped:
            pop(i, None)
            lazy_pop(i, None)
        self._tensors = list(tensors)
        self._words, self._hit_pos = words, 0
        try:
            out = [self._instr(t) for t in instrs]
            if self._hit_pos != len(words):
                raise CodecError(
                    f"instruction batch {batch_no}: {len(words) - self._hit_pos} words of the hit frame belong to "
                    "no hit run (truncated or malformed)"
                )
            return out
        except CodecError:
            raise
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise CodecError(f"instruction batch {batch_no} is malformed: {type(e).__name__}: {e}") from e
        finally:
            self._tensors = []

    def _instr(self, tree: Any) -> Any:
        tag = tree[0]
        if tag == "R":
            return self._run_op(tree)
        if tag == "X":
            return self._redistribute(tree)
        if tag == "H":
            return self._hit_run(tree[1])
        if tag == "Y":
            return self._define_hit(tree)
        if tag == "D":
            ids = [int(i) for i in tree[1]]
            self._free(ids)
            return Free(ids)
        if tag == "U":
            return Upload(self.operand(tree[1]), self.value(tree[2]))  # type: ignore[arg-type]
        if tag == "F":
            return Fetch(self.operand(tree[1]), self.value(tree[2]), tuple(tree[3]))  # type: ignore[arg-type]
        if tag == "B":
            return Barrier(self.value(tree[1]))
        custom = CUSTOM.get(tag) if isinstance(tag, str) else None
        if custom is None:
            raise CodecError(
                f"unknown instruction tag {tag!r}: known tags are {sorted(BUILTIN_TAGS)} and the registered "
                f"{sorted(CUSTOM)}; the worker must import the module that calls register_codec for it"
            )
        return custom[2](tree[1], self)

    def operator(self, tree: Any) -> Operator:
        """The operator of an encoder's ``ctx.operator(node)``."""
        if type(tree) is not list or tree[:1] not in (["R"], ["X"]):
            raise CodecError(f"not an operator tree: {tree!r:.120}")
        return (self._run_op(tree) if tree[0] == "R" else self._redistribute(tree)).node

    def _run_op(self, tree: list[Any]) -> RunOp:
        _tag, node_id, ins, tmpl_tree, outs, call_site = tree
        inputs = [self.operand(r) for r in ins]
        tm = self._template(tmpl_tree)
        return self._make_run_op(node_id, inputs, tm, outs, call_site)

    def _make_run_op(
        self, node_id: int, inputs: list[Operand | None], tm: _Template, outs: list[Any], call_site: Any
    ) -> RunOp:
        """The ``RunOp`` of template ``tm`` on ``inputs``; ``outs``: output trees (or operands)."""
        if tm.flat:
            args = _fill_flat(tm.args, inputs)
            kwargs = (
                {k: inputs[v.k] if type(v) is Slot else v for k, v in tm.kwargs.items()} if tm.kwargs else {}
            )
        else:
            args, kwargs = _fill(tm.args, inputs), _fill(tm.kwargs, inputs)
        if tm.cargs is None:
            cargs, ckwargs = args, kwargs
        else:
            cargs, ckwargs = _fill(tm.cargs, inputs), _fill(tm.ckwargs, inputs)
        view_args = tm.view_args
        if view_args is None:
            view_args = tuple(a for a in cargs if not isinstance(a, Operand))
        self._view_call = (tm.op, view_args)
        try:
            outputs = [r if type(r) is Operand else self.operand(r) for r in outs]
        finally:
            self._view_call = None
        call = OpCall(tm.op, cargs, ckwargs, inputs, tm.mesh, list(tm.placements), tm.out_meta)
        node = Operator(
            node_id,
            tm.op,
            args,
            kwargs,
            inputs,
            outputs,  # type: ignore[arg-type]
            family=tm.family,
            assign=tm.assign,
            cost=tm.cost,
            note=tm.note,
            payload=BoundOp(tm.rule, call),
        )
        # a stored, flat template is the same object for every call of this op and layout: workers replay it
        replay_key = tm if tm.stored and tm.flat and tm.cargs is None else None
        return RunOp(node, call_site, replay_key=replay_key)

    def _template(self, tree: Any) -> _Template:
        if type(tree) is int:
            return self._lookup("tmpl", tree)  # type: ignore[no-any-return]
        one_shot = tree[0] == "!"
        d = tree[1] if one_shot else tree
        op_ref, args, kwargs, cargs, family, note, assign, cost, mesh, placements, out_meta = d
        tm = _Template()
        tm.op, tm.rule = self._op(op_ref)
        tm.args, tm.kwargs = self.value(args), self.value(kwargs)
        tm.cargs, tm.ckwargs = (None, None) if cargs is None else (self.value(cargs[0]), self.value(cargs[1]))
        tm.flat = cargs is None and not any(type(a) is not Slot and _has_slot(a) for a in tm.args)
        tm.flat = tm.flat and not any(type(v) is not Slot and _has_slot(v) for v in tm.kwargs.values())
        tm.view_args = tuple(a for a in tm.args if type(a) is not Slot) if tm.flat else None
        tm.family, tm.note = family, note
        tm.assign = _assign(assign)
        tm.cost = OperatorCost(*cost)
        tm.mesh = self.mesh(mesh)
        tm.placements = [None if p is None else self._pl(p) for p in placements]
        tm.out_meta = [
            TensorMeta(tuple(s), self._dtype(dt), None if st is None else tuple(st)) for s, dt, st in out_meta
        ]
        tm.stored = not one_shot
        if not one_shot:
            self._tables["tmpl"].append(tm)
        return tm

    def _redistribute(self, tree: list[Any]) -> Redistribute:
        _tag, node_id, x_tree, tmpl_tree, y_tree, call_site = tree
        x = self.operand(x_tree)
        plan, assign, cost, note, family = self._plan(tmpl_tree)
        y = self.operand(y_tree)
        assert x is not None and y is not None
        node = Operator(
            node_id,
            REDISTRIBUTE,
            (x,),
            {},
            [x],
            [y],
            family=family,
            assign=assign,
            cost=cost,
            note=note,
            payload=plan,
        )
        return Redistribute(node, call_site)

    def _plan(self, tree: Any) -> tuple[Any, ...]:
        if type(tree) is int:
            return self._lookup("tmpl", tree)  # type: ignore[no-any-return]
        shape, src_mesh, src_pl, dst_mesh, dst_pl, steps, assign, cost, note, family = tree
        src = self.mesh(src_mesh)
        src_placements = self._pl(src_pl)
        dst = self.mesh(dst_mesh)
        plan = RedistributePlan(
            tuple(shape),
            src,  # type: ignore[arg-type]
            src_placements,
            dst,  # type: ignore[arg-type]
            self._pl(dst_pl),
            tuple(self._step(s) for s in steps),
        )
        entry = (plan, _assign(assign), OperatorCost(*cost), note, family)
        self._tables["tmpl"].append(entry)
        return entry

    def _step(self, tree: list[Any]) -> Any:
        cls = STEP_TYPES.get(tree[0])
        if cls is None:
            raise CodecError(f"unknown redistribute step {tree[0]!r}; known: {sorted(STEP_TYPES)}")
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**dict(zip(names, (self.value(v) for v in tree[1:]), strict=True)))


def _assign(tree: Any) -> AssignInfo | None:
    return None if tree is None else AssignInfo(tuple(tree[0]), tree[1])
