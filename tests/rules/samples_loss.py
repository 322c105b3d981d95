"""Samples for the loss family (uneven sizes on purpose: 5 and 3 do not divide by 2 or 4; broadcast targets)."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample

aten = torch.ops.aten
g = torch.Generator().manual_seed(2)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * 2


X = rand(5, 3)
NONE, MEAN, SUM = 0, 1, 2

SAMPLES: dict[object, list[Sample]] = {
    aten.huber_loss.default: [
        Sample((X, rand(5, 3))),
        Sample((X, rand(5, 3), NONE, 0.5)),
        Sample((X, rand(5, 3), SUM, 1.5)),
        Sample((X, rand(3)), {"reduction": MEAN, "delta": 0.7}),
        Sample((rand(2, 5, 1), rand(5, 3), NONE)),
        Sample((rand(7), rand(7), SUM)),
    ],
}
