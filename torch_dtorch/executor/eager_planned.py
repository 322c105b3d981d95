"""The eager executor's recording of planned calls: the fast path's hits (:meth:`PlannedRecording.record_fast`, one
compact :class:`~torch_dtorch.executor.instructions.FastRun` each), replays of a known plan
(:meth:`PlannedRecording.call_planned`), and the freeing of the copies redistributed inputs get.

A mixin of :class:`~torch_dtorch.executor.eager.EagerGraphExecutor` (its lock, pending batch and dead-operand queue);
split out so that module keeps to batching, data transfers and synchronization.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from collections.abc import Callable, Sequence
from time import monotonic as _monotonic
from typing import Any

import torch

from torch_dtorch.config import get_config
from torch_dtorch.executor.constructor import (
    BoundOp,
    GraphConstructor,
    RedistributeSpec,
    planned_outputs,
)
from torch_dtorch.executor.fast import FastPlan, replay_moves
from torch_dtorch.executor.instructions import FastRun, Instruction, RunOp
from torch_dtorch.graph import AssignInfo, Operand, Operator, OperatorCost, TensorMeta
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placements
from torch_dtorch.placement_rules import OpCall, OpRule

__all__ = ["PlannedRecording", "user_call_site"]

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


class PlannedRecording:
    """Recording of planned calls (see the module docstring); the attributes below are the executor's."""

    _lock: threading.RLock
    _closed: bool
    constructor: GraphConstructor
    batch_size: int
    _pending: list[Instruction]
    _dead: collections.deque[int]
    _owned: dict[int, list[int]]
    _last: float
    _wake: threading.Event
    _check_open: Callable[[], None]
    _drain_dead: Callable[[], None]
    _flush_locked: Callable[[], None]
    sync: Callable[..., None]
    _append: Callable[[Instruction], None]

    def _free_moved(self, copies: Sequence[Operand | None], outputs: Sequence[Operand]) -> None:
        """The redistributed copies of an op's inputs are dead once the op ran, unless an output views one: then
        they die with that output. Callers hold ``self._lock``."""
        for y in copies:
            if y is None:
                continue
            owner = next((o for o in outputs if o.base is y), None)
            if owner is None:
                self._dead.append(y.id)
            else:
                self._owned.setdefault(owner.id, []).append(y.id)

    def record_fast(
        self, plan: FastPlan, args: tuple[Any, ...] | None, inputs: list[Operand | None]
    ) -> list[Operand]:
        """Record one call of a cached plan (the eager fast path's hit): new output operands and one compact
        :class:`FastRun` instruction, expanded where it runs. Returns the outputs. This is the controller's
        per-op cost, so the common case is written out inline. ``args`` ``None``: ``plan.args_of(inputs)``, built
        only where the run is expanded.

        The memory pre-check counts the plan's new bytes (a few integer adds); where they pass what the last free
        figure allows, it reads a fresh one, and if that is not enough either, the executor settles (flush, free
        the dead, wait for the workers: :meth:`sync`) before the final check, which raises
        :class:`~torch_dtorch.errors.DeviceMemoryError` before anything of this call is recorded."""
        guard = self.constructor.memory
        if guard is not None:
            mem = plan.mem
            if mem is None or mem.guard is not guard:
                mem = guard.plan_bytes(plan, inputs)
            n = mem.nbytes
            if n:
                i = mem.pool
                planned = guard.planned_bytes
                if i >= 0 and planned[i] + n <= guard.budget[i]:  # one pool (the common case), inline
                    planned[i] += n
                elif (i >= 0 or not guard.hit(mem)) and not guard.recheck(mem):
                    self.sync()
                    guard.settle(str(plan.op), mem)
        with self._lock:
            if self._closed:
                self._check_open()
            c = self.constructor
            g = c.graph
            if not plan.compact or g.record or len(c.listeners) != 1:
                if args is None:
                    assert plan.args_of is not None
                    args = plan.args_of(inputs)
                return self.call_planned(
                    plan.rule, plan.call(args, inputs), plan.out_specs, plan.assign, plan.cost, plan.moves
                )
            first = g._next_operand
            oid = first + plan.nmoves
            out0 = plan.out0
            if out0 is not None:
                shape, dtype, mesh, pl, stride, fp = out0
                grad = False
                if fp:
                    for x in inputs:
                        if x is not None and x.requires_grad:
                            grad = True
                            break
                vo = plan.view_of
                base = inputs[vo] if vo is not None else None
                outs = [Operand(oid, shape, dtype, mesh, pl, stride, None, [], base,
                                plan.view if base is not None else None, grad)]  # fmt: skip
                g._next_operand = oid + 1
            else:
                outs = plan.outputs(oid, inputs)
                g._next_operand = oid + len(outs)
            opid = g._next_operator
            g._next_operator = opid + plan.nmoves + 1
            instr = FastRun(
                plan, args, inputs, outs, first, opid, user_call_site() if get_config().debug else None
            )
            # _append, inline
            if self._dead:
                self._drain_dead()
            pending = self._pending
            pending.append(instr)
            self._last = _monotonic()
            n = len(pending)
            if n >= self.batch_size:
                self._flush_locked()
            elif n == 1:
                self._wake.set()
            return outs

    def call_planned(
        self,
        rule: OpRule,
        call: OpCall,
        out_specs: Sequence[tuple[TensorMeta, DeviceMesh | None, Placements]],
        assign: AssignInfo,
        cost: OperatorCost,
        moves: Sequence[tuple[int, int, RedistributeSpec]] = (),
    ) -> list[Operand]:
        """Record an operator whose plan is known (see :meth:`GraphConstructor.call_planned`). The eager fast path
        calls this for every cache hit, so the common case (no redistribute, only this executor listening, nothing
        recorded) builds the operands, the operator and its instruction inline."""
        with self._lock:
            if self._closed:
                self._check_open()
            c = self.constructor
            g = c.graph
            if g.record or len(c.listeners) != 1:
                copies: list[Operand | None] = []
                if moves:
                    moved = list(call.inputs)
                    for slot, _, spec in moves:
                        x = moved[slot]
                        assert x is not None
                        moved[slot] = c.emit_redistribute(x, spec)
                        copies.append(moved[slot])
                    call = call.retarget(moved, call.placements)
                outs = c.call_planned(rule, call, out_specs, assign, cost)
                self._free_moved(copies, outs)
                return outs
            call_site = user_call_site() if get_config().debug else None
            if moves:
                call = self._replay_moves(call, moves, call_site)
            inputs = call.inputs
            outs = planned_outputs(g, rule, call, out_specs)
            node = Operator(
                g._next_operator, call.op, call.args, call.kwargs, inputs, outs, rule.family, assign, cost, "",
                BoundOp(rule, call),
            )  # fmt: skip
            g._next_operator += 1
            self._append(RunOp(node, call_site))
            if moves:
                self._free_moved([inputs[slot] for slot, _, _ in moves], outs)
            return outs

    def _replay_moves(
        self, call: OpCall, moves: Sequence[tuple[int, int, RedistributeSpec]], call_site: str | None
    ) -> OpCall:
        # callers hold self._lock
        g = self.constructor.graph
        moved, args, inputs = replay_moves(
            moves, call.args, list(call.inputs), g._next_operand, g._next_operator, call_site
        )
        g._next_operand += len(moved)
        g._next_operator += len(moved)
        for instr in moved:
            self._append(instr)
        return OpCall(call.op, args, call.kwargs, inputs, call.mesh, call.placements, call.out_meta)


def user_call_site() -> str | None:
    """``file:line in fn`` of the innermost frame outside torch_dtorch and torch (``DTORCH_DEBUG=1`` only)."""
    f = sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        if not path.startswith(_PKG_DIR) and not path.startswith(_TORCH_DIR) and "threading.py" not in path:
            return f"{path}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back  # type: ignore[assignment]
    return None
