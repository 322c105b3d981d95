"""Samples for the quantized linears: uneven output rows (7) and batch dims, with and without bias."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample
from torch_dtorch.placement import Replicate, Shard
from torch_dtorch.placement_rules.families.quantized import (
    FP8_LINEAR,
    INT8_LINEAR,
    quantize_weight_fp8,
    quantize_weight_int8,
)

g = torch.Generator().manual_seed(22)


def _samples(quantize: object) -> list[Sample]:
    out = []
    for x_shape, n, bias in (((3, 5, 8), 7, True), ((4, 8), 6, False)):
        q, s = quantize(torch.randn(n, 8, generator=g))  # type: ignore[operator]
        b = torch.randn(n, generator=g) if bias else None
        # uneven weight rows and batch shards keep the per-row quantization identical: exact up to float sums
        out.append(
            Sample((torch.randn(*x_shape, generator=g), q, s, b), atol=1e-4, rtol=1e-4, no_partial=True)
        )
    return out


SAMPLES: dict[object, list[Sample]] = {
    INT8_LINEAR: _samples(quantize_weight_int8),
    # fp8: a feature-sharded x quantizes each slice with its own scale (not the single-device bits): the sampled
    # placements keep the feature dim of x and of the weight whole (the row-parallel case is checked against float32 in
    # tests/rules/test_quantized.py)
    FP8_LINEAR: [
        Sample(
            s.args,
            atol=1e-4,
            rtol=1e-4,
            no_partial=True,
            options=lambda slot, t: [
                Replicate(),
                *[Shard(d) for d in range(t.ndim - (1 if slot < 2 else 0))],
            ],
        )
        for s in _samples(quantize_weight_fp8)
    ],
}
