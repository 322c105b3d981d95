"""Pointwise family: unary, binary and ternary elementwise ops with broadcasting.

Signatures (one mesh axis):
- for every output dim ``d``: each input that has the aligned dim at full size is ``S(aligned)``, broadcast inputs
  (missing dim or size 1) are ``R`` -> ``S(d)``. A replicated operand next to a sharded peer is sliced locally
  (Replicate -> Shard costs nothing), which is the documented automatic alignment.
- Partial, only where the op is linear in its Partial inputs (``sum`` and ``avg``):
  ``UNARY`` (neg, mul/div by a scalar): ``P -> P``; ``ADDITIVE`` (add/sub of two tensors): ``P, P -> P``;
  ``MULTIPLICATIVE`` (mul: one ``P`` and the rest ``R``; div: numerator ``P``): ``-> P``.
  Everything else (``relu(P)``, ``P + 2``) gets no Partial signature, so a Partial input is all-reduced first.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import torch

from torch_dtorch.placement import Partial, Placement, Replicate, Shard
from torch_dtorch.placement_rules.call import OpCall
from torch_dtorch.placement_rules.rule import register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["Linearity", "broadcast_shard_signatures", "pointwise_signatures"]

aten = torch.ops.aten
_R = Replicate()
_LINEAR_PARTIALS = ("sum", "avg")


class Linearity(Enum):
    NONE = "none"
    UNARY = "unary"
    ADDITIVE = "additive"
    MULTIPLICATIVE = "multiplicative"
    NUMERATOR = "numerator"


def broadcast_shard_signatures(
    in_shapes: Sequence[Sequence[int] | None], out_shape: Sequence[int], num_outputs: int = 1
) -> list[PlacementSignature]:
    """``S(d)`` on the output for every dim, each input sharded on its aligned dim or replicated if broadcast."""
    out_nd = len(out_shape)
    sigs = []
    for d in range(out_nd):
        ins: list[Placement] = []
        for shape in in_shapes:
            if shape is None:
                ins.append(_R)
                continue
            aligned = d - (out_nd - len(shape))
            ins.append(Shard(aligned) if aligned >= 0 and shape[aligned] == out_shape[d] else _R)
        sigs.append(sig(ins, [Shard(d)] * num_outputs))
    return sigs


def _partial_signatures(call: OpCall, linearity: Linearity) -> list[PlacementSignature]:
    n = len(call.inputs)
    tensor_slots = [i for i, x in enumerate(call.inputs) if x is not None]
    out: list[PlacementSignature] = []
    for op in _LINEAR_PARTIALS:
        p = Partial(op)
        if linearity is Linearity.UNARY and n == 1:
            out.append(sig([p], p))
        elif linearity is Linearity.ADDITIVE and len(tensor_slots) == n >= 2:
            out.append(sig([p] * n, p))
        elif linearity is Linearity.MULTIPLICATIVE:
            for i in tensor_slots:
                out.append(sig([p if j == i else _R for j in range(n)], p))
        elif linearity is Linearity.NUMERATOR and n >= 1:
            out.append(sig([p] + [_R] * (n - 1), p))
    return out


def pointwise_signatures(call: OpCall, linearity: Linearity = Linearity.NONE) -> list[PlacementSignature]:
    in_shapes = [x.shape if x is not None else None for x in call.inputs]
    sigs = broadcast_shard_signatures(in_shapes, call.out_meta[0].shape, call.num_outputs)
    if linearity is not Linearity.NONE and call.num_outputs == 1:
        sigs += _partial_signatures(call, linearity)
    return sigs


# --- registrations ------------------------------------------------------------------------------------------------

UNARY_OPS = [
    aten.abs.default, aten.acos.default, aten.asin.default, aten.atan.default, aten.ceil.default,
    aten.cos.default, aten.cosh.default, aten.erf.default, aten.erfinv.default, aten.exp.default,
    aten.exp2.default, aten.expm1.default, aten.floor.default, aten.frac.default, aten.log.default,
    aten.log10.default, aten.log1p.default, aten.log2.default, aten.reciprocal.default, aten.round.default,
    aten.rsqrt.default, aten.sign.default, aten.sgn.default, aten.sigmoid.default, aten.sin.default,
    aten.sinh.default, aten.sqrt.default, aten.tan.default, aten.tanh.default, aten.trunc.default,
    aten.relu.default, aten.gelu.default, aten.silu.default, aten.mish.default, aten.hardswish.default,
    aten.hardsigmoid.default, aten.elu.default, aten.leaky_relu.default, aten.softplus.default,
    aten.hardtanh.default, aten.logical_not.default, aten.bitwise_not.default, aten.isnan.default,
    aten.isinf.default, aten.isfinite.default, aten.nan_to_num.default, aten.pow.Tensor_Scalar,
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.add.Scalar, aten.sub.Scalar,
    aten.rsub.Scalar, aten.remainder.Scalar, aten.fmod.Scalar, aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar,
    aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar, aten.bitwise_and.Scalar, aten.bitwise_or.Scalar,
    aten.floor_divide.Scalar, aten.pow.Scalar, aten.logit.default, aten.sinc.default, aten.deg2rad.default,
    aten.rad2deg.default, aten.signbit.default, aten.lgamma.default, aten.digamma.default, aten.erfc.default,
    aten.angle.default, aten.positive.default, aten.isneginf.default, aten.isposinf.default,
]  # fmt: skip

UNARY_LINEAR_OPS = [aten.neg.default, aten.mul.Scalar, aten.div.Scalar]

BINARY_OPS = [
    aten.pow.Tensor_Tensor, aten.maximum.default, aten.minimum.default, aten.fmax.default, aten.fmin.default,
    aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor,
    aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default, aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor, aten.remainder.Tensor, aten.fmod.Tensor, aten.atan2.default,
    aten.rsub.Tensor, aten.floor_divide.default, aten.hypot.default, aten.copysign.Tensor, aten.div.Tensor_mode,
    aten.xlogy.Tensor, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.clamp.Tensor,
    aten.where.self, aten.lerp.Scalar, aten.lerp.Tensor, aten.addcmul.default, aten.addcdiv.default,
    aten.gelu_backward.default, aten.threshold_backward.default, aten.sigmoid_backward.default,
    aten.silu_backward.default, aten.tanh_backward.default,
]  # fmt: skip


@register_rule(*UNARY_OPS, *BINARY_OPS, family="pointwise")
def pointwise(call: OpCall) -> list[PlacementSignature]:
    """Elementwise with broadcasting; Partial inputs are reduced first (the op is not linear)."""
    return pointwise_signatures(call)


@register_rule(*UNARY_LINEAR_OPS, family="pointwise")
def pointwise_unary_linear(call: OpCall) -> list[PlacementSignature]:
    """Linear in its single tensor input: ``P -> P``."""
    return pointwise_signatures(call, Linearity.UNARY)


@register_rule(aten.add.Tensor, aten.sub.Tensor, family="pointwise")
def pointwise_additive(call: OpCall) -> list[PlacementSignature]:
    """``P + P -> P`` (same reduce op); a Partial plus a Replicate is not linear and is reduced first."""
    return pointwise_signatures(call, Linearity.ADDITIVE)


@register_rule(aten.mul.Tensor, family="pointwise")
def pointwise_mul(call: OpCall) -> list[PlacementSignature]:
    """``P * R -> P`` and ``R * P -> P``."""
    return pointwise_signatures(call, Linearity.MULTIPLICATIVE)


@register_rule(aten.div.Tensor, family="pointwise")
def pointwise_div(call: OpCall) -> list[PlacementSignature]:
    """``P / R -> P``."""
    return pointwise_signatures(call, Linearity.NUMERATOR)
