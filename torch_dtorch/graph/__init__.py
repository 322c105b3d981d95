"""Layer 1 — graph representation (data only): Operand, Operator, LogicalGraph and its printer."""

from __future__ import annotations

from torch_dtorch.graph.graph import LogicalGraph
from torch_dtorch.graph.operand import Operand, TensorMeta, ViewInfo, contiguous_strides, dtype_str
from torch_dtorch.graph.operator import AssignInfo, Operator, OperatorCost, op_name
from torch_dtorch.graph.printer import format_graph, format_operator

__all__ = [
    "AssignInfo",
    "LogicalGraph",
    "Operand",
    "Operator",
    "OperatorCost",
    "TensorMeta",
    "ViewInfo",
    "contiguous_strides",
    "dtype_str",
    "format_graph",
    "format_operator",
    "op_name",
]
