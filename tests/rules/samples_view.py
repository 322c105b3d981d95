"""Samples for the view family (uneven sizes on purpose: 5 and 3 do not divide by 2 or 4; size-1 dims)."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample

aten = torch.ops.aten
g = torch.Generator().manual_seed(1)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


X = rand(5, 3)
X3 = rand(2, 5, 3)
ONES = rand(5, 1, 3)

SAMPLES: dict[object, list[Sample]] = {
    aten.view.default: [
        Sample((X, [15])),  # S(0) merge is uneven on 2 and 4 ranks: falls back
        Sample((rand(4, 3), [12])),  # even on 2 ranks, uneven on 3
        Sample((rand(8, 6), [8, 2, 3])),
        Sample((rand(6, 4), [2, 3, 4])),  # split of a sharded dim: leading factor
        Sample((X, [-1, 1, 3])),
        Sample((ONES, [5, 3])),
        Sample((rand(6), [2, 3])),
    ],
    aten._unsafe_view.default: [Sample((X, [3, 5])), Sample((rand(4, 3), [2, 6]))],
    aten.reshape.default: [Sample((X3, [10, 3])), Sample((rand(4, 6), [2, 2, 6])), Sample((X.t(), [15]))],
    aten.view_as.default: [Sample((rand(4, 3), rand(12))), Sample((X3, rand(10, 3)))],
    aten.flatten.using_ints: [Sample((X3, 1)), Sample((X3, 0, 1)), Sample((rand(4, 2, 3),))],
    aten.unflatten.int: [Sample((rand(6, 5), 0, [2, 3])), Sample((X, -1, [3, 1])), Sample((X3, 1, [5, -1]))],
    aten.alias.default: [Sample((X,))],
    aten.detach.default: [Sample((X3,))],
    aten.permute.default: [Sample((X3, [2, 0, 1])), Sample((X3, [-1, 1, 0]))],
    aten.transpose.int: [Sample((X3, 0, -1)), Sample((X, 1, 0))],
    aten.t.default: [Sample((X,)), Sample((rand(5),))],
    aten.movedim.int: [Sample((X3, 0, 2)), Sample((X3, -1, 0))],
    aten.movedim.intlist: [Sample((X3, [0, 1], [2, 0]))],
    aten.unsqueeze.default: [Sample((X, 0)), Sample((X, 1)), Sample((X, -1))],
    aten.squeeze.default: [Sample((ONES,)), Sample((rand(2, 3),))],  # [2, 3] on 3 ranks: local dims of size 1
    aten.squeeze.dim: [Sample((ONES, 1)), Sample((rand(2, 3), 0))],
    aten.squeeze.dims: [Sample((rand(5, 1, 3, 1), [1, -1])), Sample((rand(2, 1, 3), [0, 1]))],
    aten.expand.default: [
        Sample((rand(5, 1), [5, 3])),
        Sample((rand(5, 1), [2, -1, 3])),
        Sample((rand(3), [5, 3])),
    ],
    aten.expand_as.default: [Sample((rand(5, 1), X3))],
    aten.slice.Tensor: [
        Sample((X, 0, 1, 4)),
        Sample((X, 1, 0, None, 2)),
        Sample((X, 0)),  # a full slice keeps a sharded dim
        Sample((X3, -1, 0, 100)),
    ],
    aten.narrow.default: [Sample((X, 0, 1, 3)), Sample((X3, -1, 1, 2))],
    aten.select.int: [Sample((X, 0, 2)), Sample((X3, -1, -1))],
    aten.split.Tensor: [Sample((X, 2)), Sample((X, 2, 1)), Sample((X3, 2, -1))],
    aten.split_with_sizes.default: [Sample((X, [2, 3])), Sample((X, [1, 2], 1))],
    aten.chunk.default: [Sample((X, 2)), Sample((X3, 3, -1))],
    aten.unbind.int: [Sample((X,)), Sample((X3, 2))],
    aten.as_strided.default: [Sample((X, [3, 2], [1, 3], 1))],
}
