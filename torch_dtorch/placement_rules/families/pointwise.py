"""Pointwise family: unary, binary and ternary elementwise ops with broadcasting.

Signatures (one mesh axis):
- for every output dim ``d``: each input that has the aligned dim at full size is ``S(aligned)``, broadcast inputs
  (missing dim or size 1) are ``R`` -> ``S(d)``. A replicated operand next to a sharded peer is sliced locally
  (Replicate -> Shard costs nothing), which is the documented automatic alignment.
- Partial, only where the op is linear in its Partial inputs (``sum`` and ``avg``):
  ``UNARY`` (neg, mul/div by a scalar): ``P -> P``; ``ADDITIVE`` (add/sub of two tensors): ``P, P -> P``;
  ``MULTIPLICATIVE`` (mul: one ``P`` and the rest ``R``; div: numerator ``P``): ``-> P``.
  Everything else (``relu(P)``, ``P + 2``) gets no Partial signature, so a Partial input is all-reduced first.
- ``_prelu_kernel(x, weight)`` (behind ``F.prelu``, the weight reshaped to broadcast over the channels) is a binary
  op like the others: a per-channel weight is ``S`` where the channels are sharded, a single weight ``R``.
- ``log_sigmoid_forward(x) -> (output, buffer)`` (behind ``F.logsigmoid``): ``S(d) -> (S(d), S(d))``; on CUDA the
  buffer is empty ``(0,)`` (the meta kernel models the CPU's full one): shapes follow the mesh's device, and an
  empty buffer is ``R``.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import torch

from torch_dtorch.graph import OperatorCost, TensorMeta
from torch_dtorch.placement import LINEAR_REDUCE_OPS, Partial, Placement, Replicate, Shard
from torch_dtorch.placement_rules.call import OpCall
from torch_dtorch.placement_rules.growth import ELEMENTWISE_GROWTH, LOOKUP_GROWTH
from torch_dtorch.placement_rules.rule import OpRule, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["Linearity", "broadcast_shard_signatures", "pointwise_signatures"]

aten = torch.ops.aten
_R = Replicate()


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
    for op in LINEAR_REDUCE_OPS:
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
    aten.silu_backward.default, aten.tanh_backward.default, aten._prelu_kernel.default,
]  # fmt: skip


@register_rule(*UNARY_OPS, *BINARY_OPS, family="pointwise", growth=ELEMENTWISE_GROWTH)
def pointwise(call: OpCall) -> list[PlacementSignature]:
    """Elementwise with broadcasting; Partial inputs are reduced first (the op is not linear)."""
    return pointwise_signatures(call)


@register_rule(*UNARY_LINEAR_OPS, family="pointwise", growth=ELEMENTWISE_GROWTH)
def pointwise_unary_linear(call: OpCall) -> list[PlacementSignature]:
    """Linear in its single tensor input: ``P -> P``."""
    return pointwise_signatures(call, Linearity.UNARY)


@register_rule(aten.add.Tensor, aten.sub.Tensor, family="pointwise", growth=ELEMENTWISE_GROWTH)
def pointwise_additive(call: OpCall) -> list[PlacementSignature]:
    """``P + P -> P`` (same reduce op); a Partial plus a Replicate is not linear and is reduced first."""
    return pointwise_signatures(call, Linearity.ADDITIVE)


@register_rule(aten.mul.Tensor, family="pointwise", growth=ELEMENTWISE_GROWTH)
def pointwise_mul(call: OpCall) -> list[PlacementSignature]:
    """``P * R -> P`` and ``R * P -> P``."""
    return pointwise_signatures(call, Linearity.MULTIPLICATIVE)


@register_rule(aten.div.Tensor, family="pointwise", growth=ELEMENTWISE_GROWTH)
def pointwise_div(call: OpCall) -> list[PlacementSignature]:
    """``P / R -> P``."""
    return pointwise_signatures(call, Linearity.NUMERATOR)


# --- special functions and other elementwise ops (registered whole so they do not arrive as ``.out`` calls) -------

SPECIAL_UNARY_OPS = [
    aten.acosh.default, aten.asinh.default, aten.atanh.default, aten.i0.default, aten.special_i0e.default,
    aten.special_i1.default, aten.special_i1e.default, aten.special_entr.default, aten.special_erfcx.default,
    aten.special_log_ndtr.default, aten.special_ndtri.default, aten.special_airy_ai.default,
    aten.special_bessel_j0.default, aten.special_bessel_j1.default, aten.special_bessel_y0.default,
    aten.special_bessel_y1.default, aten.special_modified_bessel_i0.default,
    aten.special_modified_bessel_i1.default, aten.special_modified_bessel_k0.default,
    aten.special_modified_bessel_k1.default, aten.special_scaled_modified_bessel_k0.default,
    aten.special_scaled_modified_bessel_k1.default, aten.special_spherical_bessel_j0.default,
    aten.polygamma.default, aten.hardshrink.default, aten.softshrink.default, aten.threshold.default,
    aten.round.decimals, aten.frexp.Tensor, aten.zero.default, aten.mvlgamma.default,
]  # fmt: skip

SPECIAL_BINARY_OPS = [
    aten.heaviside.default, aten.logaddexp.default, aten.logaddexp2.default, aten.igamma.default,
    aten.igammac.default, aten.nextafter.default, aten.special_xlog1py.default, aten.special_zeta.default,
    aten.clamp_min.Tensor, aten.clamp_max.Tensor, aten.complex.default, aten.polar.default,
    aten.native_dropout_backward.default, aten.special_chebyshev_polynomial_t.default,
    aten.special_chebyshev_polynomial_u.default, aten.special_chebyshev_polynomial_v.default,
    aten.special_chebyshev_polynomial_w.default, aten.special_hermite_polynomial_h.default,
    aten.special_hermite_polynomial_he.default, aten.special_laguerre_polynomial_l.default,
    aten.special_legendre_polynomial_p.default, aten.special_shifted_chebyshev_polynomial_t.default,
    aten.special_shifted_chebyshev_polynomial_u.default, aten.special_shifted_chebyshev_polynomial_v.default,
    aten.special_shifted_chebyshev_polynomial_w.default, aten.xlogy.Scalar_Self, aten.xlogy.Scalar_Other,
]  # fmt: skip

_REGISTERED = {op for op in (*UNARY_OPS, *UNARY_LINEAR_OPS, *BINARY_OPS)}
register_rule(
    *[op for op in (*SPECIAL_UNARY_OPS, *SPECIAL_BINARY_OPS) if op not in _REGISTERED], family="pointwise"
)(pointwise)


class LogSigmoidForwardRule(OpRule):
    """``log_sigmoid_forward``: elementwise with a backward ``buffer`` whose shape depends on the device."""

    family = "pointwise"

    def infer_meta(self, call: OpCall) -> list[TensorMeta]:
        out, buffer = super().infer_meta(call)
        if call.mesh is not None and call.mesh.device_type == "cuda":
            buffer = TensorMeta((0,), buffer.dtype, (1,))  # the CUDA kernel returns an empty buffer
        return [out, buffer]

    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        out, buffer = call.out_meta
        full = tuple(buffer.shape) == tuple(out.shape)
        return [sig([Shard(d)], [Shard(d), Shard(d) if full else _R]) for d in range(len(out.shape))]


register_rule(aten.log_sigmoid_forward.default, family="pointwise")(LogSigmoidForwardRule)


@register_rule(
    aten.bucketize.Tensor,
    aten.isin.Tensor_Tensor,
    aten.isin.Tensor_Scalar,
    family="pointwise",
    growth=LOOKUP_GROWTH,
)
def elementwise_lookup(call: OpCall) -> list[PlacementSignature]:
    """Elementwise in ``self`` against a whole lookup tensor (boundaries, test elements), which stays Replicate."""
    x = call.inputs[0]
    assert x is not None
    n = len(call.inputs)
    return [sig([Shard(d)] + [_R] * (n - 1), [Shard(d)] * call.num_outputs) for d in range(x.ndim)]


@register_rule(aten.conj_physical.default, aten._conj_physical.default, family="pointwise")
def conj_physical(call: OpCall) -> list[PlacementSignature]:
    """A materialized complex conjugate (FFTs write it through ``conj_physical.out``): linear over the reals, so
    ``P -> P`` for ``sum``/``avg`` (``conj_physical`` is composite, so it joins the intercept list and arrives whole)."""
    return pointwise_signatures(call, Linearity.UNARY)


# --- lazy conjugate / negative views --------------------------------------------------------------------------------


def _zero_cost(call: OpCall) -> OperatorCost:
    return OperatorCost()


@register_rule(aten._conj.default, aten._neg_view.default, family="pointwise", view_of=0, cost=_zero_cost)
def lazy_bit_view(call: OpCall) -> list[PlacementSignature]:
    """``_conj`` / ``_neg_view`` (behind ``torch.conj``, ``x.conj()``, ``imag`` of a conjugate): torch returns a view
    of the same memory with a lazy conj/neg *bit*. Left to PyTorch's composite kernel, the bit would sit on the
    storage-less controller tensor, which the workers never see (a silent wrong value); this rule sends the op to
    the workers instead, so every shard becomes a real conj/neg view of its input's shard (writes through it reach
    the base, as in torch) and the controller's tensor carries no bit. Every placement passes through; Partial
    ``sum``/``avg`` too (both maps are linear over the reals; ``max``/``min`` are not, so those reduce first)."""
    x = call.inputs[0]
    assert x is not None
    sigs = [sig([Shard(d)], Shard(d)) for d in range(x.ndim)]
    return sigs + [sig([Partial(p)], Partial(p)) for p in LINEAR_REDUCE_OPS]
