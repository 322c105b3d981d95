"""Samples for the pointwise family (uneven sizes on purpose: 5 and 3 do not divide by 2 or 4)."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample
from torch_dtorch.placement_rules.families.pointwise import BINARY_OPS, UNARY_LINEAR_OPS, UNARY_OPS

aten = torch.ops.aten
g = torch.Generator().manual_seed(0)


def rand(*shape: int, positive: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    t = torch.randn(*shape, generator=g, dtype=dtype)
    return t.abs() + 0.5 if positive else t


X = rand(5, 3)
POS = rand(5, 3, positive=True)
ROW = rand(3)
BOOL = rand(5, 3) > 0
INT = torch.randint(1, 7, (5, 3), generator=g)
UNIT = torch.rand(5, 3, generator=g) * 1.8 - 0.9

_SPECIAL: dict[object, list[Sample]] = {
    aten.acos.default: [Sample((UNIT,))],
    aten.asin.default: [Sample((UNIT,))],
    aten.erfinv.default: [Sample((UNIT,))],
    aten.logit.default: [Sample(((UNIT.abs() * 0.9 + 0.05),))],
    aten.log.default: [Sample((POS,))],
    aten.log10.default: [Sample((POS,))],
    aten.log1p.default: [Sample((POS,))],
    aten.log2.default: [Sample((POS,))],
    aten.sqrt.default: [Sample((POS,))],
    aten.rsqrt.default: [Sample((POS,))],
    aten.lgamma.default: [Sample((POS,))],
    aten.digamma.default: [Sample((POS,))],
    aten.reciprocal.default: [Sample((POS,))],
    aten.isneginf.default: [Sample((X.masked_fill(X > 1, float("-inf")),))],
    aten.isposinf.default: [Sample((X.masked_fill(X > 1, float("inf")),))],
    aten.logical_not.default: [Sample((BOOL,))],
    aten.bitwise_not.default: [Sample((INT,))],
    aten.pow.Tensor_Scalar: [Sample((X, 2))],
    aten.clamp.default: [Sample((X, -0.5, 0.5))],
    aten.clamp_min.default: [Sample((X, 0.1))],
    aten.clamp_max.default: [Sample((X, 0.1))],
    aten.leaky_relu.default: [Sample((X, 0.2))],
    aten.hardtanh.default: [Sample((X, -0.5, 0.5))],
    aten.elu.default: [Sample((X,))],
    aten.gelu.default: [Sample((X,)), Sample((X,), {"approximate": "tanh"})],
    aten.add.Scalar: [Sample((X, 2.0))],
    aten.sub.Scalar: [Sample((X, 2.0))],
    aten.rsub.Scalar: [Sample((X, 2.0))],
    aten.mul.Scalar: [Sample((X, 3.0))],
    aten.div.Scalar: [Sample((X, 3.0))],
    aten.remainder.Scalar: [Sample((X, 0.7))],
    aten.fmod.Scalar: [Sample((X, 0.7))],
    aten.floor_divide.Scalar: [Sample((INT, 2))],
    aten.bitwise_and.Scalar: [Sample((INT, 3))],
    aten.bitwise_or.Scalar: [Sample((INT, 3))],
    aten.pow.Scalar: [Sample((2.0, X))],
    aten.masked_fill.Scalar: [Sample((X, BOOL, 0.0)), Sample((X, BOOL[:1], -1.0))],
    aten.masked_fill.Tensor: [Sample((X, BOOL, torch.tensor(2.0)))],
    aten.clamp.Tensor: [Sample((X, ROW - 0.5, ROW + 0.5))],
    aten.where.self: [Sample((BOOL, X, rand(5, 1))), Sample((BOOL[0], X, ROW))],
    aten.lerp.Scalar: [Sample((X, rand(5, 3), 0.3))],
    aten.lerp.Tensor: [Sample((X, rand(5, 3), rand(3).sigmoid()))],
    aten.addcmul.default: [Sample((X, rand(5, 3), ROW), {"value": 0.5})],
    aten.addcdiv.default: [Sample((X, rand(5, 3), POS), {"value": 0.5})],
    aten.div.Tensor_mode: [Sample((X, POS), {"rounding_mode": "floor"})],
    aten.pow.Tensor_Tensor: [Sample((POS, rand(5, 3)))],
    aten.floor_divide.default: [Sample((INT, INT.clamp(min=1)))],
    aten.remainder.Tensor: [Sample((X, POS))],
    aten.fmod.Tensor: [Sample((X, POS))],
    aten.xlogy.Tensor: [Sample((X, POS))],
    aten.threshold_backward.default: [Sample((X, rand(5, 3), 0.0))],
    aten.gelu_backward.default: [Sample((X, rand(5, 3)))],
    aten.add.Tensor: [
        Sample((X, rand(5, 3))),
        Sample((X, ROW), {"alpha": 2}),
        Sample((rand(2, 5, 3), rand(5, 1))),
    ],
    aten.sub.Tensor: [Sample((X, rand(5, 3))), Sample((ROW, X))],
    aten.mul.Tensor: [Sample((X, rand(5, 3))), Sample((rand(2, 5, 3), ROW))],
    aten.div.Tensor: [Sample((X, POS)), Sample((X, rand(5, 1).abs() + 1))],
    aten._prelu_kernel.default: [
        Sample((X, ROW)),
        Sample((X, torch.tensor(0.25))),
        Sample((rand(2, 3, 5), rand(3, 1))),
    ],
}

_BITWISE = {aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor}
_LOGICAL = {aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default}

SAMPLES: dict[object, list[Sample]] = {}
for op in UNARY_OPS + UNARY_LINEAR_OPS:
    default = [Sample((X, 0.3))] if op._overloadname == "Scalar" else [Sample((X,))]
    SAMPLES[op] = _SPECIAL.get(op, default)
for op in BINARY_OPS:
    if op in _SPECIAL:
        SAMPLES[op] = _SPECIAL[op]
    elif op in _BITWISE:
        SAMPLES[op] = [Sample((INT, INT[0]))]
    elif op in _LOGICAL:
        SAMPLES[op] = [Sample((BOOL, BOOL[:, :1]))]
    else:
        SAMPLES[op] = [Sample((X, rand(5, 3))), Sample((X, ROW))]
for op in (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor):
    SAMPLES[op] = _SPECIAL[op]
SAMPLES[aten.log_sigmoid_forward.default] = [Sample((X * 4,)), Sample((rand(2, 1, 5),))]
