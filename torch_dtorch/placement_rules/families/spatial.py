"""Spatial family: convolution, pooling, padding, interpolation (upsample), im2col, channel_shuffle.

Signatures (one mesh axis), for an op acting on the last ``k`` (spatial) dims of its input:

- pooling / padding / upsample / adaptive pooling / ``im2col``: ``S(d) -> S(d)`` (every output, e.g. pooled values
  and indices) for every leading (batch or channel) dim ``d < ndim - k``. A sharded spatial dim has no signature:
  windows and halos cross shard borders, so the matcher gathers that dim first (cost-ordered, logged).
- ``constant_pad_nd``: ``S(d) -> S(d)`` for every dim the pad leaves alone.
- ``convolution``: ``input S(0)`` (batch), ``weight R``, ``bias R`` -> ``S(0)``; ``input R``, ``weight S(0)`` and
  ``bias S(0)`` (output channels) -> ``S(1)`` (``groups == 1``, not transposed); and, for a *halo-free* spatial dim
  (kernel == stride, no padding, no dilation, not transposed: a patchify such as SD3's patch embedding), ``input
  S(d)``, ``weight R``, ``bias R`` -> ``S(d)`` when every rank's block of the input is exactly ``stride`` times its
  block of the output (checked on the concrete mesh for every set of axes that could shard the dim; uneven shards
  that cut a patch get no signature and are gathered). Cost: ``2 · N · C_out · C_in/g · prod(kernel) · prod(out
  spatial)`` FLOPs.
- ``channel_shuffle`` / ``pixel_shuffle`` / ``pixel_unshuffle``: ``S(0) -> S(0)`` (batch) for batched inputs.
- ``grid_sampler_*``, ``max_unpool*``, ``col2im``: Replicate only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain, combinations, product
from typing import Any

import torch

from torch_dtorch.graph import OperatorCost
from torch_dtorch.placement import Replicate, Shard, chunk_size_and_offset
from torch_dtorch.placement_rules.call import LocalContext, OpCall, every_shard_nonempty
from torch_dtorch.placement_rules.families.indexing import keep_dim_signatures
from torch_dtorch.placement_rules.rule import register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["SPATIAL_OPS"]

aten = torch.ops.aten
_R = Replicate()

#: op -> number of trailing spatial dims it acts on
SPATIAL_OPS: dict[object, int] = {
    aten.max_pool2d_with_indices.default: 2, aten.max_pool3d_with_indices.default: 3,
    aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3, aten._adaptive_avg_pool2d.default: 2,
    aten._adaptive_avg_pool3d.default: 3, aten.adaptive_max_pool2d.default: 2, aten.adaptive_max_pool3d.default: 3,
    aten.reflection_pad1d.default: 1, aten.reflection_pad2d.default: 2, aten.reflection_pad3d.default: 3,
    aten.replication_pad1d.default: 1, aten.replication_pad2d.default: 2, aten.replication_pad3d.default: 3,
    aten.upsample_nearest1d.default: 1, aten.upsample_nearest2d.default: 2, aten.upsample_nearest3d.default: 3,
    aten._upsample_nearest_exact1d.default: 1, aten._upsample_nearest_exact2d.default: 2,
    aten._upsample_nearest_exact3d.default: 3, aten.upsample_linear1d.default: 1,
    aten.upsample_bilinear2d.default: 2, aten.upsample_bicubic2d.default: 2, aten.upsample_trilinear3d.default: 3,
    aten._upsample_bilinear2d_aa.default: 2, aten._upsample_bicubic2d_aa.default: 2, aten.im2col.default: 2,
    aten.max_pool1d.default: 1, aten.avg_pool1d.default: 1, aten.adaptive_max_pool1d.default: 1,
    aten.max_pool1d_with_indices.default: 1,
}  # fmt: skip


def empty_safe_kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the op locally; a rank whose shard of the input is empty (uneven sharding of a small batch or channel
    dim, or of a conv weight's output channels) returns empty outputs of its local shapes instead (these kernels
    reject empty batch/channel dims)."""
    x = args[0]
    empty = [a for a in args[:2] if isinstance(a, torch.Tensor) and a.numel() == 0 and a.ndim > 0]
    if empty and isinstance(x, torch.Tensor):
        outs = [
            torch.empty(shape, dtype=meta.dtype, device=x.device)
            for shape, meta in zip(ctx.out_shapes, call.out_meta, strict=True)
        ]
        return outs[0] if len(outs) == 1 else tuple(outs)
    return call.op(*args, **kwargs)


def _no_empty_shard(call: OpCall) -> bool:
    """No rank's shard of the first two inputs is empty: :func:`empty_safe_kernel` is the op itself (workers
    replay it)."""
    return every_shard_nonempty(call, [k for k in (0, 1) if k < len(call.inputs)])


@register_rule(*SPATIAL_OPS, family="spatial", kernel=empty_safe_kernel, as_is=_no_empty_shard)
def spatial(call: OpCall) -> list[PlacementSignature]:
    """Leading (batch/channel) dims stay sharded; spatial dims are gathered first."""
    x = call.inputs[0]
    assert x is not None
    k = SPATIAL_OPS[call.op]
    return keep_dim_signatures(call, list(range(max(x.ndim - k, 0))), [0])


@register_rule(
    aten.constant_pad_nd.default, family="spatial", kernel=empty_safe_kernel, as_is=_no_empty_shard
)
def constant_pad(call: OpCall) -> list[PlacementSignature]:
    """Dims the pad leaves alone stay sharded (``pad`` lists (before, after) pairs from the last dim back)."""
    x = call.inputs[0]
    assert x is not None
    pad = list(call.arg("pad"))
    touched = {x.ndim - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    return keep_dim_signatures(call, [d for d in range(x.ndim) if d not in touched], [0])


@register_rule(
    aten.channel_shuffle.default,
    aten.pixel_shuffle.default,
    aten.pixel_unshuffle.default,
    family="spatial",
    kernel=empty_safe_kernel,
)
def batch_only(call: OpCall) -> list[PlacementSignature]:
    """The batch dim of a batched (4-d or more) input stays sharded."""
    x = call.inputs[0]
    assert x is not None
    return keep_dim_signatures(call, [0] if x.ndim >= 4 else [], [0])


def _conv_cost(call: OpCall) -> OperatorCost:
    x, w = call.inputs[0], call.inputs[1]
    assert x is not None and w is not None
    out = call.out_meta[0]
    groups = int(call.arg("groups", 1))
    flops = 2 * math.prod(out.shape) * (w.shape[1] if not call.arg("transposed") else w.shape[0] // groups)
    flops *= math.prod(w.shape[2:])
    read = sum(y.nbytes() for y in call.inputs if y is not None)
    written = math.prod(out.shape) * out.dtype.itemsize
    return OperatorCost(flops=flops, bytes_read=read, bytes_written=written)


@register_rule(aten.convolution.default, family="spatial", cost=_conv_cost, kernel=empty_safe_kernel)
def convolution(call: OpCall) -> list[PlacementSignature]:
    """Batch-parallel (``input S(0)``) or output-channel-parallel (``weight S(0)`` -> ``S(1)``)."""
    x = call.inputs[0]
    assert x is not None
    has_bias = len(call.inputs) > 2 and call.inputs[2] is not None
    n = len(call.inputs)
    sigs = []
    batched = x.ndim == len(call.arg("stride")) + 2
    if batched:
        sigs.append(sig([Shard(0)] + [_R] * (n - 1), Shard(0)))
    if int(call.arg("groups", 1)) == 1 and not call.arg("transposed"):
        bias = [Shard(0)] if has_bias else ([_R] if n > 2 else [])
        sigs.append(sig([_R, Shard(0), *bias], Shard(1 if batched else 0)))
    for d in _halo_free_dims(call):
        sigs.append(sig([Shard(d)] + [_R] * (n - 1), Shard(d)))
    return sigs


def _blocks_agree(
    size_in: int, size_out: int, stride: int, mesh_shape: Sequence[int], axes: Sequence[int]
) -> bool:
    """Whether sharding a dim of ``size_in`` and its output of ``size_out`` over ``axes`` (nested, first axis
    first) gives every rank an input block of exactly ``stride`` times its output block."""
    for coord in product(*(range(mesh_shape[a]) for a in axes)):
        start_in, len_in, start_out, len_out = 0, size_in, 0, size_out
        for a, c in zip(axes, coord, strict=True):
            len_in, off_in = chunk_size_and_offset(len_in, mesh_shape[a], c)
            len_out, off_out = chunk_size_and_offset(len_out, mesh_shape[a], c)
            start_in, start_out = start_in + off_in, start_out + off_out
        if len_in != stride * len_out or (len_out and start_in != stride * start_out):
            return False
    return True


def _halo_free_dims(call: OpCall) -> list[int]:
    """Spatial dims of a convolution's input that may stay sharded: each output element reads one window that
    lies inside one input block (kernel == stride, padding 0, dilation 1, not transposed), and the blocks of input
    and output agree on every rank for every set of mesh axes that could shard the dim."""
    x, w = call.inputs[0], call.inputs[1]
    assert x is not None and w is not None
    if call.arg("transposed"):
        return []
    stride, padding, dilation = (
        list(call.arg("stride")),
        list(call.arg("padding")),
        list(call.arg("dilation")),
    )
    k = len(stride)
    kernel = list(w.shape[2:])
    mesh_shape = call.mesh.shape if call.mesh is not None else ()
    axes = range(len(mesh_shape))
    subsets = list(chain.from_iterable(combinations(axes, r) for r in range(1, len(mesh_shape) + 1)))
    out_shape = call.out_meta[0].shape
    dims = []
    for i in range(k):
        d = x.ndim - k + i
        s = int(stride[i])
        if kernel[i] != s or int(padding[i]) != 0 or int(dilation[i]) != 1 or x.shape[d] != s * out_shape[d]:
            continue
        if all(_blocks_agree(x.shape[d], out_shape[d], s, mesh_shape, sub) for sub in subsets):
            dims.append(d)
    return dims


@register_rule(
    aten.grid_sampler_2d.default, aten.grid_sampler_3d.default, aten.max_unpool2d.default,
    aten.max_unpool3d.default, aten.col2im.default, family="spatial",
)  # fmt: skip
def replicate_only_spatial(call: OpCall) -> list[PlacementSignature]:
    """Data-dependent or overlapping spatial access: Replicate only."""
    return []
