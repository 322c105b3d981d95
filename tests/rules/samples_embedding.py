"""Samples for the embedding family: uneven vocab (7 rows over 2, 3, 4 ranks), repeated and boundary indices."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample

aten = torch.ops.aten
g = torch.Generator().manual_seed(4)

SAMPLES: dict[object, list[Sample]] = {
    aten.embedding.default: [
        Sample((torch.randn(7, 3, generator=g), torch.tensor([0, 6, 3, 3, 1]))),
        Sample((torch.randn(7, 5, generator=g), torch.tensor([[6, 0, 2], [4, 4, 5]]))),
        Sample((torch.randn(5, 3, generator=g), torch.tensor([[1], [4], [0]])), {"padding_idx": 0}),
    ],
}
