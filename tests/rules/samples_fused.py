"""Samples for the fused ops: uneven batch, sequence and head counts (3, 5, 7 over 2, 3, 4 ranks), both rotary
layouts, with and without bias."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample
from torch_dtorch.placement_rules.families.fused import LINEAR_GELU, MODULATE, ROTARY, SILU_LINEAR

g = torch.Generator().manual_seed(23)


def r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


SAMPLES: dict[object, list[Sample]] = {
    ROTARY: [
        Sample((r(3, 5, 3, 8), r(5, 8), r(5, 8), 1), no_partial=True),  # [B, S, H, D]
        Sample((r(2, 3, 7, 4), r(7, 4), r(7, 4), 2), no_partial=True),  # [B, H, S, D]
    ],
    MODULATE: [Sample((r(3, 5, 8), r(3, 8), r(3, 8), 1e-6), no_partial=True)],
    SILU_LINEAR: [
        Sample((r(3, 8), r(7, 8), r(7)), atol=1e-5, rtol=1e-5, no_partial=True),
        Sample((r(2, 3, 8), r(6, 8), None), atol=1e-5, rtol=1e-5, no_partial=True),
    ],
    LINEAR_GELU: [
        Sample((r(2, 5, 8), r(7, 8), r(7), "tanh"), atol=1e-5, rtol=1e-5, no_partial=True),
        Sample((r(3, 8), r(6, 8), None, "none"), atol=1e-5, rtol=1e-5, no_partial=True),
    ],
}
