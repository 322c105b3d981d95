"""``GraphConstructor``: turns op calls on operands into LogicalGraph operators, with placements inferred by the
rules and redistributes inserted where an input must change layout. Runners (next layer) execute what it records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from torch_dtorch.config import RedistributePolicy
from torch_dtorch.executor.dtype_check import check_dtypes
from torch_dtorch.executor.memory_check import MemoryGuard, shard_bytes
from torch_dtorch.graph import AssignInfo, LogicalGraph, Operand, Operator, OperatorCost, TensorMeta, ViewInfo
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placement, Placements, Replicate, normalize_placements, placements_str
from torch_dtorch.placement_rules import OpCall, OpRule, get_rule
from torch_dtorch.placement_rules.redistribute.planner import RedistributePlan, plan_redistribute

__all__ = ["BoundOp", "GraphConstructor", "LastCall", "RedistributeSpec", "redistribute_spec"]

log = logging.getLogger(__name__)

REDISTRIBUTE = "redistribute"


class BoundOp(NamedTuple):
    """What a worker needs to run one operator: its rule and the call on the (redistributed) operands."""

    rule: OpRule
    call: OpCall


class LastCall(NamedTuple):
    """What :meth:`GraphConstructor.call` decided for its last call (the eager fast path builds its templates from
    it; the eager executor frees the moved copies)."""

    op: Any
    call: OpCall
    rule: OpRule
    plan: Any  # the rule's OpPlan
    #: input slots that were redistributed first
    moved: Sequence[int]
    outputs: list[Operand]
    #: the inputs after the moves (the copies in the moved slots)
    inputs: list[Operand | None]


class RedistributeSpec(NamedTuple):
    """Everything about one redistribute of an operand of a given layout (the eager fast path keeps these)."""

    plan: RedistributePlan
    out_mesh: DeviceMesh
    out_placements: Placements
    assign: AssignInfo
    cost: OperatorCost
    note: str

    def operator_fields(self, x: Operand, y: Operand) -> dict[str, Any]:
        """The fields of the redistribute operator that moves ``x`` to ``y`` (besides its id and op), the same
        whether the constructor records it or the fast path expands a hit."""
        return {
            "args": (x,),
            "kwargs": {},
            "inputs": [x],
            "outputs": [y],
            "family": "collective",
            "assign": self.assign,
            "cost": self.cost,
            "note": self.note,
            "payload": self.plan,
        }


def redistribute_spec(
    x: Operand, mesh: DeviceMesh, root_placements: Placements, *, user_mesh: DeviceMesh | None = None
) -> RedistributeSpec:
    """Plan moving ``x`` to ``root_placements`` on ``mesh`` (which may be another mesh: a stage move)."""
    assert x.mesh is not None
    plan: RedistributePlan = plan_redistribute(
        x.shape, x.mesh, x.placements, dst_mesh=mesh.root, dst_placements=root_placements
    )
    out_mesh = user_mesh if user_mesh is not None else mesh.root
    out_pl = out_mesh.from_root_placements(root_placements)
    if out_pl is None:
        out_mesh, out_pl = mesh.root, root_placements
    nbytes = x.nbytes()
    return RedistributeSpec(
        plan,
        out_mesh,
        out_pl,
        AssignInfo(tuple(sorted(set(x.mesh.devices) | set(mesh.devices))), "comm"),
        OperatorCost(bytes_read=nbytes, bytes_written=nbytes, comm_bytes=int(plan.comm_bytes(x.itemsize))),
        "; ".join(str(s) for s in plan.steps) or "no-op",
    )


class GraphConstructor:
    """Adds operators to a :class:`LogicalGraph`.

    Args:
        graph: the graph to append to (a new one by default).
        default_mesh: mesh for calls with no distributed input (factories).
        policy: redistribute policy override (default: ``DTORCH_REDISTRIBUTE``).
    """

    def __init__(
        self,
        graph: LogicalGraph | None = None,
        *,
        default_mesh: DeviceMesh | None = None,
        policy: RedistributePolicy | None = None,
    ) -> None:
        self.graph = graph if graph is not None else LogicalGraph()
        self.default_mesh = default_mesh
        self.policy = policy
        #: called with every operator added (redistributes included), in order: how executors stream work
        self.listeners: list[Callable[[Operator], None]] = []
        #: what the last :meth:`call` decided
        self.last_call: LastCall | None = None
        #: calls planned in full (:meth:`call`: rule matching and planning); the eager fast path replays the rest
        self.num_planned = 0
        #: the memory pre-check of the planned allocations (:mod:`.memory_check`; ``None``: not checked)
        self.memory: MemoryGuard | None = None

    # --- inputs -------------------------------------------------------------------------------------------------
    def input(
        self,
        shape: Sequence[int],
        mesh: DeviceMesh | None,
        placements: Sequence[Placement] | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        tag: str | None = None,
    ) -> Operand:
        """A distributed input (parameter, activation) that lives on the workers already."""
        mesh = mesh if mesh is not None else self.default_mesh
        if mesh is None:
            return self.graph.add_input(shape, None, (), dtype=dtype, tag=tag)
        if placements is None:
            placements = [Replicate()] * mesh.ndim
        pl = normalize_placements(placements, ndim=len(shape), mesh_ndim=mesh.ndim, what=tag or "input")
        return self.graph.add_input(shape, mesh, pl, dtype=dtype, tag=tag)

    # --- ops ----------------------------------------------------------------------------------------------------
    def call(
        self,
        op: Any,
        *args: Any,
        placements: Sequence[Placements] | None = None,
        device_mesh: DeviceMesh | None = None,
        **kwargs: Any,
    ) -> Any:
        """Record ``op(*args, **kwargs)`` on operands; returns the output operand(s) in the op's structure.

        ``placements``/``device_mesh`` request output placements (factories), as in ``torch.zeros(...,
        device_mesh=mesh, placements=[Shard(0)])``.
        """
        self.num_planned += 1
        call = OpCall.make(op, args, kwargs, mesh=device_mesh or self.default_mesh)
        rule = get_rule(op)
        prefer: tuple[Placements, ...] | None = None
        mesh_for_out = self._output_mesh(call, device_mesh)
        if placements is not None:
            if mesh_for_out is None:
                raise ValueError(f"{op}: placements= given without a device mesh; pass device_mesh=")
            prefer = tuple(mesh_for_out.to_root_placements(p) for p in placements)
        plan = rule.plan(call, policy=self.policy, prefer_outputs=prefer)
        check_dtypes(rule, call)  # meta tensors miss dtype errors (int @ float, bool & float, int // 0)
        inputs = list(call.inputs)
        moved = plan.match.needs_redistribute(call)
        sizes = (
            self._check_memory(op, call, rule, plan, moved, mesh_for_out) if self.memory is not None else None
        )
        for i in moved:
            x = inputs[i]
            assert x is not None and call.mesh is not None
            target = plan.match.in_targets[i]
            assert target is not None
            log.debug(
                "%s: input %d %s -> %s",
                op,
                i,
                placements_str(call.placements[i] or ()),
                placements_str(target),
            )
            inputs[i] = self._redistribute(x, call.mesh, target)
        bound = BoundOp(rule, call.retarget(inputs, list(plan.match.in_targets)))
        if rule.output_is_input is not None:  # in-place: the output is the (pinned, unmoved) input itself
            written = inputs[rule.output_is_input]
            assert written is not None
            _check_write_reaches_base(op, written)
            outputs = [written]
        elif (
            rule.writes_inputs
        ):  # list ops in place (``_foreach_add_``): the outputs are the first input slots
            outputs = []
            for written in inputs[: len(plan.out_meta)]:
                assert written is not None
                _check_write_reaches_base(op, written)
                outputs.append(written)
        else:
            outputs = [
                self._new_output(meta, pl, call, mesh_for_out, rule.view_of, inputs)
                for meta, pl in zip(plan.out_meta, plan.out_placements, strict=True)
            ]
        self._emit(
            op,
            args=bound.call.args,
            kwargs=bound.call.kwargs,
            inputs=inputs,
            outputs=outputs,
            family=rule.family,
            assign=plan.assign,
            cost=plan.cost,
            payload=bound,
        )
        if sizes:
            guard = self.memory
            assert guard is not None
            for i in moved:
                if (x := inputs[i]) is not None and i in sizes:
                    guard.track(x.id, sizes[i])
            if rule.view_of is None and rule.output_is_input is None and not rule.writes_inputs:
                for k, y in enumerate(outputs):
                    guard.track(y.id, sizes.get(-1 - k, {}))
        self.last_call = LastCall(
            op=op, call=call, rule=rule, plan=plan, moved=moved, outputs=outputs, inputs=inputs
        )
        return self._structure(op, outputs)

    def _check_memory(
        self,
        op: Any,
        call: OpCall,
        rule: OpRule,
        plan: Any,
        moved: Sequence[int],
        mesh_for_out: DeviceMesh | None,
    ) -> dict[int, dict[int, int]]:
        """Pre-check what this call allocates (redistributed input copies, fresh outputs) before anything is
        emitted; returns the bytes per device by input slot (``i``) and output (``-1 - k``)."""
        guard = self.memory
        assert guard is not None
        sizes: dict[int, dict[int, int]] = {}
        labels: list[tuple[str, dict[int, int]]] = []
        if moved and call.mesh is not None:
            root = call.mesh.root
            for i in moved:
                x = call.inputs[i]
                target = plan.match.in_targets[i]
                if x is not None and target is not None:
                    per = sizes[i] = shard_bytes(x.shape, x.dtype, root, target)
                    labels.append((f"copy of input {x.name} as {placements_str(target)}", per))
        if (
            mesh_for_out is not None
            and rule.view_of is None
            and rule.output_is_input is None
            and not rule.writes_inputs
        ):
            root = mesh_for_out.root
            for k, (meta, pl) in enumerate(zip(plan.out_meta, plan.out_placements, strict=True)):
                per = sizes[-1 - k] = shard_bytes(meta.shape, meta.dtype, root, pl)
                dtype = str(meta.dtype).removeprefix("torch.")
                labels.append((f"output {k}: {dtype}{list(meta.shape)} {placements_str(pl)}", per))
        guard.check(str(op), labels)
        return sizes

    def call_planned(
        self,
        rule: OpRule,
        call: OpCall,
        out_specs: Sequence[tuple[TensorMeta, DeviceMesh | None, Placements]],
        assign: AssignInfo,
        cost: OperatorCost,
        moves: Sequence[tuple[int, Any, RedistributeSpec]] = (),
    ) -> list[Operand]:
        """Add an operator whose plan is already known (the eager fast path replays what :meth:`call` decided for
        the same op, input layouts and constants). ``call.placements`` are the rule's input targets; ``moves``
        lists ``(input slot, positional index, redistribute spec)`` of the inputs to move first. Returns the
        outputs."""
        if moves:
            moved = list(call.inputs)
            for i, _, spec in moves:
                x = moved[i]
                assert x is not None
                moved[i] = self.emit_redistribute(x, spec)
            call = call.retarget(moved, call.placements)
        inputs = call.inputs
        outputs = planned_outputs(self.graph, rule, call, out_specs)
        node = self.graph.add_operator(
            call.op,
            args=call.args,
            kwargs=call.kwargs,
            inputs=inputs,
            outputs=outputs,
            family=rule.family,
            assign=assign,
            cost=cost,
            payload=BoundOp(rule, call),
        )
        for listener in self.listeners:
            listener(node)
        return outputs

    def redistribute(
        self,
        x: Operand,
        placements: Sequence[Placement],
        *,
        device_mesh: DeviceMesh | None = None,
        copy: bool = True,
    ) -> Operand:
        """Explicit redistribute (``x.redistribute(mesh, placements)``); also moves between meshes (stages).
        ``copy=False``: the result is a tensor of its own (the user's ``x.redistribute(...)``), not a copy standing
        in for ``x`` (see :func:`_check_write_reaches_base`): writes through its views land in it."""
        if x.mesh is None:
            raise ValueError(
                f"redistribute: {x.describe()} is not bound to a mesh yet; use it with a mesh first"
            )
        mesh = device_mesh if device_mesh is not None else x.mesh
        pl = normalize_placements(
            placements, ndim=x.ndim, mesh_ndim=mesh.ndim, what=f"redistribute of {x.name}"
        )
        return self.redistribute_by_spec(
            x, redistribute_spec(x, mesh, mesh.to_root_placements(pl), user_mesh=mesh), copy=copy
        )

    def redistribute_by_spec(self, x: Operand, spec: RedistributeSpec, *, copy: bool = True) -> Operand:
        """:meth:`redistribute` of a planned ``spec`` (memory pre-check included); returns the new operand."""
        guard = self.memory
        if guard is None:
            return self.emit_redistribute(x, spec, copy=copy)
        out_root = spec.out_mesh.root
        per = shard_bytes(x.shape, x.dtype, out_root, spec.out_mesh.to_root_placements(spec.out_placements))
        guard.check("redistribute", [(f"{x.describe()} -> {placements_str(spec.out_placements)}", per)])
        y = self.emit_redistribute(x, spec, copy=copy)
        guard.track(y.id, per)
        return y

    # --- internals ----------------------------------------------------------------------------------------------
    def _redistribute(
        self,
        x: Operand,
        mesh: DeviceMesh,
        root_placements: Placements,
        *,
        user_mesh: DeviceMesh | None = None,
    ) -> Operand:
        return self.emit_redistribute(x, redistribute_spec(x, mesh, root_placements, user_mesh=user_mesh))

    def emit_redistribute(self, x: Operand, spec: RedistributeSpec, *, copy: bool = True) -> Operand:
        """Add the redistribute operator ``spec`` describes for ``x``; returns the re-laid-out operand (``copy``:
        a copy standing in for ``x``, its ``copy_of``)."""
        y = self.graph.new_operand(
            TensorMeta(x.shape, x.dtype), spec.out_mesh, spec.out_placements, requires_grad=x.requires_grad
        )
        if copy:
            y.copy_of = x
        self._emit(REDISTRIBUTE, **spec.operator_fields(x, y))
        return y

    def _emit(self, op: Any, **fields: Any) -> Operator:
        node = self.graph.add_operator(op, **fields)
        for listener in self.listeners:
            listener(node)
        return node

    def _output_mesh(self, call: OpCall, requested: DeviceMesh | None) -> DeviceMesh | None:
        meshes = {x.mesh for x in call.inputs if x is not None and x.mesh is not None}
        if len(meshes) == 1:
            return meshes.pop()
        if requested is not None:
            return requested
        return call.mesh if call.mesh is not None else self.default_mesh

    def _new_output(
        self,
        meta: TensorMeta,
        root_pl: Placements,
        call: OpCall,
        mesh: DeviceMesh | None,
        view_of: int | None,
        inputs: list[Operand | None],
    ) -> Operand:
        base = inputs[view_of] if view_of is not None else None
        view = ViewInfo(call.op, non_tensor_args(call)) if base is not None else None
        requires_grad = any(x.requires_grad for x in inputs if x is not None) and meta.dtype.is_floating_point
        if mesh is None:
            return self.graph.new_operand(meta, None, (), base=base, view=view, requires_grad=requires_grad)
        pl = mesh.from_root_placements(root_pl)
        if pl is None:
            mesh, pl = mesh.root, root_pl
        return self.graph.new_operand(meta, mesh, pl, base=base, view=view, requires_grad=requires_grad)

    @staticmethod
    def _structure(op: Any, outputs: list[Operand]) -> Any:
        kind = _RETURN_KIND.get(op)
        if kind is None:
            kind = _RETURN_KIND[op] = _return_kind(op)
        if kind == "list":
            return outputs
        if kind == "single" or (kind == "auto" and len(outputs) == 1):
            return outputs[0]
        return tuple(outputs)

    def last(self) -> Operator:
        return self.graph.operators[-1]


_RETURN_KIND: dict[Any, str] = {}


def _return_kind(op: Any) -> str:
    """How an op returns its outputs: one tensor, a list (split), a tuple, or unknown (non-aten ops)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return "auto"
    rets = schema.returns
    if len(rets) == 1:
        return "list" if str(rets[0].type) == "List[Tensor]" else "single"
    return "tuple"


def _check_write_reaches_base(op: Any, written: Operand) -> None:
    """A write through a view lands in the base only if no redistribute copied anything on the way."""
    x: Operand | None = written
    while x is not None:
        if x.copy_of is not None and x is not written:
            raise NotImplementedError(
                f"{op}: in-place write to {written.describe()}, a view of a redistributed copy of "
                f"{x.copy_of.describe()}: the write would not reach the original tensor. Make the view from a "
                "tensor whose placements the view keeps (e.g. do not index a sharded dim), or use the "
                "out-of-place op"
            )
        x = x.base
    return


def planned_outputs(
    graph: LogicalGraph,
    rule: OpRule,
    call: OpCall,
    out_specs: Sequence[tuple[TensorMeta, DeviceMesh | None, Placements]],
) -> list[Operand]:
    """The output operands of a planned call (views keep their base; ``requires_grad`` follows the inputs; an
    in-place op's output is the input it writes)."""
    inputs = call.inputs
    if rule.output_is_input is not None:
        written = inputs[rule.output_is_input]
        assert written is not None
        return [written]
    if rule.writes_inputs:  # list ops in place: the outputs are the first input slots
        return [x for x in inputs[: len(out_specs)] if x is not None]
    grad = False
    for x in inputs:
        if x is not None and x.requires_grad:
            grad = True
            break
    view_of = rule.view_of
    base = inputs[view_of] if view_of is not None else None
    view = ViewInfo(call.op, non_tensor_args(call)) if base is not None else None
    outs = []
    oid = graph._next_operand
    for meta, mesh, pl in out_specs:
        dtype = meta.dtype
        o = Operand(
            id=oid,
            shape=meta.shape,
            dtype=dtype,
            mesh=mesh,
            placements=pl,
            stride=meta.stride,
            base=base,
            view=view,
            requires_grad=grad and dtype.is_floating_point,
        )
        outs.append(o)
        if graph.record:
            graph.operands[oid] = o
        oid += 1
    graph._next_operand = oid
    return outs


def non_tensor_args(call: OpCall) -> tuple[Any, ...]:
    return tuple(a for a in call.args if not isinstance(a, Operand))
