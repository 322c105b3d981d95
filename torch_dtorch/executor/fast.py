"""The executor's side of the eager fast path: a :class:`FastPlan` is everything decided for one op on given input
layouts and constants (rule, redistributes of its inputs, output metadata and placements, device assignment, cost).

A cache hit of :mod:`torch_dtorch.device.fastpath` records one :class:`~torch_dtorch.executor.instructions.FastRun`
(plan + operands) through :meth:`~torch_dtorch.executor.eager.EagerGraphExecutor.record_fast`; the
``Redistribute``/``RunOp``/``Free`` instructions it stands for are only built where it is executed or encoded
(:meth:`FastPlan.expand`), off the controller's issue path.

Inputs a plan redistributes get fresh operands that nothing else refers to; the expansion frees them right after
the op (a view of a moved input would keep them alive, so such plans are not compact: see
:attr:`FastPlan.compact`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch_dtorch.executor.constructor import REDISTRIBUTE, BoundOp, RedistributeSpec, non_tensor_args
from torch_dtorch.executor.instructions import FastRun, Free, Instruction, Redistribute, RunOp
from torch_dtorch.graph import AssignInfo, Operand, Operator, OperatorCost, TensorMeta
from torch_dtorch.graph.operand import ViewInfo
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placements
from torch_dtorch.placement_rules import OpCall, OpRule
from torch_dtorch.placement_rules.plan_keys import const_key

__all__ = ["FastPlan", "replay_key", "replay_moves"]


def replay_moves(
    moves: Sequence[tuple[int, Any, RedistributeSpec]],
    args: tuple[Any, ...],
    inputs: list[Operand | None],
    first_id: int,
    first_op: int,
    call_site: str | None,
) -> tuple[list[Redistribute], tuple[Any, ...], list[Operand | None]]:
    """The ``Redistribute`` of every moved input (operand ids from ``first_id``, operator ids from ``first_op``) and
    the call's ``args``/``inputs`` with the moved copies in their places: the inline form of
    ``GraphConstructor.emit_redistribute``, shared by the fast path's expansion and the executor's planned calls.
    A move's position is an argument index, or ``(index, j)`` for element ``j`` of a list argument."""
    inputs = list(inputs)
    largs = list(args)
    out: list[Redistribute] = []
    for k, (slot, pos, spec) in enumerate(moves):
        x = inputs[slot]
        assert x is not None
        y = Operand(
            id=first_id + k,
            shape=x.shape,
            dtype=x.dtype,
            mesh=spec.out_mesh,
            placements=spec.out_placements,
            requires_grad=x.requires_grad,
            copy_of=x,
        )
        node = Operator(id=first_op + k, op=REDISTRIBUTE, **spec.operator_fields(x, y))
        out.append(Redistribute(node, call_site))
        inputs[slot] = y
        if type(pos) is tuple:  # element ``j`` of the list argument at ``p`` (``cat``'s tensors)
            p, j = pos
            lst = list(largs[p])
            lst[j] = y
            largs[p] = lst
        else:
            largs[pos] = y
    return out, tuple(largs), inputs


def replay_key(run: FastRun) -> Any:
    """What a worker keys the resolved local call of ``run`` by: its plan, or for a plan whose runs carry their own
    constants (:attr:`FastPlan.varies`) the plan and those constants; ``None``: unhashable constants (the general
    path runs it)."""
    plan = run.plan
    if not plan.varies:
        return plan
    try:
        key = (plan, const_key(run.args))
        hash(key)
    except TypeError:
        return None
    return key


class FastPlan:
    """One op's cached plan (see the module docstring).

    Args:
        rule / call: the rule and the call the full path planned (its constant arguments are the plan's).
        in_placements: the rule's input targets (root placements, per tensor slot).
        out_specs: ``(meta, mesh, placements)`` of every output.
        assign / cost: of the op.
        moves: ``(tensor slot, positional index, redistribute spec)`` of every input to move first (the index is
            ``(index, j)`` for element ``j`` of a list argument).
    """

    __slots__ = (
        "rule",
        "op",
        "kwargs",
        "root_mesh",
        "in_placements",
        "out_meta",
        "out_specs",
        "outs",
        "assign",
        "cost",
        "moves",
        "view_of",
        "view",
        "compact",
        "nmoves",
        "out0",
        "written",
        "args_of",
        "mem",
        "varies",
    )

    def __init__(
        self,
        rule: OpRule,
        call: OpCall,
        in_placements: Sequence[Placements | None],
        out_specs: Sequence[tuple[TensorMeta, DeviceMesh | None, Placements]],
        assign: AssignInfo,
        cost: OperatorCost,
        moves: Sequence[tuple[int, Any, RedistributeSpec]],
    ) -> None:
        self.rule = rule
        self.op = call.op
        self.kwargs = call.kwargs
        self.root_mesh = call.mesh
        self.in_placements = tuple(in_placements)
        self.out_meta = [m for m, _, _ in out_specs]
        self.out_specs = tuple(out_specs)
        #: what each output operand is made of: (shape, dtype, mesh, placements, stride, may require grad)
        self.outs = tuple(
            (m.shape, m.dtype, mesh, pl, m.stride, m.dtype.is_floating_point) for m, mesh, pl in out_specs
        )
        self.assign = assign
        self.cost = cost
        self.moves = tuple(moves)
        self.nmoves = len(self.moves)
        #: the only output's spec (single-output ops, the common case, skip the list building)
        self.out0 = self.outs[0] if len(self.outs) == 1 else None
        #: the input slot an in-place op writes (its one output *is* that input: no new operand, no new bytes);
        #: ``None``: the outputs are new operands
        self.written = rule.output_is_input
        #: ``inputs -> positional args`` for runs recorded without their args (the native fast path's hits: the
        #: cache key fixes every constant, so only the tensor inputs vary); set by the fast path's template
        self.args_of: Callable[[list[Operand | None]], tuple[Any, ...]] | None = None
        #: what one hit allocates per memory pool (a ``memory_check.HitBytes``), worked out by the memory guard at
        #: the first hit it sees
        self.mem: Any = None
        #: the runs carry constants this plan does not fix (a factory's values: ``arange(past, past + 1)``,
        #: ``full(shape, value)``), so a worker resolves it per constants (:func:`replay_key`); set by the fast path
        self.varies = False
        self.view_of = rule.view_of
        self.view = ViewInfo(call.op, non_tensor_args(call)) if rule.view_of is not None else None
        #: recorded as one FastRun per call; otherwise through GraphConstructor.call_planned
        self.compact = (
            not (self.view_of is not None and any(slot == self.view_of for slot, _, _ in moves))
            and not rule.writes_inputs
        )  # (list ops in place: their outputs are their first list)

    def call(self, args: tuple[Any, ...], inputs: list[Operand | None]) -> OpCall:
        """The :class:`OpCall` of one call of this plan on ``args``/``inputs``."""
        return OpCall(
            self.op, args, self.kwargs, inputs, self.root_mesh, list(self.in_placements), self.out_meta
        )

    def outputs(self, first_id: int, inputs: Sequence[Operand | None]) -> list[Operand]:
        """New output operands ``first_id, first_id + 1, ...`` (views keep their base; ``requires_grad`` follows
        the inputs; an in-place op's output is the input it writes)."""
        if self.written is not None:
            return [inputs[self.written]]  # type: ignore[list-item]
        grad = False
        for x in inputs:
            if x is not None and x.requires_grad:
                grad = True
                break
        view_of = self.view_of
        base = inputs[view_of] if view_of is not None else None
        view = self.view if base is not None else None
        return [
            Operand(
                id=first_id + i,
                shape=shape,
                dtype=dtype,
                mesh=mesh,
                placements=pl,
                stride=stride,
                base=base,
                view=view,
                requires_grad=grad and fp,
            )
            for i, (shape, dtype, mesh, pl, stride, fp) in enumerate(self.outs)
        ]

    def expand(self, run: FastRun) -> tuple[Instruction, ...]:
        """The instructions ``run`` stands for: one ``Redistribute`` per moved input, the ``RunOp``, and a ``Free``
        of the moved copies."""
        call_site = run.call_site
        inputs = run.inputs
        args = run.args
        if args is None:
            assert self.args_of is not None
            args = self.args_of(inputs)
        out: list[Instruction] = []
        oid, opid = run.first_id, run.first_op
        if self.moves:
            moved, args, inputs = replay_moves(self.moves, args, inputs, oid, opid, call_site)
            out.extend(moved)
            oid += len(moved)
            opid += len(moved)
        call = self.call(args, inputs)
        node = Operator(
            id=opid,
            op=self.op,
            args=args,
            kwargs=self.kwargs,
            inputs=inputs,
            outputs=run.outputs,
            family=self.rule.family,
            assign=self.assign,
            cost=self.cost,
            payload=BoundOp(self.rule, call),
        )
        out.append(RunOp(node, call_site, replay_key=self))
        if self.moves:
            out.append(Free(list(range(run.first_id, oid))))
        return tuple(out)

    def __repr__(self) -> str:
        return f"FastPlan({self.op}, moves={len(self.moves)}, outputs={len(self.outs)})"
