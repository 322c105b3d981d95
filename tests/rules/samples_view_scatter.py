"""Samples for view_scatter.py: ``as_strided``-built views and their scatter inverses (uneven sizes on purpose)."""

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
    aten.diagonal.default: [Sample((X,)), Sample((X3, 1, 0, 2)), Sample((X3, -1, -1, 1))],
    aten.unfold.default: [Sample((X3, 1, 2, 1)), Sample((X, 0, 3, 2)), Sample((rand(7), 0, 2, 3))],
    aten.view_as_complex.default: [Sample((rand(5, 3, 2),)), Sample((rand(3, 2),))],
    aten.rot90.default: [Sample((X3,)), Sample((X3, 2, [1, 2])), Sample((X, -1, [1, 0]))],
    aten.slice_scatter.default: [
        Sample((X, rand(2, 3), 0, 1, 3)),
        Sample((X3, rand(2, 5, 2), -1, 0, None, 2)),
    ],
    aten.select_scatter.default: [Sample((X, rand(3), 0, 2)), Sample((X3, rand(2, 5), -1, 1))],
    aten.diagonal_scatter.default: [Sample((X, rand(3))), Sample((X3, rand(5, 2), 1, 0, 2))],
}
