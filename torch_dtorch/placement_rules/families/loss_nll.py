"""``nll_loss_forward`` (what ``F.cross_entropy`` / ``F.nll_loss`` run on ``[N, C]`` or ``[C]`` inputs) without
gathering the batch.

Signatures (one mesh axis), for ``self`` sharded on its batch dim ``0`` (2-D input) with ``target`` ``S(0)`` and
``weight`` ``R``:

- ``reduction='none'``: ``output`` ``S(0)``, ``total_weight`` ``R`` (torch returns a constant ``0`` there);
- ``reduction='sum'``: ``output`` and ``total_weight`` ``P(sum)`` (each rank sums its rows: exact);
- ``reduction='mean'``: ``output`` and ``total_weight`` ``R`` by a **communicating kernel**: each rank computes the
  sum and total weight of its rows (``reduction='sum'``), the ranks of the batch-sharding axes exchange those two
  numbers point-to-point, and each divides the group's summed loss by its summed weight (in group order, so the
  replicas are bit-identical). ``ignore_index`` and class weights are exact: the total weight is data-dependent,
  which is why no Partial placement can express the mean.

The class dim is never sharded here (a vocab-parallel loss needs a max/sum-exp exchange: ``loss_parallel``, not
built); an input sharded on it is gathered first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.placement import Partial, Placement, Replicate, Shard
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.families.context_parallel import device_comm, exchange, register_comm_kernel
from torch_dtorch.placement_rules.families.loss import REDUCTION_MEAN, REDUCTION_NONE, REDUCTION_SUM
from torch_dtorch.placement_rules.families.norm_comm import comm_group
from torch_dtorch.placement_rules.rule import register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["NLL_TAG"]

aten = torch.ops.aten
_R = Replicate()
_P = Partial("sum")
#: point-to-point tag of the (loss sum, total weight) pairs exchanged for ``reduction='mean'``
NLL_TAG = 0x6E6C


def _reduction(call: OpCall) -> int:
    return int(call.arg("reduction", REDUCTION_MEAN))


def _batch_axes(call: OpCall) -> list[int]:
    """Mesh axes of size > 1 on which ``self`` is sharded on its batch dim (the matched signature's inputs)."""
    x, pl, mesh = call.inputs[0], call.placements[0], call.mesh
    if x is None or pl is None or mesh is None or x.ndim != 2:
        return []
    return [a for a, p in enumerate(pl) if mesh.shape[a] > 1 and isinstance(p, Shard) and p.dim % 2 == 0]


def _needs_comm(call: OpCall) -> bool:
    return _reduction(call) == REDUCTION_MEAN and bool(_batch_axes(call))


def _kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    reduction = _reduction(call)
    axes = _batch_axes(call)
    if reduction == REDUCTION_NONE or not axes:
        return call.op(*args, **kwargs)
    names = [a.name for a in call.op._schema.arguments]
    bound = dict(zip(names, args, strict=False)) | kwargs
    bound["reduction"] = REDUCTION_SUM
    total, weight = call.op(*(bound[n] for n in names))
    if reduction == REDUCTION_SUM:
        return total, weight
    assert call.mesh is not None
    comm = device_comm(ctx, what=f"{call.op} (reduction='mean') over a sharded batch")
    devices, me = comm_group(call.mesh, ctx.coordinate, axes)
    mine = torch.stack([total.to(weight.dtype), weight])
    parts = exchange(comm, devices, me, [mine] * len(devices), tag=NLL_TAG)
    summed = torch.stack([p.to(mine.device) for p in parts]).sum(0)
    return (summed[0] / summed[1]).to(total.dtype), summed[1].to(weight.dtype)


def _local(call: OpCall) -> bool:
    """:func:`_kernel` is the op itself (no reduction over a sharded batch): workers replay it."""
    return _reduction(call) == REDUCTION_NONE or not _batch_axes(call)


@register_rule(aten.nll_loss_forward.default, family="loss", kernel=_kernel, as_is=_local)
def nll_loss_forward(call: OpCall) -> Sequence[PlacementSignature]:
    """Batch sharded (2-D input): ``none`` -> ``S(0)``; ``sum`` -> ``P(sum)``; ``mean`` -> ``R`` (exchanging the
    per-rank sums and weights)."""
    x = call.inputs[0]
    assert x is not None
    if x.ndim != 2:
        return []
    ins: list[Placement] = [Shard(0), Shard(0), _R]
    reduction = _reduction(call)
    if reduction == REDUCTION_NONE:
        return [sig(ins, [Shard(0), _R])]
    if reduction == REDUCTION_SUM:
        return [sig(ins, [_P, _P])]
    return [sig(ins, [_R, _R])]


register_comm_kernel(aten.nll_loss_forward.default, _needs_comm)
