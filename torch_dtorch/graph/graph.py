"""``LogicalGraph``: insertion-ordered operators over operands, printable one line per op."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from torch_dtorch.graph.operand import Operand, TensorMeta, ViewInfo
from torch_dtorch.graph.operator import AssignInfo, Operator, OperatorCost
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placements

__all__ = ["LogicalGraph"]


class LogicalGraph:
    """Operands and operators in the order they were added. Pure data: no rules, no execution.

    ``record=False`` (the eager executor's streaming mode) numbers operands and operators but keeps neither them
    nor consumer lists, so a long eager loop does not grow the controller's memory.
    """

    def __init__(self, *, record: bool = True) -> None:
        self.record = record
        self.operands: dict[int, Operand] = {}
        self.operators: list[Operator] = []
        self._next_operand = 0
        self._next_operator = 0

    def new_operand(
        self,
        meta: TensorMeta,
        mesh: DeviceMesh | None,
        placements: Placements,
        *,
        base: Operand | None = None,
        view: ViewInfo | None = None,
        requires_grad: bool = False,
        tag: str | None = None,
    ) -> Operand:
        operand = Operand(
            id=self._next_operand,
            shape=tuple(meta.shape),
            dtype=meta.dtype,
            mesh=mesh,
            placements=tuple(placements),
            stride=meta.stride,
            base=base,
            view=view,
            requires_grad=requires_grad,
            tag=tag,
        )
        self._next_operand += 1
        if self.record:
            self.operands[operand.id] = operand
        return operand

    def add_input(
        self,
        shape: Sequence[int],
        mesh: DeviceMesh | None,
        placements: Placements,
        *,
        dtype: torch.dtype = torch.float32,
        tag: str | None = None,
    ) -> Operand:
        """An operand that no operator produces (a distributed input, parameter or constant)."""
        return self.new_operand(TensorMeta(tuple(shape), dtype), mesh, placements, tag=tag)

    def add_operator(
        self,
        op: Any,
        *,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: list[Operand | None],
        outputs: list[Operand],
        family: str = "",
        assign: AssignInfo | None = None,
        cost: OperatorCost | None = None,
        note: str = "",
        payload: Any = None,
    ) -> Operator:
        node = Operator(
            id=self._next_operator,
            op=op,
            args=args,
            kwargs=kwargs,
            inputs=inputs,
            outputs=outputs,
            family=family,
            assign=assign,
            cost=cost or OperatorCost(),
            note=note,
            payload=payload,
        )
        self._next_operator += 1
        if self.record:
            for i in inputs:
                if i is not None:
                    i.consumers.append(node)
            self.operators.append(node)
            for o in outputs:
                o.producer = node
        return node

    def __iter__(self) -> Iterator[Operator]:
        return iter(self.operators)

    def __len__(self) -> int:
        return len(self.operators)

    def inputs(self) -> list[Operand]:
        """Operands that were added as inputs and are used by at least one operator, in id order."""
        return [o for o in self.operands.values() if o.producer is None]

    def total_cost(self) -> OperatorCost:
        total = OperatorCost()
        for node in self.operators:
            total = total + node.cost
        return total

    def __str__(self) -> str:
        from torch_dtorch.graph.printer import format_graph

        return format_graph(self)
