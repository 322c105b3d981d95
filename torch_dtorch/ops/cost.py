"""``OperatorCost`` helpers: FLOPs and bytes per operator, the data a roofline report is built from.

Costs are global (the whole mesh's work); communication bytes of redistributes are counted separately.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from torch_dtorch.graph import Operand, OperatorCost, TensorMeta

__all__ = [
    "OperatorCost",
    "elementwise_cost",
    "matmul_cost",
    "meta_nbytes",
    "sdpa_cost",
    "traffic_cost",
]


def meta_nbytes(meta: TensorMeta) -> int:
    return math.prod(meta.shape) * meta.dtype.itemsize


def _read(inputs: Iterable[Operand | None]) -> int:
    return sum(i.nbytes() for i in inputs if i is not None)


def traffic_cost(
    inputs: Iterable[Operand | None], outputs: Sequence[TensorMeta], *, flops: int = 0
) -> OperatorCost:
    """Bytes read = every input once; bytes written = every output once."""
    return OperatorCost(
        flops=flops, bytes_read=_read(inputs), bytes_written=sum(meta_nbytes(o) for o in outputs)
    )


def elementwise_cost(
    inputs: Iterable[Operand | None], outputs: Sequence[TensorMeta], *, flops_per_element: int = 1
) -> OperatorCost:
    """Pointwise ops, reductions, norms: a few FLOPs per output (or input) element."""
    inputs = list(inputs)
    n = max([math.prod(o.shape) for o in outputs] + [i.numel() for i in inputs if i is not None] + [0])
    return traffic_cost(inputs, outputs, flops=flops_per_element * n)


def matmul_cost(
    inputs: Iterable[Operand | None], outputs: Sequence[TensorMeta], *, m: int, n: int, k: int, batch: int = 1
) -> OperatorCost:
    """``2·M·N·K`` per batch element."""
    return traffic_cost(inputs, outputs, flops=2 * batch * m * n * k)


def sdpa_cost(
    inputs: Iterable[Operand | None],
    outputs: Sequence[TensorMeta],
    *,
    batch_heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    v_dim: int,
    causal: bool = False,
) -> OperatorCost:
    """``QK^T`` (2·L·S·E) + ``PV`` (2·L·S·Ev) per batch·head; causal halves the useful work."""
    flops = 2 * batch_heads * q_len * kv_len * (head_dim + v_dim)
    if causal:
        flops //= 2
    return traffic_cost(inputs, outputs, flops=flops)
