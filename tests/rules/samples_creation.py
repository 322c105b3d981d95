"""Samples for the creation family. Factories are checked with every requested output placement (R and S(d) per
mesh axis, ``Sample.out_placements``) at uneven sizes; random and ``empty*`` results are checked for shapes only
(``compare=False``): test_creation.py compares random ops with torch under the same seed."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample
from torch_dtorch.placement import Replicate, Shard

aten = torch.ops.aten
g = torch.Generator().manual_seed(2)

R = Replicate()
OUT_1D = [R, Shard(0)]
OUT_2D = [R, Shard(0), Shard(1)]
X = torch.randn(5, 3, generator=g)
X3 = torch.randn(5, 1, 7, generator=g)
INT = torch.randint(0, 9, (5, 3), generator=g)


def factory(*args: object, compare: bool = True, out: list | None = None, **kwargs: object) -> Sample:
    return Sample(args, dict(kwargs), compare=compare, out_placements=OUT_2D if out is None else out)


SAMPLES: dict[object, list[Sample]] = {
    aten.zeros.default: [
        factory([5, 3]),
        factory([7], out=OUT_1D),
        factory([5, 1, 3], out=[R, Shard(1), Shard(2)]),
    ],
    aten.ones.default: [factory([5, 3], dtype=torch.int64), factory([1, 7])],
    aten.full.default: [factory([5, 3], 2.5), factory([3, 5], 7, dtype=torch.int32)],
    aten.empty.memory_format: [factory([5, 3], compare=False)],
    aten.rand.default: [factory([5, 3], compare=False), factory([7], compare=False, out=OUT_1D)],
    aten.randn.default: [factory([5, 3], compare=False), factory([3, 7], compare=False, dtype=torch.float64)],
    aten.scalar_tensor.default: [factory(1.5, out=[R]), factory(3, dtype=torch.int64, out=[R])],
    aten.arange.default: [
        factory(7, out=OUT_1D),
        factory(5.5, out=OUT_1D),
        factory(9, dtype=torch.float32, out=OUT_1D),
    ],
    aten.arange.start: [factory(-3, 8, out=OUT_1D), factory(0.25, 3, out=OUT_1D)],
    aten.arange.start_step: [
        factory(1, 20, 3, out=OUT_1D),
        factory(10, -4, -3, dtype=torch.float16, out=OUT_1D),
        factory(0.1, 2.3, 0.3, out=OUT_1D),
        factory(-1.0, 1.0, 0.15, dtype=torch.float64, out=OUT_1D),
    ],
    aten.linspace.default: [
        factory(-1.0, 2.0, 7, out=OUT_1D),
        factory(0, 10, 5, dtype=torch.float64, out=OUT_1D),
    ],
    aten.eye.default: [factory(5), factory(3, dtype=torch.int64)],
    aten.eye.m: [factory(5, 3), factory(3, 7, dtype=torch.bool)],
    aten.new_zeros.default: [factory(X, [5, 3]), factory(INT, [7], out=OUT_1D)],
    aten.new_ones.default: [factory(X, [3, 5], dtype=torch.float64)],
    aten.new_empty.default: [factory(X, [5, 3], compare=False)],
    aten.new_full.default: [factory(X, [5, 3], 1.25), factory(INT, [1, 7], 4)],
    aten.zeros_like.default: [Sample((X,)), Sample((X3,), {"dtype": torch.float64})],
    aten.ones_like.default: [Sample((X,)), Sample((INT,), {"dtype": torch.float32})],
    aten.full_like.default: [Sample((X, 3.5)), Sample((X3, 2))],
    aten.empty_like.default: [Sample((X,), compare=False)],
    aten.rand_like.default: [Sample((X,), compare=False), Sample((X3,), compare=False)],
    aten.randn_like.default: [Sample((X,), compare=False), Sample((X.t(),), compare=False)],
}
