"""Normalization family: layer/RMS/group norm and (log-)softmax.

Signatures (one mesh axis):
- ``layer_norm``, ``native_layer_norm``, ``rms_norm`` (normalized over the last ``k`` dims): input ``S(d)`` for each
  leading dim ``d < ndim - k``, ``weight``/``bias`` ``R`` (they span the normalized dims, which are never sharded:
  the statistics need every element) -> every output ``S(d)`` (``mean``/``rstd`` keep the leading dims).
  An input sharded on a normalized dim fits no signature and is redistributed first (all-to-all to a leading dim
  or all-gather), never computed on a slice.
- ``group_norm``, ``native_group_norm`` (input ``[N, C, *]``): batch ``S(0)`` with ``weight``/``bias`` ``R`` -> ``S(0)``
  (``mean``/``rstd`` ``[N, G]`` too). Channels ``S(1)`` with ``weight``/``bias`` ``S(0)`` -> ``S(1)`` (``mean``/``rstd``
  ``S(1)``) only when every shard, for every nesting of the mesh axes, holds whole groups (its channel count and
  offset are multiples of ``C / G``); the local call then gets ``local C / (C / G)`` groups. Spatial dims: none.
- ``_softmax``, ``_log_softmax``, ``softmax.int``, ``log_softmax.int``: ``S(d) -> S(d)`` for every ``d`` but the
  softmax dim; ``half_to_float`` / ``dtype`` pass through.
- No Partial signatures: none of these ops is linear.

``layer_norm``, ``rms_norm``, ``group_norm``, ``softmax.int`` and ``log_softmax.int`` are CompositeImplicitAutograd:
intercepted. ``rms_norm`` is registered only where ``aten.rms_norm`` exists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import combinations
from typing import Any

import torch

from torch_dtorch.graph import TensorMeta
from torch_dtorch.placement import Replicate, Shard, local_shape_and_offset
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.rule import OpRule, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["groups_split_evenly", "leading_dim_signatures"]

aten = torch.ops.aten
_R = Replicate()


def leading_dim_signatures(call: OpCall, num_leading: int) -> list[PlacementSignature]:
    """Input (slot 0) ``S(d)`` for ``d < num_leading``, every other slot ``R`` -> every output ``S(d)``."""
    n_in = len(call.inputs)
    return [
        sig([Shard(d)] + [_R] * (n_in - 1), [Shard(d)] * call.num_outputs) for d in range(max(num_leading, 0))
    ]


# --- layer norm / rms norm ------------------------------------------------------------------------------------------


def _input_ndim(call: OpCall) -> int:
    x = call.inputs[0]
    assert x is not None
    return x.ndim


@register_rule(aten.native_layer_norm.default, family="normalization")
def native_layer_norm(call: OpCall) -> list[PlacementSignature]:
    """Shard the leading (not normalized) dims; ``(out, mean, rstd)`` all ``S(d)``."""
    return leading_dim_signatures(call, _input_ndim(call) - len(call.arg("normalized_shape")))


_RMS_NORM = [aten.rms_norm.default] if hasattr(aten, "rms_norm") else []


@register_rule(aten.layer_norm.default, *_RMS_NORM, family="normalization", intercept=True)
def layer_norm(call: OpCall) -> list[PlacementSignature]:
    """Shard the leading (not normalized) dims; weight/bias ``R``."""
    return leading_dim_signatures(call, _input_ndim(call) - len(call.arg("normalized_shape")))


# --- group norm ---------------------------------------------------------------------------------------------------


def groups_split_evenly(channels: int, groups: int, mesh_shape: Sequence[int]) -> bool:
    """Whether every shard of ``channels`` holds whole groups, for every subset of mesh axes sharding them (the
    matcher picks per axis, so any subset may end up nested on the channel dim)."""
    if groups <= 0 or channels % groups:
        return False
    size = channels // groups
    axes = [a for a, n in enumerate(mesh_shape) if n > 1]
    for r in range(1, len(axes) + 1):
        for subset in combinations(axes, r):
            placements = [Shard(0) if a in subset else _R for a in range(len(mesh_shape))]
            for coord in _coords([mesh_shape[a] if a in subset else 1 for a in range(len(mesh_shape))]):
                (n,), (off,) = local_shape_and_offset((channels,), mesh_shape, placements, coord)
                if n % size or off % size:
                    return False
    return True


def _coords(shape: Sequence[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [(*c, i) for c in out for i in range(n)]
    return out


def _group_count(call: OpCall) -> int:
    return int(call.arg("num_groups") if call.op is aten.group_norm.default else call.arg("group"))


def group_norm_signatures(call: OpCall) -> list[PlacementSignature]:
    x = call.inputs[0]
    assert x is not None
    n_out = call.num_outputs
    sigs = [sig([Shard(0), _R, _R], [Shard(0)] * n_out)]
    mesh_shape = call.mesh.shape if call.mesh is not None else ()
    if x.ndim >= 2 and groups_split_evenly(x.shape[1], _group_count(call), mesh_shape):
        stats = Shard(1)  # mean/rstd are [N, G]: whole groups split like the channels
        sigs.append(sig([Shard(1), Shard(0), Shard(0)], [Shard(1)] + [stats] * (n_out - 1)))
    return sigs


def _local_groups(call: OpCall, ctx: LocalContext) -> int:
    x = call.inputs[0]
    assert x is not None and ctx.in_shapes[0] is not None
    per_group = x.shape[1] // _group_count(call)
    return ctx.in_shapes[0][1] // per_group


def _group_norm_localize(call: OpCall, ctx: LocalContext) -> tuple[tuple[Any, ...], dict[str, Any]]:
    bound = dict(call.bound)
    local = ctx.in_shapes[0]
    assert local is not None
    if call.op is aten.group_norm.default:
        bound["num_groups"] = _local_groups(call, ctx)
    else:
        bound.update(N=local[0], C=local[1], HxW=math.prod(local[2:]), group=_local_groups(call, ctx))
    names = [a.name for a in call.op._schema.arguments]
    return tuple(bound[n] for n in names if n in bound), {}


def _group_norm_kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A shard with no channels has no groups (torch rejects ``num_groups=0``): its outputs are empty."""
    x = args[0]
    if x.shape[1] > 0:
        return call.op(*args, **kwargs)
    out = torch.empty_like(x)
    if call.op is aten.group_norm.default:
        return out
    stats = [
        torch.empty(s, dtype=m.dtype, device=x.device) for s, m in zip(ctx.out_shapes[1:], call.out_meta[1:])
    ]
    return (out, *stats)


@register_rule(
    aten.group_norm.default,
    family="normalization",
    intercept=True,
    localize=_group_norm_localize,
    kernel=_group_norm_kernel,
)
def group_norm(call: OpCall) -> list[PlacementSignature]:
    """Batch ``S(0)``; channels ``S(1)`` (weight/bias ``S(0)``) when the groups split evenly."""
    return group_norm_signatures(call)


@register_rule(
    aten.native_group_norm.default,
    family="normalization",
    localize=_group_norm_localize,
    kernel=_group_norm_kernel,
)
def native_group_norm(call: OpCall) -> list[PlacementSignature]:
    """As ``group_norm``; ``N``/``C``/``HxW``/``group`` are localized, ``mean``/``rstd`` ``[N, G]`` follow."""
    return group_norm_signatures(call)


# --- softmax ------------------------------------------------------------------------------------------------------


def softmax_signatures(call: OpCall) -> list[PlacementSignature]:
    nd = _input_ndim(call)
    if nd == 0:
        return []
    dim = int(call.arg("dim")) % nd
    return [sig([Shard(d)], Shard(d)) for d in range(nd) if d != dim]


@register_rule(
    aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default, family="normalization"
)
def softmax(call: OpCall) -> list[PlacementSignature]:
    """Shard any dim but the softmax dim (``_safe_softmax``: what SDPA's math form calls, a row of ``-inf`` gives
    zeros; seen whole by compiled training's capture)."""
    return softmax_signatures(call)


@register_rule(aten.softmax.int, aten.log_softmax.int, family="normalization", intercept=True)
def softmax_composite(call: OpCall) -> list[PlacementSignature]:
    """Shard any dim but the softmax dim; ``dtype`` passes through."""
    return softmax_signatures(call)


class BatchNormRule(OpRule):
    """``native_batch_norm``, ``_native_batch_norm_legit``, ``_batch_norm_with_update``.

    Evaluation (``training=False``): the input ``S(0)`` (batch) with weight, bias and running statistics ``R`` ->
    output ``S(0)``, saved statistics ``R``. Training normalizes with statistics over the batch: Replicate only.
    The running statistics are updated in place on the workers, so they are *pinned* (never redistributed: a
    redistributed copy would take the update instead of the caller's tensor); keep them Replicate."""

    family = "normalization"
    pinned_inputs = (3, 4)

    @staticmethod
    def _training(call: OpCall) -> bool:
        return call.op is aten._batch_norm_with_update.default or bool(call.arg("training"))

    def infer_meta(self, call: OpCall) -> list[TensorMeta]:
        """Meta (and CUDA) kernels give the saved statistics shape ``(C,)`` in evaluation; the CPU kernels return
        them empty, ``(0,)``: follow the workers' device so local outputs match the inferred global shapes."""
        metas = super().infer_meta(call)
        if call.mesh is not None and call.mesh.device_type == "cpu" and not self._training(call):
            metas[1:3] = [TensorMeta((0,), m.dtype, (1,)) for m in metas[1:3]]
        return metas

    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        x = call.inputs[0]
        if self._training(call) or x is None or x.ndim < 2:
            return []
        rest = [Replicate()] * (len(call.inputs) - 1)
        return [sig([Shard(0), *rest], [Shard(0)] + [Replicate()] * (call.num_outputs - 1))]


register_rule(
    aten.native_batch_norm.default, aten._native_batch_norm_legit.default, aten._batch_norm_with_update.default,
    family="normalization",
)(BatchNormRule)  # fmt: skip
