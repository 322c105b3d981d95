"""The eager executor's recording of planned calls: the fast path's hits (:meth:`PlannedRecorder.record_fast`, one
compact :class:`~torch_dtorch.executor.instructions.FastRun` each), replays of a known plan
(:meth:`PlannedRecorder.call_planned`), and the freeing of the copies redistributed inputs get.

A :class:`PlannedRecorder` is owned by its :class:`~torch_dtorch.executor.eager.EagerGraphExecutor` (``.planned``)
and appends to the executor's pending batch under the executor's lock; the executor exposes its two entry points as
bound methods (``executor.record_fast``, ``executor.call_planned``), so a fast-path hit costs no extra call.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from time import monotonic as _monotonic
from typing import TYPE_CHECKING, Any

import torch

from torch_dtorch._compat import replay_views, view_replay_enabled
from torch_dtorch.config import get_config
from torch_dtorch.executor.constructor import (
    BoundOp,
    RedistributeSpec,
    planned_outputs,
)
from torch_dtorch.executor.fast import FastPlan, replay_moves
from torch_dtorch.executor.instructions import FastRun, RunOp
from torch_dtorch.graph import AssignInfo, Operand, Operator, OperatorCost, TensorMeta
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placements
from torch_dtorch.placement_rules import OpCall, OpRule

if TYPE_CHECKING:
    from torch_dtorch.executor.eager import EagerGraphExecutor

__all__ = ["PlannedRecorder", "user_call_site"]

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


class PlannedRecorder:
    """Recording of planned calls into ``executor``'s batch (see the module docstring).

    Args:
        executor: the owning :class:`~torch_dtorch.executor.eager.EagerGraphExecutor` (its lock, pending batch and
            dead-operand queue; the objects that never change are kept here too, for the hot path).
    """

    def __init__(self, executor: EagerGraphExecutor) -> None:
        self._ex = executor
        self._lock = executor._lock
        self.constructor = executor.constructor
        self._dead = executor._dead
        self._wake = executor._wake
        self._copy_views = executor.copy_views
        #: the copy-view registry's records (non-empty: hits check their writes and views against it)
        self._cv_live = executor.copy_views.records

    def free_moved(self, copies: Sequence[Operand | None], outputs: Sequence[Operand]) -> None:
        """The redistributed copies of an op's inputs are dead once the op ran, unless outputs view one (a
        copy-view): then the copy lives while they or their views do, and is refreshed after every write to what it
        copies (:mod:`.copy_views`). Callers hold ``self._lock``."""
        for y in copies:
            if y is None:
                continue
            views = [o for o in outputs if o.base is y]
            if not views:
                self._dead.append(y.id)
            else:
                self._copy_views.add(y, views)

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
        ex = self._ex
        guard = self.constructor.memory
        tracked = None
        if guard is not None:
            mem = plan.mem
            if mem is None or mem.guard is not guard:
                mem = guard.plan_bytes(plan, inputs)
            n = mem.nbytes
            if n:
                tracked = mem
                i = mem.pool
                planned = guard.planned_bytes
                if i >= 0 and planned[i] + n <= guard.budget[i]:  # one pool (the common case), inline
                    planned[i] += n
                elif (i >= 0 or not guard.hit(mem)) and not guard.recheck(mem):
                    guard.settle(str(plan.op), mem)  # (syncs the executor: the guard's settle callback)
        with self._lock:
            if ex._closed:
                ex._check_open()
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
            w = plan.written
            if w is not None:  # in place: the output is the written input (checked by the fast path)
                outs: list[Operand] = [inputs[w]]  # type: ignore[list-item]
                g._next_operand = oid
            elif out0 is not None:
                shape, dtype, mesh, pl, stride, fp = out0
                grad = False
                if fp:
                    for x in inputs:
                        if x is not None and x.requires_grad:
                            grad = True
                            break
                vo = plan.view_of
                base = inputs[vo] if vo is not None else None
                # positional on purpose: this is the per-hit cost, and keyword arguments double the dataclass's
                # __init__ (+0.5 us per op in bench/eager_overhead.py). Fields: id, shape, dtype, mesh, placements,
                # stride, producer, consumers, base, view, requires_grad
                view = plan.view if base is not None else None
                outs = [Operand(oid, shape, dtype, mesh, pl, stride, None, [], base, view, grad)]
                g._next_operand = oid + 1
                if base is not None and not view_replay_enabled():
                    replay_views()  # autograd must replay dtorch views, not as_strided them
            else:
                outs = plan.outputs(oid, inputs)
                g._next_operand = oid + len(outs)
                if plan.view_of is not None:
                    replay_views()
            opid = g._next_operator
            g._next_operator = opid + plan.nmoves + 1
            instr = FastRun(
                plan, args, inputs, outs, first, opid, user_call_site() if get_config().debug else None
            )
            # ex._append, inline
            if self._dead:
                ex._drain_dead()
            if tracked is not None and outs:  # the bytes die with the output (memory_ledger.py)
                guard.ledger.track_hit(outs[0].id, tracked.per_pool)  # type: ignore[union-attr]
            pending = ex._pending
            pending.append(instr)
            ex._last = _monotonic()
            n = len(pending)
            if n >= ex.batch_size:
                ex._flush_locked()
            elif n == 1:
                self._wake.set()
            if self._cv_live:  # a write refreshes the copy-views of its storage; views of them are tracked
                self._copy_views.after_call(plan.rule, outs)
            return outs

    def call_planned(
        self,
        rule: OpRule,
        call: OpCall,
        out_specs: Sequence[tuple[TensorMeta, DeviceMesh | None, Placements]],
        assign: AssignInfo,
        cost: OperatorCost,
        moves: Sequence[tuple[int, Any, RedistributeSpec]] = (),
    ) -> list[Operand]:
        """Record an operator whose plan is known (see :meth:`GraphConstructor.call_planned`). The eager fast path
        calls this for every cache hit, so the common case (no redistribute, only this executor listening, nothing
        recorded) builds the operands, the operator and its instruction inline."""
        ex = self._ex
        with self._lock:
            if ex._closed:
                ex._check_open()
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
                self.free_moved(copies, outs)
                if self._cv_live:
                    self._copy_views.after_call(rule, outs)
                if rule.view_of is not None:
                    replay_views()
                return outs
            call_site = user_call_site() if get_config().debug else None
            if moves:
                call = self._replay_moves(call, moves, call_site)
            inputs = call.inputs
            outs = planned_outputs(g, rule, call, out_specs)
            node = Operator(
                id=g._next_operator,
                op=call.op,
                args=call.args,
                kwargs=call.kwargs,
                inputs=inputs,
                outputs=outs,
                family=rule.family,
                assign=assign,
                cost=cost,
                payload=BoundOp(rule, call),
            )
            g._next_operator += 1
            ex._append(RunOp(node, call_site))
            if moves:
                self.free_moved([inputs[slot] for slot, _, _ in moves], outs)
            if self._cv_live:
                self._copy_views.after_call(rule, outs)
            if rule.view_of is not None:
                replay_views()
            return outs

    def _replay_moves(
        self, call: OpCall, moves: Sequence[tuple[int, Any, RedistributeSpec]], call_site: str | None
    ) -> OpCall:
        # callers hold self._lock
        g = self.constructor.graph
        moved, args, inputs = replay_moves(
            moves, call.args, list(call.inputs), g._next_operand, g._next_operator, call_site
        )
        g._next_operand += len(moved)
        g._next_operator += len(moved)
        for instr in moved:
            self._ex._append(instr)
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
