"""Samples for the misc family (uneven sizes; size-1 dims; casts that do and do not keep Partial)."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample
from torch_dtorch.placement import Replicate, Shard

aten = torch.ops.aten
g = torch.Generator().manual_seed(3)

X = torch.randn(5, 3, generator=g)
X3 = torch.randn(5, 1, 7, generator=g)
INT = torch.randint(0, 4, (5, 3), generator=g)
CPU = torch.device("cpu")

SAMPLES: dict[object, list[Sample]] = {
    aten.clone.default: [Sample((X,)), Sample((X3,), {"memory_format": torch.contiguous_format})],
    aten.lift_fresh_copy.default: [Sample((X,))],
    aten._to_copy.default: [
        Sample((X,), {"dtype": torch.float64}),
        Sample((X,), {"dtype": torch.float16}, atol=1e-2, rtol=1e-2),
        Sample((X * 3,), {"dtype": torch.int32}),
        Sample((X3,), {"device": CPU}),
        Sample((INT,), {"dtype": torch.float32}),
    ],
    aten.to.dtype: [Sample((X, torch.float64)), Sample((X * 3, torch.int64)), Sample((X3, torch.float32))],
    aten.to.dtype_layout: [
        Sample((X,), {"dtype": torch.float64, "device": CPU}),
        Sample((X3,), {"device": "cpu"}),
    ],
    aten.to.device: [Sample((X, CPU, torch.float64)), Sample((X3, "cpu", torch.bool))],
    aten.to.other: [Sample((X, INT)), Sample((INT, X3))],
    aten.type_as.default: [Sample((X, X3.double())), Sample((X * 3, INT))],
    aten.contiguous.default: [Sample((X,)), Sample((X3.transpose(0, 2),))],
    aten.copy.default: [
        Sample((X, torch.randn(5, 3, generator=g))),
        Sample((X, torch.randn(3, generator=g))),
        Sample((X3, torch.randn(5, 1, 1, generator=g).double())),
        Sample((INT, X * 3)),
    ],
    aten.fill.Scalar: [Sample((X, 2.5)), Sample((INT, 3))],
    aten.fill.Tensor: [Sample((X3, torch.tensor(1.5)))],
    aten.dropout.default: [
        Sample((X, 0.3, False)),
        Sample((X3, 0.0, True)),
        Sample((X, 1.0, True)),
        Sample((X, 0.4, True), compare=False),
    ],
    aten.native_dropout.default: [
        Sample((X, 0.3, False)),
        Sample((X3, 0.4, True), compare=False),
    ],
    aten.one_hot.default: [Sample((INT, 5)), Sample((INT[0], 4))],
    # random: shapes and dtypes only (the values follow the generator state, checked in tests/apps/llama)
    aten.multinomial.default: [
        Sample(
            (torch.softmax(torch.randn(5, 7, generator=torch.Generator().manual_seed(4)), -1), 3),
            compare=False,
            options=lambda slot, t: [Replicate(), Shard(0), Shard(1)],
        ),
        Sample(
            (torch.softmax(torch.randn(5, 7, generator=torch.Generator().manual_seed(5)), -1), 4, True),
            compare=False,
            options=lambda slot, t: [Replicate(), Shard(0), Shard(1)],
        ),
    ],
}
