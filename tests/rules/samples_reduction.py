"""Samples for the reduction family (uneven sizes on purpose: 5, 3 and 7 do not divide by 2 or 4; size-1 dims give
empty shards on meshes of 2 and more)."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample

aten = torch.ops.aten
g = torch.Generator().manual_seed(1)

X = torch.randn(5, 3, generator=g)
X3 = torch.randn(5, 1, 7, generator=g)
POS = torch.rand(5, 3, generator=g) + 0.5
INT = torch.randint(-4, 9, (5, 3), generator=g)
BOOL = torch.randn(5, 3, generator=g) > 0.3
UNIQ = torch.randperm(15, generator=g).reshape(5, 3).float()  # no ties: indices are well defined
SCALAR = torch.tensor(1.5)


def _dim_samples(dims: list[object], *, x: torch.Tensor = X, x3: torch.Tensor = X3) -> list[Sample]:
    """Every ``dim`` in ``dims`` with and without keepdim, on a 2-d and (first dim only) a 3-d input."""
    out = [Sample((x, d, keep)) for d in dims for keep in (False, True)]
    return [*out, Sample((x3, dims[0], True)), Sample((x3, dims[-1]))]


_DIMS = [[0], [1], [-1], [0, 1], []]

SAMPLES: dict[object, list[Sample]] = {
    aten.sum.default: [
        Sample((X,)),
        Sample((X3,)),
        Sample((INT,)),
        Sample((BOOL,)),
        Sample((X,), {"dtype": torch.float64}),
    ],
    aten.sum.dim_IntList: [
        *_dim_samples(_DIMS),
        Sample((X3, [0, 2])),
        Sample((X3, None, True)),
        Sample((INT, [0])),
        Sample((X, [0]), {"dtype": torch.float64}),
        Sample((X, [1]), {"dtype": torch.int64}),
    ],
    aten.mean.default: [Sample((X,)), Sample((X3,)), Sample((X,), {"dtype": torch.float64})],
    aten.mean.dim: [
        *_dim_samples(_DIMS),
        Sample((X3, [0, 2])),
        Sample((X, [0], True), {"dtype": torch.float64}),
    ],
    aten.amax.default: [*_dim_samples(_DIMS), Sample((INT, [0])), Sample((BOOL, [1]))],
    aten.amin.default: [*_dim_samples(_DIMS), Sample((INT, [0])), Sample((BOOL, [1]))],
    aten.max.default: [Sample((X,)), Sample((X3,)), Sample((INT,))],
    aten.min.default: [Sample((X,)), Sample((X3,)), Sample((INT,))],
    aten.max.dim: [Sample((UNIQ, 0)), Sample((UNIQ, -1, True)), Sample((X3, 2, True)), Sample((SCALAR, 0))],
    aten.min.dim: [Sample((UNIQ, 1)), Sample((UNIQ, 0, True)), Sample((X3, 0))],
    aten.argmax.default: [
        Sample((UNIQ,)),
        Sample((UNIQ, 1)),
        Sample((UNIQ, 0, True)),
        Sample((UNIQ, None, True)),
    ],
    aten.argmin.default: [Sample((UNIQ,)), Sample((UNIQ, -1)), Sample((UNIQ, 0, True))],
    aten.var.correction: [
        Sample((X,)),
        Sample((X, [0])),
        Sample((X, [1]), {"keepdim": True, "correction": 0}),
        Sample((X3, [0, 2])),
    ],
    aten.std.correction: [Sample((X,)), Sample((X, [0])), Sample((X3, [2]), {"correction": 0})],
    aten.var_mean.correction: [Sample((X, [1])), Sample((X3, [0]), {"keepdim": True})],
    aten.prod.default: [Sample((POS,)), Sample((INT,))],
    aten.prod.dim_int: [Sample((POS, 0)), Sample((POS, -1, True)), Sample((X3, 2))],
    aten.any.default: [Sample((BOOL,)), Sample((X,))],
    aten.all.default: [Sample((BOOL,)), Sample((INT,))],
    aten.any.dim: [Sample((BOOL, 0)), Sample((BOOL, 1, True)), Sample((X3 > 0, 2))],
    aten.all.dim: [Sample((BOOL, 0)), Sample((BOOL, -1, True)), Sample((X3 > -1, 0))],
    aten.any.dims: [
        Sample((BOOL, [0, 1])),
        Sample((BOOL, None)),
        Sample((BOOL, [])),
        Sample((X3 > 0, [0], True)),
    ],
    aten.all.dims: [Sample((BOOL, [1])), Sample((BOOL, [], True)), Sample((X3 > -1, [0, 2]))],
    aten.logsumexp.default: [Sample((X, [1])), Sample((X, [0], True)), Sample((X3, [0, 2]))],
    aten.norm.ScalarOpt_dim: [
        Sample((X, 2, [1])),
        Sample((X, 1, [0], True)),
        Sample((X3, None, [2])),
        Sample((X, float("inf"), [0, 1])),
        Sample((X3, 0, [0, 2])),
    ],
    aten.linalg_vector_norm.default: [
        Sample((X,)),
        Sample((X, 1)),
        Sample((X, 1, [0], True)),
        Sample((X3, 0, [0, 2])),
        Sample((X, float("inf"), [1])),
        Sample((X3, float("-inf"), None, True)),
        Sample((X, 3, [-1])),
        Sample((X, 1, [0]), {"dtype": torch.float64}),
        Sample((X.to(torch.complex64), 1, [0])),
    ],
    aten.cumsum.default: [
        Sample((X, 0)),
        Sample((X, -1)),
        Sample((X3, 2)),
        Sample((INT, 1)),
        Sample((X, 1), {"dtype": torch.float64}),
    ],
}
