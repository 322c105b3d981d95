"""Sorting and scan family: cumulative ops, sort/argsort/topk/kthvalue/median/mode along one dim.

Signatures (one mesh axis): ``S(d) -> S(d)`` (every output: values and indices alike) for every dim ``d`` other
than the scanned/sorted ``dim`` (``S(d - 1)`` for ``d > dim`` on the outputs of ``kthvalue``/``median``/``mode``,
which drop ``dim`` unless ``keepdim``); the op then runs on whole rows. A sharded ``dim`` has no signature: the matcher
gathers it (cost-ordered, logged) before the op. Reductions over every element (``median()``, ``nanmedian()``)
are Replicate only. Partial inputs are reduced first (none of these ops is linear, ``cumsum`` aside, which lives in
the reduction family).
"""

from __future__ import annotations

import torch

from torch_dtorch.placement_rules.call import OpCall
from torch_dtorch.placement_rules.families.indexing import keep_dim_signatures
from torch_dtorch.placement_rules.families.view import norm_dim
from torch_dtorch.placement_rules.rule import register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature

__all__ = ["ALONG_DIM_OPS"]

aten = torch.ops.aten

ALONG_DIM_OPS = [
    aten.cumprod.default, aten.cummax.default, aten.cummin.default, aten.logcumsumexp.default,
    aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable, aten.topk.default,
    aten.kthvalue.default, aten.median.dim, aten.nanmedian.dim, aten.mode.default, aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default, aten.glu.default, aten.renorm.default,
]  # fmt: skip


#: ops that reduce ``dim`` (dropped from the outputs unless ``keepdim``)
_REDUCING_OPS = frozenset({aten.kthvalue.default, aten.median.dim, aten.nanmedian.dim, aten.mode.default})


@register_rule(*ALONG_DIM_OPS, family="sorting")
def along_dim(call: OpCall) -> list[PlacementSignature]:
    """Every dim but ``dim`` stays sharded (``renorm``: only ``dim`` itself, each slice normed on its own)."""
    x = call.inputs[0]
    assert x is not None
    nd = x.ndim
    dim = norm_dim(int(call.arg("dim", -1)), nd)
    if call.op is aten.renorm.default:
        dims = [dim] if nd > 0 else []
    else:
        dims = [d for d in range(nd) if d != dim]
    slots = [k for k, y in enumerate(call.inputs) if y is not None and y.ndim == nd and y.shape == x.shape]
    out_dims = None
    if call.op in _REDUCING_OPS and not call.arg("keepdim", False):
        out_dims = [d - 1 if d > dim else d for d in dims]  # the reduced dim is gone from the outputs
    return keep_dim_signatures(call, dims, slots, out_dims=out_dims)


@register_rule(aten.median.default, aten.nanmedian.default, family="sorting")
def median_all(call: OpCall) -> list[PlacementSignature]:
    """A median over every element: Replicate only."""
    return []
