"""Quantized matmul (:mod:`torch_dtorch.placement_rules.families.quantized`).

Wraps ``torch._scaled_mm`` (fp8 GEMM with scales): private, so a torch release may rename or reshape it.
"""

from __future__ import annotations

import torch


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``torch._scaled_mm`` (fp8 GEMM with scales; row-wise scales: ``scale_a [M, 1]``, ``scale_b [1, N]``)."""
    return torch._scaled_mm(
        a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum
    )
