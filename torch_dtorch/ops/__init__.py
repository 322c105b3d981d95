"""Operator support shared by the rule families: costs (and, later, fused_compile and system ops)."""

from __future__ import annotations

from torch_dtorch.ops.cost import (
    OperatorCost,
    elementwise_cost,
    matmul_cost,
    meta_nbytes,
    sdpa_cost,
    traffic_cost,
)

__all__ = ["OperatorCost", "elementwise_cost", "matmul_cost", "meta_nbytes", "sdpa_cost", "traffic_cost"]
