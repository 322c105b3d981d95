"""Fixtures shared by the rule tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from torch_dtorch.placement_rules.families import quantized


@pytest.fixture
def fp8_gemm_on_cpu() -> Iterator[None]:
    """Compiled programs decompose ``fp8_linear`` into the fp8 GEMM formula on the CPU too (as on a Hopper GPU:
    ``torch._scaled_mm`` runs on the CPU), so the CPU tests check the GPU path's graph and arithmetic."""
    quantized.DECOMPOSE_FP8_ANYWHERE = True
    try:
        yield
    finally:
        quantized.DECOMPOSE_FP8_ANYWHERE = False
