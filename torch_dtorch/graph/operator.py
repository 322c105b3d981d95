"""``Operator``: one core op in a LogicalGraph, with its device assignment and cost."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch_dtorch.graph.operand import Operand

__all__ = ["AssignInfo", "Operator", "OperatorCost"]


@dataclass(frozen=True)
class AssignInfo:
    """Which devices run an operator and on which stream (``compute`` or ``comm``)."""

    devices: tuple[int, ...]
    stream: str = "compute"


@dataclass(frozen=True)
class OperatorCost:
    """Estimated work of one operator over the whole mesh: FLOPs and bytes read/written (global, not per rank)."""

    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    comm_bytes: int = 0

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def __add__(self, other: OperatorCost) -> OperatorCost:
        return OperatorCost(
            self.flops + other.flops,
            self.bytes_read + other.bytes_read,
            self.bytes_written + other.bytes_written,
            self.comm_bytes + other.comm_bytes,
        )


@dataclass(eq=False, slots=True)
class Operator:
    """A core operator: an intercepted dispatcher overload (or a dtorch op such as ``redistribute``).

    ``args``/``kwargs`` keep the call's structure with :class:`Operand` in tensor positions; ``inputs`` are the
    flattened tensor slots in schema order (``None`` for an absent optional tensor).
    """

    id: int
    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: list[Operand | None]
    outputs: list[Operand]
    family: str = ""
    assign: AssignInfo | None = None
    cost: OperatorCost = field(default_factory=OperatorCost)
    note: str = ""
    #: op-specific data that is not printed (e.g. a redistribute plan, the rule that built the operator)
    payload: Any = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return op_name(self.op)


def op_name(op: Any) -> str:
    """``aten.mm.default`` -> ``aten.mm``; other overloads keep their overload name (``aten.transpose.int``)."""
    if isinstance(op, str):
        return op
    name = str(op)
    return name.removesuffix(".default")
