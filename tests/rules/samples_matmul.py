"""Samples for the matmul family: uneven sizes (5, 7, 3), size-1 and broadcast batch dims, 1-d operands."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample

aten = torch.ops.aten
g = torch.Generator().manual_seed(1)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def S(*args: object, **kwargs: object) -> Sample:
    # sums of randomly split Partial operands lose a few ulps
    return Sample(tuple(args), dict(kwargs), atol=1e-4, rtol=1e-4)


SAMPLES: dict[object, list[Sample]] = {
    aten.mm.default: [S(rand(5, 3), rand(3, 7)), S(rand(1, 7), rand(7, 5))],
    aten.bmm.default: [S(rand(3, 5, 7), rand(3, 7, 2)), S(rand(1, 3, 5), rand(1, 5, 7))],
    aten.addmm.default: [
        S(rand(7), rand(5, 3), rand(3, 7)),
        S(rand(5, 1), rand(5, 3), rand(3, 7), beta=0.5, alpha=2.0),
        S(rand(5, 7), rand(5, 3), rand(3, 7)),
        S(rand(()), rand(3, 5), rand(5, 1)),
    ],
    aten.baddbmm.default: [
        S(rand(3, 5, 7), rand(3, 5, 2), rand(3, 2, 7), beta=0.5, alpha=2.0),
        S(rand(1, 7), rand(3, 5, 2), rand(3, 2, 7)),
    ],
    aten.mv.default: [S(rand(5, 7), rand(7))],
    aten.addmv.default: [
        S(rand(5), rand(5, 7), rand(7)),
        S(rand(1), rand(5, 7), rand(7), beta=0.5, alpha=2.0),
        S(rand(()), rand(1, 7), rand(7), beta=0.0),
    ],
    aten.dot.default: [S(rand(7), rand(7))],
    aten.vdot.default: [
        S(rand(7), rand(7)),
        S(torch.randn(5, dtype=torch.complex64, generator=g), rand(5) + 0j),
    ],
    aten.matmul.default: [
        S(rand(7), rand(7)),
        S(rand(5, 7), rand(7)),
        S(rand(7), rand(7, 5)),
        S(rand(3, 5, 7), rand(7)),
        S(rand(7), rand(3, 7, 5)),
        S(rand(3, 5, 7), rand(7, 2)),
        S(rand(5, 7), rand(3, 7, 2)),
        S(rand(2, 1, 5, 3), rand(3, 3, 7)),
    ],
    aten.linear.default: [
        S(rand(5, 3), rand(7, 3), rand(7)),
        S(rand(2, 5, 3), rand(7, 3)),
        S(rand(3), rand(7, 3), rand(1)),
        S(rand(5, 3), rand(3)),
    ],
    aten.einsum.default: [
        S("mk,kn->mn", [rand(5, 3), rand(3, 7)]),
        S("bhqd,bhkd->bhqk", [rand(2, 3, 5, 3), rand(2, 1, 7, 3)]),
        S("...ij,...jk", [rand(2, 1, 5, 3), rand(3, 3, 2)]),
        S("ij->ji", [rand(5, 3)]),
        S("ii->i", [rand(3, 3)]),
        S("i,j->ij", [rand(5), rand(3)]),
        S("ij,jk,kl->il", [rand(5, 3), rand(3, 2), rand(2, 7)]),
        S("bij,j", [rand(3, 5, 7), rand(7)]),
    ],
}
