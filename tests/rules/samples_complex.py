"""Samples for the complex views (uneven sizes on purpose)."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample

aten = torch.ops.aten
g = torch.Generator().manual_seed(3)


def crand(*shape: int) -> torch.Tensor:
    return torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g))


SAMPLES: dict[object, list[Sample]] = {
    aten.view_as_real.default: [Sample((crand(5, 3),)), Sample((crand(2, 5, 3),)), Sample((crand(7),))],
}
