"""Samples for the shape family (uneven sizes on purpose: 5 and 3 do not divide by 2 or 4)."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample

aten = torch.ops.aten
g = torch.Generator().manual_seed(2)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


X = rand(5, 3)
X3 = rand(2, 5, 3)

SAMPLES: dict[object, list[Sample]] = {
    aten.cat.default: [
        Sample(([X, rand(2, 3)],)),
        Sample(([X, rand(5, 2)], 1)),
        Sample(([X, rand(5, 1), rand(5, 3)], -1)),
        Sample(([X, torch.empty(0)],)),  # legacy: 1-d empty inputs are skipped
    ],
    aten.stack.default: [
        Sample(([X, rand(5, 3)],)),
        Sample(([X, rand(5, 3)], 1)),
        Sample(([X, rand(5, 3)], -1)),
    ],
    aten.flip.default: [Sample((X, [0])), Sample((X3, [-1, 0]))],
    aten.roll.default: [Sample((X, [2], [0])), Sample((X3, [1, 2], [0, -1])), Sample((X, [3]))],
    aten.repeat.default: [Sample((X, [2, 1])), Sample((X, [2, 1, 3])), Sample((X, [1, 1]))],
    aten.tril.default: [Sample((X,)), Sample((X3, 1))],
    aten.triu.default: [Sample((X,)), Sample((X3, -1))],
}
