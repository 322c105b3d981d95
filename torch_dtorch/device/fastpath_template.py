"""A learned fast-path template (:mod:`torch_dtorch.device.fastpath`): the :class:`FastPlan` a hit replays, with the
output layouts and the argument slots a hit fills."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch_dtorch.device.fastpath_keys import intern_layout
from torch_dtorch.executor.constructor import redistribute_spec
from torch_dtorch.executor.fast import FastPlan
from torch_dtorch.graph import Operand, TensorMeta
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placements
from torch_dtorch.placement_rules import OpCall, OpRule

__all__ = ["Template", "TemplateOwner"]


class TemplateOwner(Protocol):
    """What a template needs of the op's fast path (:class:`~torch_dtorch.device.fastpath.FastOp`)."""

    #: positional index of every tensor slot, in schema order
    slot_pos: tuple[int, ...]
    #: n when the tensor slots are exactly positions 0..n-1
    dense: int
    #: the position of the op's one ``Tensor[]`` argument (``None``: no list argument)
    list_pos: int | None


class Template:
    """A learned fast-path template: ``plan`` is the :class:`FastPlan` a hit replays (built from the call's
    ``OpPlan``, the ``op_plan`` argument), with the output layouts and the slots a hit fills."""

    __slots__ = (
        "plan",
        "out_layouts",
        "mesh",
        "devices",
        "owner",
        "skeleton",
        "operand_slots",
        "const_slots",
        "tail",
    )

    def __init__(
        self,
        rule: OpRule,
        call: OpCall,
        op_plan: Any,
        moved: list[int],
        out_specs: Sequence[tuple[TensorMeta, DeviceMesh | None, Placements]],
        mesh: Any,
        slot_pos: tuple[int, ...],
        owner: TemplateOwner,
        targs: list[Any],
    ) -> None:
        targets = op_plan.match.in_targets
        assert call.mesh is not None or not moved
        lp = owner.list_pos
        moves = tuple(
            (
                i,
                slot_pos[i] if lp is None else (lp, i),  # a list op's slot i is element i of its list
                redistribute_spec(call.inputs[i], call.mesh, targets[i]),  # type: ignore[arg-type]
            )
            for i in moved
        )
        self.plan = FastPlan(rule, call, targets, out_specs, op_plan.assign, op_plan.cost, moves)
        self.out_layouts = tuple(intern_layout(om, pl, m.shape, m.stride, m.dtype) for m, om, pl in out_specs)
        self.mesh = mesh  # the mesh of the first tensor input (the runtime's "last mesh" after the call)
        #: the devices of ``mesh``'s root (a plain 0-d CPU tensor argument is uploaded to each, see ``_hit_scalars``)
        self.devices = tuple(mesh.devices)
        self.owner = owner
        # the recorded call's positional arguments: the native kernel's hits only send the tensor inputs (its key
        # holds every constant, so a hit's constants are these)
        self.skeleton = tuple(targs)
        self.plan.args_of = self.args_for
        self.operand_slots: tuple[tuple[int, int], ...] = ()
        self.const_slots: tuple[int, ...] = ()
        self.tail: tuple[Any, ...] | None = None
        if lp is not None:  # the list is the only tensor argument; a hit always sends its arguments
            return
        n = len(targs)
        #: (tensor slot, position) of every slot holding an operand (a Python number in a tensor slot, ``x + 1.0``,
        #: is a constant: its slot's input is ``None``)
        self.operand_slots = tuple(
            (k, p) for k, p in enumerate(owner.slot_pos) if p < n and isinstance(targs[p], Operand)
        )
        self.const_slots = tuple(
            k for k, p in enumerate(owner.slot_pos) if p < n and not isinstance(targs[p], Operand)
        )
        d = owner.dense
        dense = d and n >= d and self.operand_slots == tuple((k, k) for k in range(d))
        self.tail = self.skeleton[d:] if dense else None

    def args_for(self, inputs: list[Operand | None]) -> tuple[Any, ...]:
        """The positional arguments of a call with these tensor inputs (one per tensor slot)."""
        if self.tail is not None:
            return (*inputs[: self.owner.dense], *self.tail)
        args = list(self.skeleton)
        if self.owner.list_pos is not None:
            args[self.owner.list_pos] = list(inputs)
            return tuple(args)
        for k, p in self.operand_slots:
            args[p] = inputs[k]
        return tuple(args)
